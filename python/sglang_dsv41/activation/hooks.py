"""Adapters: per-process verification that every patch owed to the role is installed.

Each runs as a BEFORE hook on the first object a process role builds after
load_plugins(); the check itself lives in ``sglang_dsv41.plugin.verify``. The same
place decides, from the server's ``--enable-metrics``, whether this process
exports the plugin's Prometheus series, and reports its patch count there
(a scheduler also the launch guard's verdict, which the launcher cannot export).
"""

from sglang_dsv41.plugin.verify import role_status, verify_role
from sglang_dsv41 import metrics
from sglang_dsv41.launch_guards.verdict import publish_verdict
from sglang_dsv41.plugin.spec import Role

# The launcher starts the detokenizer router through this module-level name of
# the engine module; the router process never calls load_plugins() itself.
ROUTER_TARGET_MODULE = "sglang.srt.entrypoints.engine"
ROUTER_TARGET_NAME = "run_multi_detokenizer_router_process"

_reported: set = set()


def _verify(role: Role, args, kwargs) -> None:
    verify_role(role)
    if role in _reported:
        return
    _reported.add(role)
    server_args = kwargs.get("server_args", args[0] if args else None)
    metrics.configure(bool(getattr(server_args, "enable_metrics", False)))
    applied, missing = role_status(role)
    metrics.role_verified(role.value, len(applied), len(applied) + len(missing))
    if role is Role.SCHEDULER:
        publish_verdict(server_args)


def verify_scheduler(self, *args, **kwargs):
    _verify(Role.SCHEDULER, args, kwargs)


def verify_tokenizer_manager(self, *args, **kwargs):
    from sglang.srt.managers.multi_tokenizer_mixin import TokenizerWorker

    role = Role.TOKENIZER_WORKER if isinstance(self, TokenizerWorker) else Role.LAUNCHER
    _verify(role, args, kwargs)


def verify_launcher_router(self, *args, **kwargs):
    _verify(Role.LAUNCHER, args, kwargs)


def verify_detokenizer(self, *args, **kwargs):
    _verify(Role.DETOKENIZER, args, kwargs)


def verify_dp_controller(self, *args, **kwargs):
    _verify(Role.DP_CONTROLLER, args, kwargs)


def verify_detokenizer_router(self, *args, **kwargs):
    _verify(Role.DETOKENIZER_ROUTER, args, kwargs)


def run_detokenizer_router_with_plugins(*args, **kwargs):
    """Body of the detokenizer router process: load plugins, then run upstream's.

    Module level, so the spawned process unpickles it by this name and imports
    this package rather than only the upstream function.
    """
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.managers import multi_tokenizer_mixin

    return multi_tokenizer_mixin.run_multi_detokenizer_router_process(*args, **kwargs)


def around_launch_detokenizers(original, *args, **kwargs):
    """AROUND Engine._launch_detokenizer_subprocesses: start the router through us.

    sglang 0.5.23 starts the router process without load_plugins(), so that
    role would run with no plugin at all. For the duration of the launch the
    engine module's name for the router body points at our wrapper; the
    detokenizer workers are started exactly as before.
    """
    import importlib

    engine = importlib.import_module(ROUTER_TARGET_MODULE)
    upstream = getattr(engine, ROUTER_TARGET_NAME)  # AttributeError: fails the launch loudly
    setattr(engine, ROUTER_TARGET_NAME, run_detokenizer_router_with_plugins)
    try:
        return original(*args, **kwargs)
    finally:
        setattr(engine, ROUTER_TARGET_NAME, upstream)
