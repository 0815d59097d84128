"""The intra-node NVLink routing record of one MooncakeKVManager, kept in its instance dict.

Plain: both hook modules (routing and KV staging) read it, and neither imports
the other for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from sglang_dsv41.mooncake_nvlink.routing import KindTable, MemoryAccess, TransferRouter, address_is_here, session_host

ROUTING_STATE_ATTR = "_dsv41_nvlink_routing"


@dataclass
class RoutingState:
    reason: str  # why the intra-node NVLink transport counts as active
    memory: MemoryAccess
    router: TransferRouter
    kinds: KindTable
    # Decode session id -> whether it runs on this host, decided at its first transfer.
    peer_here: dict = field(default_factory=dict)
    peer_lock: threading.Lock = field(default_factory=threading.Lock)

    def place_peer(self, session_id: str) -> tuple[bool, bool]:
        """(the decode of ``session_id`` runs on this host, this call decided it).

        A peer is remote only when its address is certainly not this machine's;
        one the kernel cannot place keeps the intra-node pieces."""
        here = self.peer_here.get(session_id)
        if here is not None:
            return here, False
        with self.peer_lock:
            if session_id in self.peer_here:
                return self.peer_here[session_id], False
            here = address_is_here(session_host(session_id)) is not False
            self.peer_here[session_id] = here
            return here, True


def routing_state(manager) -> Optional[RoutingState]:
    state = manager.__dict__.get(ROUTING_STATE_ATTR)
    return state if isinstance(state, RoutingState) else None


def set_routing_state(manager, state: RoutingState) -> None:
    manager.__dict__[ROUTING_STATE_ATTR] = state
