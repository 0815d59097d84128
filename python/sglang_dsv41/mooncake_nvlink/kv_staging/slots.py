"""KV staging for Mooncake PD transfers: a batch of many small blocks as one engine write.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import Allocation, BatchCopy
from sglang_dsv41.mooncake_nvlink.routing import AUX_DATA_HEADER, parse_decimal
from sglang_dsv41.mooncake_nvlink.kv_staging.peer import DEFAULT_PEER_MIN_BLOCKS, as_triples

# --- settings -------------------------------------------------------------------

STAGING_ENV = "SGLANG_DSV41_KV_STAGING"
SLOTS_ENV = "SGLANG_DSV41_KV_STAGING_SLOTS"
SLOT_MB_ENV = "SGLANG_DSV41_KV_STAGING_SLOT_MB"
MIN_BLOCKS_ENV = "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS"
ACK_TIMEOUT_ENV = "SGLANG_DSV41_KV_STAGING_ACK_TIMEOUT_S"

DEFAULT_SLOTS = 8
DEFAULT_SLOT_MB = 32
DEFAULT_MIN_BLOCKS = 128
DEFAULT_ACK_TIMEOUT_S = 30.0
MAX_SLOTS = 1024
MAX_SLOT_MB = 4096


class StagingConfigError(ValueError):
    """A staging setting with a value this package does not accept."""


MODE_SLOTS = "slots"  # SGLANG_DSV41_KV_STAGING=1: gather, one engine write, scatter
MODE_PEER = "peer"  # SGLANG_DSV41_KV_STAGING=peer: one peer write (core.peer_copy)


@dataclass(frozen=True)
class StagingConfig:
    mode: str = MODE_SLOTS
    slots: int = DEFAULT_SLOTS
    slot_bytes: int = DEFAULT_SLOT_MB << 20
    min_blocks: int = DEFAULT_MIN_BLOCKS
    ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S


def _int_setting(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise StagingConfigError(f"{name}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise StagingConfigError(f"{name}={value} is outside {lo}..{hi}")
    return value


def staging_config(environ: Optional[Mapping[str, str]] = None) -> Optional[StagingConfig]:
    """The staging settings, or None when staging is off. Bad values raise StagingConfigError."""
    env = os.environ if environ is None else environ
    switch = (env.get(STAGING_ENV) or "").strip()
    if switch in ("", "0"):
        return None
    if switch not in ("1", MODE_PEER):
        raise StagingConfigError(
            f"{STAGING_ENV}={switch!r}: use 1 (slot staging), peer (peer writes) or 0 / unset (off)")
    mode = MODE_PEER if switch == MODE_PEER else MODE_SLOTS
    default_min = DEFAULT_PEER_MIN_BLOCKS if mode == MODE_PEER else DEFAULT_MIN_BLOCKS
    raw_timeout = (env.get(ACK_TIMEOUT_ENV) or "").strip()
    timeout = DEFAULT_ACK_TIMEOUT_S
    if raw_timeout:
        try:
            timeout = float(raw_timeout)
        except ValueError:
            raise StagingConfigError(f"{ACK_TIMEOUT_ENV}={raw_timeout!r} is not a number") from None
        if not 0.1 <= timeout <= 3600:
            raise StagingConfigError(f"{ACK_TIMEOUT_ENV}={timeout} is outside 0.1..3600 seconds")
    return StagingConfig(
        mode=mode,
        slots=_int_setting(env, SLOTS_ENV, DEFAULT_SLOTS, 1, MAX_SLOTS),
        slot_bytes=_int_setting(env, SLOT_MB_ENV, DEFAULT_SLOT_MB, 1, MAX_SLOT_MB) << 20,
        min_blocks=_int_setting(env, MIN_BLOCKS_ENV, default_min, 1, 1 << 20),
        ack_timeout_s=timeout,
    )


# --- wire formats ---------------------------------------------------------------
#
# Grant, appended to decode's registration message:
#   [GRANT_TAG, <QQQ: slot pointer, slot bytes, lease id>]
# Staged-blocks message, on the AUX_DATA channel like host-block frames:
#   [b"AUX_DATA", room, STAGED_TAG, <QQQQ: slot pointer, lease id, nonce, bytes>,
#    table: little-endian u64 (destination, length) pairs, reply address]
# Acknowledgement, to the reply address:
#   [ACK_TAG, <Q: nonce>, b"ok" | b"refused: <reason>"]
# The staged bytes lie in the slot in table order, without gaps.

GRANT_TAG = b"dsv41-kv-staging-grant-v1"
STAGED_TAG = b"dsv41-staged-blocks-v1"
ACK_TAG = b"dsv41-staged-ack-v1"
_GRANT = struct.Struct("<QQQ")
_STAGED_HEADER = struct.Struct("<QQQQ")
_NONCE = struct.Struct("<Q")
_PAIR_DTYPE = np.dtype("<u8")
MAX_STAGED_ENTRIES = 1 << 20
MAX_ENTRY_BYTES = 1 << 40
MAX_REPLY_ADDRESS = 256
ACK_OK = b"ok"


class StagingFrameError(ValueError):
    """A staging message that does not follow the format exactly."""


@dataclass(frozen=True)
class Grant:
    slot_ptr: int
    slot_bytes: int
    lease: int


def encode_grant(grant: Grant) -> list[bytes]:
    return [GRANT_TAG, _GRANT.pack(grant.slot_ptr, grant.slot_bytes, grant.lease)]


def find_grant(frames: Sequence[bytes]) -> Optional[Grant]:
    """The grant appended to a registration message, if any (the last one wins)."""
    for i in range(len(frames) - 2, -1, -1):
        if frames[i] == GRANT_TAG:
            raw = frames[i + 1]
            if len(raw) != _GRANT.size:
                raise StagingFrameError(f"grant of {len(raw)} bytes, expected {_GRANT.size}")
            ptr, size, lease = _GRANT.unpack(bytes(raw))
            if ptr == 0 or size == 0:
                raise StagingFrameError("grant names an empty slot")
            return Grant(ptr, size, lease)
    return None


def strip_grant(frames: Sequence[bytes]) -> list[bytes]:
    """The registration message as a peer without staging would have sent it."""
    out = list(frames)
    for i in range(len(out) - 2, -1, -1):
        if out[i] == GRANT_TAG:
            del out[i:i + 2]
            break
    return out


@dataclass(frozen=True)
class StagedMessage:
    room: int
    slot_ptr: int
    lease: int
    nonce: int
    total_bytes: int
    dsts: np.ndarray
    lengths: np.ndarray
    reply_to: str


def is_staged_message(frames: Sequence[bytes]) -> bool:
    return len(frames) >= 3 and frames[0] == AUX_DATA_HEADER and frames[2] == STAGED_TAG


def encode_staged(
    room: int, grant: Grant, nonce: int, dsts: np.ndarray, lengths: np.ndarray, reply_to: str
) -> list[bytes]:
    table = np.empty((len(dsts), 2), dtype=_PAIR_DTYPE)
    table[:, 0] = dsts
    table[:, 1] = lengths
    total = int(lengths.sum())
    return [
        AUX_DATA_HEADER,
        str(int(room)).encode("ascii"),
        STAGED_TAG,
        _STAGED_HEADER.pack(grant.slot_ptr, grant.lease, nonce, total),
        table.tobytes(),
        reply_to.encode("ascii"),
    ]


def parse_staged(frames: Sequence[bytes]) -> StagedMessage:
    """Strict parser: every deviation from the format raises StagingFrameError."""
    if len(frames) != 6:
        raise StagingFrameError(f"expected 6 frames, got {len(frames)}")
    header, room_raw, tag, fixed, table, reply = (bytes(f) for f in frames)
    if header != AUX_DATA_HEADER or tag != STAGED_TAG:
        raise StagingFrameError("not a staged-blocks message")
    room = parse_decimal(room_raw, "room", StagingFrameError)
    if len(fixed) != _STAGED_HEADER.size:
        raise StagingFrameError(f"header of {len(fixed)} bytes, expected {_STAGED_HEADER.size}")
    slot_ptr, lease, nonce, total = _STAGED_HEADER.unpack(fixed)
    pair = 2 * _PAIR_DTYPE.itemsize
    if not table or len(table) % pair:
        raise StagingFrameError(f"table of {len(table)} bytes is not n*{pair}, n>0")
    if len(table) // pair > MAX_STAGED_ENTRIES:
        raise StagingFrameError(f"{len(table) // pair} entries exceed {MAX_STAGED_ENTRIES}")
    pairs = np.frombuffer(table, dtype=_PAIR_DTYPE).reshape(-1, 2)
    dsts, lengths = pairs[:, 0].copy(), pairs[:, 1].copy()
    if (lengths == 0).any():
        raise StagingFrameError("an entry declares length 0")
    # Bounded lengths keep the 64-bit sum exact (at most 2^20 entries of 2^40 bytes).
    if int(lengths.max()) > MAX_ENTRY_BYTES:
        raise StagingFrameError(f"an entry declares more than {MAX_ENTRY_BYTES} bytes")
    declared = int(lengths.sum(dtype=np.uint64))
    if declared != total:
        raise StagingFrameError(f"table declares {declared} bytes, the header {total}")
    if len(reply) > MAX_REPLY_ADDRESS or not reply.startswith(b"tcp://"):
        raise StagingFrameError(f"reply address {reply[:64]!r} is not tcp://host:port")
    try:
        reply_to = reply.decode("ascii")
    except UnicodeDecodeError:
        raise StagingFrameError("reply address is not ASCII") from None
    return StagedMessage(room, slot_ptr, lease, nonce, total, dsts, lengths, reply_to)


def encode_ack(nonce: int, refusal: Optional[str] = None) -> list[bytes]:
    status = ACK_OK if refusal is None else b"refused: " + refusal.encode("utf-8", "replace")[:512]
    return [ACK_TAG, _NONCE.pack(nonce), status]


def parse_ack(frames: Sequence[bytes]) -> tuple[int, Optional[str]]:
    """(nonce, None when the scatter was done, else the refusal)."""
    if len(frames) != 3 or bytes(frames[0]) != ACK_TAG or len(frames[1]) != _NONCE.size:
        raise StagingFrameError("not a staged-blocks acknowledgement")
    (nonce,) = _NONCE.unpack(bytes(frames[1]))
    status = bytes(frames[2])
    return nonce, None if status == ACK_OK else status.decode("utf-8", "replace")


# --- region checks, vectorized ------------------------------------------------------


class SpanChecker:
    """Answers "does each [dst, dst+len) lie inside one region" for a whole table at once."""

    def __init__(self, regions: Sequence[tuple[int, int]]):
        cleaned = sorted((int(p), int(n)) for p, n in regions if int(n) > 0 and int(p) >= 0)
        self._starts = np.array([p for p, _ in cleaned], dtype=np.uint64)
        # furthest end reached by any region starting at or before each start
        ends = [p + n for p, n in cleaned]
        furthest = []
        best = 0
        for e in ends:
            best = max(best, e)
            furthest.append(best)
        self._furthest_u64 = np.array(furthest, dtype=np.uint64)
        self.count = len(cleaned)

    def first_outside(self, dsts: np.ndarray, lengths: np.ndarray) -> Optional[int]:
        """Index of the first span not inside one region, or None when all are."""
        if len(dsts) == 0:
            return None
        if self.count == 0:
            return 0
        idx = np.searchsorted(self._starts, dsts, side="right").astype(np.int64) - 1
        ends = dsts + lengths
        wrapped = ends < dsts  # u64 overflow: never inside
        ok = (idx >= 0) & ~wrapped
        safe_idx = np.where(idx >= 0, idx, 0)
        ok &= ends <= self._furthest_u64[safe_idx]
        if ok.all():
            return None
        return int(np.argmin(ok))


# --- decode side: the slot pool and the receiver ------------------------------------


class SlotPool:
    """A fixed pool of equal slots, one per prefill peer, allocated up front."""

    def __init__(self, copier: BatchCopy, config: StagingConfig):
        self.config = config
        self.allocation: Allocation = copier.allocate(config.slots * config.slot_bytes)
        self._lock = threading.Lock()
        self._by_peer: dict[str, int] = {}
        self._leases: dict[int, int] = {}  # slot index -> lease id
        self.refused_peers: set[str] = set()

    @property
    def region(self) -> tuple[int, int]:
        return self.allocation.ptr, self.allocation.nbytes

    def slot_ptr(self, index: int) -> int:
        return self.allocation.ptr + index * self.config.slot_bytes

    def lease(self, peer: str) -> Optional[Grant]:
        """The peer's grant (the same one again on re-registration), or None when the pool is full."""
        with self._lock:
            index = self._by_peer.get(peer)
            if index is None:
                if len(self._by_peer) >= self.config.slots:
                    self.refused_peers.add(peer)
                    return None
                index = len(self._by_peer)
                self._by_peer[peer] = index
                self._leases[index] = secrets.randbits(63) | 1
            return Grant(self.slot_ptr(index), self.config.slot_bytes, self._leases[index])

    def holder(self, slot_ptr: int, lease: int) -> Optional[int]:
        """The slot index when ``slot_ptr`` starts a slot currently leased as ``lease``."""
        offset = slot_ptr - self.allocation.ptr
        if offset < 0 or offset % self.config.slot_bytes:
            return None
        index = offset // self.config.slot_bytes
        if index >= self.config.slots or self._leases.get(index) != lease:
            return None
        return index


@dataclass(frozen=True)
class ScatterVerdict:
    done: bool
    room: Optional[int]
    entries: int
    nbytes: int
    reply_to: Optional[str]
    ack: Optional[list[bytes]]
    reason: Optional[str] = None


class StagedReceiver:
    """Scatters staged-blocks messages from leased slots into published regions.

    ``handle`` never raises ``Exception``: the decode thread calling it must go
    on serving. It returns the acknowledgement to send (None only when the
    message is too malformed to name a reply address and nonce).
    """

    def __init__(self, pool: SlotPool, published: Sequence[tuple[int, int]], copier: BatchCopy):
        self.pool = pool
        self.spans = SpanChecker(published)
        self.copier = copier
        self.scattered = 0
        self.refused = 0

    def _refuse(self, message: Optional[StagedMessage], reason: str) -> ScatterVerdict:
        self.refused += 1
        if message is None:
            return ScatterVerdict(False, None, 0, 0, None, None, reason)
        return ScatterVerdict(
            False, message.room, 0, 0, message.reply_to, encode_ack(message.nonce, reason), reason
        )

    def handle(self, frames: Sequence[bytes]) -> ScatterVerdict:
        try:
            message = parse_staged(frames)
        except StagingFrameError as exc:
            return self._refuse(None, f"malformed: {exc}")
        except Exception as exc:  # frames that are not even bytes
            return self._refuse(None, f"malformed: {type(exc).__name__}: {exc}")
        if self.pool.holder(message.slot_ptr, message.lease) is None:
            return self._refuse(message, f"slot {message.slot_ptr:#x} is not leased as claimed")
        if message.total_bytes > self.pool.config.slot_bytes:
            return self._refuse(
                message, f"{message.total_bytes} bytes exceed the {self.pool.config.slot_bytes}-byte slot"
            )
        bad = self.spans.first_outside(message.dsts, message.lengths)
        if bad is not None:
            return self._refuse(
                message,
                f"entry {bad} [{int(message.dsts[bad]):#x}, +{int(message.lengths[bad])}) is not "
                f"inside any of the {self.spans.count} published regions",
            )
        offsets = np.empty(len(message.lengths), dtype=np.uint64)
        offsets[0] = 0
        np.cumsum(message.lengths[:-1], out=offsets[1:])
        try:
            self.copier.copy(offsets + np.uint64(message.slot_ptr), message.dsts, message.lengths)
        except Exception as exc:
            return self._refuse(message, f"scatter failed: {type(exc).__name__}: {exc}")
        self.scattered += 1
        return ScatterVerdict(
            True, message.room, len(message.lengths), message.total_bytes,
            message.reply_to, encode_ack(message.nonce),
        )


# --- prefill side: the local buffers and the sender --------------------------------------


class LocalBuffers:
    """Registered gather buffers of the prefill side, lent one per transfer in flight."""

    def __init__(self, copier: BatchCopy, config: StagingConfig):
        self.config = config
        self.allocation: Allocation = copier.allocate(config.slots * config.slot_bytes)
        self._free = list(range(config.slots))
        self._lock = threading.Lock()

    @property
    def region(self) -> tuple[int, int]:
        return self.allocation.ptr, self.allocation.nbytes

    def take(self) -> Optional[int]:
        with self._lock:
            return self.allocation.ptr + self._free.pop() * self.config.slot_bytes if self._free else None

    def give_back(self, ptr: int) -> None:
        with self._lock:
            self._free.append((ptr - self.allocation.ptr) // self.config.slot_bytes)


class StagingRefused(RuntimeError):
    """The decode side refused or never acknowledged a staged batch."""


@dataclass
class GrantState:
    """What one prefill process knows about one granted slot."""

    grant: Grant
    lock: threading.Lock = field(default_factory=threading.Lock)
    poisoned: Optional[str] = None


# Why a batch took the direct path instead of staging (metric label values).
FALLBACK_NO_GRANT = "no_grant"
FALLBACK_SMALL = "few_blocks"
FALLBACK_BLOCK_TOO_LARGE = "block_larger_than_slot"
FALLBACK_BUSY = "busy"
FALLBACK_POISONED = "slot_retired"


@dataclass(frozen=True)
class StagedOutcome:
    """``rc`` as the engine would answer; ``fallback`` names why staging was not used."""

    rc: int
    fallback: Optional[str] = None
    writes: int = 0
    nbytes: int = 0


class StagedSender:
    """Sends one transfer batch of device blocks through a granted slot.

    ``write(blocks)`` is the engine's batch write (0 on success); ``notify(frames)``
    sends on the ordered side channel; ``await_ack(nonce, timeout)`` returns the
    acknowledgement's refusal (None when the scatter was done) or raises
    TimeoutError.
    """

    def __init__(self, copier: BatchCopy, buffers: LocalBuffers, config: StagingConfig):
        self.copier = copier
        self.buffers = buffers
        self.config = config

    def groups(self, lengths: np.ndarray) -> Optional[list[tuple[int, int]]]:
        """[start, end) index ranges of at most one slot each; None when one block exceeds a slot."""
        cap = self.config.slot_bytes
        if int(lengths.max()) > cap:
            return None
        out = []
        start = 0
        ends = np.cumsum(lengths, dtype=np.uint64)
        base = 0
        while start < len(lengths):
            end = int(np.searchsorted(ends, base + cap, side="right"))
            out.append((start, end))
            base = int(ends[end - 1])
            start = end
        return out

    def send(
        self,
        blocks: Sequence[tuple[int, int, int]],
        state: Optional[GrantState],
        room: int,
        reply_to: str,
        write: Callable[[list[tuple[int, int, int]]], int],
        notify: Callable[[list[bytes]], None],
        await_ack: Callable[[int, float], Optional[str]],
    ) -> StagedOutcome:
        if state is None:
            return StagedOutcome(write(list(blocks)), FALLBACK_NO_GRANT)
        if state.poisoned is not None:
            return StagedOutcome(write(list(blocks)), FALLBACK_POISONED)
        if len(blocks) < self.config.min_blocks:
            return StagedOutcome(write(list(blocks)), FALLBACK_SMALL)
        srcs, dsts, lengths = as_triples(blocks)
        groups = self.groups(lengths)
        if groups is None:
            return StagedOutcome(write(list(blocks)), FALLBACK_BLOCK_TOO_LARGE)
        if not state.lock.acquire(blocking=False):
            return StagedOutcome(write(list(blocks)), FALLBACK_BUSY)
        try:
            local = self.buffers.take()
            if local is None:
                return StagedOutcome(write(list(blocks)), FALLBACK_BUSY)
            try:
                return self._send_groups(
                    groups, srcs, dsts, lengths, local, state, room, reply_to, write, notify, await_ack
                )
            finally:
                self.buffers.give_back(local)
        finally:
            state.lock.release()

    def _send_groups(self, groups, srcs, dsts, lengths, local, state, room, reply_to,
                     write, notify, await_ack) -> StagedOutcome:
        grant = state.grant
        sent = 0
        for start, end in groups:
            n = lengths[start:end]
            offsets = np.empty(len(n), dtype=np.uint64)
            offsets[0] = 0
            np.cumsum(n[:-1], out=offsets[1:])
            total = int(offsets[-1] + n[-1])
            self.copier.copy(srcs[start:end], offsets + np.uint64(local), n)
            rc = write([(local, grant.slot_ptr, total)])
            if rc != 0:
                return StagedOutcome(rc, None, sent, 0)
            nonce = secrets.randbits(63)
            notify(encode_staged(room, grant, nonce, dsts[start:end], n, reply_to))
            try:
                refusal = await_ack(nonce, self.config.ack_timeout_s)
            except TimeoutError:
                # Decode may still read this slot later: never write it again.
                state.poisoned = f"no acknowledgement within {self.config.ack_timeout_s} s"
                raise StagingRefused(state.poisoned) from None
            if refusal is not None:
                raise StagingRefused(refusal)
            sent += 1
        return StagedOutcome(0, None, sent, int(lengths.sum()))
