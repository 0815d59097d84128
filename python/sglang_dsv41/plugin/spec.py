"""The shape of one patch-table entry. Plain data: importing this never imports sglang.

Design: docs/design/fingerprint.md (what an entry's fingerprint covers).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class HookKind(str, enum.Enum):
    # sglang HookRegistry kinds
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"
    # register_resolution_hook(step): wraps one named server-args resolution step
    RESOLUTION = "resolution"
    # setattr of a name upstream does not define; refused if upstream defines it
    NEW_ATTRIBUTE = "new_attribute"

    @property
    def uses_hook_registry(self) -> bool:
        return self in (HookKind.BEFORE, HookKind.AFTER, HookKind.AROUND, HookKind.REPLACE)


class Role(str, enum.Enum):
    """sglang process roles. Each patch names the roles that must run it."""

    LAUNCHER = "launcher"  # `sglang serve` / Engine process (args resolution, TokenizerManager)
    SCHEDULER = "scheduler"  # one per TP/PP/CP rank: model, runners, Mooncake KV manager
    TOKENIZER_WORKER = "tokenizer_worker"  # multi-tokenizer HTTP worker processes
    DETOKENIZER = "detokenizer"
    DP_CONTROLLER = "dp_controller"
    # with --detokenizer-worker-num > 1: fans scheduler output out to the detokenizers
    DETOKENIZER_ROUTER = "detokenizer_router"


@dataclass(frozen=True)
class Patch:
    """One change to sglang. The table in ``plugin.table`` is the only list of these.

    ``target``: the dotted upstream path; for RESOLUTION the resolution step
    function, for NEW_ATTRIBUTE ``<owner class path>.<new name>`` (fingerprinted
    through the owner class). ``hook``: ``module:callable`` in this package, imported
    lazily. ``depends_on``: what the fingerprint covers, ``"source"`` (signature and
    code) or ``"signature"`` (call shape only); ``relies_on``: the owner's methods a
    NEW_ATTRIBUTE's code calls or assumes. ``upstream``: the PR or issue that would
    make the patch unnecessary; ``remove_when``: when it can go.
    """

    id: str
    group: str
    target: str
    kind: HookKind
    hook: str
    roles: frozenset[Role]
    reason: str
    source: str
    signature: str
    ast_sha: str
    depends_on: str = "source"
    relies_on: tuple[str, ...] = ()
    upstream: str | None = None  # empty: the feature's
    remove_when: str = ""  # empty: the feature's

    @property
    def owner_path(self) -> str:
        return self.target.rsplit(".", 1)[0]

    @property
    def attribute(self) -> str:
        return self.target.rsplit(".", 1)[1]

    @property
    def fingerprint_target(self) -> str:
        """The upstream object whose source the fingerprint covers."""
        if self.kind is HookKind.NEW_ATTRIBUTE:
            return self.owner_path
        return self.target

    @property
    def new_attribute(self) -> str | None:
        """The name a NEW_ATTRIBUTE entry adds; None for every other kind."""
        return self.attribute if self.kind is HookKind.NEW_ATTRIBUTE else None

    allows_variable = False  # a patch target is always a def or a class

    @property
    def resolution_step(self) -> str:
        return self.attribute

    def hook_module(self) -> str:
        return self.hook.split(":", 1)[0]

    def hook_name(self) -> str:
        return self.hook.split(":", 1)[1]


@dataclass(frozen=True)
class Feature:
    """What one feature package is for, stated once for all of its patches.

    ``name`` is the package, the patch group, the ``test/`` and ``benchmarks/``
    folders and the feature's row in docs/PATCHES.md. A patch whose
    ``upstream`` or ``remove_when`` is empty goes with the feature's.
    """

    name: str
    summary: str
    upstream: str | None = None
    remove_when: str = ""
    design_note: str | None = None  # docs/design/<name>.md, where the feature has a protocol

    def remove_when_of(self, patch: Patch) -> str:
        return patch.remove_when or self.remove_when

    def upstream_of(self, patch: Patch) -> str | None:
        return patch.upstream or self.upstream


def roles(*names: Role) -> frozenset[Role]:
    return frozenset(names)
