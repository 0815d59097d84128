"""Adapters: per-process verification that every patch owed to the role is installed.

Each runs as a BEFORE hook on the first object a process role builds after
load_plugins(); the check itself lives in ``sglang_dsv41.activation``. The same
place decides, from the server's ``--enable-metrics``, whether this process
exports the plugin's Prometheus series, and reports its patch count there.
"""

from sglang_dsv41.activation import role_status, verify_role
from sglang_dsv41.core import plugin_metrics
from sglang_dsv41.patch_spec import Role

_reported: set = set()


def _verify(role: Role, args, kwargs) -> None:
    verify_role(role)
    if role in _reported:
        return
    _reported.add(role)
    server_args = kwargs.get("server_args", args[0] if args else None)
    plugin_metrics.configure(bool(getattr(server_args, "enable_metrics", False)))
    applied, missing = role_status(role)
    plugin_metrics.role_verified(role.value, len(applied), len(applied) + len(missing))


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
