"""``sglang-dsv41 fingerprint``: compare, or rewrite in the source checkout, the table's fingerprints."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from sglang_dsv41.plugin import fingerprint as fp
from sglang_dsv41.plugin.pin import DISTRIBUTION_NAME
from sglang_dsv41.plugin.table import FEATURE_MODULES, PATCHES

def _rewrite_fingerprints(table_path: Path, items, call_name: str, key: str,
                          namespace: dict, only: set[str] | None = None) -> int:
    """Rewrite the signature/ast_sha literals of every ``call_name(...)`` entry of a
    table module from the installed sources (``key`` is the field naming it)."""
    text = table_path.read_text()
    tree = ast.parse(text)
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    by_key = {item.id: item for item in items}
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == call_name):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        # The key may be built from module constants (an f-string): evaluate it there.
        name = eval(compile(ast.Expression(kw[key]), str(table_path), "eval"), dict(namespace))
        item = by_key[name]
        if only and item.id not in only:
            continue
        got = fp.fingerprint_of(item)
        for field, value in (("signature", got.signature), ("ast_sha", got.ast_sha)):
            v = kw[field]
            start = offsets[v.lineno - 1] + v.col_offset
            end = offsets[v.end_lineno - 1] + v.end_col_offset
            edits.append((start, end, json.dumps(value)))  # a valid Python str literal
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    table_path.write_text(text)
    return len(edits) // 2


def _source_checkout_of(module_file: str) -> Path | None:
    """The source checkout this package is imported from, or None for an installed copy.

    ``fingerprint --update`` rewrites Python sources; doing that to a copy in
    site-packages would silently change what the loader checks on that machine.
    """
    package_dir = Path(module_file).resolve().parent
    pyproject = package_dir.parent / "pyproject.toml"
    if "site-packages" in package_dir.parts or "dist-packages" in package_dir.parts:
        return None
    try:
        declares_us = f'name = "{DISTRIBUTION_NAME}"' in pyproject.read_text()
    except OSError:
        return None
    return package_dir.parent if declares_us else None


def fingerprint_cmd(args) -> int:
    from sglang_dsv41.plugin import internals as pinned_internals

    items = PATCHES + pinned_internals.INTERNALS
    known = {item.id for item in items}
    unknown = [i for i in args.ids if i not in known]
    if unknown:
        print(f"fingerprint: unknown id(s) {', '.join(unknown)}; known ids are the patch ids of "
              "docs/PATCHES.md and the pinned internals' names", file=sys.stderr)
        return 2
    if args.update:
        import sglang_dsv41

        if _source_checkout_of(sglang_dsv41.__file__) is None:
            print(f"fingerprint --update: refusing to rewrite {Path(sglang_dsv41.__file__).parent}: it is "
                  "not a source checkout of this package (run it from the repository, "
                  "`pip install -e ./python`)", file=sys.stderr)
            return 2
        only = set(args.ids) or None
        n = sum(_rewrite_fingerprints(Path(module.__file__), module.PATCHES, "Patch", "id", vars(module), only)
                for module in FEATURE_MODULES)
        m = _rewrite_fingerprints(Path(pinned_internals.__file__), pinned_internals.INTERNALS,
                                  "Internal", "name", vars(pinned_internals), only)
        print(f"rewrote fingerprints of {n} patches in the features' patches.py and of {m} internals "
              f"in {pinned_internals.__file__}")
        return 0
    wanted = set(args.ids)
    rows = []
    for item in items:
        if wanted and item.id not in wanted:
            continue
        row = {"id": item.id, "target": item.fingerprint_target,
               "expected": {"ast_sha": item.ast_sha, "signature": item.signature}}
        try:
            got = fp.fingerprint_of(item)
        except fp.TargetNotFound as exc:
            row.update(verdict="MISSING", found=None, reason=str(exc))
        else:
            same = got.signature == item.signature and got.ast_sha == item.ast_sha
            row.update(verdict="same" if same else "DRIFT",
                       found={"ast_sha": got.ast_sha, "signature": got.signature})
        rows.append(row)
    drift = sum(r["verdict"] != "same" for r in rows)
    if args.json:
        print(json.dumps({"sglang": fp.installed_version("sglang"), "drifted": drift,
                          "targets": rows}, indent=2))
    else:
        for r in rows:
            if r["found"] is None:
                print(f"{r['id']}: MISSING {r['reason']}")
            else:
                print(f"{r['id']}: {r['verdict']} {r['target']} "
                      f"{r['found']['ast_sha']} {r['found']['signature']}")
    return 1 if drift else 0
