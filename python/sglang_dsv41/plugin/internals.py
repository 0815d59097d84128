"""Private sglang names this package's tooling relies on, with their fingerprints.

The patch table covers what we change in sglang. This list covers what
``plan``, ``doctor``, the activation check, ``testing.patches_installed`` and
the test harnesses read or call without changing it: underscore names and
internals that sglang may rename or rework in any release. ``doctor`` and
``upgrade-check`` fingerprint them the same way as the patch targets (a
variable by the statements that bind it), so an upgrade that breaks the
tooling shows up as a DRIFT line instead of a traceback later.

``sglang-dsv41 fingerprint --update`` fills in ``signature``/``ast_sha``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    name: str  # dotted upstream path: function, class, method, or variable
    used_by: str
    signature: str
    ast_sha: str
    depends_on: str = "source"  # "signature" where we only call it

    # The interface fingerprint.fingerprint_of reads (shared with Patch).
    new_attribute = None
    relies_on = ()
    allows_variable = True

    @property
    def id(self) -> str:
        return self.name

    @property
    def fingerprint_target(self) -> str:
        return self.name


_HR = "sglang.srt.plugins.hook_registry"
_MOONCAKE_STORE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store.MooncakeStoreConfig"

INTERNALS: tuple[Internal, ...] = (
    # --- plan (deploy_plan.py): sglang's own argument handling and resolution
    Internal(
        name="sglang.cli.serve._extract_model_type_override",
        used_by="plan: splits `sglang serve` arguments as the CLI does",
        signature="(extra_argv)",
        ast_sha="85687f675fa08f79",
    ),
    Internal(
        name="sglang.cli.serve._normalize_positional_model_path",
        used_by="plan: the positional model path of `sglang serve`",
        signature="(extra_argv)",
        ast_sha="45dee469e65efdab",
    ),
    Internal(
        name="sglang.srt.utils.server_args_config_parser.ConfigArgumentMerger.merge_config_with_args",
        used_by="plan: --config files merged as sglang merges them",
        signature="(self, cli_args: List[str])",
        ast_sha="76206f3be84fae84",
        depends_on="signature",
    ),
    Internal(
        name="sglang.srt.server_args.prepare_server_args",
        used_by="plan: builds ServerArgs from a command line",
        signature="(argv: list[str])",
        ast_sha="25349c63d42293ad",
        depends_on="signature",
    ),
    Internal(
        name="sglang.srt.server_args.ZMQ_TCP_PORT_DELTA",
        used_by="plan: ports DP attention derives from --port",
        signature="variable",
        ast_sha="cd2edec3d9fafc34",
    ),
    Internal(
        name="sglang.srt.arg_groups.model_override_base.resolving_view",
        used_by="plan: the resolved view of server arguments",
        signature="(server_args: Any)",
        ast_sha="2a0db2c83af381c2",
    ),
    Internal(
        name="sglang.srt.arg_groups.model_override_base.model_config_of",
        used_by="plan: the model config of resolved arguments",
        signature="(server_args: Any)",
        ast_sha="34da0033ba3c3904",
    ),
    Internal(
        name="sglang.srt.runtime_context.override_platform",
        used_by="plan: resolves as on a CUDA host from a CPU-only machine",
        signature="(**facts: Any)",
        ast_sha="4909958c3d60f33a",
    ),
    Internal(
        name="sglang.srt.runtime_context.parallel_widths_of",
        used_by="plan: attention TP/DP widths of a layout",
        signature="(cfg: Any)",
        ast_sha="b0c0cc8b4be5749d",
    ),
    Internal(
        name="sglang.srt.environ.Envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER",
        used_by="plan: which CP ranks transfer KV in PD",
        signature="variable",
        ast_sha="df4b0473b78ded0d",
    ),
    Internal(
        name="sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
        ".parse_storage_backend_extra_config",
        used_by="plan: reads --hicache-storage-backend-extra-config",
        signature="(storage_backend_extra_config: Optional[str])",
        ast_sha="aefc589da2c3a140",
    ),
    Internal(
        name=f"{_MOONCAKE_STORE}.load_from_extra_config",
        used_by="plan: the Mooncake store master address",
        signature="(extra_config: dict)",
        ast_sha="2678b1abcd62c0f6",
    ),
    Internal(
        name=f"{_MOONCAKE_STORE}.from_file",
        used_by="plan: the Mooncake store master address",
        signature="()",
        ast_sha="e2f0b8fe34207292",
    ),
    Internal(
        name=f"{_MOONCAKE_STORE}.load_from_env",
        used_by="plan: the Mooncake store master address",
        signature="()",
        ast_sha="1655711be998580e",
    ),
    # --- doctor, the activation check, testing.patches_installed, the worker app
    Internal(
        name=f"{_HR}._current_plugin_source",
        used_by="doctor: runs other plugins under their own source",
        signature="variable",
        ast_sha="ddf77d3ed8ac8e95",
    ),
    Internal(
        name=f"{_HR}.HookSource",
        used_by="doctor: runs other plugins under their own source",
        signature="class HookSource(NamedTuple)",
        ast_sha="e74bc71275ebd2bf",
    ),
    Internal(
        name=f"{_HR}.HookRegistry._hooks",
        used_by="doctor: finds other plugins hooking our targets",
        signature="variable",
        ast_sha="322c0ce1ab7ae580",
    ),
    Internal(
        name=f"{_HR}.HookRegistry._patched",
        used_by="activation check: whether a target was patched",
        signature="variable",
        ast_sha="e6dcce302408fafa",
    ),
    Internal(
        name=f"{_HR}._wrap_fn",
        used_by="testing.patches_installed: builds wrappers as sglang does",
        signature="(original_fn: Callable, hook: Callable, hook_type: HookType)",
        ast_sha="ac079b9a45c637bd",
    ),
    Internal(
        name="sglang.srt.arg_groups.resolution_hooks._HOOKS",
        used_by="doctor and the activation check: registered resolution hooks",
        signature="variable",
        ast_sha="858180bab461d9ec",
    ),
    Internal(
        name="sglang.srt.entrypoints.http_server.app",
        used_by="loader and worker_app: the stock app multi-tokenizer workers serve",
        signature="variable",
        ast_sha="39cf2429aa5bfb26",
    ),
    # --- test harnesses (test/*/): private methods and module flags they drive
    Internal(
        name="sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
        used_by="test/embed_overrides harness: runs the real admission pass",
        signature="(self, prefill_delayer_single_pass: Optional[PrefillDelayerSinglePassExecutor], running_batch: ScheduleBatch)",
        ast_sha="45ba42893ea4ee31",
        depends_on="signature",
    ),
    Internal(
        name="sglang.srt.disaggregation.common.conn.CommonKVManager._resolve_rank_mapping",
        used_by="test/pd_handshake harness",
        signature="(self, info: PrefillServerInfo)",
        ast_sha="958bd30e65ce1501",
        depends_on="signature",
    ),
    Internal(
        name="sglang.srt.disaggregation.common.conn.CommonKVManager"
        "._should_skip_cp_replicated_state_transfer",
        used_by="test/pd_handshake harness",
        signature="(self)",
        ast_sha="207918c0fd92bb56",
        depends_on="signature",
    ),
    Internal(
        name="sglang.srt.disaggregation.common.conn.CommonKVReceiver._register_kv_args",
        used_by="test/pd_handshake harness; KV staging: the registration goes once per prefill "
        "peer through _send_bootstrap_message with operation '_register_kv_args' (where the "
        "grant is added), so its body is pinned",
        signature="(self)",
        ast_sha="f1ef5017c1a882a8",
    ),
    Internal(
        name="sglang.srt.models.deepseek_v4._is_cuda",
        used_by="test/vision_cp build cases: the model module's platform flag",
        signature="variable",
        ast_sha="213e7952b7bb9b88",
    ),
    Internal(
        name="sglang.srt.models.deepseek_v4._is_npu",
        used_by="test/vision_cp build cases: the model module's platform flag",
        signature="variable",
        ast_sha="ddcc5854a798da03",
    ),
    Internal(
        name="sglang.srt.distributed.parallel_state._is_cpu",
        used_by="test/vision_cp CP harness: gloo groups on CPU",
        signature="variable",
        ast_sha="56106b91c01712ee",
    ),
    # --- KV peer writes (mooncake_nvlink/kv_staging/hooks.py)
    Internal(
        name="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.build_receiver_registration_message",
        used_by="KV peer writes: the peer map's frames follow the last frame of this message, past "
        "every frame KVArgsRegisterInfo.from_zmq reads",
        signature="(self)",
        ast_sha="8c0a12621c827db9",
    ),
    Internal(
        name="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_probe",
        used_by="KV peer writes: the prefill probes each decode it maps (0: the decode's engine "
        "answered), and counts one that stops answering failed as sglang does",
        signature="(self, session_id: str)",
        ast_sha="48a5a2d4a2f30c11",
        depends_on="signature",
    ),
)


def problems(internal: Internal, tree=None) -> list[str]:
    """What differs between the pinned fingerprint and ``tree`` (the installed sglang)."""
    from sglang_dsv41.plugin import fingerprint as fp

    try:
        got = fp.fingerprint_of(internal, tree)
    except fp.TargetNotFound as exc:
        return [f"not found: {exc}"]
    out = []
    if got.signature != internal.signature:
        out.append(f"signature drifted: expected {internal.signature!r}, found {got.signature!r}")
    if got.ast_sha != internal.ast_sha:
        out.append(f"source drifted: expected ast sha {internal.ast_sha}, found {got.ast_sha}")
    return out
