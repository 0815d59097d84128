"""Keep Mooncake's intra-node NVLink transport for device memory; carry host blocks beside it.

Design: docs/design/mooncake_nvlink.md.
"""

from __future__ import annotations

import bisect
import enum
import errno
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Protocol, Sequence

logger = logging.getLogger("sglang_dsv41.mooncake")

# --- when is the intra-node NVLink transport active --------------------------

# Mooncake installs its intra-node NVLink transport when MC_INTRANODE_NVLINK is
# *present* (getenv != NULL), whatever its value, so presence is what counts
# here too: a false positive only routes host blocks over zmq (correct, a bit
# slower), a false negative brings back the registration failure.
NVLINK_INTRA_ENV_FLAGS = ("MC_INTRANODE_NVLINK", "MC_INTRA_NVLINK")
PROTOCOL_ENV = "MOONCAKE_PROTOCOL"
NVLINK_INTRA_PROTOCOLS = frozenset({"nvlink_intra", "nvlink-intra", "intra_nvlink"})


def nvlink_intra_reason(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why the intra-node NVLink transport is active, or None when it is not."""
    env = os.environ if environ is None else environ
    for name in NVLINK_INTRA_ENV_FLAGS:
        if name in env:
            return f"{name} is set"
    protocol = (env.get(PROTOCOL_ENV) or "").strip().lower()
    if protocol in NVLINK_INTRA_PROTOCOLS:
        return f"{PROTOCOL_ENV}={protocol}"
    return None


def nvlink_intra_active(environ: Optional[Mapping[str, str]] = None) -> bool:
    return nvlink_intra_reason(environ) is not None


# --- is the decode peer on this host -------------------------------------------


def session_host(session_id: str) -> str:
    """The host part of a Mooncake session id (``host:port``, ``[v6]:port``)."""
    host = session_id.rpartition(":")[0] if ":" in session_id else session_id
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def address_is_here(host: str) -> Optional[bool]:
    """Whether ``host`` is an address of this machine (of this network namespace),
    or None when that cannot be told (a name that does not resolve, no address).

    The kernel's own answer: a datagram socket connected to one of this machine's
    addresses takes that very address as its source, to any other address it
    takes another one, and with no route there at all the address is certainly
    not ours. Intra-node pieces must stay on for None: wrongly calling a local
    peer remote would send host blocks to a transport that cannot carry them."""
    if not host:
        return None
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    verdict = None
    for family, _, _, _, address in infos:
        target = ipaddress.ip_address(address[0].split("%", 1)[0])
        if target.is_loopback:
            return True
        if target.is_unspecified:
            continue
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(address)  # sends nothing: only picks the route and source address
                source = ipaddress.ip_address(probe.getsockname()[0].split("%", 1)[0])
        except OSError as exc:
            if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                verdict = False
            continue
        if source == target:
            return True
        verdict = False
    return verdict


# --- memory classification and raw access ------------------------------------


class MemoryKind(str, enum.Enum):
    HOST = "host"
    DEVICE = "device"


class MemoryAccessError(RuntimeError):
    """A pointer could not be classified, read or written."""


class MemoryAccess(Protocol):
    """What routing needs from the memory system. Only *local* pointers are passed."""

    def kind_of(self, ptr: int) -> MemoryKind: ...

    def read(self, ptr: int, length: int) -> bytes: ...

    def write(self, dst: int, payload: bytes, offset: int, length: int) -> None:
        """Copy ``payload[offset:offset+length]`` to ``dst``."""


Region = tuple[int, int]  # (start pointer, length in bytes)
Block = tuple[int, int, int]  # (source pointer, destination pointer, length)


class RegionTable:
    """Answers "which region holds [addr, addr+length)" in O(log n).

    Regions may overlap (sglang can report one buffer twice); a span is inside
    the table when one single region holds all of it.
    """

    def __init__(self, regions: Iterable[Region]):
        cleaned = sorted(
            (int(p), int(n)) for p, n in regions if int(n) > 0 and int(p) >= 0
        )
        self._regions = cleaned
        self._starts = [p for p, _ in cleaned]
        # For each prefix of the start-sorted list, the region reaching furthest:
        # a span starting at addr fits in some region iff it fits in that one.
        self._furthest: list[int] = []
        best = -1
        for i, (p, n) in enumerate(cleaned):
            if best < 0 or p + n > cleaned[best][0] + cleaned[best][1]:
                best = i
            self._furthest.append(best)

    def __len__(self) -> int:
        return len(self._regions)

    @property
    def regions(self) -> list[Region]:
        return list(self._regions)

    def index_containing(self, addr: int, length: int) -> Optional[int]:
        if length <= 0 or addr < 0:
            return None
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        j = self._furthest[i]
        start, size = self._regions[j]
        return j if addr + length <= start + size else None

    def containing(self, addr: int, length: int) -> Optional[Region]:
        j = self.index_containing(addr, length)
        return None if j is None else self._regions[j]


# A 64 KiB granule lying wholly inside one segment of known memory remembers
# that segment, so finding a block's buffer costs one dict look-up instead of a
# bisection over multi-digit integers; the dict is bounded.
GRANULE_SHIFT = 16
MAX_REMEMBERED_GRANULES = 1 << 16
# A short all-device batch whose blocks change buffer at most blocks (a send of
# one page per buffer: a contiguous KV chunk, the sliding-window state of every
# layer) is remembered as the device segment of each of its positions. sglang
# sends the same such shape for every request, so the next one is checked with
# one range test per block, no look-up. Bounded: a few shapes per length.
MAX_SHAPE_BLOCKS = 128
SHAPES_PER_LENGTH = 4


class KindTable:
    """Classifies local pointers from regions classified once at registration.

    Pointers outside every known region (buffers registered elsewhere) are
    asked of ``fallback`` each time.
    """

    def __init__(
        self,
        classified: Sequence[tuple[int, int, MemoryKind]],
        fallback: Callable[[int], MemoryKind],
    ):
        self._table = RegionTable((p, n) for p, n, _ in classified)
        kinds = {(int(p), int(n)): k for p, n, k in classified if int(n) > 0}
        self._kinds = [kinds[r] for r in self._table.regions]
        self._fallback = fallback
        # The table's region edges cut the address space into segments inside
        # which no region starts or ends, so every pointer of a segment gets the
        # answer ``kind_of`` gives its first byte: True (device), False (host),
        # None (no known region: ask ``fallback``). The last segment is open-ended.
        self._edges = sorted({e for p, n in self._table.regions for e in (p, p + n)})
        self._edge_kinds: list[Optional[bool]] = []
        for edge in self._edges:
            j = self._table.index_containing(edge, 1)
            self._edge_kinds.append(None if j is None else self._kinds[j] is MemoryKind.DEVICE)
        self._granules: dict[int, tuple[int, int, bool]] = {}
        self._shapes: dict[int, tuple[tuple[tuple[int, int], ...], ...]] = {}  # blocks -> segments by position

    def kind_of(self, ptr: int) -> MemoryKind:
        j = self._table.index_containing(ptr, 1)
        if j is None:
            return self._fallback(ptr)
        return self._kinds[j]

    def device_bytes_from(self, addr: int) -> int:
        """Bytes from ``addr`` to the end of the device region holding it; 0 outside device memory."""
        j = self._table.index_containing(int(addr), 1)
        if j is None or self._kinds[j] is not MemoryKind.DEVICE:
            return 0
        start, length = self._table.regions[j]
        return start + length - int(addr)

    def split(self, blocks: Sequence[Block]) -> tuple[Sequence[Block], list[Block]]:
        """Like ``split_by_source``, tuned for the hot path.

        Consecutive blocks mostly come from one buffer (upstream builds batches
        layer by layer), so the last segment is remembered and most blocks cost
        one range test; a block from another buffer (the sliding-window state
        sends one page per layer, each layer its own buffer) costs one granule
        look-up, or the first time one bisection of the segment edges. A short
        batch of that kind is remembered by shape (``MAX_SHAPE_BLOCKS``): the
        next one like it costs a range test per block. An all-device batch is
        returned as it came, uncopied.
        """
        for segments in self._shapes.get(len(blocks), ()):
            for block, (lo, hi) in zip(blocks, segments):
                if not lo <= block[0] < hi:
                    break
            else:
                return blocks, []
        host_at, look_ups = self._host_positions(blocks)
        if not host_at:
            if 2 * look_ups > len(blocks) and len(blocks) <= MAX_SHAPE_BLOCKS:
                self._remember_shape(blocks)
            return blocks, []
        host_set = set(host_at)
        device = [b for i, b in enumerate(blocks) if i not in host_set]
        return device, [blocks[i] for i in host_at]

    def _host_positions(self, blocks: Sequence[Block]) -> tuple[list[int], int]:
        """(positions of the host blocks, segment look-ups made: all blocks when some is host)."""
        # Inlined: this loop runs once per block of every transfer batch. First
        # the common case, every source in device memory, with as little work
        # per block as Python allows; the first host block hands over, with its
        # span, to the loop that collects positions.
        granule_of, shift = self._granules.get, GRANULE_SHIFT  # locals: no look-up per block
        lo = hi = 0
        is_device = True
        look_ups = 0
        for block in blocks:
            src = block[0]
            if lo <= src < hi:
                continue
            look_ups += 1
            span = granule_of(src >> shift)
            if span is None:
                span = self._segment_of(int(src))
            lo, hi, is_device = span
            if not is_device:
                break
        else:
            return [], look_ups
        # the first block equal to this one is this one: an equal block before
        # it would have had the same source, and stopped the loop there
        first_host = blocks.index(block)
        host_at: list[int] = []
        for i in range(first_host, len(blocks)):
            src = blocks[i][0]
            if not lo <= src < hi:
                span = granule_of(src >> shift)
                if span is None:
                    span = self._segment_of(int(src))
                lo, hi, is_device = span
            if not is_device:
                host_at.append(i)
        return host_at, len(blocks)

    def _remember_shape(self, blocks: Sequence[Block]) -> None:
        """Remember an all-device batch's segment per position; not when a source lies outside
        known memory (its kind comes from the fallback, each time)."""
        segments = []
        for block in blocks:
            span = self._known_segment(int(block[0]))
            if span is None or not span[2]:
                return
            segments.append(span[:2])
        known = self._shapes.get(len(blocks), ())
        self._shapes[len(blocks)] = (tuple(segments),) + known[:SHAPES_PER_LENGTH - 1]

    def _known_segment(self, ptr: int) -> Optional[tuple[int, int, bool]]:
        """(start, end, is_device) of the segment of known memory holding ptr, else None."""
        k = bisect.bisect_right(self._edges, ptr) - 1
        known = self._edge_kinds[k] if k >= 0 else None
        return None if known is None else (self._edges[k], self._edges[k + 1], known)

    def _segment_of(self, ptr: int) -> tuple[int, int, bool]:
        """(start, end, is_device) of ptr's segment, or of ptr alone outside known memory."""
        span = self._known_segment(ptr)
        if span is None:
            return ptr, ptr + 1, self._fallback(ptr) is MemoryKind.DEVICE
        granule = ptr >> GRANULE_SHIFT
        if (
            span[0] <= granule << GRANULE_SHIFT
            and (granule + 1) << GRANULE_SHIFT <= span[1]
            and len(self._granules) < MAX_REMEMBERED_GRANULES
        ):
            self._granules[granule] = span
        return span


# --- registration -------------------------------------------------------------

HOST_LEFT_OUT_REASON = (
    "host memory: the intra-node NVLink transport registers device memory only "
    "(one host region fails the whole batch); its blocks travel as host-block "
    "frames on the ordered zmq channel"
)


@dataclass
class RegistrationPlan:
    register: list[Region] = field(default_factory=list)
    left_out: list[tuple[int, int, str]] = field(default_factory=list)
    classified: list[tuple[int, int, MemoryKind]] = field(default_factory=list)

    def describe_left_out(self, limit: int = 8) -> str:
        if not self.left_out:
            return "no region left out"
        shown = ", ".join(f"{hex(p)}+{n}" for p, n, _ in self.left_out[:limit])
        more = len(self.left_out) - limit
        reasons = sorted({r for _, _, r in self.left_out})
        return (
            f"left {len(self.left_out)} of {len(self.left_out) + len(self.register)} "
            f"regions out of engine registration ({shown}{f', +{more} more' if more > 0 else ''}): "
            + "; ".join(reasons)
        )


def plan_registration(
    regions: Sequence[Region], kind_of: Callable[[int], MemoryKind]
) -> RegistrationPlan:
    """Keep device regions for the engine, leave host regions out (with the reason).

    A pointer that cannot be classified raises: registering it blindly would
    bring back the all-or-nothing registration failure.
    """
    plan = RegistrationPlan()
    for ptr, length in regions:
        kind = kind_of(int(ptr))
        plan.classified.append((int(ptr), int(length), kind))
        if kind is MemoryKind.DEVICE:
            plan.register.append((ptr, length))
        else:
            plan.left_out.append((int(ptr), int(length), HOST_LEFT_OUT_REASON))
    return plan


def split_by_source(
    blocks: Iterable[Block], kind_of: Callable[[int], MemoryKind]
) -> tuple[list[Block], list[Block]]:
    """(device-sourced, host-sourced). Only the local source is classified, never the peer's dst."""
    device: list[Block] = []
    host: list[Block] = []
    for block in blocks:
        (device if kind_of(int(block[0])) is MemoryKind.DEVICE else host).append(block)
    return device, host


# --- host-block frames ---------------------------------------------------------
#
# A host-block message rides the upstream AUX_DATA channel so it shares the
# ordered push socket with the completion status:
#   [b"AUX_DATA", room (ascii decimal), HOST_BLOCKS_TAG, table, payload]
# table: per block a big-endian (dst u64, length u64) pair; payload: the blocks'
# bytes, concatenated in table order. The tag sits where upstream expects an
# integer buffer index, so a receiver without this plugin fails to parse the
# frame instead of writing it anywhere.

AUX_DATA_HEADER = b"AUX_DATA"
HOST_BLOCKS_TAG = b"dsv41-host-blocks-v1"
_ENTRY = struct.Struct(">QQ")
MAX_BLOCKS_PER_MESSAGE = 1 << 16
MAX_ROOM_DIGITS = 20
_U64_END = 1 << 64
# Sender-side cap on one message's payload; larger batches become several
# messages on the same socket (order is kept).
DEFAULT_MAX_MESSAGE_PAYLOAD = 64 << 20


class HostBlockFrameError(ValueError):
    """A host-block message that does not follow the format exactly."""


@dataclass(frozen=True)
class HostBlockEntry:
    dst: int
    length: int
    offset: int  # into the message payload


@dataclass(frozen=True)
class HostBlockMessage:
    room: int
    entries: tuple[HostBlockEntry, ...]
    payload: bytes

    @property
    def total_bytes(self) -> int:
        return len(self.payload)


def is_host_block_message(frames: Sequence[bytes]) -> bool:
    """The cheap test the aux handler uses to decide who parses the message."""
    return len(frames) >= 3 and frames[0] == AUX_DATA_HEADER and frames[2] == HOST_BLOCKS_TAG


def encode_host_blocks(room: int, blocks: Sequence[tuple[int, bytes]]) -> list[bytes]:
    """Frames for one message carrying ``blocks`` = [(dst pointer, data)]."""
    if not blocks:
        raise ValueError("a host-block message needs at least one block")
    if len(blocks) > MAX_BLOCKS_PER_MESSAGE:
        raise ValueError(f"{len(blocks)} blocks exceed {MAX_BLOCKS_PER_MESSAGE} per message")
    if room < 0 or len(str(room)) > MAX_ROOM_DIGITS:
        raise ValueError(f"room {room} cannot be encoded")
    table = bytearray()
    for dst, data in blocks:
        if not data:
            raise ValueError("empty host block")
        if dst < 0 or dst + len(data) > _U64_END:
            raise ValueError(f"destination {dst:#x}+{len(data)} outside the address space")
        table += _ENTRY.pack(dst, len(data))
    payload = b"".join(bytes(d) for _, d in blocks)
    return [AUX_DATA_HEADER, str(room).encode("ascii"), HOST_BLOCKS_TAG, bytes(table), payload]


def host_block_message_size(frames: Sequence[bytes]) -> tuple[int, int]:
    """(blocks, payload bytes) of a message built by ``encode_host_blocks``."""
    return len(frames[3]) // _ENTRY.size, len(frames[4])


def parse_decimal(raw: bytes, what: str, error: type[ValueError] = HostBlockFrameError) -> int:
    """A room number as the AUX_DATA frames carry it; anything else raises ``error``."""
    if not raw or len(raw) > MAX_ROOM_DIGITS or not all(0x30 <= b <= 0x39 for b in raw):
        raise error(f"{what} is not a plain decimal number: {raw[:32]!r}")
    return int(raw)


def parse_host_blocks(frames: Sequence[bytes]) -> HostBlockMessage:
    """Strict parser: every deviation from the format raises HostBlockFrameError."""
    if len(frames) != 5:
        raise HostBlockFrameError(f"expected 5 frames, got {len(frames)}")
    header, room_raw, tag, table, payload = frames
    if header != AUX_DATA_HEADER:
        raise HostBlockFrameError(f"wrong header {bytes(header[:16])!r}")
    if tag != HOST_BLOCKS_TAG:
        raise HostBlockFrameError(f"wrong tag {bytes(tag[:32])!r}")
    room = parse_decimal(bytes(room_raw), "room")
    if len(table) == 0 or len(table) % _ENTRY.size:
        raise HostBlockFrameError(f"block table of {len(table)} bytes is not n*{_ENTRY.size}, n>0")
    count = len(table) // _ENTRY.size
    if count > MAX_BLOCKS_PER_MESSAGE:
        raise HostBlockFrameError(f"{count} blocks exceed {MAX_BLOCKS_PER_MESSAGE}")
    entries = []
    offset = 0
    for i, (dst, length) in enumerate(_ENTRY.iter_unpack(bytes(table))):
        if length == 0:
            raise HostBlockFrameError(f"block {i} declares length 0")
        if dst + length > _U64_END:
            raise HostBlockFrameError(f"block {i} at {dst:#x}+{length} wraps the address space")
        if offset + length > len(payload):
            raise HostBlockFrameError(
                f"block {i} declares {length} bytes but only {len(payload) - offset} remain"
            )
        entries.append(HostBlockEntry(dst=dst, length=length, offset=offset))
        offset += length
    if offset != len(payload):
        raise HostBlockFrameError(
            f"payload is {len(payload)} bytes, the table declares {offset}"
        )
    return HostBlockMessage(room=room, entries=tuple(entries), payload=bytes(payload))


# --- receiver ------------------------------------------------------------------


@dataclass(frozen=True)
class ReceiveVerdict:
    written: bool
    room: Optional[int]
    blocks: int
    nbytes: int
    reason: Optional[str] = None


class HostBlockReceiver:
    """Writes host-block messages into published regions, all blocks or none.

    Every destination is checked before the first write; a write that still
    fails puts back what the earlier blocks overwrote (read beforehand: host
    blocks are aux and small state rows). ``handle`` never raises
    ``Exception``: the decode thread that calls it must keep serving.
    """

    def __init__(self, regions: RegionTable, memory: MemoryAccess, log: logging.Logger = logger,
                 room_awaits_kv: Optional[Callable[[int], bool]] = None):
        """``room_awaits_kv(room)``: whether a request here still waits for that room's KV; a
        message for any other room (unknown, finished, failed, aborted: its slots may hold
        another request's data by now) is dropped. None: every room is taken (tests)."""
        self.regions = regions
        self.memory = memory
        self.log = log
        self.room_awaits_kv = room_awaits_kv
        self.messages_written = 0
        self.messages_dropped = 0

    def _drop(self, room: Optional[int], reason: str) -> ReceiveVerdict:
        self.messages_dropped += 1
        self.log.error("dropped a host-block message (room %s): %s; nothing written", room, reason)
        return ReceiveVerdict(False, room, 0, 0, reason)

    def _restore(self, entries, before: list[bytes]) -> str:
        """Put back what ``entries`` overwrote; says whether that worked."""
        try:
            for entry, old in zip(entries, before):
                self.memory.write(entry.dst, old, 0, entry.length)
        except Exception as exc:
            return f"restoring the earlier blocks failed too ({type(exc).__name__}: {exc})"
        return "the earlier blocks were restored, nothing of the message remains"

    def handle(self, frames: Sequence[bytes]) -> ReceiveVerdict:
        try:
            message = parse_host_blocks(frames)
        except HostBlockFrameError as exc:
            return self._drop(None, f"malformed: {exc}")
        except Exception as exc:  # frames that are not even bytes
            return self._drop(None, f"malformed: {type(exc).__name__}: {exc}")
        try:
            awaited = self.room_awaits_kv is None or self.room_awaits_kv(message.room)
        except Exception as exc:
            return self._drop(message.room, f"cannot look its room up: {type(exc).__name__}: {exc}")
        if not awaited:
            return self._drop(message.room, "no request here waits for this room's KV "
                                            "(unknown, finished, failed or aborted)")
        for i, entry in enumerate(message.entries):
            if self.regions.containing(entry.dst, entry.length) is None:
                return self._drop(
                    message.room,
                    f"block {i} [{entry.dst:#x}, {entry.dst + entry.length:#x}) is not inside "
                    f"any of the {len(self.regions)} published regions",
                )
        try:  # what the blocks overwrite, to put back if one of them fails
            before = [self.memory.read(entry.dst, entry.length) for entry in message.entries]
        except Exception as exc:
            return self._drop(message.room, f"destination not readable: {type(exc).__name__}: {exc}")
        done = 0
        try:
            for entry in message.entries:
                self.memory.write(entry.dst, message.payload, entry.offset, entry.length)
                done += 1
        except Exception as exc:
            self.messages_dropped += 1
            reason = (f"write failed at block {done} of {len(message.entries)}: "
                      f"{type(exc).__name__}: {exc}; {self._restore(message.entries[:done + 1], before)}")
            self.log.error("host-block message (room %s): %s", message.room, reason)
            return ReceiveVerdict(False, message.room, 0, 0, reason)
        self.messages_written += 1
        self.log.debug(
            "wrote host-block message (room %s): %d blocks, %d bytes",
            message.room, len(message.entries), message.total_bytes,
        )
        return ReceiveVerdict(True, message.room, len(message.entries), message.total_bytes)


# --- sender --------------------------------------------------------------------


class NoSideChannel(RuntimeError):
    """No peer endpoint is known for host blocks of this transfer."""


@dataclass(frozen=True)
class SideChannel:
    room: int  # carried for the receiver's logs only
    send: Callable[[list[bytes]], None]


def chunk_host_blocks(blocks: Sequence[Block], max_payload: int) -> list[list[Block]]:
    """Group blocks into messages of at most ``max_payload`` bytes (one oversized block goes alone)."""
    chunks: list[list[Block]] = []
    current: list[Block] = []
    size = 0
    for block in blocks:
        length = int(block[2])
        if current and (size + length > max_payload or len(current) >= MAX_BLOCKS_PER_MESSAGE):
            chunks.append(current)
            current, size = [], 0
        current.append(block)
        size += length
    if current:
        chunks.append(current)
    return chunks


class TransferRouter:
    """Splits a transfer batch between the engine and the host-block side channel."""

    def __init__(
        self,
        classifier: "KindTable | Callable[[int], MemoryKind]",
        memory: MemoryAccess,
        max_message_payload: int = DEFAULT_MAX_MESSAGE_PAYLOAD,
        log: logging.Logger = logger,
    ):
        """``classifier``: a KindTable (fast path) or any local-pointer classifier."""
        if isinstance(classifier, KindTable):
            self._split = classifier.split
        else:
            self._split = lambda blocks: split_by_source(blocks, classifier)
        self.memory = memory
        self.max_message_payload = max_message_payload
        self.log = log

    def route(
        self,
        blocks: Sequence[Block],
        send_device: Callable[[list[Block]], int],
        open_side_channel: Callable[[], SideChannel],
    ) -> int:
        """0 when every block was handed over; the engine's code or -1 otherwise.

        Device blocks first, then host blocks; both finish before this returns,
        so a status the caller sends afterwards on the same socket comes after them.
        """
        try:
            device, host = self._split(blocks)
        except Exception as exc:
            self.log.error("cannot classify transfer sources: %s", exc)
            return -1
        rc = send_device(device) if device else 0
        if rc != 0 or not host:
            return rc
        try:
            channel = open_side_channel()
            for chunk in chunk_host_blocks(host, self.max_message_payload):
                data = [(int(dst), self.memory.read(int(src), int(n))) for src, dst, n in chunk]
                channel.send(encode_host_blocks(channel.room, data))
        except Exception as exc:
            self.log.error(
                "host blocks not delivered (%d blocks, %d bytes): %s: %s",
                len(host), sum(int(b[2]) for b in host), type(exc).__name__, exc,
            )
            return -1
        return 0
