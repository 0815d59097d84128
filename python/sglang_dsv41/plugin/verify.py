"""Is each patch really installed in this process? (run after sglang applied the hooks)"""

from __future__ import annotations

import logging
import os

from sglang_dsv41.plugin.spec import HookKind, Patch, Role
from sglang_dsv41.plugin.table import owed_to

logger = logging.getLogger("sglang_dsv41")


class PatchNotActive(RuntimeError):
    pass


_verified_roles: set[Role] = set()


def _closure_values(fn) -> list:
    cells = getattr(fn, "__closure__", None) or ()
    out = []
    for cell in cells:
        try:
            out.append(cell.cell_contents)
        except ValueError:  # empty cell
            pass
    return out


def _current_attribute(patch: Patch):
    from sglang_dsv41.loader import resolve_upstream

    owner = resolve_upstream(patch.owner_path)
    if isinstance(owner, type):
        raw = owner.__dict__.get(patch.attribute)
        if isinstance(raw, (classmethod, staticmethod)):
            raw = raw.__func__
        return raw
    return getattr(owner, patch.attribute, None)


def is_installed(patch: Patch, hook) -> bool:
    """True when the live upstream attribute routes through ``hook``."""
    if hook is None:
        return False
    if patch.kind is HookKind.RESOLUTION:
        from sglang.srt.arg_groups import resolution_hooks

        return hook in resolution_hooks._HOOKS.get(patch.resolution_step, ())
    current = _current_attribute(patch)
    if patch.kind is HookKind.NEW_ATTRIBUTE:
        return current is hook
    from sglang.srt.plugins.hook_registry import HookRegistry

    if patch.target not in HookRegistry._patched:
        return False
    seen = 0
    while current is not None and seen < 64:  # walk the wrapper chain
        if hook in _closure_values(current):
            return True
        current = getattr(current, "__wrapped__", None)
        seen += 1
    return False


def _installed_or_why_not(patch: Patch) -> str | None:
    """None when installed, else why not (the import error when the module fails)."""
    from sglang_dsv41.loader import UpstreamImportError, registered_hook

    try:
        return None if is_installed(patch, registered_hook(patch.id)) else ""
    except UpstreamImportError as exc:
        return str(exc)


def _describe_missing(patch: Patch) -> str:
    why = _installed_or_why_not(patch)
    return f"{patch.id} ({patch.target}; {why})" if why else f"{patch.id} ({patch.target})"


def role_status(role: Role) -> tuple[list[Patch], list[Patch]]:
    applied, missing = [], []
    for patch in owed_to(role):
        (applied if _installed_or_why_not(patch) is None else missing).append(patch)
    return applied, missing


def verify_role(role: Role) -> None:
    if role in _verified_roles:
        return
    from sglang_dsv41.loader import drift_allowed

    applied, missing = role_status(role)
    owed = len(applied) + len(missing)
    line = (
        f"[sglang-dsv41] role={role.value} pid={os.getpid()} "
        f"patches applied={len(applied)}/{owed} owed"
    )
    if missing:
        detail = ", ".join(_describe_missing(p) for p in missing)
        if not drift_allowed():
            logger.critical("%s; NOT ACTIVE: %s", line, detail)
            raise PatchNotActive(f"{line}; not active in this process: {detail}")
        logger.warning("%s; NOT ACTIVE (drift allowed): %s", line, detail)
    else:
        logger.info(line)
    _verified_roles.add(role)
