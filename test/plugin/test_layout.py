"""The tree shows the design: feature packages, machinery, tools, and the rules between them.

The rules are read from the sources (``_layout.py``); the mutation tests run the
same reader on a copy of the package with one rule broken, so a rule that could
not fail would show here.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import _layout
from conftest import REPO_ROOT

PYTHON = REPO_ROOT / "python"
DOCSTRING_LIMIT = _layout.DOCSTRING_MAX_LINES
# The app module sglang's HTTP server is pointed at: it exists to load sglang.
LOADS_SGLANG_BY_DESIGN = {"sglang_dsv41.worker_app"}
# A statement importing a test module, inside code written as a string for a child interpreter.
CHILD_IMPORT = re.compile(r"(?:^|;)[ \t]*(?:import|from)[ \t]+test_\w*", re.MULTILINE)


def test_the_package_keeps_its_layout_rules():
    graph = _layout.read_graph(PYTHON)
    assert graph.modules and graph.edges
    assert _layout.violations(graph) == []


def test_the_top_level_is_features_machinery_and_tools_only():
    from sglang_dsv41.plugin.table import FEATURE_MODULES

    features = {m.__name__.split(".")[1] for m in FEATURE_MODULES}
    assert set(_layout.FEATURE_IMPORTS) == features
    top = {m.split(".")[1] for m in _layout.read_graph(PYTHON).modules if "." in m}
    assert top == features | {"plugin", "tools", "metrics", "loader", "worker_app"}


def test_plain_modules_import_without_loading_sglang():
    """Every module but the hooks (and the worker app) imports in a fresh interpreter with
    no sglang module loaded; the first one that loads sglang is named."""
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import sglang_dsv41
        skip = {sorted(LOADS_SGLANG_BY_DESIGN)!r}
        for m in sorted(m.name for m in pkgutil.walk_packages(sglang_dsv41.__path__, "sglang_dsv41.")):
            if m.rsplit(".", 1)[-1].startswith("hooks") or m in skip:
                continue
            importlib.import_module(m)
            if any(n == "sglang" or n.startswith("sglang.") for n in sys.modules):
                print("LOADS-SGLANG", m)
                break
        else:
            print("NONE")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "NONE"


def _test_and_bench_files():
    return sorted((REPO_ROOT / "test").rglob("*.py")) + sorted((REPO_ROOT / "benchmarks").rglob("*.py"))


def test_no_private_names_are_taken_from_our_modules():
    files = sorted(PYTHON.rglob("*.py")) + _test_and_bench_files()
    taken = [hit for path in files for hit in _layout.private_names_taken(path)]
    assert taken == []


def _loads_by_path(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name not in ("spec_from_file_location", "insert", "syspath_prepend", "run_path"):
        return None
    text = ast.unparse(node)
    if "benchmarks" in text or "test_" in text:
        return text
    return None


def _test_module_imports(path: Path) -> list[str]:
    """Imports of a ``test_*`` module and loads of a benchmark by path, in code or in a code string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        mods = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = [node.module]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        found += [f"{path}:{node.lineno}: imports {m}" for m in mods if m.split(".")[0].startswith("test_")]
        if isinstance(node, ast.Call) and (text := _loads_by_path(node)):
            found.append(f"{path}:{node.lineno}: {text}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{path}:{node.lineno}: a code string imports a test module: {m.group().strip()}"
                      for m in CHILD_IMPORT.finditer(node.value)]
    return found


def test_tests_never_import_a_test_module_or_load_a_benchmark_by_path():
    assert [hit for path in sorted((REPO_ROOT / "test").rglob("*.py")) for hit in _test_module_imports(path)] == []


OTHER_TEST = "test_" + "other"  # split, so this file does not match itself


@pytest.mark.parametrize("code", [
    f"import {OTHER_TEST} as steps",
    f"from {OTHER_TEST} import helper",
    f"import json; from {OTHER_TEST} import helper",
])
def test_a_code_string_importing_a_test_module_fails_the_layout(tmp_path, code):
    child = tmp_path / "test_child.py"
    child.write_text(f"STEP = {chr(10) + '    ' + code + chr(10)!r}\nrun_python(STEP)\n")
    (hit,) = _test_module_imports(child)
    assert "a code string imports a test module" in hit and OTHER_TEST in hit


# --- the rules fail when broken: the same reader on a copy with one change


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    shutil.copytree(PYTHON / "sglang_dsv41", tmp_path / "sglang_dsv41",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))
    return tmp_path


def _add_line(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n" + line + "\n")


def _problems(root: Path) -> list[str]:
    return _layout.violations(_layout.read_graph(root))


def test_a_hook_importing_tools_fails_the_layout(tree_copy):
    _add_line(tree_copy, "sglang_dsv41.pd_handshake.hooks", "from sglang_dsv41.tools import smoke")
    problems = _problems(tree_copy)
    assert any("pd_handshake.hooks" in p and "nothing a server runs may import tools/" in p for p in problems)


def test_tools_importing_a_hook_fails_the_layout(tree_copy):
    _add_line(tree_copy, "sglang_dsv41.tools.plan.checks",
              "from sglang_dsv41.launch_guards.hooks import crash_features")
    assert any("tools/ never imports a hook module" in p for p in _problems(tree_copy))


def test_an_import_cycle_fails_the_layout(tree_copy):
    _add_line(tree_copy, "sglang_dsv41.mooncake_nvlink.routing", "from sglang_dsv41.mooncake_nvlink import state")
    cycles = [p for p in _problems(tree_copy) if p.startswith("import cycle")]
    assert cycles and "sglang_dsv41.mooncake_nvlink.state" in cycles[0]


def test_a_lazy_import_back_into_a_hook_module_is_a_cycle_too(tree_copy):
    # The shape the routing state once had: the KV hooks looked the NVLink hooks up late.
    _add_line(tree_copy, "sglang_dsv41.mooncake_nvlink.kv_staging.hooks",
              "def _late():\n    from sglang_dsv41.mooncake_nvlink import hooks\n    return hooks")
    assert any(p.startswith("import cycle") and "kv_staging.hooks" in p for p in _problems(tree_copy))


def test_an_undeclared_import_between_features_fails_the_layout(tree_copy):
    _add_line(tree_copy, "sglang_dsv41.vision_cp.rules", "from sglang_dsv41.pd_handshake import pairing")
    assert any("vision_cp.rules" in p and "undeclared import between features" in p
               for p in _problems(tree_copy))


def test_a_private_name_across_modules_fails_the_layout(tree_copy):
    _add_line(tree_copy, "sglang_dsv41.tools.smoke", "from sglang_dsv41.plugin.fingerprint import _private")
    assert any("private name _private" in p for p in _problems(tree_copy))


def test_a_patches_module_that_imports_logic_fails_the_layout(tree_copy):
    _add_line(tree_copy, "sglang_dsv41.cp_bcg.patches", "from sglang_dsv41.cp_bcg import rules")
    assert any("patches.py is data" in p for p in _problems(tree_copy))


def _docstring_of(lines: int) -> str:
    return '"""' + "\n    ".join(f"line {n}" for n in range(1, lines + 1)) + '\n    """'


@pytest.mark.parametrize("where", ["function", "nested"])
def test_a_long_docstring_fails_the_layout(tree_copy, where):
    body = f"def explained():\n    {_docstring_of(DOCSTRING_LIMIT + 1)}\n"
    qualname = "sglang_dsv41.tools.smoke.explained"
    if where == "nested":  # a method of a class defined under an if
        body = "if True:\n    class Holder:\n" + textwrap.indent(body, "        ")
        qualname = "sglang_dsv41.tools.smoke.Holder.explained"
    _add_line(tree_copy, "sglang_dsv41.tools.smoke", body)
    assert f"{qualname}: a docstring of {DOCSTRING_LIMIT + 1} lines" in " ".join(_problems(tree_copy))


def test_a_long_module_docstring_fails_the_layout_and_the_limit_itself_passes(tree_copy):
    path = tree_copy / "sglang_dsv41" / "metrics.py"
    text = path.read_text()
    start, end = text.index('"""'), text.index('"""', text.index('"""') + 3) + 3
    path.write_text(text[:start] + _docstring_of(DOCSTRING_LIMIT) + text[end:])
    assert not [p for p in _problems(tree_copy) if "docstring" in p]
    path.write_text(text[:start] + _docstring_of(DOCSTRING_LIMIT + 1) + text[end:])
    assert any(p.startswith(f"sglang_dsv41.metrics: a docstring of {DOCSTRING_LIMIT + 1} lines")
               for p in _problems(tree_copy))
