"""Fingerprints of upstream functions and classes, read from the installed files.

Nothing here imports sglang: the source file of a dotted target is found on disk
(``importlib.util.find_spec`` of the top-level package only) and parsed with
``ast``. A fingerprint is the signature plus a hash of the normalized AST, so a
reformat or a docstring edit does not count as drift but any code change does.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path


class TargetNotFound(LookupError):
    pass


@dataclass(frozen=True)
class Fingerprint:
    signature: str
    ast_sha: str


def package_root(top_level: str = "sglang") -> Path:
    spec = importlib.util.find_spec(top_level)
    if spec is None or not spec.submodule_search_locations:
        raise TargetNotFound(f"package {top_level!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def installed_version(dist: str = "sglang") -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def locate(target: str) -> tuple[Path, list[str]]:
    """Split a dotted target into (source file, qualname parts inside it)."""
    parts = target.split(".")
    root = package_root(parts[0])
    for split in range(len(parts), 0, -1):
        rel = parts[1:split]
        as_module = root.joinpath(*rel).with_suffix(".py") if rel else None
        as_package = root.joinpath(*rel, "__init__.py")
        for candidate in (as_module, as_package):
            if candidate is not None and candidate.is_file():
                return candidate, parts[split:]
    raise TargetNotFound(f"no source file for {target!r} under {root}")


@functools.lru_cache(maxsize=64)
def _parse(path: str, mtime_ns: int) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)


def _definitions(body):
    """Top-level definitions, including those under module-level if/try blocks."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        elif isinstance(node, ast.If):
            yield from _definitions(node.body)
            yield from _definitions(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _definitions(node.body)


def find_node(target: str) -> ast.AST:
    path, qualname = locate(target)
    if not qualname:
        raise TargetNotFound(f"{target!r} names a module, not a function or class")
    scope = _parse(str(path), path.stat().st_mtime_ns).body
    node = None
    for name in qualname:
        matches = [n for n in _definitions(scope) if n.name == name]
        if not matches:
            raise TargetNotFound(f"{target!r}: {name!r} is not defined in {path}")
        node = matches[-1]  # the last definition is the one Python keeps
        scope = getattr(node, "body", [])
    return node


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


def signature_of(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return f"class {node.name}({bases})"
    prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
    return f"{prefix}({ast.unparse(node.args)})"


def fingerprint_node(node: ast.AST) -> Fingerprint:
    import copy

    normalized = _StripDocstrings().visit(copy.deepcopy(node))
    dump = ast.dump(normalized, annotate_fields=True, include_attributes=False)
    digest = hashlib.sha256(dump.encode()).hexdigest()[:16]
    return Fingerprint(signature=signature_of(node), ast_sha=digest)


def fingerprint(target: str) -> Fingerprint:
    return fingerprint_node(find_node(target))


def is_generator_or_async(target: str) -> bool:
    node = find_node(target)
    if isinstance(node, ast.AsyncFunctionDef):
        return True
    if isinstance(node, ast.FunctionDef):
        own = [n for n in ast.walk(node) if isinstance(n, (ast.Yield, ast.YieldFrom))]
        return bool(own)
    return False
