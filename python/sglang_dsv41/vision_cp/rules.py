"""Server-argument rules for DeepSeek-V4.1 with vision and prefill context parallelism.

Why these rules exist:
- The eager CP runner merges image features before sharding; only the
  interleave strategy is wired for that, so zigzag must be refused.
- No prefill CUDA graph path replays the image merge, so the prefill graph has
  to resolve to disabled; a user who asked for one explicitly gets an error
  instead of a silent override.
- DSpark with decoder SWA bounded replay has not been made to work with vision
  prefill CP.
- Encoder SWA bounded replay does not support CP. sglang checks the resolved
  attention CP size, which prefill CP declares only after the V4.1 validator has
  run, so the request for prefill CP itself has to count as CP here.
"""

from __future__ import annotations

from dataclasses import dataclass

V41_MODEL_TYPE = "deepseek_v41"


@dataclass(frozen=True)
class VisionCPArgs:
    model_type: str
    vision_layers: int
    language_model_only: bool
    enable_prefill_cp: bool
    cp_strategy: str | None
    prefill_graph_enabled: bool
    prefill_graph_explicit: bool
    speculative_algorithm: str | None
    decoder_swa_bounded_replay: bool | None
    encoder_swa_bounded_replay: bool


@dataclass(frozen=True)
class VisionCPVerdict:
    disable_prefill_graph: bool = False


def check_vision_prefill_cp(args: VisionCPArgs) -> VisionCPVerdict:
    """Raise ValueError for a refused combination; say what resolution must change."""
    if args.model_type != V41_MODEL_TYPE:
        return VisionCPVerdict()

    if args.encoder_swa_bounded_replay and args.enable_prefill_cp:
        raise ValueError(
            "--enable-encoder-swa-bounded-replay does not support context "
            "parallelism yet (--enable-prefill-cp was given)"
        )

    # --language-model-only never builds the vision tower: text rules only.
    vision_on = args.vision_layers > 0 and not args.language_model_only
    if not (args.enable_prefill_cp and vision_on):
        return VisionCPVerdict()

    if args.cp_strategy != "interleave":
        raise ValueError(
            "DeepSeek-V4.1 vision with prefill CP requires --cp-strategy interleave; "
            f"got {args.cp_strategy!r}."
        )
    is_dspark = str(args.speculative_algorithm or "").upper() == "DSPARK"
    if is_dspark and args.decoder_swa_bounded_replay:
        raise ValueError(
            "DeepSeek-V4.1 vision with prefill CP does not support DSpark together "
            "with --enable-decoder-swa-bounded-replay yet; disable one of them."
        )
    if args.prefill_graph_enabled:
        if args.prefill_graph_explicit:
            raise ValueError(
                "DeepSeek-V4.1 vision with prefill CP runs eager prefill; remove the "
                "explicit --cuda-graph-backend-prefill setting."
            )
        return VisionCPVerdict(disable_prefill_graph=True)
    return VisionCPVerdict()
