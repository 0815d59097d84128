"""The activation feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

_ACT = "sglang_dsv41.activation.hooks"

FEATURE = Feature(
    name="activation",
    summary='prove in every process role that its patches are installed',
    remove_when="sglang's plugin loader stops a process whose hooks failed to apply and reports, in every process role, which hooks are installed; until then this check is the only proof that a process runs patched code",
)

PATCHES: tuple[Patch, ...] = (
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
        ast_sha="7c245dffa1126dfe",
        depends_on="signature",
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
        ast_sha="a8c4b0ed14e9ffd9",
        depends_on="signature",
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
        ast_sha="7c245dffa1126dfe",
        depends_on="signature",
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
        ast_sha="7c245dffa1126dfe",
        depends_on="signature",
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
        ast_sha="a7f0af3afa1d32f7",
        depends_on="signature",
    ),
    Patch(
        id="ACT-DTR-VERIFY",
        group="activation",
        target="sglang.srt.managers.multi_tokenizer_mixin.MultiDetokenizerRouter.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_detokenizer_router",
        roles=roles(Role.DETOKENIZER_ROUTER),
        reason="With --detokenizer-worker-num > 1 a router process fans scheduler output out "
        "to the detokenizers; the first object it builds verifies its patches.",
        source="this package",
        signature="(self, ipc_name_list: List[str], port_args: PortArgs)",
        ast_sha="1cc7ee711839c251",
        depends_on="signature",
    ),
    Patch(
        id="ACT-DTR-START",
        group="activation",
        target="sglang.srt.entrypoints.engine.Engine._launch_detokenizer_subprocesses",
        kind=HookKind.AROUND,
        hook=f"{_ACT}:around_launch_detokenizers",
        roles=roles(Role.LAUNCHER),
        reason="The detokenizer router process never calls load_plugins() in sglang 0.5.23. "
        "While the launcher starts the detokenizers, the engine module's name for the router "
        "process body points at a module-level function of ours that loads plugins first and "
        "then runs upstream's; the fingerprint pins the launch body that reads that name.",
        source="this package",
        signature="(cls, server_args: ServerArgs, port_args: PortArgs, run_detokenizer_process_func: Callable)",
        ast_sha="139308172d1b8ef9",
        remove_when="sglang's detokenizer router process calls load_plugins() itself",
    ),
)
