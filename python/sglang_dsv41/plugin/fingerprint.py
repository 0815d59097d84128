"""Fingerprints of upstream sglang code, read from source files without importing them.

:func:`fingerprint_of` is the one computation: the load-time checks, ``doctor``,
``fingerprint --update`` and ``upgrade-check`` all call it, so they cannot
disagree about what counts as a change. A dotted target is found in a source
tree (the installed package, a folder holding an ``sglang`` package, or a wheel)
and parsed with ``ast``; what is covered follows the entry's ``depends_on``.
Nothing here imports sglang.

Design: docs/design/fingerprint.md.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib.metadata
import importlib.util
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path


class TargetNotFound(LookupError):
    pass


@dataclass(frozen=True)
class Fingerprint:
    signature: str
    ast_sha: str


# ---------------------------------------------------------------- source trees


class SourceTree:
    """The Python files of one sglang release, read as text."""

    label = "?"

    def read_text(self, rel: str) -> str | None:
        raise NotImplementedError

    def __init__(self) -> None:
        self._parsed: dict[str, ast.Module] = {}
        self._texts: dict[str, str] = {}

    def text(self, rel: str) -> str | None:
        if rel not in self._texts:
            found = self.read_text(rel)
            if found is None:
                return None
            self._texts[rel] = found
        return self._texts[rel]

    def parse(self, rel: str) -> ast.Module | None:
        if rel not in self._parsed:
            text = self.text(rel)
            if text is None:
                return None
            try:
                self._parsed[rel] = ast.parse(text, filename=rel)
            except SyntaxError as exc:
                raise TargetNotFound(f"cannot parse {rel}: {exc.msg} (line {exc.lineno})") from None
        return self._parsed[rel]

    def version(self) -> str | None:
        """The release version written in the package (``sglang/_version.py``)."""
        module = self.parse("sglang/_version.py")
        for node in module.body if module else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                if "__version__" in names and isinstance(node.value.value, str):
                    return node.value.value
        return None


class FolderTree(SourceTree):
    """A folder holding the ``sglang`` package (site-packages, an unpacked wheel)."""

    def __init__(self, root: Path, label: str | None = None) -> None:
        super().__init__()
        self.root = Path(root)
        self.label = label or str(self.root / "sglang")

    def read_text(self, rel: str) -> str | None:
        path = self.root / rel
        return path.read_text(encoding="utf-8") if path.is_file() else None


class WheelTree(SourceTree):
    """An sglang wheel, read in place (a wheel is a zip file)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.label = str(self.path)
        self._zip = zipfile.ZipFile(self.path)
        self._names = set(self._zip.namelist())

    def read_text(self, rel: str) -> str | None:
        if rel not in self._names:
            return None
        return self._zip.read(rel).decode("utf-8")

    def version(self) -> str | None:
        # A wheel's name carries its version: sglang-0.5.23-cp311-...whl
        parts = self.path.name.split("-")
        named = parts[1] if len(parts) > 2 and parts[0] == "sglang" else None
        return super().version() or named


def package_root(top_level: str = "sglang") -> Path:
    spec = importlib.util.find_spec(top_level)
    if spec is None or not spec.submodule_search_locations:
        raise TargetNotFound(f"package {top_level!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


_installed: FolderTree | None = None


def installed_tree() -> FolderTree:
    """The installed sglang, as the running process would import it."""
    global _installed
    root = package_root().parent
    if _installed is None or _installed.root != root:
        _installed = FolderTree(root, label=f"installed sglang ({root / 'sglang'})")
    return _installed


def installed_version(dist: str = "sglang") -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- resolution


def locate(target: str, tree: SourceTree | None = None) -> tuple[str, list[str]]:
    """Split a dotted target into (source file inside the tree, qualname parts)."""
    tree = tree or installed_tree()
    parts = target.split(".")
    for split in range(len(parts), 0, -1):
        mod = parts[:split]
        for rel in ("/".join(mod) + ".py", "/".join(mod) + "/__init__.py"):
            if tree.text(rel) is not None:
                return rel, parts[split:]
    raise TargetNotFound(f"no source file for {target!r} in {tree.label}")


def _flatten(body):
    """Statements of one scope in source order, entering module-level if/try/with
    blocks (both branches of an if; not except handlers, which are fallbacks)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _flatten(node.body)
            yield from _flatten(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            yield from _flatten(node.body)
            yield from _flatten(node.orelse)
            yield from _flatten(node.finalbody)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from _flatten(node.body)
        else:
            yield node


def _assigned_names(target) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_assigned_names(e) for e in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _assigned_names(target.value)
    return set()


def _binds(node: ast.stmt, name: str) -> bool:
    """Does this statement (re)bind ``name`` in its own scope?"""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(name in _assigned_names(t) for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return node.value is not None and name in _assigned_names(node.target)
    if isinstance(node, ast.AugAssign):
        return name in _assigned_names(node.target)
    if isinstance(node, ast.Delete):
        return any(name in _assigned_names(t) for t in node.targets)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
    return False


def _rebinds_attribute(node: ast.stmt, owner: str, attr: str) -> bool:
    """``owner.attr = ...``, ``del owner.attr`` or ``setattr(owner, "attr", ...)``."""
    dotted = f"{owner}.{attr}"
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Attribute) and ast.unparse(t) == dotted for t in node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return isinstance(node.target, ast.Attribute) and ast.unparse(node.target) == dotted
    if isinstance(node, ast.Delete):
        return any(isinstance(t, ast.Attribute) and ast.unparse(t) == dotted for t in node.targets)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        call = node.value
        return (
            isinstance(call.func, ast.Name)
            and call.func.id == "setattr"
            and len(call.args) >= 2
            and ast.unparse(call.args[0]) == owner
            and isinstance(call.args[1], ast.Constant)
            and call.args[1].value == attr
        )
    return False


@dataclass
class Resolved:
    """Where a dotted target lives and what decides its final value."""

    target: str
    rel: str  # file inside the tree, e.g. sglang/srt/managers/scheduler.py
    qualname: list[str]
    node: ast.AST | None  # the def/class Python keeps; None for a variable
    rebinds: list[ast.stmt]  # statements that re-bind the name after that def
    bindings: list[ast.stmt]  # a variable's binding statements (node is None)
    text: str
    module: ast.Module


def resolve(target: str, tree: SourceTree | None = None, *, allow_variable: bool = False) -> Resolved:
    """Find the definition Python keeps for ``target`` and anything that re-binds it."""
    tree = tree or installed_tree()
    rel, qualname = locate(target, tree)
    if not qualname:
        raise TargetNotFound(f"{target!r} names a module, not a function, class or variable")
    module = tree.parse(rel)
    scopes = [module.body]
    node: ast.AST | None = None
    rebinds: list[ast.stmt] = []
    bindings: list[ast.stmt] = []
    for depth, name in enumerate(qualname):
        last = depth == len(qualname) - 1
        stmts = [s for s in _flatten(scopes[-1]) if _binds(s, name)]
        defs = [i for i, s in enumerate(stmts)
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        where = ".".join(qualname[:depth]) or rel
        if not stmts:
            raise TargetNotFound(f"{target!r}: {name!r} is not defined in {where} ({rel})")
        if not defs:
            if last and allow_variable:
                bindings = stmts
                node = None
                break
            raise TargetNotFound(
                f"{target!r}: {name!r} in {where} is bound by `{_short(stmts[-1])}`, "
                "not defined by a def or class"
            )
        node = stmts[defs[-1]]
        rebinds += stmts[defs[-1] + 1:]
        if not last and not isinstance(node, ast.ClassDef):
            raise TargetNotFound(f"{target!r}: {name!r} is a function, not a class")
        scopes.append(node.body)
    # Attribute re-binding from an enclosing scope: `Cls.meth = ...` at module level,
    # `Inner.meth = ...` in the body of Outer, and so on.
    for depth in range(len(qualname) - 1):
        owner = ".".join(qualname[depth:-1])
        rebinds += [s for s in _flatten(scopes[depth]) if _rebinds_attribute(s, owner, qualname[-1])]
    return Resolved(target, rel, qualname, node, rebinds, bindings, tree.text(rel), module)


def _short(node: ast.AST, limit: int = 120) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- fingerprint material


class _StripDocstrings(ast.NodeTransformer):
    def _strip(self, node):
        self.generic_visit(node)
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _strip


def _dump(node) -> str:
    return ast.dump(node, annotate_fields=True, include_attributes=False)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def signature_of(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return f"class {node.name}({bases})"
    prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
    return f"{prefix}({ast.unparse(node.args)})"


def _shape(node: ast.AST) -> str:
    if isinstance(node, ast.AsyncFunctionDef):
        return "async"
    if isinstance(node, ast.FunctionDef):
        own = [n for n in _own_nodes(node) if isinstance(n, (ast.Yield, ast.YieldFrom))]
        return "generator" if own else "function"
    return "class"


def _own_nodes(func):
    """Nodes of a function body, not entering nested functions, classes or lambdas."""
    stack = list(func.body)
    while stack:
        n = stack.pop()
        yield n
        for child in ast.iter_child_nodes(n):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(child)


def _code_dump(node: ast.AST) -> str:
    """Decorators, annotations and body without the signature, docstrings dropped."""
    normalized = _StripDocstrings().visit(copy.deepcopy(node))
    if isinstance(normalized, ast.ClassDef):
        normalized.bases = []
    else:
        normalized.args = ast.arguments(
            posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
        )
    return _dump(normalized)


def _binding_material(stmt: ast.stmt, name: str) -> str:
    """A binding statement as fingerprint material; of an import, only the alias
    that binds ``name`` (other names added to the same import are not drift)."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        mine = [a for a in stmt.names if (a.asname or a.name.split(".")[0]) == name]
        stmt = copy.copy(stmt)
        stmt.names = mine
    return _dump(stmt)


def _binding_text(rebinds: list[ast.stmt], name: str) -> str:
    return "\n".join(_binding_material(s, name) for s in rebinds)


def node_components(found: Resolved, depends_on: str) -> dict[str, str]:
    """The parts of one resolved target that a fingerprint of scope ``depends_on`` covers."""
    if found.node is None:
        return {"signature": "variable", "value": _binding_text(found.bindings, found.qualname[-1])}
    parts = {"signature": signature_of(found.node)}
    if depends_on == "signature":
        decorators = getattr(found.node, "decorator_list", [])
        parts["decorators"] = "\n".join(_dump(d) for d in decorators)
        parts["shape"] = _shape(found.node)
    elif depends_on == "source":
        parts["code"] = _sha(_code_dump(found.node))
    else:
        raise ValueError(f"unknown fingerprint scope {depends_on!r}")
    parts["binding"] = _binding_text(found.rebinds, found.qualname[-1])
    return parts


MISSING = "<missing>"


def components_of(item, tree: SourceTree | None = None) -> dict[str, str]:
    """Everything the fingerprint of ``item`` (a Patch or a pinned Internal) covers.

    Raises TargetNotFound when the target itself (or a NEW_ATTRIBUTE's owner
    class) is not in the tree; a method listed in ``relies_on`` that is missing
    is recorded as such, so the fingerprint changes instead.
    """
    tree = tree or installed_tree()
    new_name = getattr(item, "new_attribute", None)
    allow_variable = getattr(item, "allows_variable", False)
    found = resolve(item.fingerprint_target, tree, allow_variable=allow_variable)
    if new_name is None:
        return node_components(found, item.depends_on)
    owner = found.node
    if not isinstance(owner, ast.ClassDef):
        raise TargetNotFound(f"{item.fingerprint_target!r} is not a class")
    parts = {
        "signature": signature_of(owner),
        "decorators": "\n".join(_dump(d) for d in owner.decorator_list),
        "binding": _binding_text(found.rebinds, found.qualname[-1]),
        "absent": "absent" if new_name_definition(found, new_name) is None else "defined upstream",
    }
    for method in item.relies_on:
        try:
            used = resolve(f"{item.fingerprint_target}.{method}", tree)
        except TargetNotFound:
            parts[f"relies_on:{method}"] = MISSING
            continue
        parts[f"relies_on:{method}"] = json.dumps(node_components(used, "source"), sort_keys=True)
    return parts


def new_name_definition(owner: Resolved, name: str) -> ast.stmt | None:
    """The statement defining ``name`` in the owner class, or re-binding it from outside."""
    inside = [s for s in _flatten(owner.node.body) if _binds(s, name)]
    if inside:
        return inside[-1]
    scopes = [owner.module.body]
    outside = []
    for depth in range(len(owner.qualname)):
        owner_dotted = ".".join(owner.qualname[depth:])
        outside += [s for s in _flatten(scopes[-1]) if _rebinds_attribute(s, owner_dotted, name)]
        nxt = [s for s in _flatten(scopes[-1]) if isinstance(s, ast.ClassDef)
               and s.name == owner.qualname[depth]]
        if not nxt:
            break
        scopes.append(nxt[-1].body)
    return outside[-1] if outside else None


def fingerprint_from_components(parts: dict[str, str]) -> Fingerprint:
    material = json.dumps(sorted(parts.items()))
    return Fingerprint(signature=parts["signature"], ast_sha=_sha(material))


def fingerprint_of(item, tree: SourceTree | None = None) -> Fingerprint:
    """THE fingerprint of a patch-table entry or a pinned internal in ``tree``."""
    return fingerprint_from_components(components_of(item, tree))


# ---------------------------------------------------------------- older helpers


def find_node(target: str, tree: SourceTree | None = None) -> ast.AST:
    found = resolve(target, tree)
    return found.node


def fingerprint_node(node: ast.AST) -> Fingerprint:
    """Whole-object fingerprint of one def or class (signature + code)."""
    normalized = _StripDocstrings().visit(copy.deepcopy(node))
    return Fingerprint(signature=signature_of(node), ast_sha=_sha(_dump(normalized)))


def fingerprint(target: str, tree: SourceTree | None = None) -> Fingerprint:
    return fingerprint_node(find_node(target, tree))


def is_generator_or_async(target: str, tree: SourceTree | None = None) -> bool:
    return _shape(find_node(target, tree)) in ("async", "generator")
