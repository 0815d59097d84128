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

from sglang_dsv41.mooncake_nvlink.kv_staging.setting import StagingConfigError, staging_config
from sglang_dsv41.plugin import drift
from sglang_dsv41.plugin import fingerprint as fp
from sglang_dsv41.plugin.pin import ALLOW_DRIFT_ENV
from sglang_dsv41.plugin.spec import HookKind, Patch
from sglang_dsv41.plugin.table import PATCHES

logger = logging.getLogger("sglang_dsv41")

STOCK_APP_PATH = "sglang.srt.entrypoints.http_server:app"
WORKER_APP_PATH = "sglang_dsv41.worker_app:app"
APP_PATH_ENV = "SGLANG_HTTP_SERVER_APP_PATH"
INNER_APP_PATH_ENV = "SGLANG_DSV41_INNER_APP_PATH"

_activated = False
_registered: dict[str, object] = {}  # patch id -> the callable we installed
_OWN_HANDLER_FLAG = "_sglang_dsv41_own_handler"


def configure_own_logger() -> None:
    """Give the ``sglang_dsv41`` logger a handler of its own, at INFO.

    Some sglang processes (multi-tokenizer HTTP workers, the detokenizer
    router) leave the root logger at WARNING, where a status line that relied
    on the root handler was dropped. Only our logger is configured, never the
    user's root logger; it stops propagating so that processes whose root
    logger prints INFO do not print our lines twice. A handler someone else
    attached to our logger (a logging config file) is left alone.
    """
    if logger.handlers:
        return
    handler = logging.StreamHandler()  # stderr, like the root handler sglang sets up
    handler.setFormatter(
        logging.Formatter("[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    )
    setattr(handler, _OWN_HANDLER_FLAG, True)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False


class UpstreamImportError(ImportError):
    """An upstream module a patch targets could not be imported; names the real error."""


def upstream_module_name(target: str) -> str:
    """The importable module part of a dotted upstream path (found on disk, no import)."""
    _path, inside = fp.locate(target)
    parts = target.split(".")
    return ".".join(parts[: len(parts) - len(inside)])


def resolve_upstream(target: str):
    """The live upstream object at ``target``.

    ``pkgutil.resolve_name`` swallows the ImportError of a module that fails to
    import and reports a missing attribute of its parent package instead
    (``module 'sglang.srt.models' has no attribute 'deepseek_v4'``). Importing
    the module that holds the source explicitly keeps the real error.
    """
    module_name = upstream_module_name(target)
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:
        raise UpstreamImportError(
            f"cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from exc
    for name in target[len(module_name) + 1:].split(".") if target != module_name else ():
        obj = getattr(obj, name)
    return obj


def import_problems(patches) -> list[drift.Problem]:
    """One problem per patch whose upstream module does not import, naming the error."""
    failed: dict[str, str] = {}
    found = []
    for patch in patches:
        try:
            module_name = upstream_module_name(patch.fingerprint_target)
        except fp.TargetNotFound:
            continue  # reported by the fingerprint checks
        if module_name not in failed:
            try:
                importlib.import_module(module_name)
                failed[module_name] = ""
            except Exception as exc:
                failed[module_name] = f"{type(exc).__name__}: {exc}"
        if failed[module_name]:
            found.append(
                drift.Problem(
                    patch.id, patch.target,
                    f"cannot import {module_name}: {failed[module_name]}",
                )
            )
    return found


def drift_allowed() -> bool:
    return os.environ.get(ALLOW_DRIFT_ENV, "") == "1"


def _fail(lines: list[str], drift: bool = False) -> "SystemExit":
    """``drift``: the problems are upstream drift, the only ones ALLOW_DRIFT can let pass."""
    text = "\n".join(["[sglang-dsv41] refusing to start:"] + [f"  - {l}" for l in lines])
    if drift:
        text += f"\n  (set {ALLOW_DRIFT_ENV}=1 to run anyway with a warning per patch)"
    logger.critical(text)
    return SystemExit(text)


def hook_callable(patch: Patch):
    module = importlib.import_module(patch.hook_module())
    return getattr(module, patch.hook_name())


def registered_hook(patch_id: str):
    return _registered.get(patch_id)


def register_patch(patch: Patch) -> None:
    fn = hook_callable(patch)
    if patch.kind.uses_hook_registry:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(patch.target, fn, HookType(patch.kind.value))
    elif patch.kind is HookKind.RESOLUTION:
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook(patch.resolution_step)(fn)
    elif patch.kind is HookKind.NEW_ATTRIBUTE:
        owner = resolve_upstream(patch.owner_path)
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
    configure_own_logger()
    try:  # the KV transfer manager would refuse it too, minutes later: stop before the model loads
        staging_config()
    except StagingConfigError as exc:
        text = f"[sglang-dsv41] refusing to start: kv_staging patches (MC-KVS-*): {exc}"
        logger.critical(text)
        raise SystemExit(text) from None
    # A target module that fails to import (a hardware library missing, say)
    # stops the process naming the real error; sglang's own hook application
    # imports these modules right after us anyway.
    problems = drift.all_problems(PATCHES) + import_problems(PATCHES)
    if problems:
        if not drift_allowed():
            raise _fail([str(p) for p in problems], drift=True)
        for p in problems:
            logger.warning("[sglang-dsv41] DRIFT ALLOWED by %s=1: %s", ALLOW_DRIFT_ENV, p)
    drifted_missing = {
        p.patch_id for p in problems
        if p.patch_id and ("not found" in p.message or p.message.startswith("cannot import"))
    }
    for patch in PATCHES:
        if patch.id in drifted_missing:
            logger.warning("[sglang-dsv41] patch %s not registered: target missing", patch.id)
            continue
        try:
            register_patch(patch)
        except SystemExit:
            raise
        except Exception as exc:  # the surrounding loader would swallow it
            raise _fail([f"patch {patch.id} ({patch.target}): registration failed: {exc!r}"])
    route_multi_tokenizer_workers()
    _activated = True
    logger.info(
        "[sglang-dsv41] pid=%d registered %d/%d patches", os.getpid(), len(_registered), len(PATCHES)
    )
