"""The patch table is the single list of patches, and it matches installed sglang 0.5.23."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import sglang_dsv41.hooks as hooks_pkg
from conftest import REPO_ROOT
from sglang_dsv41 import checks
from sglang_dsv41.patch_spec import HookKind
from sglang_dsv41.patch_table import PATCHES
from sglang_dsv41.patches_doc import render


def test_ids_are_unique_and_entries_complete():
    ids = [p.id for p in PATCHES]
    assert len(ids) == len(set(ids))
    for p in PATCHES:
        assert re.fullmatch(r"[A-Z]+(-[A-Z0-9]+)+", p.id), p.id
        assert p.roles, p.id
        assert p.reason.strip() and p.source.strip() and p.group.strip(), p.id
        assert re.fullmatch(r"[0-9a-f]{16}", p.ast_sha), f"{p.id}: fingerprint not generated"


def test_every_hook_module_is_in_the_table_and_every_hook_resolves():
    named = {p.hook_module() for p in PATCHES}
    on_disk = {
        f"{hooks_pkg.__name__}.{m.name}"
        for m in pkgutil.walk_packages(hooks_pkg.__path__)
        if not m.ispkg
    }
    assert on_disk - named == set(), "hook modules with no patch-table entry"
    for p in PATCHES:
        fn = getattr(importlib.import_module(p.hook_module()), p.hook_name())
        assert callable(fn), p.id


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_fingerprint_matches_installed_sglang(patch):
    assert checks.patch_problems(patch) == []


def test_installed_sglang_is_the_pinned_release():
    assert checks.version_problem() is None


def test_patches_md_is_generated_from_the_table():
    on_disk = (REPO_ROOT / "docs" / "PATCHES.md").read_text()
    assert on_disk == render(), "docs/PATCHES.md is stale: run `make patches-doc`"
    for p in PATCHES:
        assert f"## {p.id}" in on_disk


def test_new_attribute_that_upstream_defines_is_refused():
    from sglang_dsv41.patch_spec import Patch, Role
    from sglang_dsv41 import fingerprint as fp

    owner = "sglang.srt.managers.scheduler.Scheduler"
    got = fp.fingerprint(owner)
    shadowing = Patch(
        id="TEST-SHADOW", group="test", target=f"{owner}.get_next_batch_to_run",
        kind=HookKind.NEW_ATTRIBUTE, hook="x:y", roles=frozenset({Role.SCHEDULER}),
        reason="r", source="s", signature=got.signature, ast_sha=got.ast_sha,
    )
    problems = checks.patch_problems(shadowing)
    assert any("would shadow" in p.message for p in problems)


def test_after_hook_on_async_target_is_refused():
    from sglang_dsv41.patch_spec import Patch, Role
    from sglang_dsv41 import fingerprint as fp

    target = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
    got = fp.fingerprint(target)
    patch = Patch(
        id="TEST-ASYNC", group="test", target=target, kind=HookKind.AFTER, hook="x:y",
        roles=frozenset({Role.LAUNCHER}), reason="r", source="s",
        signature=got.signature, ast_sha=got.ast_sha,
    )
    assert any("async" in p.message for p in checks.patch_problems(patch))


def test_fingerprint_ignores_docstrings_but_not_code(tmp_path):
    import ast
    from sglang_dsv41.fingerprint import fingerprint_node

    a = ast.parse('def f(x):\n    """doc"""\n    return x + 1\n').body[0]
    b = ast.parse('def f(x):\n    """other doc"""\n\n    return (x + 1)\n').body[0]
    c = ast.parse('def f(x):\n    return x + 2\n').body[0]
    assert fingerprint_node(a) == fingerprint_node(b)
    assert fingerprint_node(a).ast_sha != fingerprint_node(c).ast_sha
