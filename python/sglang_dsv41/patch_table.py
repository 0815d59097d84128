"""THE patch table: every change this package makes to sglang, and nothing else.

The loader registers exactly these entries, the activation check verifies
exactly these entries per process role, ``docs/PATCHES.md`` is generated from
them, and a test fails when a module under ``hooks/`` is not named here.

Fingerprints are taken from sglang 0.5.23's installed sources by
``sglang-dsv41 fingerprint``; see AGENTS.md before changing one.
"""

from __future__ import annotations

from sglang_dsv41.patch_spec import HookKind, Patch, Role, roles

_ACT = "sglang_dsv41.hooks.activation"

PATCHES: tuple[Patch, ...] = (
    # --- activation: prove in every process role that its patches are installed
    Patch(
        id="ACT-SCHED",
        group="activation",
        target="sglang.srt.managers.scheduler.Scheduler.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_scheduler",
        roles=roles(Role.SCHEDULER),
        reason="First object a scheduler process builds after load_plugins(); verifies "
        "that every patch owed to the scheduler role is installed and logs the status line.",
        source="this package (sglang's loader swallows hook failures)",
        signature="(self, server_args: ServerArgs, port_args: PortArgs)",
        ast_sha="451e6fc7ed80c78c",
    ),
    Patch(
        id="ACT-TOKENIZER",
        group="activation",
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_tokenizer_manager",
        roles=roles(Role.LAUNCHER, Role.TOKENIZER_WORKER),
        reason="Built in the launcher (single tokenizer) and, through TokenizerWorker, in "
        "every multi-tokenizer HTTP worker; verifies the patches owed to that role.",
        source="this package",
        signature="(self, server_args: ServerArgs, port_args: PortArgs, *, start_pd_bootstrap_service: bool=True)",
        ast_sha="9194cd9ba33f0fac",
    ),
    Patch(
        id="ACT-ROUTER",
        group="activation",
        target="sglang.srt.managers.multi_tokenizer_mixin.MultiTokenizerRouter.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_launcher_router",
        roles=roles(Role.LAUNCHER),
        reason="With --tokenizer-worker-num > 1 the launcher builds this router instead of a "
        "TokenizerManager; verifies the launcher's patches there.",
        source="this package",
        signature="(self, server_args: ServerArgs, port_args: PortArgs)",
        ast_sha="8d460203f1750357",
    ),
    Patch(
        id="ACT-DETOK",
        group="activation",
        target="sglang.srt.managers.detokenizer_manager.DetokenizerManager.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_detokenizer",
        roles=roles(Role.DETOKENIZER),
        reason="First object the detokenizer process builds after load_plugins().",
        source="this package",
        signature="(self, server_args: ServerArgs, port_args: PortArgs)",
        ast_sha="cac29a0cbd6a263d",
    ),
    Patch(
        id="ACT-DPC",
        group="activation",
        target="sglang.srt.managers.data_parallel_controller.DataParallelController.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_dp_controller",
        roles=roles(Role.DP_CONTROLLER),
        reason="First object the DP controller process builds after load_plugins().",
        source="this package",
        signature="(self, server_args: ServerArgs, port_args: PortArgs, run_scheduler_process_func: Callable, prelaunched_schedulers: dict[tuple[int, int], tuple[int, Connection]] | None=None)",
        ast_sha="3456bfad1061e316",
    ),
    # --- vision-cp: DeepSeek-V4.1 vision with prefill context parallelism
    Patch(
        id="VCP-ARGS",
        group="vision-cp",
        target="sglang.srt.arg_groups.deepseek_v4_hook.validate_deepseek_v41_features",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.hooks.vision_cp_args:before_validate_v41_features",
        roles=roles(Role.LAUNCHER),
        reason="V4.1 vision + prefill CP: interleave strategy required, prefill CUDA graph "
        "resolved to disabled (error when explicit), DSpark with decoder SWA bounded replay "
        "refused; encoder SWA bounded replay refused under prefill CP, which upstream "
        "misses because attention CP is declared only after this validator.",
        source="seed arg_groups/deepseek_v4_hook.py (_validate_deepseek_v41_vision_prefill_cp, "
        "'context parallelism' incompatibility); UPSTREAM-0.5.23 rows B1, B2",
        signature="(server_args: ServerArgs)",
        ast_sha="4194690793d556cd",
    ),
    # === vision-cp runtime (issue 5) entries above this line ===
    # === owner-broadcast (issue 3) entries above this line ===
    # === mooncake-nvlink (issue 4) entries above this line ===
    # === pd-handshake (issue 6) entries above this line ===
    # === embed-overrides (issue 5) entries above this line ===
)


def by_id() -> dict[str, Patch]:
    return {p.id: p for p in PATCHES}


def owed_to(role: Role) -> tuple[Patch, ...]:
    return tuple(p for p in PATCHES if role in p.roles)
