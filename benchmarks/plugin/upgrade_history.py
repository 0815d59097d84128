"""How many patch-table entries past sglang upgrades would have flagged, before and
after the fingerprints covered only what each hook depends on.

For each step between consecutive releases (default 0.5.20 -> 0.5.21 -> 0.5.22 ->
0.5.23), over the entries whose target existed in the older release:

- whole-object: the fingerprint every entry used to have (the whole def or class
  at its target; a NEW_ATTRIBUTE entry's whole owner class), no binding check;
- precise: ``upgrade-check``'s verdict (``upgrade_check.check_item``, the same
  fingerprint function the load-time check uses), older release as the pinned one.

Pinned internals had no fingerprint before, so only the precise count exists.

    PYTHONPATH=python .venv/bin/python benchmarks/plugin/upgrade_history.py \
        [--wheels DIR] [VERSION_OR_WHEEL ...]

With --wheels, ``DIR/<version>/sglang-<version>-*.whl`` is used when present;
anything else is fetched with ``pip download --no-deps`` (about 30-40 MB each).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from sglang_dsv41.plugin import fingerprint as fp
from sglang_dsv41.tools import upgrade_check as uc
from sglang_dsv41.plugin.table import PATCHES
from sglang_dsv41.plugin.internals import INTERNALS


def _open(spec: str, wheels: Path | None, workdir: Path) -> fp.SourceTree:
    if wheels is not None:
        found = sorted((wheels / spec).glob(f"sglang-{spec}-*.whl")) if (wheels / spec).is_dir() else []
        if found:
            return uc.open_tree(str(found[-1]), workdir)
    return uc.open_tree(spec, workdir)


def _whole_object_flag(patch, older: fp.SourceTree, newer: fp.SourceTree) -> bool:
    before = fp.fingerprint(patch.fingerprint_target, older)
    try:
        return fp.fingerprint(patch.fingerprint_target, newer) != before
    except fp.TargetNotFound:
        return True


def _exists(item, tree: fp.SourceTree) -> bool:
    try:
        fp.resolve(item.fingerprint_target, tree, allow_variable=item.allows_variable)
        return True
    except fp.TargetNotFound:
        return False


def step(older: fp.SourceTree, newer: fp.SourceTree) -> dict:
    entries = [p for p in PATCHES if _exists(p, older)]
    whole = [p.id for p in entries if _whole_object_flag(p, older, newer)]
    precise = {}
    for p in entries:
        finding = uc.check_item(p, older, newer, use_table=False)
        if finding.status != uc.SAME:
            precise[p.id] = f"{finding.status} ({'; '.join(finding.reasons)})"
    internals = [i for i in INTERNALS if _exists(i, older)]
    moved = {}
    for i in internals:
        finding = uc.check_item(i, older, newer, use_table=False)
        if finding.status != uc.SAME:
            moved[i.name] = f"{finding.status} ({'; '.join(finding.reasons)})"
    return {"entries": len(entries), "whole": whole, "precise": precise,
            "internals": len(internals), "internals_flagged": moved}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", default=["0.5.20", "0.5.21", "0.5.22", "0.5.23"])
    parser.add_argument("--wheels", type=Path, help="folder with <version>/sglang-<version>-*.whl")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="upgrade-history-") as tmp:
        try:
            trees = [_open(r, args.wheels, Path(tmp)) for r in args.releases]
        except uc.BadInput as exc:
            print(f"upgrade_history: {exc}", file=sys.stderr)
            return 2
        names = [t.version() or r for t, r in zip(trees, args.releases)]
        rows = []
        details = []
        for (a, older), (b, newer) in zip(zip(names, trees), zip(names[1:], trees[1:])):
            result = step(older, newer)
            rows.append(f"| {a} -> {b} | {result['entries']} | {len(result['whole'])} | "
                        f"{len(result['precise'])} | {len(result['internals_flagged'])} of "
                        f"{result['internals']} |")
            quiet = sorted(set(result["whole"]) - set(result["precise"]))
            details.append(f"{a} -> {b}:")
            details.append("  flagged by whole-object only (no longer flagged): " + (", ".join(quiet) or "none"))
            for pid, why in result["precise"].items():
                details.append(f"  precise {pid}: {why}")
            for name, why in result["internals_flagged"].items():
                details.append(f"  internal {name}: {why}")
    print("| step | entries whose target existed | flagged, whole-object | flagged, precise "
          "| pinned internals flagged |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
