"""Render docs/PATCHES.md from the patch table (the doc is generated, never edited)."""

from __future__ import annotations

from sglang_dsv41._pin import PINNED_SGLANG_VERSION
from sglang_dsv41.patch_table import PATCHES


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


def render() -> str:
    lines = [
        "# Patches carried by sglang-dsv41",
        "",
        "Generated from `python/sglang_dsv41/patch_table.py` by "
        "`sglang-dsv41 patches-doc --write docs/PATCHES.md`; a test fails when it is stale.",
        f"Fingerprints are of sglang {PINNED_SGLANG_VERSION}'s installed sources "
        "(sha256 of what each hook depends on, normalized AST, first 16 hex digits; "
        "see `fingerprint.py`). `sglang-dsv41 upgrade-check` compares a new release "
        "against them (docs/UPGRADING.md).",
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
            f"- fingerprint covers: {_covers(p)}",
            f"- upstream signature: `{_cell(p.signature)}`",
            f"- upstream ast sha: `{p.ast_sha}`",
            f"- upstream change that would make it unnecessary: {_cell(p.upstream or 'none known')}",
            f"- remove when: {_cell(p.remove_when or 'not stated')}",
            "",
        ]
    return "\n".join(lines)
