"""Test support: install chosen patch-table entries in this process, and undo them.

sglang applies hooks once per process and HookRegistry.reset() does not
un-patch, so tests that need one patch (not the whole plugin) install it here
with sglang's own wrapper builder, the calling convention a server gets, and
get the upstream attribute back on exit.
"""

from __future__ import annotations

import pkgutil
from contextlib import contextmanager

_MISSING = object()


@contextmanager
def patches_installed(*patch_ids: str):
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    from sglang_dsv41.loader import hook_callable
    from sglang_dsv41.plugin.spec import HookKind
    from sglang_dsv41.plugin.table import by_id

    table = by_id()
    undo = []
    try:
        for pid in patch_ids:
            patch = table[pid]
            owner = pkgutil.resolve_name(patch.owner_path)
            name = patch.attribute
            before = owner.__dict__.get(name, _MISSING)
            hook = hook_callable(patch)
            if patch.kind is HookKind.NEW_ATTRIBUTE:
                assert before is _MISSING, f"{patch.target} exists upstream"
                setattr(owner, name, hook)
            elif patch.kind.uses_hook_registry:
                assert before is not _MISSING, f"{patch.target} missing upstream"
                setattr(owner, name, _wrap_fn(before, hook, HookType(patch.kind.value)))
            else:
                raise ValueError(f"{pid}: {patch.kind.value} patches are installed by the loader only")
            undo.append((owner, name, before))
        yield
    finally:
        for owner, name, before in reversed(undo):
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
