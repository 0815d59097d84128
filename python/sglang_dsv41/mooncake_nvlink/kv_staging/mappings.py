"""The prefill's opened peer maps, one per decode session, and when each one closes.

An opened CUDA IPC mapping keeps the decode's allocation alive: a decode that
restarts while the prefill still maps its old KV pool would find that memory
taken. So a session's mapping closes (once no write uses it) when the decode
registers again, when another session registers from the same decode endpoint
(a restart gets a new session id), when sglang counts the session failed, when
the manager is torn down, and when more than ``limit`` sessions are mapped
(the one mapped longest ago goes first).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from sglang_dsv41.mooncake_nvlink.kv_staging.peer import (
    FALLBACK_PEER_MAP_FAILED,
    PeerMap,
    PeerMapError,
    PeerTarget,
    PeerTransport,
)

logger = logging.getLogger("sglang_dsv41.mooncake")

# Decode ranks one prefill rank writes to; far above any one node's (8 decode ranks
# per decode server, a few servers), low enough that a churn of restarts holds no
# unbounded device memory.
MAX_MAPPED_SESSIONS = 64

# Why a mapping was let go: the labels of sglang_dsv41_kv_staging_peer_maps_total.
REGISTERED_AGAIN = "registered_again"
ENDPOINT_REUSED = "endpoint_reused"
SESSION_FAILED = "session_failed"
LIMIT = "limit"
TEARDOWN = "teardown"


@dataclass
class _Mapped:
    peer: PeerMap
    target: Optional[PeerTarget]  # None: the map could not be opened (counted, direct path)
    endpoint: Optional[tuple]


class SessionMappings:
    def __init__(self, transport: PeerTransport, limit: int = MAX_MAPPED_SESSIONS,
                 on_release: Optional[Callable[[str], None]] = None):
        self.transport = transport
        self.limit = limit
        self._on_release = on_release  # told the reason (a metric label) of each mapping let go
        self._by_session: dict[str, _Mapped] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_session)

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._by_session)

    def target(self, session: str, peer: PeerMap, endpoint: Optional[tuple]) -> tuple[Optional[PeerTarget], Optional[str]]:
        """The opened map of ``session``'s registration ``peer``, or (None, why not)."""
        with self._lock:
            known = self._by_session.get(session)
            if known is not None and known.peer is peer:
                return known.target, (None if known.target is not None else FALLBACK_PEER_MAP_FAILED)
            if known is not None:
                self._let_go(session, REGISTERED_AGAIN)
            if endpoint is not None:
                for other, mapped in list(self._by_session.items()):
                    if mapped.endpoint == endpoint:
                        self._let_go(other, ENDPOINT_REUSED, f"now session {session}")
            while len(self._by_session) >= self.limit:
                self._let_go(next(iter(self._by_session)), LIMIT, f"more than {self.limit} sessions")
            try:
                target = self.transport.open(peer)
                logger.info("[sglang-dsv41] KV peer writes: mapped decode session %s (%d regions in %d "
                            "allocations, %s)", session, len(peer.regions), len(peer.handles), peer.kind)
            except (PeerMapError, OSError) as exc:
                logger.error("[sglang-dsv41] KV peer writes: cannot map decode session %s (%s): %s; its "
                             "batches go the direct way", session, peer.kind, exc)
                target = None
            self._by_session[session] = _Mapped(peer, target, endpoint)
        return target, (None if target is not None else FALLBACK_PEER_MAP_FAILED)

    def drop(self, sessions: Iterable[str], reason: str) -> int:
        """Let go of these sessions' mappings (each closes once idle); how many were mapped."""
        with self._lock:
            gone = [s for s in sessions if s in self._by_session]
            for session in gone:
                self._let_go(session, reason)
        return len(gone)

    def close_all(self, reason: str) -> int:
        return self.drop(self.sessions(), reason)

    def _let_go(self, session: str, reason: str, detail: str = "") -> None:  # caller holds the lock
        mapped = self._by_session.pop(session)
        if mapped.target is None:
            return
        mapped.target.retire()
        logger.info("[sglang-dsv41] KV peer writes: released the mapping of decode session %s "
                    "(closed once idle): %s%s", session, reason, f", {detail}" if detail else "")
        if self._on_release is not None:
            self._on_release(reason)
