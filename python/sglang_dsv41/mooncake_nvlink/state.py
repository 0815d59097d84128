"""The intra-node NVLink routing record of one MooncakeKVManager, kept in its instance dict.

Plain: both hook modules (routing and KV staging) read it, and neither imports
the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_dsv41.mooncake_nvlink.routing import KindTable, MemoryAccess, TransferRouter

ROUTING_STATE_ATTR = "_dsv41_nvlink_routing"


@dataclass
class RoutingState:
    reason: str  # why the intra-node NVLink transport counts as active
    memory: MemoryAccess
    router: TransferRouter
    kinds: KindTable


def routing_state(manager) -> Optional[RoutingState]:
    state = manager.__dict__.get(ROUTING_STATE_ATTR)
    return state if isinstance(state, RoutingState) else None


def set_routing_state(manager, state: RoutingState) -> None:
    manager.__dict__[ROUTING_STATE_ATTR] = state
