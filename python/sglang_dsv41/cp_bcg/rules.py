"""When DeepSeek-V4 interleave prefill CP may run inside the breakable prefill CUDA graph.

Opt-in (``cp_bcg_enabled``); the supported shape and why each limit exists are in
docs/design/cp_bcg.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_dsv41.cp_bcg.setting import CP_BCG_ENV, cp_bcg_enabled, parse_cp_bcg_setting  # noqa: F401

# Checked once at import too, so a bad value stops the process at plugin load,
# naming the patch whose hook imports this module.
cp_bcg_enabled()


@dataclass(frozen=True)
class CPBCGArgs:
    """The resolved server arguments the gate reads (plain values, no sglang types)."""

    is_deepseek_v4: bool
    prefill_attention_backend: str | None
    enable_prefill_cp: bool
    cp_strategy: str | None
    tp_size: int
    attn_cp_size: int
    pp_size: int
    dp_size: int
    enable_dp_attention: bool
    ep_size: int
    decoder_swa_bounded_replay: bool
    vision_layers: int
    language_model_only: bool


def cp_bcg_refusal(args: CPBCGArgs, *, enabled: bool) -> str | None:
    """None when the DeepSeek-V4 CP breakable graph applies, else why it does not."""
    if not enabled:
        return f"{CP_BCG_ENV} is not 1"
    if not args.is_deepseek_v4:
        return "not a DeepSeek-V4 model"
    if args.prefill_attention_backend != "dsv4":
        return f"prefill attention backend is {args.prefill_attention_backend!r}, not 'dsv4'"
    if not args.enable_prefill_cp:
        return "prefill CP is off"
    if args.cp_strategy != "interleave":
        return f"CP strategy is {args.cp_strategy!r}, not 'interleave'"
    if not args.tp_size > 1 or args.attn_cp_size != args.tp_size:
        return f"attention CP ({args.attn_cp_size}) must equal TP ({args.tp_size}) > 1"
    if args.pp_size != 1:
        return "pipeline parallelism"
    if args.dp_size != 1 or args.enable_dp_attention:
        return "data-parallel attention"
    if args.ep_size not in (1, args.tp_size):
        return f"expert parallelism {args.ep_size} is neither 1 nor TP"
    if args.decoder_swa_bounded_replay:
        return "decoder SWA bounded replay"
    if args.vision_layers > 0 and not args.language_model_only:
        return "vision tower under CP (use --language-model-only for text-only serving)"
    return None

