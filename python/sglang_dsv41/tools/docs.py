"""Render docs/PATCHES.md from the patch table (the doc is generated, never edited)."""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

from sglang_dsv41.plugin.pin import PINNED_SGLANG_VERSION
from sglang_dsv41.plugin.table import FEATURES, PATCHES, feature_of


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _covers(p) -> str:
    if p.new_attribute:
        relied = ", ".join(f"`{m}`" for m in p.relies_on) or "none"
        return (f"the owner class header, `{p.new_attribute}` still absent upstream, and the "
                f"code of the methods it relies on ({relied})")
    if p.depends_on == "signature":
        return "signature, decorators and binding only (the hook does not depend on the body)"
    return "signature, code and binding"


def _folder(name: str) -> str:
    return "mooncake_nvlink/kv_staging" if name == "kv_staging" else name


def render() -> str:
    lines = [
        "# Patches carried by sglang-dsv41",
        "",
        "Generated from each feature's `python/sglang_dsv41/<feature>/patches.py`, assembled in "
        "`plugin/table.py`, by `sglang-dsv41 patches-doc --write docs/PATCHES.md`; a test fails "
        "when it is stale.",
        f"Fingerprints are of sglang {PINNED_SGLANG_VERSION}'s installed sources "
        "(sha256 of what each hook depends on, normalized AST, first 16 hex digits; "
        "see `plugin/fingerprint.py`). `sglang-dsv41 upgrade-check` compares a new release "
        "against them (docs/UPGRADING.md).",
        "",
        f"{len(FEATURES)} features, {len(PATCHES)} patches, registered in this order.",
        "",
        "| feature | what it does | patches | package | upstream | remove when |",
        "|---|---|---|---|---|---|",
    ]
    for f in FEATURES:
        count = sum(p.group == f.name for p in PATCHES)
        design = f" ([design](design/{f.name}.md))" if f.design_note else ""
        lines.append(f"| {f.name} | {_cell(f.summary)}{design} | {count} | `{_folder(f.name)}/` | "
                     f"{_cell(f.upstream or 'none known')} | {_cell(f.remove_when or 'not stated')} |")
    lines += [
        "",
        "| id | feature | target | kind | roles | hook |",
        "|---|---|---|---|---|---|",
    ]
    for p in PATCHES:
        role_list = ", ".join(sorted(r.value for r in p.roles))
        lines.append(
            f"| {p.id} | {p.group} | `{p.target}` | {p.kind.value} | {role_list} | `{p.hook}` |"
        )
    lines.append("")
    for p in PATCHES:
        feature = feature_of(p)
        lines += [
            f"## {p.id}",
            "",
            f"- feature: {p.group}",
            f"- target: `{p.target}` ({p.kind.value})",
            f"- roles: {', '.join(sorted(r.value for r in p.roles))}",
            f"- why: {_cell(p.reason)}",
            f"- behaviour from: {_cell(p.source)}",
            f"- fingerprint covers: {_covers(p)}",
            f"- upstream signature: `{_cell(p.signature)}`",
            f"- upstream ast sha: `{p.ast_sha}`",
            f"- upstream change that would make it unnecessary: "
            f"{_cell(feature.upstream_of(p) or 'none known')}",
            f"- remove when: {_cell(p.remove_when or 'with the feature (above)')}",
            "",
        ]
    return "\n".join(lines)


MAX_DOC_BYTES = 4 << 20  # a README or PATCHES.md is far smaller


def _regular_file_or_none(path: Path) -> str | None:
    """Why ``path`` is no file a document can be written to (None: it is one, or not there yet)."""
    try:
        info = path.stat()
    except OSError:  # not there (yet), or a path the write itself reports on
        return None
    if stat.S_ISDIR(info.st_mode):
        return os.strerror(errno.EISDIR)
    if not stat.S_ISREG(info.st_mode):  # a device or a pipe: reading or writing it may never end
        return "not a regular file"
    if info.st_size > MAX_DOC_BYTES:
        return f"{info.st_size} bytes, more than a document this tool writes ({MAX_DOC_BYTES})"
    return None


def patches_doc_cmd(args) -> int:
    text = render()
    if args.write:
        why = _regular_file_or_none(Path(args.write))
        if why is not None:
            print(f"patches-doc: cannot write {args.write}: {why}", file=sys.stderr)
            return 2
        try:
            Path(args.write).write_text(text)
        except OSError as exc:  # a missing folder, a folder in its place, no permission
            print(f"patches-doc: cannot write {args.write}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(text)
    return 0


def settings_doc_cmd(args) -> int:
    from sglang_dsv41.plugin.settings import render_table, replace_table

    if not args.write:
        print(render_table())
        return 0
    path = Path(args.write)
    why = _regular_file_or_none(path)
    if why is not None:
        print(f"settings-doc: cannot update {path}: {why}", file=sys.stderr)
        return 2
    try:
        text = path.read_text()
        updated = replace_table(text)
    except (OSError, ValueError) as exc:
        print(f"settings-doc: cannot update {path}: {exc}", file=sys.stderr)
        return 2
    try:
        path.write_text(updated)
    except OSError as exc:
        print(f"settings-doc: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote the runtime-switches table in {path}")
    return 0
