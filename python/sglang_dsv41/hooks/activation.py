"""Adapters: per-process verification that every patch owed to the role is installed.

Each runs as a BEFORE hook on the first object a process role builds after
load_plugins(); the check itself lives in ``sglang_dsv41.activation``.
"""

from sglang_dsv41.activation import verify_role
from sglang_dsv41.patch_spec import Role


def verify_scheduler(self, *args, **kwargs):
    verify_role(Role.SCHEDULER)


def verify_tokenizer_manager(self, *args, **kwargs):
    from sglang.srt.managers.multi_tokenizer_mixin import TokenizerWorker

    verify_role(Role.TOKENIZER_WORKER if isinstance(self, TokenizerWorker) else Role.LAUNCHER)


def verify_launcher_router(self, *args, **kwargs):
    verify_role(Role.LAUNCHER)


def verify_detokenizer(self, *args, **kwargs):
    verify_role(Role.DETOKENIZER)


def verify_dp_controller(self, *args, **kwargs):
    verify_role(Role.DP_CONTROLLER)
