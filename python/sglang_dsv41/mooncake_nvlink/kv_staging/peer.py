"""Peer writes for Mooncake PD transfers on one host: a batch as one kernel, no engine.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import itertools
import os
import struct
import threading
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np

from sglang_dsv41.mooncake_nvlink import cuda_libs
from sglang_dsv41.mooncake_nvlink.cuda_libs import HANDLE_BYTES
from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import (
    BatchCopy,
    BatchCopyError,
    PagedCopy,
    PagesOutsideBuffers,
    expand_paged,
    paged_segments,
)

PEER_MAP_TAG = b"dsv41-kv-peer-map-v1"
_ENTRY = struct.Struct(f"<QQQ{HANDLE_BYTES}s")  # region pointer, length, offset in allocation, handle
MAX_PEER_REGIONS = 1 << 14
KINDS = ("cuda-ipc", "host-cma")

# Why a batch took the direct path instead of a peer write (metric label values).
FALLBACK_NO_PEER_MAP = "no_peer_map"
FALLBACK_PEER_MAP_FAILED = "peer_map_unusable"
FALLBACK_OUTSIDE_PEER_MAP = "outside_peer_map"


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
        self._starts = np.array([peer.regions[i].ptr for i in order], dtype=np.uint64)
        self._ends = np.array([peer.regions[i].ptr + peer.regions[i].length for i in order], dtype=np.uint64)
        self._mapped = np.array([mapped_starts[i] for i in order], dtype=np.uint64)
        # The same table as Python ints, for look-ups one address at a time.
        self._start_list = self._starts.tolist()
        self._end_list = self._ends.tolist()
        self._mapped_list = self._mapped.tolist()
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False
        self._closed = False
        self.context: object = None  # what the transport needs to write (host-cma: the pid)

    def translate(self, dsts: np.ndarray, lengths: np.ndarray) -> tuple[Optional[np.ndarray], Optional[int]]:
        """(local destinations, None), or (None, index of the first span inside no region)."""
        idx = np.searchsorted(self._starts, dsts, side="right").astype(np.int64) - 1
        safe = np.where(idx >= 0, idx, 0)
        ends = dsts + lengths
        ok = (idx >= 0) & (ends >= dsts) & (ends <= self._ends[safe])
        if not ok.all():
            return None, int(np.argmin(ok))
        return dsts - self._starts[safe] + self._mapped[safe], None

    def locate(self, dst: int) -> Optional[tuple[int, int]]:
        """(local address of ``dst``, bytes from it to its region's end), or None outside the map."""
        k = bisect.bisect_right(self._start_list, dst) - 1
        if k < 0 or dst >= self._end_list[k]:
            return None
        return dst - self._start_list[k] + self._mapped_list[k], self._end_list[k] - dst

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

    def write(self, target: PeerTarget, srcs: np.ndarray, dsts: np.ndarray, lengths: np.ndarray) -> None:
        """One batch from local sources to translated destinations; returns when it landed."""

    def write_pages(self, target: PeerTarget, copies: Sequence[PagedCopy]) -> None:
        """Paged copies (destinations translated) as one batch; returns when it landed."""

    def close(self, opened: Sequence[bytes]) -> None:
        """Give back mappings ``open`` made (reference counted per handle)."""


def _check_peer(peer: PeerMap, kind: str) -> None:
    if peer.kind != kind:
        raise PeerMapError(f"peer exported {peer.kind} regions; this side writes with {kind}")
    here = host_identity()
    if peer.host != here:
        raise PeerMapError(f"peer runs on another host (boot id {peer.host[:13]}..., here {here[:13]}...)")


# --- CUDA IPC --------------------------------------------------------------------------


_CUDA_IPC_LAZY_PEER_ACCESS = 1


class CudaIpcTransport:
    """Decode regions exported as CUDA IPC handles; batches written with the batched copy."""

    kind = "cuda-ipc"

    def __init__(self, copier: Optional[BatchCopy], device: int, runtime=None, driver=None):
        """``copier``: None on a decode, which only exports. ``runtime``/``driver``: the CUDA
        runtime (a ``cuda_libs.CudaRuntime``) and driver library, or stand-ins with the same
        calls (tests); found in the process when None."""
        self.copier = copier
        self.device = device
        try:
            if runtime is None:
                try:  # torch's own runtime first: the same current device and context as its kernels
                    runtime = cuda_libs.cuda_runtime(loaded_only=True)
                except cuda_libs.CudaLibraryError:
                    runtime = cuda_libs.cuda_runtime()
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
        _check_peer(peer, self.kind)
        self._on_device()
        opened: list[bytes] = []
        bases: dict[bytes, int] = {}
        try:
            for handle in dict.fromkeys(r.handle for r in peer.regions):
                bases[handle] = self._open_one(handle)
                opened.append(handle)
        except PeerMapError:
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

    def write(self, target: PeerTarget, srcs, dsts, lengths) -> None:
        self.copier.copy(srcs, dsts, lengths)

    def write_pages(self, target: PeerTarget, copies: Sequence[PagedCopy]) -> None:
        self.copier.copy_pages(copies)  # every mapping is local memory: one launch for all targets

    def close(self, opened: Sequence[bytes]) -> None:
        with self._lock:
            for handle in opened:
                known = self._mapped.get(handle)
                if known is None:
                    continue
                known[1] -= 1
                if known[1] == 0:
                    del self._mapped[handle]
                    self._on_device()
                    err = self._rt.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(known[0]))
                    if err:
                        self._rt.lib.cudaGetLastError()

    @property
    def open_mappings(self) -> int:
        with self._lock:
            return len(self._mapped)


# --- host memory of another process -------------------------------------------------------


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_IOV_MAX = 1024
_PID = struct.Struct("<Q")


class HostCmaTransport:
    """Another process's host memory written with ``process_vm_writev`` (cross memory attach)."""

    kind = "host-cma"

    def __init__(self):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._writev = libc.process_vm_writev
        self._writev.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                                 ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]
        self._writev.restype = ctypes.c_ssize_t
        self._readv = libc.process_vm_readv
        self._readv.argtypes, self._readv.restype = self._writev.argtypes, ctypes.c_ssize_t
        self._opened = 0
        self._lock = threading.Lock()

    def export(self, regions: Sequence[tuple[int, int]]) -> PeerMap:
        handle = _PID.pack(os.getpid()).ljust(HANDLE_BYTES, b"\0")
        out = tuple(PeerRegion(int(p), int(n), 0, handle) for p, n in regions if int(n) > 0)
        if not out:
            raise PeerMapError("no region to export")
        return PeerMap(self.kind, host_identity(), out)

    def open(self, peer: PeerMap) -> PeerTarget:
        _check_peer(peer, self.kind)
        pids = {_PID.unpack(r.handle[:_PID.size])[0] for r in peer.regions}
        if len(pids) != 1:
            raise PeerMapError(f"host peer map names {len(pids)} processes")
        pid = pids.pop()
        if pid == os.getpid():
            raise PeerMapError("host peer map names this very process")
        # Read one byte of the first region: the same permission a write needs,
        # without touching the peer's memory.
        probe = ctypes.c_char()
        local = IoVec(ctypes.cast(ctypes.byref(probe), ctypes.c_void_p), 1)
        remote = IoVec(peer.regions[0].ptr, 1)
        if self._readv(int(pid), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != 1:
            err = ctypes.get_errno()
            raise PeerMapError(f"process {pid} cannot be written: {os.strerror(err) if err else 'short read'}")
        with self._lock:
            self._opened += 1
        target = PeerTarget(peer, [r.ptr for r in peer.regions], self, [peer.regions[0].handle])
        target.context = pid
        return target

    def write(self, target: PeerTarget, srcs, dsts, lengths) -> None:
        pid = target.context
        s, d, n = (np.asarray(a, dtype=np.uint64) for a in (srcs, dsts, lengths))
        i, done_in_entry = 0, 0
        while i < len(n):
            count = min(_IOV_MAX, len(n) - i)
            local = (IoVec * count)()
            remote = (IoVec * count)()
            for k in range(count):
                skip = done_in_entry if k == 0 else 0
                size = int(n[i + k]) - skip
                local[k].base, local[k].len = int(s[i + k]) + skip, size
                remote[k].base, remote[k].len = int(d[i + k]) + skip, size
            wrote = self._writev(int(pid), local, count, remote, count, 0)
            if wrote < 0:
                err = ctypes.get_errno()
                raise BatchCopyError(f"process_vm_writev to {pid} failed: {os.strerror(err)}")
            if wrote == 0:
                raise BatchCopyError(f"process_vm_writev to {pid} made no progress")
            while wrote > 0:  # advance over what landed (a partial write stops at a page)
                left = int(n[i]) - done_in_entry
                if wrote >= left:
                    wrote -= left
                    i, done_in_entry = i + 1, 0
                else:
                    done_in_entry += wrote
                    wrote = 0

    def write_pages(self, target: PeerTarget, copies: Sequence[PagedCopy]) -> None:
        self.write(target, *expand_paged(copies))

    def close(self, opened: Sequence[bytes]) -> None:
        with self._lock:
            self._opened -= 1

    @property
    def open_mappings(self) -> int:
        with self._lock:
            return self._opened


# --- prefill: one batch -------------------------------------------------------------------


def as_triples(blocks: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(srcs, dsts, lengths) as uint64 arrays from the engine's (src, dst, length) blocks."""
    try:  # C-level conversion: a batch can be a thousand blocks
        flat = np.fromiter(
            itertools.chain.from_iterable(blocks), dtype=np.int64, count=3 * len(blocks)
        ).reshape(-1, 3).view(np.uint64)
    except (ValueError, TypeError, OverflowError):  # not plain (src, dst, length) triples
        flat = np.array([[int(v) for v in block[:3]] for block in blocks], dtype=np.uint64)
    return flat[:, 0], flat[:, 1], flat[:, 2]


@dataclass(frozen=True)
class PeerOutcome:
    """``rc`` as the engine would answer; ``fallback`` names why no peer write was made."""

    rc: int
    fallback: Optional[str] = None
    nbytes: int = 0


def send_peer_batch(blocks, target: Optional[PeerTarget], min_blocks: int, write_direct) -> PeerOutcome:
    """One transfer batch: a peer write when it qualifies, else ``write_direct(blocks)``.

    A failed peer write raises (BatchCopyError, ...): the caller turns it into
    the request's transfer failure. Nothing was half-sent the direct way.
    """
    if len(blocks) < min_blocks:
        return PeerOutcome(write_direct(blocks), "few_blocks")
    if target is None:
        return PeerOutcome(write_direct(blocks), FALLBACK_NO_PEER_MAP)
    srcs, dsts, lengths = as_triples(blocks)
    local, outside = target.translate(dsts, lengths)
    if local is None:
        return PeerOutcome(write_direct(blocks), FALLBACK_OUTSIDE_PEER_MAP)
    if not target.acquire():  # retired meanwhile: a newer map replaced it
        return PeerOutcome(write_direct(blocks), FALLBACK_NO_PEER_MAP)
    try:
        target.transport.write(target, srcs, local, lengths)
    finally:
        target.release()
    return PeerOutcome(0, None, int(lengths.sum()))


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
    max_item: int
    page_bytes: int  # bytes one page pair moves over every entry


def bind_layout(layout: PagedLayout, target: "PeerTarget", device_bytes_from) -> tuple[Optional[BoundLayout], Optional[str]]:
    """(bound layout, None), or (None, why the page path cannot serve this layout).

    ``device_bytes_from(addr)``: bytes from ``addr`` to the end of the device
    region of this process holding it, 0 when it is not device memory.
    """
    if not len(layout) or any(n <= 0 or max(s, d) >= _ADDRESS_CEILING for s, d, n in layout.entries):
        return None, PAGED_NOT_PAGES  # (the table is built in int64: no address near its top)
    entries, src_pages, dst_pages = [], [], []
    for s, d, n in layout.entries:
        room = device_bytes_from(s)
        if room < n:
            return None, PAGED_SOURCE_NOT_DEVICE
        found = target.locate(d)
        if found is None or found[1] < n:
            return None, PAGED_OUTSIDE_PEER_MAP
        entries.append((s, found[0], n))
        src_pages.append(room // n)
        dst_pages.append(found[1] // n)
    rows = np.array(entries, dtype=np.int64).reshape(-1, 3)
    return BoundLayout(target, tuple(entries), min(src_pages), min(dst_pages), paged_segments(rows),
                       max(e[2] for e in entries), sum(e[2] for e in entries)), None


_ADDRESS_CEILING = 1 << 62

# Up to this many pages a Python loop finds the runs faster than NumPy's calls (measured on
# the H200 host: 32 pages 7 us in Python, 22 us in NumPy).
_SMALL_PAGE_LIST = 128


def _page_array(pages) -> Optional[np.ndarray]:
    arr = np.asarray(pages)
    if arr.ndim != 1 or not arr.size or arr.dtype.kind not in "iu":
        return None
    return arr


@dataclass(frozen=True)
class PageRuns:
    """A call's (src, dst) page pairs as runs where both sides go up by one."""

    first_src: Sequence[int]  # Python lists for short calls, int64 arrays for long ones
    first_dst: Sequence[int]
    counts: Sequence[int]
    src_end: int  # highest page + 1, per side
    dst_end: int

    def __len__(self) -> int:
        return len(self.counts)


def page_runs(src_pages, dst_pages) -> Optional[PageRuns]:
    """The runs of a call's page lists; None when they cannot describe a transfer
    (different lengths, empty, not integers, negative pages): the caller leaves
    such a call to the block path.
    """
    p, d = _page_array(src_pages), _page_array(dst_pages)
    if p is None or d is None or p.shape != d.shape:
        return None
    if p.size <= _SMALL_PAGE_LIST:
        ps, ds = p.tolist(), d.tolist()
        if min(ps) < 0 or min(ds) < 0:
            return None
        first_src, first_dst, counts = [ps[0]], [ds[0]], [1]
        for i in range(1, len(ps)):
            if ps[i] == ps[i - 1] + 1 and ds[i] == ds[i - 1] + 1:
                counts[-1] += 1
            else:
                first_src.append(ps[i])
                first_dst.append(ds[i])
                counts.append(1)
        return PageRuns(first_src, first_dst, counts, max(ps) + 1, max(ds) + 1)
    p, d = p.astype(np.int64, copy=False), d.astype(np.int64, copy=False)
    if min(p.min(), d.min()) < 0:
        return None
    breaks = np.flatnonzero((np.diff(p) != 1) | (np.diff(d) != 1))
    starts = np.empty(breaks.size + 1, dtype=np.int64)
    starts[0] = 0
    np.add(breaks, 1, out=starts[1:])
    return PageRuns(p[starts], d[starts], np.diff(starts, append=p.size), int(p.max()) + 1, int(d.max()) + 1)


# Why a call from page lists was left to the block path (then counted there).
PAGED_FEW_BLOCKS = "few_blocks"
PAGED_SOURCE_NOT_DEVICE = "source_not_device"
PAGED_OUTSIDE_PEER_MAP = FALLBACK_OUTSIDE_PEER_MAP
PAGED_NOT_PAGES = "not_pages"


def _page_lists(p, d) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """Two integer page arrays of one length, or (None, None). Their ids are checked
    against the buffers by the copy itself (``PagedCopy`` limits), in the launch table.
    Called once per send: sglang's own arrays pass without a conversion."""
    if type(p) is not np.ndarray or type(d) is not np.ndarray:
        p, d = np.asarray(p), np.asarray(d)
    if p.ndim != 1 or p.shape != d.shape or not p.size or p.dtype.kind not in "iu" or d.dtype.kind not in "iu":
        return None, None
    return p, d


def paged_call(bound: BoundLayout, src_pages, dst_pages) -> tuple[Optional[PagedCopy], Optional[str]]:
    """(the call's paged copy, None), or (None, why the page path cannot take it).

    The copy carries the layout's page counts: writing it refuses pages
    outside the buffers on either side (``PagesOutsideBuffers``).
    """
    p, d = _page_lists(src_pages, dst_pages)
    if p is None:
        return None, PAGED_NOT_PAGES
    return _copy_of(bound, p, d), None


def _copy_of(bound: BoundLayout, p: np.ndarray, d: np.ndarray) -> PagedCopy:
    return PagedCopy(bound.segments, p, d, bound.max_item, bound.page_bytes,
                     bound.src_pages, bound.dst_pages)


def outside_reason(exc: PagesOutsideBuffers) -> str:
    """The block-path reason for a call whose pages the copy refused."""
    if exc.negative:
        return PAGED_NOT_PAGES
    return PAGED_SOURCE_NOT_DEVICE if exc.side == "source" else PAGED_OUTSIDE_PEER_MAP


def _few_blocks(bound: BoundLayout, copy: PagedCopy, min_blocks: int) -> bool:
    """Would upstream's block list for this call be under ``min_blocks`` blocks?"""
    entries, pages = len(bound.entries), len(copy.src_pages)
    if entries * pages < min_blocks:
        return True
    if entries >= min_blocks:
        return False
    runs = page_runs(copy.src_pages, copy.dst_pages)
    return runs is not None and entries * len(runs) < min_blocks  # None: negative pages, refused by the copy


def send_paged_batch(bound: BoundLayout, src_pages, dst_pages, min_blocks: int) -> PeerOutcome:
    """One transfer call given as page lists: one peer write of every buffer's pages, or why not.

    No block list: the paged kernel finds each page's address on the device.
    Returns ``PeerOutcome(rc=0)`` after the copy landed; ``fallback`` set
    (nothing written) when the call should take the block path, including
    pages outside the buffers (refused by the copy before it writes); raises
    when the copy failed (the request's transfer failure).
    """
    copy, why_not = paged_call(bound, src_pages, dst_pages)
    if copy is None:
        return PeerOutcome(-1, why_not)
    if _few_blocks(bound, copy, min_blocks):
        return PeerOutcome(-1, PAGED_FEW_BLOCKS)
    target = bound.target
    if not target.acquire():  # retired meanwhile: a newer map replaced it
        return PeerOutcome(-1, FALLBACK_NO_PEER_MAP)
    try:
        target.transport.write_pages(target, [copy])
    except PagesOutsideBuffers as exc:
        return PeerOutcome(-1, outside_reason(exc))
    finally:
        target.release()
    return PeerOutcome(0, None, len(copy.src_pages) * bound.page_bytes)


class PeerWrites:
    """Writes held back until a barrier, then made as one batched copy.

    A request's last sends (its final KV chunk, its state) each cost a launch
    and a synchronize when written one by one; held here they go as one.
    ``add_pages`` keeps a copy of the page lists and holds the target open (a
    newer map cannot close it meanwhile); ``flush`` writes everything and
    returns when it landed, ``discard`` drops it unwritten. Not thread-safe:
    one per sending thread. (Starting the largest call at once, to overlap
    its copy with the rest, was measured slower: a second launch and
    synchronize cost more than the overlap saves.)
    """

    def __init__(self):
        self._copies: list[tuple[PeerTarget, PagedCopy]] = []
        self._held_open: dict[int, PeerTarget] = {}  # targets acquired for what is held
        self.calls = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._copies)

    def _hold_open(self, target: PeerTarget) -> bool:
        """Acquire ``target`` for what is held (the caller checked it is not held open yet)."""
        if not target.acquire():  # retired meanwhile: a newer map replaced it
            return False
        self._held_open[id(target)] = target
        return True

    def add_pages(self, bound: BoundLayout, src_pages, dst_pages) -> Optional[str]:
        """Hold one call's pages; None, or why the page path cannot take it (nothing held).

        Page ids are checked when written, for every held call at once: one
        outside its buffers fails the flush (``PagesOutsideBuffers``, nothing
        written), which is the request's failure.
        """
        p, d = _page_lists(src_pages, dst_pages)
        if p is None:
            return PAGED_NOT_PAGES
        target = bound.target
        if id(target) not in self._held_open and not self._hold_open(target):
            return FALLBACK_NO_PEER_MAP
        # The caller's arrays may change once it returns: hold copies, as int64 (the launch
        # table's type: the flush then writes them without converting).
        self._copies.append((target, _copy_of(bound, p.astype(np.int64), d.astype(np.int64))))
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
        opened = self._held_open
        self._copies, self._held_open = [], {}
        self.calls, self.nbytes = 0, 0
        for target in opened.values():
            target.release()
