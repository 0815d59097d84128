"""Held peer writes: a transfer worker's last chunk of a request, written as one copy.

In peer mode the worker's queue is wrapped (``ChunkAwareQueue``): when the
worker takes a request's last chunk, its KV and state sends are held on this
thread instead of written at once, and the hooks write them together
(``flush_held``) before the status that completes the request, or drop them
(``drop_held``) when the request failed. Plain: no sglang import.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from sglang_dsv41 import metrics
from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PeerWrites

logger = logging.getLogger("sglang_dsv41.mooncake")

_thread = threading.local()


def holding() -> Optional[PeerWrites]:
    """This thread's held writes while it sends a last chunk in peer mode, else None."""
    return getattr(_thread, "writes", None)


def hold(writes: Optional[PeerWrites]) -> None:
    """Hold this thread's sends in ``writes`` from now on (None: write them at once)."""
    _thread.writes = writes


def flush_held(where: str) -> Optional[str]:
    """Write this thread's held writes; None, or why they failed (the request's failure)."""
    writes = holding()
    if writes is None or not len(writes):
        return None
    calls = writes.calls
    try:
        writes.flush()
    except Exception as exc:
        metrics.count_kv_staging("kv_staging_held_writes", "failed")
        logger.error("[sglang-dsv41] KV peer write of %d held sends (%s) failed: %s: %s",
                     calls, where, type(exc).__name__, exc)
        return f"KV peer write of a request's last sends failed: {type(exc).__name__}: {exc}"
    metrics.count_kv_staging("kv_staging_held_writes", "written")
    return None


def drop_held(why: str) -> None:
    writes = holding()
    if writes is not None and len(writes):
        metrics.count_kv_staging("kv_staging_held_writes", "dropped")
        logger.warning("[sglang-dsv41] KV peer writes: %d held sends dropped unwritten (%s)", writes.calls, why)
        writes.discard()


def current_room() -> Optional[int]:
    """The room of the chunk this transfer worker took last, None off a transfer worker."""
    return getattr(_thread, "room", None)


def fail_room(manager, why: str) -> int:
    """A failed peer write fails its request, not the decode session: the room is concluded
    failed here, every later send of it on this worker is dropped (``room_failed``), and sglang
    is told the send returned (its own handling of a failed send would also give up on every
    request of that decode). Nothing of the write is in flight: it was waited for. Off a
    transfer worker the room is unknown: -1, sglang's own handling."""
    room = current_room()
    if room is None:
        return -1
    drop_held("its request failed")
    _thread.failed_room = room
    manager.conclude_failure(bootstrap_room=room, failure_reason=why)
    return 0


def room_failed() -> bool:
    """Whether this worker's current chunk belongs to a room a peer write failed: send nothing more."""
    room = current_room()
    return room is not None and getattr(_thread, "failed_room", None) == room


class ChunkAwareQueue:
    """A transfer worker's queue that tells this module which chunk (and room) the worker took."""

    def __init__(self, queue):
        self._queue = queue

    def get(self, *args, **kwargs):
        drop_held("the worker took its next chunk")
        _thread.writes = None
        chunk = self._queue.get(*args, **kwargs)
        # sglang skips a failed room's later chunks before any send: the mark ends with its chunk
        _thread.room, _thread.failed_room = getattr(chunk, "room", None), None
        if getattr(chunk, "is_last_chunk", False):
            _thread.writes = _thread.pool = getattr(_thread, "pool", None) or PeerWrites()
        return chunk

    def __getattr__(self, name):
        return getattr(self._queue, name)
