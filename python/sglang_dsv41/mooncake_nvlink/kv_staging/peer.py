"""Peer writes for Mooncake PD transfers on one host: a batch as one kernel, no engine.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import bisect
import ctypes
import struct
import threading
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np

from sglang_dsv41.mooncake_nvlink import cuda_libs
from sglang_dsv41.mooncake_nvlink.cuda_libs import HANDLE_BYTES
from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import (
    ADDRESS_LIMIT,
    CudaBatchCopy,
    PagedCopy,
    paged_segments,
)

PEER_MAP_TAG = b"dsv41-kv-peer-map-v1"
_ENTRY = struct.Struct(f"<QQQ{HANDLE_BYTES}s")  # region pointer, length, offset in allocation, handle
MAX_PEER_REGIONS = 1 << 14
# host-cma: another process's host memory, the GPU's stand-in in tests (test/helpers/host_peer.py)
KINDS = ("cuda-ipc", "host-cma")

# Why a send went the direct way instead of a peer write (metric label values).
FALLBACK_NO_PEER_MAP = "no_peer_map"
FALLBACK_PEER_MAP_FAILED = "peer_map_unusable"
FALLBACK_OUTSIDE_PEER_MAP = "outside_peer_map"
FEW_BLOCKS = "few_blocks"
SOURCE_NOT_DEVICE = "source_not_device"
NOT_PAGES = "not_pages"


class PeerMapError(RuntimeError):
    """A peer map that cannot be built, parsed or opened here."""


def host_identity() -> str:
    """This kernel's boot id: equal for two processes only when they share a host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as fh:
            return fh.read().strip().decode("ascii", "replace")[:64] or "unknown"
    except OSError:
        return "unknown"


@dataclass(frozen=True)
class PeerRegion:
    ptr: int  # in the exporting process
    length: int
    offset: int  # from the start of the allocation the handle names
    handle: bytes


@dataclass(frozen=True)
class PeerMap:
    kind: str
    host: str
    regions: tuple[PeerRegion, ...]

    @property
    def handles(self) -> frozenset[bytes]:
        return frozenset(r.handle for r in self.regions)


# --- wire format -------------------------------------------------------------------
#
# Appended to decode's registration message (after any staging grant):
#   [PEER_MAP_TAG, kind (ascii), host boot id (ascii), table]
# table: per region, little-endian <QQQ> pointer, length, offset, then the
# 64-byte handle (host-cma: the exporting pid as <Q>, zero padded).


def encode_peer_map(peer: PeerMap) -> list[bytes]:
    table = b"".join(_ENTRY.pack(r.ptr, r.length, r.offset, r.handle) for r in peer.regions)
    return [PEER_MAP_TAG, peer.kind.encode("ascii"), peer.host.encode("ascii"), table]


def find_peer_map(frames: Sequence[bytes]) -> Optional[PeerMap]:
    """The peer map appended to a registration message, if any. Malformed: PeerMapError."""
    for i in range(len(frames) - 1, -1, -1):
        if isinstance(frames[i], (bytes, bytearray, memoryview)) and bytes(frames[i]) == PEER_MAP_TAG:
            if len(frames) - i < 4:
                raise PeerMapError(f"peer map of {len(frames) - i - 1} frames, expected 3")
            return parse_peer_map(frames[i + 1:i + 4])
    return None


def parse_peer_map(frames: Sequence[bytes]) -> PeerMap:
    if not all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames):
        raise PeerMapError("peer map frames must be bytes")
    kind_raw, host_raw, table = (bytes(f) for f in frames)
    try:
        kind, host = kind_raw.decode("ascii"), host_raw.decode("ascii")
    except UnicodeDecodeError:
        raise PeerMapError("peer map kind or host is not ASCII") from None
    if kind not in KINDS:
        raise PeerMapError(f"peer map of unknown kind {kind[:32]!r}")
    if not host or len(host) > 64:
        raise PeerMapError("peer map without a host identity")
    if not table or len(table) % _ENTRY.size:
        raise PeerMapError(f"peer map table of {len(table)} bytes is not n*{_ENTRY.size}, n>0")
    if len(table) // _ENTRY.size > MAX_PEER_REGIONS:
        raise PeerMapError(f"peer map of {len(table) // _ENTRY.size} regions exceeds {MAX_PEER_REGIONS}")
    regions = []
    for ptr, length, offset, handle in _ENTRY.iter_unpack(table):
        if ptr == 0 or length == 0 or ptr + length >= 1 << 64 or offset >= 1 << 62:
            raise PeerMapError(f"peer map region [{ptr:#x}, +{length}) is empty or wraps")
        regions.append(PeerRegion(ptr, length, offset, handle))
    ordered = sorted(regions, key=lambda r: r.ptr)
    for a, b in zip(ordered, ordered[1:]):
        if a.ptr + a.length > b.ptr:
            raise PeerMapError(f"peer map regions [{a.ptr:#x}, +{a.length}) and [{b.ptr:#x}, +{b.length}) overlap")
    return PeerMap(kind, host, tuple(regions))


def regions_outside_mappings(peer: PeerMap, mapped_bytes: dict[bytes, int]) -> Optional[str]:
    """Why a region the peer declared reaches past the allocation its handle really maps, else None.

    The peer states each region's offset and length inside the allocation its
    handle names; ``mapped_bytes`` holds, per handle, the size of what opening
    it mapped here. A write is only ever translated inside a declared region, so
    regions inside their mappings keep every write inside memory the peer owns.
    """
    for r in peer.regions:
        size = mapped_bytes.get(r.handle)
        if size is None:
            return f"region [{r.ptr:#x}, +{r.length}) names a handle that was not opened"
        if r.offset + r.length > size:
            return (f"region [{r.ptr:#x}, +{r.length}) at offset {r.offset} reaches past its "
                    f"mapped allocation of {size} bytes")
    return None


# --- translation ---------------------------------------------------------------------


class PeerTarget:
    """One opened peer map: the peer's addresses translated into writable ones here.

    ``acquire``/``release`` bracket every batch; ``retire`` closes the mappings
    once the last batch using them has released (never under a running copy).
    """

    def __init__(self, peer: PeerMap, mapped_starts: Sequence[int], transport: "PeerTransport",
                 opened: Sequence[bytes]):
        order = sorted(range(len(peer.regions)), key=lambda i: peer.regions[i].ptr)
        self.peer = peer
        self.transport = transport
        self._opened = list(opened)
        self._starts = [peer.regions[i].ptr for i in order]
        self._ends = [peer.regions[i].ptr + peer.regions[i].length for i in order]
        self._mapped = [mapped_starts[i] for i in order]
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False
        self._closed = False

    def locate(self, dst: int) -> Optional[tuple[int, int]]:
        """(local address of ``dst``, bytes from it to its region's end), or None outside the map."""
        k = bisect.bisect_right(self._starts, dst) - 1
        if k < 0 or dst >= self._ends[k]:
            return None
        return dst - self._starts[k] + self._mapped[k], self._ends[k] - dst

    def acquire(self) -> bool:
        with self._lock:
            if self._retired:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            close = self._retired and self._users == 0 and not self._closed
            self._closed |= close
        if close:
            self.transport.close(self._opened)

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            close = self._users == 0 and not self._closed
            self._closed |= close
        if close:
            self.transport.close(self._opened)


class PeerTransport(Protocol):
    kind: str

    def export(self, regions: Sequence[tuple[int, int]]) -> PeerMap:
        """This process's ``regions`` as a map another process on this host can open."""

    def open(self, peer: PeerMap) -> PeerTarget:
        """Map a peer's regions here; PeerMapError when it cannot be done."""

    def write_pages(self, target: PeerTarget, copies: Sequence[PagedCopy]) -> None:
        """Paged copies (destinations translated) as one batch; returns when it landed."""

    def close(self, opened: Sequence[bytes]) -> None:
        """Give back mappings ``open`` made (reference counted per handle)."""


def check_peer(peer: PeerMap, kind: str) -> None:
    """PeerMapError unless ``peer`` is of ``kind`` and exported on this host."""
    if peer.kind != kind:
        raise PeerMapError(f"peer exported {peer.kind} regions; this side writes with {kind}")
    here = host_identity()
    if peer.host != here:
        raise PeerMapError(f"peer runs on another host (boot id {peer.host[:13]}..., here {here[:13]}...)")


# --- CUDA IPC --------------------------------------------------------------------------


_CUDA_IPC_LAZY_PEER_ACCESS = 1


class CudaIpcTransport:
    """Decode regions exported as CUDA IPC handles; writes made with the paged copy."""

    kind = "cuda-ipc"

    def __init__(self, copier: Optional[CudaBatchCopy], device: int, runtime=None, driver=None):
        """``copier``: None on a decode, which only exports. ``runtime``/``driver``: the CUDA
        runtime (a ``cuda_libs.CudaRuntime``) and driver library, or stand-ins with the same
        calls (tests); found in the process when None."""
        self.copier = copier
        self.device = device
        try:
            if runtime is None:
                runtime = cuda_libs.process_runtime()
            self._driver = driver if driver is not None else cuda_libs.cuda_driver()
        except cuda_libs.CudaLibraryError as exc:
            raise PeerMapError(str(exc)) from exc
        self._rt = runtime
        self._lock = threading.Lock()
        self._mapped: dict[bytes, list[int]] = {}  # handle -> [local base, references, mapped bytes]

    def _on_device(self) -> None:
        err = self._rt.lib.cudaSetDevice(self.device)
        if err:
            raise PeerMapError(f"cudaSetDevice({self.device}) failed: {self._rt.error(err)}")

    def _allocation_of(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        err = self._driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if err:
            raise PeerMapError(f"cuMemGetAddressRange({ptr:#x}) failed with driver error {err}")
        return base.value, size.value

    def export(self, regions: Sequence[tuple[int, int]]) -> PeerMap:
        self._on_device()
        handles: dict[int, bytes] = {}
        out = []
        for ptr, length in regions:
            ptr, length = int(ptr), int(length)
            base, size = self._allocation_of(ptr)
            if ptr + length > base + size:
                raise PeerMapError(f"region [{ptr:#x}, +{length}) runs past its allocation")
            handle = handles.get(base)
            if handle is None:
                raw = cuda_libs.IpcHandle()
                err = self._rt.lib.cudaIpcGetMemHandle(ctypes.byref(raw), ctypes.c_void_p(base))
                if err:
                    self._rt.lib.cudaGetLastError()
                    raise PeerMapError(
                        f"cudaIpcGetMemHandle({base:#x}) failed: {self._rt.error(err)} (memory from "
                        "the virtual memory API, e.g. expandable segments, cannot be exported this way)")
                handle = handles[base] = bytes(raw)
            out.append(PeerRegion(ptr, length, ptr - base, handle))
        if not out:
            raise PeerMapError("no device region to export")
        return PeerMap(self.kind, host_identity(), tuple(out))

    def open(self, peer: PeerMap) -> PeerTarget:
        check_peer(peer, self.kind)
        self._on_device()
        opened: list[bytes] = []
        bases: dict[bytes, int] = {}
        try:
            for handle in dict.fromkeys(r.handle for r in peer.regions):
                bases[handle] = self._open_one(handle)
                opened.append(handle)
        except Exception:  # what opened so far is closed, whatever failed
            self.close(opened)
            raise
        with self._lock:
            sizes = {h: self._mapped[h][2] for h in opened if h in self._mapped}
        outside = regions_outside_mappings(peer, sizes)
        if outside is not None:  # never trust the peer's word: no write may leave its memory
            self.close(opened)
            raise PeerMapError(f"peer map refused: {outside}")
        return PeerTarget(peer, [bases[r.handle] + r.offset for r in peer.regions], self, opened)

    def _open_one(self, handle: bytes) -> int:
        with self._lock:
            known = self._mapped.get(handle)
            if known is not None:
                known[1] += 1
                return known[0]
            raw = cuda_libs.IpcHandle.from_buffer_copy(handle)
            ptr = ctypes.c_void_p()
            err = self._rt.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _CUDA_IPC_LAZY_PEER_ACCESS)
            if err:
                self._rt.lib.cudaGetLastError()
                raise PeerMapError(f"cudaIpcOpenMemHandle failed: {self._rt.error(err)}")
            base = int(ptr.value or 0)
            try:
                found, size = self._allocation_of(base)
            except PeerMapError:
                self._rt.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(base))
                raise
            if found != base:  # the mapping must start the allocation the driver reports
                self._rt.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(base))
                raise PeerMapError(f"the opened handle maps {base:#x}, inside an allocation at {found:#x}")
            self._mapped[handle] = [base, 1, size]
            return base

    def write_pages(self, target: PeerTarget, copies: Sequence[PagedCopy]) -> None:
        self.copier.copy_pages(copies)  # every mapping is local memory: one launch for all targets

    def close(self, opened: Sequence[bytes]) -> None:
        """Never raises: a close runs on transfer threads and in teardown, and every reference
        is given back first, whatever the driver answers (a sticky error then fails the
        closes, and nothing can be done about it here)."""
        with self._lock:
            bases = []
            for handle in opened:
                known = self._mapped.get(handle)
                if known is None:
                    continue
                known[1] -= 1
                if known[1] == 0:
                    del self._mapped[handle]
                    bases.append(known[0])
            if bases and self._rt.lib.cudaSetDevice(self.device):
                self._rt.lib.cudaGetLastError()
            for base in bases:
                if self._rt.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(base)):
                    self._rt.lib.cudaGetLastError()

    @property
    def open_mappings(self) -> int:
        with self._lock:
            return len(self._mapped)


# --- prefill: one call from page lists --------------------------------------------------


@dataclass(frozen=True)
class PagedLayout:
    """Where a transfer call's pages live: per entry (buffer or layer), the page-0
    address on each side and the bytes per page. With entry (S, D, L), page
    ``p`` is ``S + p * L`` here and goes to ``D + q * L`` on the peer, for each
    (p, q) pair of the call.
    """

    entries: tuple[tuple[int, int, int], ...]  # (src page 0, dst page 0, bytes per page)

    @classmethod
    def of(cls, entries: Sequence[tuple[int, int, int]]) -> "PagedLayout":
        return cls(tuple((int(s), int(d), int(n)) for s, d, n in entries))

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True)
class BoundLayout:
    """A layout checked against this process's device memory and one opened peer map.

    Every entry's pages start at page 0 of a buffer, and all entries of a call
    take the same page numbers, so a call is inside every buffer on both sides
    exactly when each of its pages is below the smallest per-entry page count
    of its side: the copy's page limits, checked whatever the number of entries.
    """

    target: "PeerTarget"
    entries: tuple[tuple[int, int, int], ...]  # (src page 0, local address of dst page 0, bytes per page)
    src_pages: int  # pages every source buffer holds from page 0
    dst_pages: int  # pages every destination buffer holds from page 0, inside the peer map
    segments: np.ndarray  # int64 (entries x 5): the above as the paged copy's segment template
    page_bytes: int  # bytes one page pair moves over every entry


def bind_layout(layout: PagedLayout, target: "PeerTarget", device_bytes_from) -> tuple[Optional[BoundLayout], Optional[str]]:
    """(bound layout, None), or (None, why the page path cannot serve this layout).

    ``device_bytes_from(addr)``: bytes from ``addr`` to the end of the device
    region of this process holding it, 0 when it is not device memory.
    """
    if not len(layout) or any(n <= 0 or max(s, d) >= ADDRESS_LIMIT for s, d, n in layout.entries):
        return None, NOT_PAGES  # (the table is built in int64: no address near its top)
    entries, src_pages, dst_pages = [], [], []
    for s, d, n in layout.entries:
        room = device_bytes_from(s)
        if room < n:
            return None, SOURCE_NOT_DEVICE
        found = target.locate(d)
        if found is None or found[1] < n:
            return None, FALLBACK_OUTSIDE_PEER_MAP
        entries.append((s, found[0], n))
        src_pages.append(room // n)
        dst_pages.append(found[1] // n)
    rows = np.array(entries, dtype=np.int64).reshape(-1, 3)
    return BoundLayout(target, tuple(entries), min(src_pages), min(dst_pages), paged_segments(rows),
                       sum(e[2] for e in entries)), None


_new_tuple = tuple.__new__


def _page_lists(p, d) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """Two integer page arrays of one length, or (None, None). Their ids are checked
    against the buffers by the copy itself (``PagedCopy`` limits), in the launch table.
    Called once per send: sglang's own arrays pass without a conversion."""
    if type(p) is not np.ndarray or type(d) is not np.ndarray:
        p, d = np.asarray(p), np.asarray(d)
    if p.ndim != 1 or p.shape != d.shape or not p.size or p.dtype.kind not in "iu" or d.dtype.kind not in "iu":
        return None, None
    return p, d


class PeerWrites:
    """Writes held back until a barrier, then made as one batched copy (one launch and
    synchronize for a request's last sends, not one each). ``add_pages`` copies the page
    lists and holds the target open; ``flush`` writes and returns when it landed,
    ``discard`` drops it unwritten. One per sending thread. (Starting the largest call
    at once, to overlap it with the rest, measured slower: a second launch costs more.)
    """

    def __init__(self):
        self._copies: list[tuple[PeerTarget, PagedCopy]] = []
        self._held_open: dict[int, PeerTarget] = {}  # targets acquired for what is held
        self.calls = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._copies)

    def add_pages(self, bound: BoundLayout, src_pages, dst_pages) -> Optional[str]:
        """Hold one call's pages; None, or why the page path cannot take it (nothing held).

        Page ids are checked when written, for every held call at once: one
        outside its buffers fails the flush (``PagesOutsideBuffers``, nothing
        written), which is the request's failure.
        """
        p, d = _page_lists(src_pages, dst_pages)
        if p is None:
            return NOT_PAGES
        target = bound.target
        if id(target) not in self._held_open:
            if not target.acquire():  # retired meanwhile: a newer map replaced it
                return FALLBACK_NO_PEER_MAP
            self._held_open[id(target)] = target
        # The caller's arrays may change once it returns: hold copies (in their own integer
        # type: the launch table converts them as it takes them in). A tuple built as the
        # PagedCopy it is, without its constructor's argument handling: this runs per send.
        self._copies.append((target, _new_tuple(PagedCopy, (bound.segments, p.copy(), d.copy(), bound.page_bytes,
                                                            bound.src_pages, bound.dst_pages))))
        self.calls += 1
        self.nbytes += len(p) * bound.page_bytes
        return None

    def flush(self) -> int:
        """Write what is held; the bytes written. Raises when a copy failed (nothing is held after)."""
        held, opened = self._copies, self._held_open
        self._copies, self._held_open = [], {}
        nbytes, self.calls, self.nbytes = self.nbytes, 0, 0
        try:
            for target in opened.values():  # one batch per decode map (a request has one)
                target.transport.write_pages(target, [c for t, c in held if t is target])
        finally:
            for target in opened.values():
                target.release()
        return nbytes

    def discard(self) -> None:
        """Drop what is held, unwritten, and let go of its maps."""
        opened = self._held_open
        self._copies, self._held_open = [], {}
        self.calls, self.nbytes = 0, 0
        for target in opened.values():
            target.release()
