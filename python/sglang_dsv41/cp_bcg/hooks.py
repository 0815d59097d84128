"""Adapters: DeepSeek-V4 interleave prefill CP inside the breakable prefill CUDA graph.

Everything here is a pass-through unless ``SGLANG_DSV41_CP_BCG=1``
(``cp_bcg.setting.cp_bcg_enabled``):

- ``around_supports_prefill_cp_bcg``: the one predicate sglang asks, from the
  launcher's argument resolution (default graph backend, incompatibility rules)
  and from the prefill graph runner; answers yes for the supported DeepSeek-V4
  shape and leaves every other answer to upstream.
- ``around_get_cp_bcg_input_type``: the interleave strategy gets this package's
  DeepSeek-V4 adapter, a subclass of upstream's interleave adapter.
- ``around_engram_hasher_forward``: under CP inside the breakable graph the
  whole-prompt engram hash runs as an eager break at every replay.
"""

from __future__ import annotations

import functools

from sglang_dsv41.cp_bcg.rules import CPBCGArgs, cp_bcg_enabled, cp_bcg_refusal


# --- the support gate ------------------------------------------------------------------

def gate_args(server_args) -> CPBCGArgs:
    """Read what the gate needs from server args in the middle of (or after) resolution."""
    from sglang.srt.arg_groups.overrides import (
        attention_backends_of,
        model_config_of,
        resolved_view,
        resolving_view,
    )
    from sglang.srt.configs.model_config import is_deepseek_v4

    cfg = resolving_view(server_args)
    resolved = resolved_view(server_args)
    hf_config = model_config_of(server_args).hf_config
    prefill_backend, _ = attention_backends_of(resolved)
    return CPBCGArgs(
        is_deepseek_v4=bool(is_deepseek_v4(hf_config)),
        prefill_attention_backend=prefill_backend,
        enable_prefill_cp=bool(cfg.enable_prefill_cp),
        cp_strategy=cfg.cp_strategy,
        tp_size=int(cfg.tp_size),
        attn_cp_size=int(resolved.attn_cp_size),
        pp_size=int(cfg.pp_size),
        dp_size=int(cfg.dp_size),
        enable_dp_attention=bool(cfg.enable_dp_attention),
        ep_size=int(cfg.ep_size),
        decoder_swa_bounded_replay=bool(cfg.enable_decoder_swa_bounded_replay),
        vision_layers=int(getattr(hf_config, "vision_n_layers", 0) or 0),
        language_model_only=bool(cfg.language_model_only),
    )


def deepseek_v4_cp_bcg_supported(server_args) -> bool:
    return cp_bcg_refusal(gate_args(server_args), enabled=cp_bcg_enabled()) is None


def around_supports_prefill_cp_bcg(original, server_args):
    """AROUND sglang.srt.layers.cp.bcg.supports_prefill_cp_bcg.

    Only ever turns a no into a yes, for the supported DeepSeek-V4 shape;
    (interleave, dsv4) is not in upstream's combination table, so upstream
    answers no for every DeepSeek-V4 server.
    """
    if cp_bcg_enabled() and deepseek_v4_cp_bcg_supported(server_args):
        return True
    return original(server_args)


# --- the input adapter -----------------------------------------------------------------

def _runner_serves_deepseek_v4(runner) -> bool:
    from sglang.srt.configs.model_config import is_deepseek_v4

    return bool(is_deepseek_v4(runner.model_runner.model_config.hf_config))


@functools.cache
def deepseek_v4_interleave_input_type():
    """The adapter class, built on first use (it subclasses an sglang class)."""
    from sglang.srt.layers.cp.bcg.interleave_bcg import InterleaveCPBCGInput

    class DeepseekV4InterleaveCPBCGInput(InterleaveCPBCGInput):
        """Upstream's interleave adapter for a DeepSeek-V4 body.

        Inherited as they are: the fixed-address rank-major ``input_ids_global``
        buffer (MoE routing ids), the fixed-address MoE local token count, global
        ``forward_batch.positions`` and the full-bucket ``out_cache_loc`` for the
        compressor write path, and CP-local positions for the captured body.
        Different: no GLM KDA reorder capacity (``graph_num_tokens``), and the
        support test is this package's DeepSeek-V4 gate (it allows EP == TP).
        Built for a non-DeepSeek-V4 model it hands over to upstream's adapter.
        """

        @staticmethod
        def supports(server_args) -> bool:
            args = gate_args(server_args)
            if not args.is_deepseek_v4:
                return InterleaveCPBCGInput.supports(server_args)
            return cp_bcg_refusal(args, enabled=cp_bcg_enabled()) is None

        @classmethod
        def create(cls, runner):
            if not _runner_serves_deepseek_v4(runner):
                return InterleaveCPBCGInput.create(runner)
            return super().create(runner)

        def prepare(self, runner, forward_batch, *, static_num_tokens, capture):
            super().prepare(
                runner, forward_batch, static_num_tokens=static_num_tokens, capture=capture
            )
            # GLM's KDA layers reorder rows up to this capacity inside the graph;
            # DeepSeek-V4 has no such layer, and a set value would also narrow
            # attention queries to the logical rows (cp.padding).
            forward_batch.attn_cp_metadata.graph_num_tokens = None

    return DeepseekV4InterleaveCPBCGInput


def around_get_cp_bcg_input_type(original, strategy):
    """AROUND sglang.srt.layers.cp.bcg.get_cp_bcg_input_type: interleave -> our adapter."""
    chosen = original(strategy)
    if not cp_bcg_enabled():
        return chosen
    from sglang.srt.layers.cp.base import ContextParallelStrategyKind

    if strategy == ContextParallelStrategyKind.INTERLEAVE:
        return deepseek_v4_interleave_input_type()
    return chosen
