"""Adapter: the known-crash rules (launch_guards/rules.py) inside sglang's argument resolution.

Wraps the resolution step ``handle_model_capability_adjustments``: it runs in
the launcher before any process starts, after the steps that decide what the
rules read (DeepSeek-V4's own validation, which resolves decoder SWA bounded
replay; data and context parallelism; the prefill CUDA graph default for CP;
speculative decoding), and nothing after it changes those values.
"""

from __future__ import annotations

import logging
import os

from sglang_dsv41.launch_guards.rules import (
    CrashFeatures,
    GuardAction,
    GuardVerdict,
    launch_verdict,
)
from sglang_dsv41.cp_bcg.setting import DSPARK_VERIFIED_ENV
from sglang_dsv41.launch_guards.verdict import VERDICT_ATTRIBUTE, record_launcher_patches
from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.verify import role_status

logger = logging.getLogger(__name__)

_DECLARATION_SOURCE = "sglang_dsv41.launch_guard"


def crash_features(server_args) -> CrashFeatures | None:
    """The rules' view of a server whose resolution has reached this step."""
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view
    from sglang.srt.configs.model_config import is_deepseek_v4
    from sglang.srt.connector import ConnectorType
    from sglang.srt.layers.cp.bcg import supports_prefill_cp_bcg
    from sglang.srt.model_executor.cuda_graph_config import Phase
    from sglang.srt.runtime_context import parallel_widths_of
    from sglang.srt.utils.common import parse_connector_type

    cfg = resolving_view(server_args)
    if parse_connector_type(cfg.model_path) == ConnectorType.INSTANCE:
        return None  # no model config to judge (the step itself skips these too)
    locked = getattr(server_args, "_cuda_graph_config_locked", None) or set()
    prefill_backend = cfg.cuda_graph_config.prefill.backend
    prefill_cp = bool(cfg.enable_prefill_cp) or int(cfg.attn_cp_size) > 1
    return CrashFeatures(
        dspark=str(cfg.speculative_algorithm or "").upper() == "DSPARK",
        decoder_swa_bounded_replay=bool(cfg.enable_decoder_swa_bounded_replay),
        enable_prefill_cp=bool(cfg.enable_prefill_cp),
        attn_cp_size=int(cfg.attn_cp_size),
        attn_dp_size=int(parallel_widths_of(cfg)["attn_dp_size"]),
        # The record holds what the operator gave (resolution declares, never
        # writes it): None means sglang's default decided.
        replay_requested=server_args.enable_decoder_swa_bounded_replay is True,
        deepseek_v4=bool(is_deepseek_v4(model_config_of(server_args).hf_config)),
        prefill_graph_backend=str(getattr(prefill_backend, "value", prefill_backend)),
        prefill_graph_requested=(Phase.PREFILL, "backend") in locked,
        cp_graph_supported=bool(prefill_cp and supports_prefill_cp_bcg(server_args)),
        cp_graph_opt_in=_cp_bcg_enabled(),
        dspark_cp_graph_verified=os.environ.get(DSPARK_VERIFIED_ENV),
    )


def _cp_bcg_enabled() -> bool:
    # Imported here: the setting's module checks its value at import, and a bad
    # value must stop plugin load naming the CP-graph patches, not this one.
    from sglang_dsv41.cp_bcg.rules import cp_bcg_enabled

    return cp_bcg_enabled()


def guard_resolved_layout(server_args, previous) -> None:
    """Resolution hook: run the step, then refuse or correct a known-crash layout."""
    previous(server_args)
    features = crash_features(server_args)
    verdict = launch_verdict(features) if features is not None else GuardVerdict(GuardAction.NONE)
    # Bookkeeping name (leading underscore, not a field): allowed during resolution.
    setattr(server_args, VERDICT_ATTRIBUTE, verdict)
    # Every hook is installed by now (load_plugins ran before the arguments were parsed).
    applied, missing = role_status(Role.LAUNCHER)
    record_launcher_patches(server_args, len(applied), len(applied) + len(missing))
    if verdict.action is GuardAction.REFUSE:
        # SystemExit: `sglang serve` stops here with this one line and exit status 1,
        # before any process starts; nothing between here and the CLI catches it.
        raise SystemExit(verdict.message)
    if verdict.action is GuardAction.TURN_OFF_REPLAY:
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(server_args, _DECLARATION_SOURCE, enable_decoder_swa_bounded_replay=False)
        logger.warning(verdict.message)
