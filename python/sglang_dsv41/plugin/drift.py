"""Load-time checks of the installed sglang against the patch table (no sglang import)."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_dsv41.plugin import fingerprint as fp
from sglang_dsv41.plugin.pin import PINNED_SGLANG_VERSION
from sglang_dsv41.plugin.spec import HookKind, Patch


@dataclass(frozen=True)
class Problem:
    patch_id: str | None  # None: not tied to one patch (the version pin)
    target: str | None
    message: str

    def __str__(self) -> str:
        if self.patch_id is None:
            return self.message
        return f"patch {self.patch_id} ({self.target}): {self.message}"


def version_problem() -> Problem | None:
    found = fp.installed_version("sglang")
    # Local labels (+cu130) are builds of the same release; anything else is not.
    if found is None or found.split("+", 1)[0] != PINNED_SGLANG_VERSION:
        return Problem(
            None,
            None,
            f"sglang {found or 'is not installed'}"
            f"{'' if found is None else ' is installed'}; sglang-dsv41 is written "
            f"against sglang=={PINNED_SGLANG_VERSION} only",
        )
    return None


def patch_problems(patch: Patch) -> list[Problem]:
    def problem(msg: str) -> Problem:
        return Problem(patch.id, patch.target, msg)

    try:
        got = fp.fingerprint_of(patch)  # the same function upgrade-check uses
    except fp.TargetNotFound as exc:
        return [problem(f"upstream target not found: {exc}")]
    out = []
    if got.signature != patch.signature:
        out.append(
            problem(f"signature drifted: expected {patch.signature!r}, found {got.signature!r}")
        )
    if got.ast_sha != patch.ast_sha:
        out.append(
            problem(f"source drifted: expected ast sha {patch.ast_sha}, found {got.ast_sha}")
        )
    if patch.kind is HookKind.AFTER and fp.is_generator_or_async(patch.target):
        out.append(problem("AFTER hooks cannot wrap an async or generator function"))
    if patch.kind is HookKind.NEW_ATTRIBUTE:
        try:
            fp.find_node(patch.target)
        except fp.TargetNotFound:
            pass
        else:
            out.append(problem("upstream now defines this attribute; ours would shadow it"))
    return out


def all_problems(patches) -> list[Problem]:
    found = []
    pin = version_problem()
    if pin is not None:
        found.append(pin)
    for patch in patches:
        found.extend(patch_problems(patch))
    return found
