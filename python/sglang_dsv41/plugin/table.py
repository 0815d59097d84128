"""THE patch table: every change this package makes to sglang, and nothing else.

Each feature package states its entries in its own ``patches.py``; this module
assembles them in one order, which is also the order hooks on one function
nest in. The loader registers exactly these entries, each process role
verifies exactly these entries, and ``docs/PATCHES.md`` is generated from them.

Fingerprints are taken from sglang 0.5.23's installed sources by
``sglang-dsv41 fingerprint --update``, which rewrites them in each feature's
``patches.py``; see AGENTS.md before changing one.
"""

from __future__ import annotations

from types import ModuleType

from sglang_dsv41.activation import patches as activation
from sglang_dsv41.cp_bcg import patches as cp_bcg
from sglang_dsv41.embed_overrides import patches as embed_overrides
from sglang_dsv41.launch_guards import patches as launch_guards
from sglang_dsv41.mooncake_nvlink import patches as mooncake_nvlink
from sglang_dsv41.mooncake_nvlink.kv_staging import patches as kv_staging
from sglang_dsv41.owner_broadcast import patches as owner_broadcast
from sglang_dsv41.pd_handshake import patches as pd_handshake
from sglang_dsv41.pd_retraction import patches as pd_retraction
from sglang_dsv41.plugin.spec import Feature, Patch, Role
from sglang_dsv41.vision_cp import patches as vision_cp

# Registration order: hooks on one upstream function nest by it.
FEATURE_MODULES: tuple[ModuleType, ...] = (
    activation, vision_cp, owner_broadcast, mooncake_nvlink, kv_staging,
    pd_handshake, pd_retraction, embed_overrides, launch_guards, cp_bcg,
)
FEATURES: tuple[Feature, ...] = tuple(m.FEATURE for m in FEATURE_MODULES)
PATCHES: tuple[Patch, ...] = tuple(p for m in FEATURE_MODULES for p in m.PATCHES)


def by_id() -> dict[str, Patch]:
    return {p.id: p for p in PATCHES}


def feature_of(patch: Patch) -> Feature:
    return next(f for f in FEATURES if f.name == patch.group)


def owed_to(role: Role) -> tuple[Patch, ...]:
    return tuple(p for p in PATCHES if role in p.roles)
