"""The ``dsv41`` entry point: check the installed sglang, then register every patch.

sglang's ``load_plugins()`` catches ``Exception`` from plugins and from hook
application, which would leave a server running stock code. Everything that
must stop the process here raises ``SystemExit``, which that loader does not
catch. ``SGLANG_DSV41_ALLOW_DRIFT=1`` turns drift into one warning per patch.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil

from sglang_dsv41 import checks
from sglang_dsv41._pin import ALLOW_DRIFT_ENV
from sglang_dsv41.patch_spec import HookKind, Patch
from sglang_dsv41.patch_table import PATCHES

logger = logging.getLogger("sglang_dsv41")

STOCK_APP_PATH = "sglang.srt.entrypoints.http_server:app"
WORKER_APP_PATH = "sglang_dsv41.worker_app:app"
APP_PATH_ENV = "SGLANG_HTTP_SERVER_APP_PATH"
INNER_APP_PATH_ENV = "SGLANG_DSV41_INNER_APP_PATH"

_activated = False
_registered: dict[str, object] = {}  # patch id -> the callable we installed


def drift_allowed() -> bool:
    return os.environ.get(ALLOW_DRIFT_ENV, "") == "1"


def _fail(lines: list[str]) -> "SystemExit":
    text = "\n".join(["[sglang-dsv41] refusing to start:"] + [f"  - {l}" for l in lines])
    text += f"\n  (set {ALLOW_DRIFT_ENV}=1 to run anyway with a warning per patch)"
    logger.critical(text)
    return SystemExit(text)


def hook_callable(patch: Patch):
    module = importlib.import_module(patch.hook_module())
    return getattr(module, patch.hook_name())


def registered_hook(patch_id: str):
    return _registered.get(patch_id)


def _register(patch: Patch) -> None:
    fn = hook_callable(patch)
    if patch.kind.uses_hook_registry:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(patch.target, fn, HookType(patch.kind.value))
    elif patch.kind is HookKind.RESOLUTION:
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook(patch.resolution_step)(fn)
    elif patch.kind is HookKind.NEW_ATTRIBUTE:
        owner = pkgutil.resolve_name(patch.owner_path)
        if hasattr(owner, patch.attribute) and getattr(owner, patch.attribute) is not fn:
            raise _fail(
                [f"patch {patch.id} ({patch.target}): upstream already defines "
                 f"{patch.attribute!r}; adding ours would shadow it"]
            )
        setattr(owner, patch.attribute, fn)
    else:  # pragma: no cover - the enum is closed
        raise _fail([f"patch {patch.id}: unknown hook kind {patch.kind}"])
    _registered[patch.id] = fn


def route_multi_tokenizer_workers() -> None:
    """Multi-tokenizer HTTP workers never call load_plugins() in sglang 0.5.23.

    They import the app named by SGLANG_HTTP_SERVER_APP_PATH; point that at our
    module, which loads plugins first and then serves the app that was chosen.
    """
    current = os.environ.get(APP_PATH_ENV)
    if current == WORKER_APP_PATH:
        return
    if current and current != STOCK_APP_PATH:
        os.environ[INNER_APP_PATH_ENV] = current
    os.environ[APP_PATH_ENV] = WORKER_APP_PATH


def activate() -> None:
    """Entry point ``dsv41`` of group ``sglang.srt.plugins``; idempotent per process."""
    global _activated
    if _activated:
        return
    problems = checks.all_problems(PATCHES)
    if problems:
        if not drift_allowed():
            raise _fail([str(p) for p in problems])
        for p in problems:
            logger.warning("[sglang-dsv41] DRIFT ALLOWED by %s=1: %s", ALLOW_DRIFT_ENV, p)
    drifted_missing = {
        p.patch_id for p in problems if p.patch_id and "not found" in p.message
    }
    for patch in PATCHES:
        if patch.id in drifted_missing:
            logger.warning("[sglang-dsv41] patch %s not registered: target missing", patch.id)
            continue
        try:
            _register(patch)
        except SystemExit:
            raise
        except Exception as exc:  # the surrounding loader would swallow it
            raise _fail([f"patch {patch.id} ({patch.target}): registration failed: {exc!r}"])
    route_multi_tokenizer_workers()
    _activated = True
    logger.info(
        "[sglang-dsv41] pid=%d registered %d/%d patches", os.getpid(), len(_registered), len(PATCHES)
    )
