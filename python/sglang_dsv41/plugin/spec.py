"""The shape of one patch-table entry. Plain data: importing this never imports sglang."""

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

    ``target`` is the dotted upstream path. For RESOLUTION it is the resolution
    step function (fingerprinted like any other function); for NEW_ATTRIBUTE it
    is ``<owner class path>.<new name>`` and the fingerprint is taken from the
    owner class, so an upstream change to the class is noticed.
    ``hook`` is ``module:callable`` inside this package, imported lazily.

    ``depends_on`` says what the hook relies on, and so what the fingerprint
    covers (see ``fingerprint``): ``"source"`` (signature and code, the default)
    or ``"signature"`` (a hook that only needs the call shape, such as a BEFORE
    on a constructor that reads its arguments). A NEW_ATTRIBUTE entry is
    fingerprinted by the owner class header, the absence of the new name and the
    owner's methods listed in ``relies_on`` (the ones the new code calls or
    whose behaviour it assumes).

    ``upstream`` names the upstream pull request or issue that would make the
    patch unnecessary, where one exists; ``remove_when`` is the condition under
    which the patch can go.
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
