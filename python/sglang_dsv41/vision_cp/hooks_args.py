"""Adapter: the V4.1 vision + prefill CP argument rules inside sglang's resolution."""

from __future__ import annotations

import logging

from sglang_dsv41.vision_cp.rules import VisionCPArgs, check_vision_prefill_cp

logger = logging.getLogger(__name__)


def before_validate_v41_features(server_args):
    """BEFORE validate_deepseek_v41_features: apply our rules first, then upstream's."""
    from sglang.srt.arg_groups.overrides import (
        declare_resolution,
        model_config_of,
        resolving_view,
    )
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    cfg = resolving_view(server_args)
    hf_config = model_config_of(server_args).hf_config
    locked = getattr(server_args, "_cuda_graph_config_locked", None) or set()
    prefill_backend = cfg.cuda_graph_config.prefill.backend
    verdict = check_vision_prefill_cp(
        VisionCPArgs(
            model_type=getattr(hf_config, "model_type", ""),
            vision_layers=int(getattr(hf_config, "vision_n_layers", 0) or 0),
            language_model_only=bool(cfg.language_model_only),
            enable_prefill_cp=bool(cfg.enable_prefill_cp),
            cp_strategy=cfg.cp_strategy,
            prefill_graph_enabled=prefill_backend != Backend.DISABLED,
            prefill_graph_explicit=(Phase.PREFILL, "backend") in locked,
            speculative_algorithm=cfg.speculative_algorithm,
            decoder_swa_bounded_replay=cfg.enable_decoder_swa_bounded_replay,
            encoder_swa_bounded_replay=bool(cfg.enable_encoder_swa_bounded_replay),
        )
    )
    if verdict.disable_prefill_graph:
        declare_resolution(
            server_args,
            "sglang_dsv41.validate_deepseek_v41_vision_prefill_cp",
            cuda_graph_config=with_phase(
                cfg.cuda_graph_config, Phase.PREFILL, backend=Backend.DISABLED
            ),
        )
        logger.warning(
            "[sglang-dsv41] prefill CUDA graph resolved to disabled: DeepSeek-V4.1 "
            "vision with prefill CP runs eager prefill"
        )
    return None
