"""The prefill's opened peer maps, one per decode session, and when each one closes.

An opened CUDA IPC mapping keeps the decode's allocation alive: a decode that
restarts while the prefill still maps its old KV pool would find that memory
taken. So a session's mapping closes (once no write uses it) when its decode
stops answering probes (``probe``: a restart comes back under a new session id
and new ports, so nothing else tells its old incarnation is gone), when the
session registers again, when sglang counts it failed, when the manager is torn
down (and none opens after), and when more than ``limit`` sessions are mapped
(the one mapped longest ago goes first).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from sglang_dsv41.mooncake_nvlink.kv_staging.peer import (
    FALLBACK_NO_PEER_MAP,
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
# A mapped decode is probed this often; this many unanswered probes in a row mean its
# process is gone. A dead process refuses at once; a restarted decode loads its weights
# for minutes before it sizes its KV pool, so the old pool is free long before.
PROBE_INTERVAL_S = 2.0
PROBE_MISSES = 3

# Why a mapping was let go: the labels of sglang_dsv41_kv_staging_peer_maps_total.
REGISTERED_AGAIN = "registered_again"
DECODE_GONE = "decode_gone"
SESSION_FAILED = "session_failed"
LIMIT = "limit"
TEARDOWN = "teardown"


@dataclass
class _Mapped:
    peer: PeerMap
    target: Optional[PeerTarget]  # None: the map could not be opened (counted, direct path)
    misses: int = 0  # probes unanswered in a row (only the probing thread counts)


class SessionMappings:
    def __init__(self, transport: PeerTransport, limit: int = MAX_MAPPED_SESSIONS,
                 on_release: Optional[Callable[[str], None]] = None):
        self.transport = transport
        self.limit = limit
        self._on_release = on_release  # told the reason (a metric label) of each mapping let go
        self._by_session: dict[str, _Mapped] = {}
        self._lock = threading.Lock()
        self._closed = False  # torn down: sends that still run go the direct way

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_session)

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._by_session)

    def target(self, session: str, peer: PeerMap) -> tuple[Optional[PeerTarget], Optional[str]]:
        """The opened map of ``session``'s registration ``peer``, or (None, why not)."""
        with self._lock:
            if self._closed:
                return None, FALLBACK_NO_PEER_MAP
            known = self._by_session.get(session)
            if known is not None and known.peer is peer:
                return known.target, (None if known.target is not None else FALLBACK_PEER_MAP_FAILED)
            if known is not None:
                self._let_go(session, REGISTERED_AGAIN)
            while len(self._by_session) >= self.limit:
                self._let_go(next(iter(self._by_session)), LIMIT, f"more than {self.limit} sessions")
            try:
                target = self.transport.open(peer)
                logger.info("[sglang-dsv41] KV peer writes: mapped decode session %s (%d regions in %d "
                            "allocations, %s)", session, len(peer.regions), len(peer.handles), peer.kind)
            except Exception as exc:  # a map this side cannot open is the decode's word, not our crash
                logger.error("[sglang-dsv41] KV peer writes: cannot map decode session %s (%s): %s; its "
                             "batches go the direct way", session, peer.kind,
                             exc if isinstance(exc, PeerMapError) else f"{type(exc).__name__}: {exc}")
                target = None
            self._by_session[session] = _Mapped(peer, target)
        return target, (None if target is not None else FALLBACK_PEER_MAP_FAILED)

    def probe(self, answers: Callable[[str], bool], misses: int = PROBE_MISSES) -> list[str]:
        """One pass over the mapped sessions: ``answers(session)`` says whether its decode
        is alive. Returns the sessions let go because they missed ``misses`` probes in a row.
        Probes run outside the lock (one may wait on a network timeout)."""
        with self._lock:
            mapped = [(s, m) for s, m in self._by_session.items() if m.target is not None]
        gone = []
        for session, entry in mapped:
            entry.misses = 0 if answers(session) else entry.misses + 1
            if entry.misses < misses:
                continue
            with self._lock:
                if self._by_session.get(session) is entry:  # not registered again meanwhile
                    self._let_go(session, DECODE_GONE, f"{entry.misses} probes unanswered")
                    gone.append(session)
        return gone

    def drop(self, sessions: Iterable[str], reason: str) -> int:
        """Let go of these sessions' mappings (each closes once idle); how many were mapped."""
        with self._lock:
            gone = [s for s in sessions if s in self._by_session]
            for session in gone:
                self._let_go(session, reason)
        return len(gone)

    def close_all(self, reason: str) -> int:
        """Let go of every mapping, and map nothing from now on."""
        with self._lock:
            self._closed = True
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
