"""Many local copies in one launch: what KV peer writes copy with.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import NamedTuple, Optional, Protocol, Sequence

import numpy as np

from sglang_dsv41.mooncake_nvlink import cuda_libs


_U64_MAX = (1 << 64) - 1


class BatchCopyError(RuntimeError):
    """A batch could not be copied (bad arrays, allocation or device failure)."""


class BatchCopy(Protocol):
    backend: str

    def copy(self, srcs: np.ndarray, dsts: np.ndarray, lengths: np.ndarray) -> None:
        """Copy ``lengths[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every i; synchronous."""

    def copy_pages(self, copies: "Sequence[PagedCopy]") -> None:
        """Copy every page pair of every ``PagedCopy``; synchronous, one batch."""


def _as_uint64(values, name: str) -> np.ndarray:
    # A cast alone would wrap -1 to 2**64 - 1 and truncate 1.5 to 1: refuse both.
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    kind = arr.dtype.kind
    if kind == "i":
        if arr.size and arr.min() < 0:
            raise BatchCopyError(f"batch {name} holds a negative value ({int(arr.min())})")
    elif kind != "u" and not (arr.size == 0 and kind == "f"):  # [] comes as float64
        raise BatchCopyError(
            f"batch {name} are not unsigned 64-bit integers (dtype {arr.dtype})"
        )
    try:
        return np.ascontiguousarray(arr, dtype=np.uint64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BatchCopyError(f"batch {name} are not unsigned 64-bit integers: {exc}") from exc


def converted(srcs, dsts, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = _as_uint64(srcs, "source pointers")
    d = _as_uint64(dsts, "destination pointers")
    n = _as_uint64(lengths, "lengths")
    if not (s.ndim == d.ndim == n.ndim == 1) or not (len(s) == len(d) == len(n)):
        raise BatchCopyError(
            f"batch arrays differ in shape: {s.shape}, {d.shape}, {n.shape}"
        )
    return s, d, n


def as_batch(srcs, dsts, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert a batch to three contiguous uint64 arrays.

    Refuses negative or non-integer values, arrays of different shapes, a
    range that wraps past 2**64, and a null pointer with a non-zero length.
    """
    s, d, n = converted(srcs, dsts, lengths)
    if len(n):
        # Cheap bounds first (this is on the transfer path); exact checks only when they fail.
        if max(int(s.max()), int(d.max())) + int(n.max()) > _U64_MAX:
            # ~p is 2**64 - 1 - p: a length above it makes p + length wrap.
            wraps = (n > ~s) | (n > ~d)
            if wraps.any():
                i = int(np.flatnonzero(wraps)[0])
                raise BatchCopyError(
                    f"batch entry {i}: {int(n[i])} bytes from {int(s[i]):#x} to {int(d[i]):#x} "
                    "run past the end of the address space"
                )
        if not (s.min() and d.min()):
            null = ((s == 0) | (d == 0)) & (n != 0)
            if null.any():
                i = int(np.flatnonzero(null)[0])
                raise BatchCopyError(f"batch entry {i}: null pointer with {int(n[i])} bytes")
    return s, d, n

# --- page-addressed batches -------------------------------------------------------

PAGED_SEGMENT_WORDS = 5  # one segment row of the paged kernel's table
# A program's piece: the kernel starts no idle programs, so small pieces spread a
# request's few pages over many SMs (on an H200 a request's write took less GPU
# time with 32 KiB pieces than with 16 KiB).
PAGED_CHUNK_BYTES = 32768
_MAX_PROGRAMS = (1 << 31) - 1  # a grid's x limit
NO_PAGE_LIMIT = 1 << 63  # page ids are compared as unsigned: this limit refuses only negative ones
_ADDRESS_LIMIT = 1 << 62  # no GPU pointer reaches it; below it int64 arithmetic is exact
_LENGTH_LIMIT = 1 << 45  # 32 TiB: no buffer of any GPU is larger


class PagedCopy(NamedTuple):
    """Pages of several buffers moved with one list of page pairs.

    ``segments``: C-contiguous int64 rows, one per buffer, whose first three
    columns are (page-0 address at the source, page-0 address at the
    destination, bytes per page); the last two are the kernel table's page
    offset and count, filled in per launch (``paged_segments`` builds it).
    ``src_pages``/``dst_pages``: equal-length integer arrays. Page
    ``src_pages[k]`` of every buffer goes to its page ``dst_pages[k]``. Build it
    with ``paged_copy`` (which checks it) unless the caller checked the same
    facts (``peer.bind_layout`` does, once per layout).
    """

    segments: np.ndarray
    src_pages: np.ndarray
    dst_pages: np.ndarray
    max_item: int  # the largest bytes per page
    page_bytes: int  # bytes one page pair moves over every buffer
    # Pages every buffer holds on each side: the copy refuses a page at or past
    # it (``PagesOutsideBuffers``) before anything is written.
    src_limit: int = NO_PAGE_LIMIT
    dst_limit: int = NO_PAGE_LIMIT

    @property
    def entries(self) -> np.ndarray:
        return self.segments[:, :3]


class PagesOutsideBuffers(BatchCopyError):
    """A paged copy names a page its buffers do not hold; nothing of the launch was written."""

    def __init__(self, copy_index: int, side: str, page: int, limit: int):
        self.copy_index, self.side, self.page, self.limit = copy_index, side, page, limit
        self.negative = page < 0
        held = f"the {side} buffers hold pages 0 to {limit - 1}" if limit < NO_PAGE_LIMIT else "pages are never negative"
        super().__init__(f"paged copy {copy_index} names {side} page {page}; {held}")


def paged_segments(rows: np.ndarray, remember: bool = True) -> np.ndarray:
    """The (buffers x PAGED_SEGMENT_WORDS) template of ``rows`` (buffers x 3, int64).

    ``remember``: read-only, so launch plans may be cached by the template's
    identity (a layout reused for every request); a one-off template stays
    writable and its plan is never cached.
    """
    out = np.zeros((len(rows), PAGED_SEGMENT_WORDS), dtype=np.int64)
    out[:, :3] = rows
    out.flags.writeable = not remember
    return out


def pages_outside(copies: Sequence[PagedCopy]) -> Optional[PagesOutsideBuffers]:
    """The first page of ``copies`` outside its buffers, else None.

    As the launch table sees them: int64, compared as unsigned, so a negative
    page is past every limit.
    """
    for i, c in enumerate(copies):
        for side, pages, limit in (("source", c.src_pages, c.src_limit), ("destination", c.dst_pages, c.dst_limit)):
            wide = np.asarray(pages).astype(np.int64)
            bad = np.flatnonzero(wide.view(np.uint64) >= np.uint64(limit))
            if bad.size:
                return PagesOutsideBuffers(i, side, int(wide[bad[0]]), limit)
    return None


def paged_copy(entries, src_pages, dst_pages) -> PagedCopy:
    """A checked ``PagedCopy``: BatchCopyError for pages or entries no copy can take."""
    try:
        rows = np.ascontiguousarray(np.asarray(entries, dtype=np.int64).reshape(-1, 3))
    except (TypeError, ValueError, OverflowError) as exc:
        raise BatchCopyError(f"paged copy entries are not (source, destination, bytes per page) rows: {exc}") from exc
    sp, dp = np.asarray(src_pages), np.asarray(dst_pages)
    if sp.ndim != 1 or sp.shape != dp.shape or sp.dtype.kind not in "iu" or dp.dtype.kind not in "iu":
        raise BatchCopyError("paged copy page lists must be two integer arrays of one length")
    if not len(rows) or not len(sp):
        return PagedCopy(paged_segments(rows), sp, dp, 0, 0)
    if rows.min() <= 0:
        raise BatchCopyError("paged copy entries need non-null addresses and positive bytes per page")
    if min(int(sp.min()), int(dp.min())) < 0:
        raise BatchCopyError("paged copy page ids must not be negative")
    item = int(rows[:, 2].max())
    top = int(rows[:, :2].max()) + (max(int(sp.max()), int(dp.max())) + 1) * item
    if top >= _ADDRESS_LIMIT or item > _LENGTH_LIMIT:
        raise BatchCopyError(f"paged copy reaches {top:#x}: no GPU address range")
    return PagedCopy(paged_segments(rows), sp, dp, item, int(rows[:, 2].sum()))


_PAGE_ZERO = np.zeros(1, dtype=np.int64)


def block_copy(srcs, dsts, lengths) -> PagedCopy:
    """A block list as one paged copy: each non-empty block a buffer of one page, page 0 to page 0.

    Validated as ``as_batch`` does; its plan is not cached (a block list is seldom seen twice).
    """
    s, d, n = as_batch(srcs, dsts, lengths)
    keep = n != 0
    if not keep.all():
        s, d, n = s[keep], d[keep], n[keep]
    if len(n) and (max(int(s.max()), int(d.max())) >= _ADDRESS_LIMIT or int(n.max()) > _LENGTH_LIMIT):
        raise BatchCopyError("batch holds a pointer or length beyond any GPU address range")
    rows = np.stack((s, d, n), axis=1).view(np.int64)
    return PagedCopy(paged_segments(rows, remember=False), _PAGE_ZERO, _PAGE_ZERO,
                     int(n.max()) if len(n) else 0, int(n.sum()))


def _blocks_of(copies: Sequence[PagedCopy], merge_runs: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    outside = pages_outside(copies)
    if outside is not None:
        raise outside
    parts = []
    for c in copies:
        if not len(c.entries) or not len(c.src_pages):
            continue
        sp, dp = c.src_pages.astype(np.int64), c.dst_pages.astype(np.int64)
        pages = np.ones(len(sp), dtype=np.int64)
        if merge_runs:
            starts = np.flatnonzero(np.r_[True, (sp[1:] != sp[:-1] + 1) | (dp[1:] != dp[:-1] + 1)])
            pages = np.diff(np.r_[starts, len(sp)])
            sp, dp = sp[starts], dp[starts]
        item = c.entries[:, 2:3]
        parts.append(((c.entries[:, 0:1] + sp[None, :] * item).ravel(), (c.entries[:, 1:2] + dp[None, :] * item).ravel(),
                      (pages[None, :] * item).ravel()))
    if not parts:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    return tuple(np.ascontiguousarray(np.concatenate([p[k] for p in parts])).view(np.uint64) for k in range(3))


def expand_paged(copies: Sequence[PagedCopy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (srcs, dsts, lengths) block list of ``copies``: entry by entry, pages in order.

    Raises ``PagesOutsideBuffers`` as the device copy does.
    """
    return _blocks_of(copies, merge_runs=False)


def merged_page_runs(copies: Sequence[PagedCopy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(srcs, dsts, lengths) of ``copies`` with pages consecutive on both sides merged into one entry
    (what the host copier writes: one memmove per run).

    Raises ``PagesOutsideBuffers`` before anything is built, as every copier does.
    """
    return _blocks_of(copies, merge_runs=True)


class _PagedPlan(NamedTuple):
    """What a launch table holds besides the page ids, for one shape of copies."""

    head: np.ndarray  # flat int64: segment count, chunk, each segment's end, every segment row
    limits: np.ndarray  # uint64, one per page slot of the table: the first page its buffers lack
    words: int  # table length: the head, then each copy's source and destination pages
    programs: int
    templates: tuple  # the copies' segment templates: kept alive, so their ids stay theirs


PAGED_HEAD_WORDS = 2  # segment count, chunk; then one end per segment and the segment rows

# Launch plans by (chunk, per copy: template id, pages, limits). A transfer worker
# sends requests of few shapes (one KV layout, its state layouts, a page count per
# chunk length), so a request's table is its cached head and its page ids in one
# NumPy call. Cleared when full rather than kept in order: a miss costs a few calls.
LAUNCH_PLANS: dict = {}
_PLANS_MAX_WORDS = 4 << 20  # 32 MiB of cached heads at most
_plans_words = 0  # approximate under concurrent senders: it only decides when to clear


def _paged_plan(copies: Sequence[PagedCopy], chunk: int) -> _PagedPlan:
    counts = [len(c.segments) for c in copies]
    segments = sum(counts)
    rows = np.zeros((segments, PAGED_SEGMENT_WORDS), dtype=np.int64)
    if segments:
        np.concatenate([c.segments for c in copies], out=rows)
    pages = np.repeat(np.array([len(c.src_pages) for c in copies], dtype=np.int64), counts)
    units = pages * -(-rows[:, 2] // chunk)  # programs per segment
    programs = int(units.sum())
    if programs > _MAX_PROGRAMS:
        raise BatchCopyError(f"a paged copy of {programs} pieces of {chunk} bytes is beyond one launch")
    places, limits, sizes = [], [], []
    at = PAGED_HEAD_WORDS + (1 + PAGED_SEGMENT_WORDS) * segments
    for c in copies:
        n = len(c.src_pages)
        places.append(at)
        limits += (c.src_limit, c.dst_limit)
        sizes += (n, n)
        at += 2 * n
    if segments:
        rows[:, 3] = np.repeat(np.array(places, dtype=np.int64), counts)
        rows[:, 4] = pages
    head = np.concatenate([np.array([segments, chunk], dtype=np.int64), np.cumsum(units), rows.ravel()])
    return _PagedPlan(head, np.repeat(np.array(limits, dtype=np.uint64), sizes), at, programs,
                      tuple(c.segments for c in copies))


def paged_plan(copies: Sequence[PagedCopy], chunk: int) -> _PagedPlan:
    """The launch plan of ``copies`` (a table's head and page limits), cached by their shape
    when every template is read-only (``paged_segments``)."""
    global _plans_words
    if any(c.segments.flags.writeable for c in copies):
        return _paged_plan(copies, chunk)
    key = (chunk, *[(id(c.segments), len(c.src_pages), c.src_limit, c.dst_limit) for c in copies])
    plan = LAUNCH_PLANS.get(key)
    if plan is None:
        plan = _paged_plan(copies, chunk)
        if _plans_words + plan.words > _PLANS_MAX_WORDS:
            LAUNCH_PLANS.clear()
            _plans_words = 0
        if plan.words <= _PLANS_MAX_WORDS:
            LAUNCH_PLANS[key] = plan
            _plans_words += plan.words
    return plan


def fill_paged_table(reserve, copies: Sequence[PagedCopy], chunk: int) -> tuple[int, int]:
    """Write the paged kernel's table; returns (programs, bytes used).

    ``reserve(nbytes)`` returns a uint64 array of at least ``nbytes`` bytes.
    Every page id is checked against its copy's limits in the table itself
    (``PagesOutsideBuffers``): besides the plan cache, one NumPy call writes
    the table and two check it, whatever the number of copies.
    """
    plan = paged_plan(copies, chunk)
    words = reserve(8 * plan.words)
    parts = [plan.head]
    for c in copies:
        parts += (c.src_pages, c.dst_pages)
    np.concatenate(parts, out=words[:plan.words].view(np.int64))
    # Negative pages read as huge. (count_nonzero: NumPy's any() costs more than the comparison here.)
    if np.count_nonzero(words[len(plan.head):plan.words] >= plan.limits):
        raise pages_outside(copies) or BatchCopyError("paged copy page check disagrees with itself")
    return plan.programs, 8 * plan.words


class HostBatchCopy:
    """Host memory through ctypes, one memmove per entry."""

    backend = "host"

    def copy(self, srcs, dsts, lengths) -> None:
        s, d, n = as_batch(srcs, dsts, lengths)
        for src, dst, length in zip(s.tolist(), d.tolist(), n.tolist()):
            if length:
                ctypes.memmove(dst, src, length)

    def copy_pages(self, copies: Sequence[PagedCopy]) -> None:
        self.copy(*merged_page_runs(copies))


# --- CUDA ---------------------------------------------------------------------


def _torch():
    try:
        import torch
    except Exception as exc:  # not installed, or a broken install
        raise BatchCopyError(f"CUDA batch copy needs torch, which does not import: {exc}") from exc
    return torch


class DeviceContext:
    """Makes the copier's device current on the calling thread for one copy, through the CUDA driver.

    Compares the thread's current context with the device's primary context
    (one driver call when it is already current). A thread that had another
    context gets it back afterwards; a thread that had none keeps the device's
    (nothing to restore, and its next copy finds it current). Restoring by
    device number instead (cudaSetDevice, torch.cuda.set_device) would create
    that device's context whenever the thread had none: a transfer worker of a
    GPU-3 server would leave a context, some hundred MiB, on GPU 0.
    ``driver``: libcuda, or a stand-in with the same four calls (tests).
    """

    def __init__(self, device: int, driver=None):
        if driver is None:
            try:
                driver = cuda_libs.cuda_driver()
            except cuda_libs.CudaLibraryError as exc:
                raise BatchCopyError(str(exc)) from exc
        handle, context = ctypes.c_int(-1), ctypes.c_void_p()
        err = driver.cuDeviceGet(ctypes.byref(handle), device)
        err = err or driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle.value)
        if err or not context.value:
            raise BatchCopyError(f"no primary CUDA context for device {device} (driver error {err})")
        self.context = context.value  # retained for the process's life, as torch keeps it
        self._get, self._set = driver.cuCtxGetCurrent, driver.cuCtxSetCurrent

    def enter(self) -> Optional[int]:
        """Make the device's context current; returns the context to give back (None: keep ours)."""
        current = ctypes.c_void_p()
        err = self._get(ctypes.byref(current))
        if not err and current.value == self.context:
            return None
        err = err or self._set(self.context)
        if err:
            raise BatchCopyError(f"cannot make the copy's CUDA context current (driver error {err})")
        return current.value

    def leave(self, previous: Optional[int]) -> None:
        if previous:
            self._set(previous)



class _Lane:
    """One caller's stream and launch-table buffers; lanes are never shared at once."""

    def __init__(self, torch, device: int):
        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.stream_handle = self.stream.cuda_stream
        self.capacity = 0
        self.reserve(64 << 10)

    def reserve(self, nbytes: int) -> np.ndarray:
        """The pinned table as uint64, at least ``nbytes`` long; the device table grows with it."""
        if nbytes > self.capacity:
            torch = self._torch
            capacity = (max(nbytes, 2 * self.capacity) + 4095) & ~4095
            self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            self.host_words = self.host.numpy().view(np.uint64)
            self.host_ptr = self.host.data_ptr()
            self.device_table = torch.empty(capacity // 8, dtype=torch.int64, device=f"cuda:{self.device}")
            self.device_bytes = self.device_table.view(torch.uint8)
            self.device_ptr = self.device_table.data_ptr()
            self.capacity = capacity
        return self.host_words


class CudaBatchCopy:
    """Batched copies on one GPU: one Triton kernel launch per batch, after one small
    host-to-device copy of its launch table; ``copy``/``copy_pages`` return once it landed.

    The kernel is compiled and probed byte by byte at every access width (16, 8
    and 1 bytes) when the copier is built, so no request ever compiles or meets
    an untested path. Thread-safe: each concurrent call takes a lane (stream,
    pinned and device table buffers) of its own, reused afterwards.
    """

    backend = "triton"

    def __init__(self, device: int):
        torch = _torch()
        if not torch.cuda.is_available():
            raise BatchCopyError("no CUDA device is usable (torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        if not isinstance(device, int) or not 0 <= device < count:
            raise BatchCopyError(f"CUDA device {device!r} does not exist ({count} visible)")
        try:
            from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel
        except Exception as exc:  # not installed, or a broken install
            raise BatchCopyError(f"the batched copy needs Triton, which does not import: {exc}") from exc
        self._torch = torch
        self._kernel = batch_copy_kernel.paged_copy_kernel
        self.device = device
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        # diagnostics: CPU time of the last call up to its synchronize
        self.last_submit_s: Optional[float] = 0.0
        with torch.cuda.device(device):
            torch.cuda.init()
        self._context = DeviceContext(device)
        try:
            self._runtime: Optional[cuda_libs.CudaRuntime] = cuda_libs.cuda_runtime(loaded_only=True)
        except cuda_libs.CudaLibraryError:
            self._runtime = None  # uploads and waits then go through torch
        try:
            with torch.cuda.device(device):
                dummy = torch.empty(2, dtype=torch.int64, device=f"cuda:{device}")
                self._compiled = self._kernel.warmup(dummy, PAGED_CHUNK_BYTES, grid=(1,))
        except Exception as exc:  # no compiler, a Triton that refuses the kernel
            raise BatchCopyError(f"the batched copy's kernel does not compile: {exc}") from exc
        # The compiled kernel's own launcher skips the JIT's per-call argument binding;
        # a Triton whose launcher differs falls back to the JIT launch (probed both ways).
        self._fast_launch = True
        why = self._probe()
        if why is not None:
            self._fast_launch = False
            why = self._probe()
        if why is not None:
            raise BatchCopyError(f"the batched copy's kernel does not run: its probe {why}")

    def _probe(self) -> Optional[str]:
        """One launch holding a 16-, an 8- and a 1-byte-wide buffer, checked byte by byte: None, or what went wrong."""
        torch = self._torch
        device = f"cuda:{self.device}"
        try:
            src = torch.arange(256, dtype=torch.uint8, device=device)
            dst = torch.zeros(768, dtype=torch.uint8, device=device)
            torch.cuda.synchronize(self.device)
            s, d = src.data_ptr(), dst.data_ptr()
            # 64-byte pages (16-wide), 8-byte rows from byte 8 (8-wide), 3-byte rows from byte 1 (byte-wise)
            self.copy_pages([paged_copy([(s, d, 64)], np.array([0, 3]), np.array([5, 1])),
                             paged_copy([(s + 8, d + 520, 8)], np.array([2]), np.array([1])),
                             paged_copy([(s + 1, d + 601, 3)], np.array([4, 0]), np.array([0, 3]))])
            want = torch.zeros(768, dtype=torch.uint8, device=device)
            want[320:384], want[64:128] = src[0:64], src[192:256]
            want[528:536] = src[24:32]
            want[601:604], want[610:613] = src[13:16], src[1:4]
            return None if torch.equal(dst, want) else "copy differed"
        except Exception as exc:
            return f"failed: {exc}"

    def copy(self, srcs, dsts, lengths) -> None:
        """A block list, as one launch (each block a buffer of one page)."""
        self.copy_pages([block_copy(srcs, dsts, lengths)])

    def copy_pages(self, copies: Sequence[PagedCopy]) -> None:
        """Every page pair of ``copies`` in one launch of the paged kernel (no block list)."""
        started = time.perf_counter()
        if not copies:
            return
        previous = self._context.enter()
        lane = None
        try:
            lane = self._take_lane()
            try:
                self._launch(lane, copies, started)
            finally:  # even after a failure: nothing queued may land after we return
                self._sync(lane)
        except BatchCopyError:
            raise
        except Exception as exc:  # CUDA errors surface from torch or triton as RuntimeError
            raise BatchCopyError(f"paged copy on cuda:{self.device} failed: {exc}") from exc
        finally:
            self._context.leave(previous)
            if lane is not None:
                self._give_back_lane(lane)

    def _take_lane(self) -> _Lane:
        """A lane no other call is using: a free one, else a new one."""
        with self._lock:
            if self._lanes:
                return self._lanes.pop()
        return _Lane(self._torch, self.device)

    def _give_back_lane(self, lane: _Lane) -> None:
        with self._lock:
            self._lanes.append(lane)

    def _sync(self, lane: _Lane) -> None:
        """Wait for everything queued on the lane; raises if any of it failed."""
        rt = self._runtime
        if rt is None:
            lane.stream.synchronize()
            return
        err = rt.lib.cudaStreamSynchronize(lane.stream_handle)
        if err:
            raise BatchCopyError(f"paged copy on cuda:{self.device} failed: {rt.error(err)}")

    def _launch(self, lane: _Lane, copies: Sequence[PagedCopy], started: float) -> None:
        """Fill and upload the lane's table, then launch (the caller waits).

        The table goes by the copy engine. (A one-program kernel reading it from
        pinned memory was tried instead: shorter on the GPU, slower end to end,
        its own launch costing more than the hand-over to the copy engine.)
        """
        programs, used = fill_paged_table(lane.reserve, copies, PAGED_CHUNK_BYTES)
        if not programs:
            return
        rt = self._runtime
        if rt is not None:
            err = rt.lib.cudaMemcpyAsync(lane.device_ptr, lane.host_ptr, used, cuda_libs.MEMCPY_HOST_TO_DEVICE,
                                         lane.stream_handle)
            if err:
                rt.lib.cudaGetLastError()
                raise BatchCopyError(f"uploading the launch table failed: {rt.error(err)}")
        else:
            with self._torch.cuda.stream(lane.stream):
                lane.device_bytes[:used].copy_(lane.host[:used], non_blocking=True)
        launched = False
        if self._fast_launch:
            try:
                self._compiled[(programs, 1, 1)](lane.device_ptr, PAGED_CHUNK_BYTES, stream=lane.stream_handle)
                launched = True
            except (TypeError, AttributeError):  # a Triton whose launcher differs
                self._fast_launch = False
        if not launched:
            with self._torch.cuda.stream(lane.stream):
                self._kernel[(programs,)](lane.device_table, PAGED_CHUNK_BYTES)
        self.last_submit_s = time.perf_counter() - started


def batch_copy_for(device: Optional[int]) -> BatchCopy:
    """The CUDA batch copier for ``device`` (None: the current one).

    Raises BatchCopyError when it cannot be built (no usable GPU, no Triton, a
    kernel that fails its probe); the caller decides what that means.
    """
    torch = _torch()
    try:
        usable = torch.cuda.is_available()
    except Exception as exc:  # a driver that fails its own query
        raise BatchCopyError(f"CUDA is not usable: {exc}") from exc
    if not usable:
        raise BatchCopyError("no CUDA device is usable (torch.cuda.is_available() is False)")
    if device is None:
        device = torch.cuda.current_device()
    return CudaBatchCopy(int(device))
