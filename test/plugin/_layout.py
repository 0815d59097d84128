"""The package's import graph, read from its sources (AST), and the layout rules checked on it.

Plain: reads files, imports nothing of the package, so a test can run it on a
modified copy of the tree and see a rule fail.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "sglang_dsv41"
SHARED = ("plugin", "metrics", "loader", "worker_app")  # machinery every feature may use
TOOLS = "tools"
# Longer than this, a docstring's substance belongs in a design note (docs/design/).
DOCSTRING_MAX_LINES = 15
# Feature package -> the other features it may import (plain modules only, never their hooks).
FEATURE_IMPORTS = {
    "activation": {"launch_guards"},  # the launcher's status line carries the guard's verdict
    "vision_cp": set(),
    "owner_broadcast": set(),
    "embed_overrides": set(),
    "pd_handshake": set(),
    "pd_retraction": set(),
    "mooncake_nvlink": set(),  # kv_staging is its sub-package
    "launch_guards": {"cp_bcg"},  # the breakable-graph opt-in changes a known-crash rule
    "cp_bcg": set(),
}


@dataclass(frozen=True)
class Edge:
    src: str  # importing module (dotted)
    dst: str  # imported module (dotted, ours)
    names: tuple[str, ...]  # names taken from it by a from-import
    line: int
    lazy: bool  # inside a function


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(graph_modules: dict, name: str) -> str | None:
    """The module ``name`` denotes (a module, or a package's ``__init__``), else None."""
    while name:
        if name in graph_modules:
            return name
        name = name.rpartition(".")[0]
    return None


def read_graph(python_dir: Path) -> Graph:
    """Every module under ``python_dir/sglang_dsv41`` and every import between them."""
    graph = Graph()
    for path in sorted((python_dir / PACKAGE).rglob("*.py")):
        graph.modules[module_name(python_dir, path)] = path
    for mod, path in graph.modules.items():
        tree = ast.parse(path.read_text(), str(path))
        lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            lazy = id(node) in lazy_nodes
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        dst = _resolve(graph.modules, alias.name)
                        graph.edges.append(Edge(mod, dst, (), node.lineno, lazy))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == PACKAGE:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in graph.modules:  # a module taken from its package
                        graph.edges.append(Edge(mod, sub, (), node.lineno, lazy))
                    else:
                        graph.edges.append(Edge(mod, _resolve(graph.modules, node.module),
                                                (alias.name,), node.lineno, lazy))
    return graph


def area(module: str) -> str:
    """The top-level part of the package a module belongs to: a feature, tools, or shared."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def is_hook_module(module: str) -> bool:
    return module.rsplit(".", 1)[-1].startswith("hooks")


def cycles(graph: Graph) -> list[list[str]]:
    """Import cycles between modules (lazy imports count: a cycle is a design knot either way)."""
    out: dict[str, set[str]] = {m: set() for m in graph.modules}
    for e in graph.edges:
        if e.dst and e.dst != e.src and not graph.modules[e.dst].name == "__init__.py":
            out[e.src].add(e.dst)
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(out[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(out):
        if m not in state:
            visit(m)
    return found


def violations(graph: Graph) -> list[str]:
    """Every broken layout rule, one line each."""
    problems = [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    for e in graph.edges:
        if e.dst is None:
            problems.append(f"{e.src}:{e.line}: imports a module of ours that does not exist")
            continue
        src_area, dst_area = area(e.src), area(e.dst)
        where = f"{e.src}:{e.line} imports {e.dst}"
        if dst_area == TOOLS and src_area != TOOLS:
            problems.append(f"{where}: nothing a server runs may import tools/")
        if src_area == TOOLS and is_hook_module(e.dst):
            problems.append(f"{where}: tools/ never imports a hook module")
        if src_area in FEATURE_IMPORTS and dst_area in FEATURE_IMPORTS and src_area != dst_area:
            if dst_area not in FEATURE_IMPORTS[src_area]:
                problems.append(f"{where}: undeclared import between features")
            elif is_hook_module(e.dst):
                problems.append(f"{where}: a feature may use another's plain modules, never its hooks")
        if dst_area in FEATURE_IMPORTS and is_hook_module(e.dst) and area(e.src) != dst_area:
            if src_area not in FEATURE_IMPORTS and src_area != TOOLS:
                problems.append(f"{where}: only the loader reaches hooks, through the patch table")
        if not is_hook_module(e.src) and e.src.rsplit(".", 1)[-1] == "patches" and dst_area != "plugin":
            problems.append(f"{where}: a feature's patches.py is data: it imports only plugin.spec")
        for name in e.names:
            if name.startswith("_") and not name.startswith("__"):
                problems.append(f"{where}: takes the private name {name} from another module")
    for mod, path in graph.modules.items():
        problems += [f"{qualname}: a docstring of {n} lines (at most {DOCSTRING_MAX_LINES}): "
                     f"move its substance to a design note" for qualname, n in long_docstrings(mod, path)]
    return problems


def long_docstrings(module: str, path: Path) -> list[tuple[str, int]]:
    """(qualified name, line count) of each docstring in the file past ``DOCSTRING_MAX_LINES``,
    counted as ``ast.get_docstring`` leaves it (dedented, outer blank lines dropped)."""
    found = []

    def check(node, qualname: str) -> None:
        doc = ast.get_docstring(node)
        if doc and len(doc.splitlines()) > DOCSTRING_MAX_LINES:
            found.append((qualname, len(doc.splitlines())))
        visit(node, qualname)

    def visit(node, qualname: str) -> None:  # definitions nested in any statement (if, try, ...) too
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                check(child, f"{qualname}.{child.name}")
            else:
                visit(child, qualname)

    check(ast.parse(path.read_text(), str(path)), module)
    return found


def private_names_taken(path: Path) -> list[str]:
    """``from sglang_dsv41... import _x`` and ``<module of ours>._x`` in one file (tests included)."""
    tree = ast.parse(path.read_text(), str(path))
    ours: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
                ours.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE and alias.asname:
                    ours.add(alias.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ours \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
    return found
