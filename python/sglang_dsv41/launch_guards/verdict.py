"""What the launcher decides, as it travels: left on the ServerArgs record, published as metrics.

The launch guard's verdict and the launcher's own patch count. Plain: `plan`
reads the record, the schedulers publish it.
"""

from __future__ import annotations

from sglang_dsv41 import metrics
from sglang_dsv41.launch_guards.rules import GuardAction

# Where the guard leaves its verdict on the ServerArgs record, for `sglang-dsv41 plan`
# and for the schedulers (the record reaches them pickled, bookkeeping included).
VERDICT_ATTRIBUTE = "_sglang_dsv41_launch_guard"
LAUNCHER_PATCHES_ATTRIBUTE = "_sglang_dsv41_launcher_patches"  # (applied, owed)


def record_launcher_patches(server_args, applied: int, owed: int) -> None:
    """Launcher side, while it resolves the arguments (before any process starts)."""
    setattr(server_args, LAUNCHER_PATCHES_ATTRIBUTE, (applied, owed))


def publish_verdict(server_args) -> None:
    """Scheduler side: export the verdict the guard left on this server's arguments.

    The launcher, where the guard runs, cannot export metrics (sglang imports
    prometheus_client there too early); its schedulers can, and publish its patch
    count too. Nothing is published when the record carries neither (the
    launcher ran without the plugin).
    """
    launcher = getattr(server_args, LAUNCHER_PATCHES_ATTRIBUTE, None)
    if launcher is not None:
        metrics.launcher_patches(*launcher)
    verdict = getattr(server_args, VERDICT_ATTRIBUTE, None)
    if verdict is None:
        return
    metrics.launch_guard_verdict(None if verdict.action is GuardAction.NONE else verdict.rule)
