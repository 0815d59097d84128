"""Render docs/PATCHES.md from the patch table (the doc is generated, never edited)."""

from __future__ import annotations

from sglang_dsv41._pin import PINNED_SGLANG_VERSION
from sglang_dsv41.patch_table import PATCHES


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render() -> str:
    lines = [
        "# Patches carried by sglang-dsv41",
        "",
        "Generated from `python/sglang_dsv41/patch_table.py` by "
        "`sglang-dsv41 patches-doc --write docs/PATCHES.md`; a test fails when it is stale.",
        f"Fingerprints are of sglang {PINNED_SGLANG_VERSION}'s installed sources "
        "(signature + sha256 of the normalized AST, first 16 hex digits).",
        "",
        f"{len(PATCHES)} patches.",
        "",
        "| id | group | target | kind | roles | hook |",
        "|---|---|---|---|---|---|",
    ]
    for p in PATCHES:
        role_list = ", ".join(sorted(r.value for r in p.roles))
        lines.append(
            f"| {p.id} | {p.group} | `{p.target}` | {p.kind.value} | {role_list} | `{p.hook}` |"
        )
    lines.append("")
    for p in PATCHES:
        lines += [
            f"## {p.id}",
            "",
            f"- target: `{p.target}` ({p.kind.value})",
            f"- roles: {', '.join(sorted(r.value for r in p.roles))}",
            f"- why: {_cell(p.reason)}",
            f"- behaviour from: {_cell(p.source)}",
            f"- upstream signature: `{_cell(p.signature)}`",
            f"- upstream ast sha: `{p.ast_sha}`",
            "",
        ]
    return "\n".join(lines)
