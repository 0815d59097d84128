"""Many local copies in one launch: what KV peer writes copy with.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple, Optional, Sequence

import numpy as np

from sglang_dsv41.mooncake_nvlink import cuda_libs


class BatchCopyError(RuntimeError):
    """A batch could not be copied (bad arrays, allocation or device failure)."""


PAGED_SEGMENT_WORDS = 5  # one segment row of the paged kernel's table
# A program's piece: the kernel starts no idle programs, so small pieces spread a
# request's few pages over many SMs (on an H200 a request's write took less GPU
# time with 32 KiB pieces than with 16 KiB).
PAGED_CHUNK_BYTES = 32768
_MAX_PROGRAMS = (1 << 31) - 1  # a grid's x limit
NO_PAGE_LIMIT = 1 << 63  # page ids are compared as unsigned: this limit refuses only negative ones
ADDRESS_LIMIT = 1 << 62  # no GPU pointer reaches it; below it int64 arithmetic is exact
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
        held = f"the {side} buffers hold pages 0 to {limit - 1}" if limit < NO_PAGE_LIMIT else "pages are never negative"
        super().__init__(f"paged copy {copy_index} names {side} page {page}; {held}")


def paged_segments(rows: np.ndarray) -> np.ndarray:
    """The (buffers x PAGED_SEGMENT_WORDS) template of ``rows`` (buffers x 3, int64).

    Read-only: launch plans are cached by the template's identity (a layout
    reused for every request).
    """
    out = np.zeros((len(rows), PAGED_SEGMENT_WORDS), dtype=np.int64)
    out[:, :3] = rows
    out.flags.writeable = False
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
        return PagedCopy(paged_segments(rows), sp, dp, 0)
    if rows.min() <= 0:
        raise BatchCopyError("paged copy entries need non-null addresses and positive bytes per page")
    if min(int(sp.min()), int(dp.min())) < 0:
        raise BatchCopyError("paged copy page ids must not be negative")
    item = int(rows[:, 2].max())
    top = int(rows[:, :2].max()) + (max(int(sp.max()), int(dp.max())) + 1) * item
    if top >= ADDRESS_LIMIT or item > _LENGTH_LIMIT:
        raise BatchCopyError(f"paged copy reaches {top:#x}: no GPU address range")
    return PagedCopy(paged_segments(rows), sp, dp, int(rows[:, 2].sum()))


class _PagedPlan(NamedTuple):
    """What a launch table holds besides the page ids, for one shape of copies."""

    head: np.ndarray  # flat int64: segment count, chunk, each segment's end, every segment row
    limits: np.ndarray  # uint64, one per page slot of the table: the first page its buffers lack
    words: int  # table length: the head, then each copy's source and destination pages
    programs: int
    templates: tuple  # the copies' segment templates: kept alive, so their ids stay theirs


PAGED_HEAD_WORDS = 2  # segment count, chunk; then one end per segment and the segment rows

# Launch plans by (chunk, then per copy: template id, pages, limits). A transfer worker
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


def fill_paged_table(reserve, copies: Sequence[PagedCopy], chunk: int) -> tuple[int, int]:
    """Write the paged kernel's table; returns (programs, bytes used).

    ``reserve(nbytes)`` returns a uint64 array of at least ``nbytes`` bytes.
    Every page id is checked against its copy's limits in the table itself
    (``PagesOutsideBuffers``). The table's head comes from a plan cached by the
    copies' shape; then one NumPy call writes the table and two check it,
    whatever the number of copies. (One pass over the copies, unpacked: this
    runs per request write.)
    """
    global _plans_words
    key, parts = [chunk], [None]
    for segments, src_pages, dst_pages, _, src_limit, dst_limit in copies:
        key += (id(segments), len(src_pages), src_limit, dst_limit)
        parts += (src_pages, dst_pages)
    key = tuple(key)
    plan = LAUNCH_PLANS.get(key)
    if plan is None:
        plan = _paged_plan(copies, chunk)
        if _plans_words + plan.words > _PLANS_MAX_WORDS:
            LAUNCH_PLANS.clear()
            _plans_words = 0
        if plan.words <= _PLANS_MAX_WORDS:
            LAUNCH_PLANS[key] = plan
            _plans_words += plan.words
    parts[0] = plan.head
    table = reserve(8 * plan.words)[:plan.words]
    np.concatenate(parts, out=table.view(np.int64))
    # Negative pages read as huge. (count_nonzero: NumPy's any() costs more than the comparison here.)
    if np.count_nonzero(table[len(plan.head):] >= plan.limits):
        raise pages_outside(copies) or BatchCopyError("paged copy page check disagrees with itself")
    return plan.programs, 8 * plan.words


# --- CUDA ---------------------------------------------------------------------


def _torch():
    try:
        import torch
    except Exception as exc:  # not installed, or a broken install
        raise BatchCopyError(f"CUDA batch copy needs torch, which does not import: {exc}") from exc
    return torch


class DeviceContext:
    """Makes the device's primary context current on the calling thread for one copy.

    A thread that had another context gets it back; one that had none keeps the
    device's. (Restoring by device number would create a context, some hundred
    MiB, on GPU 0 for a thread that had none.) ``driver``: libcuda or a stand-in.
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
            self.device_ptr = self.device_table.data_ptr()
            self.capacity = capacity
        return self.host_words


class CudaBatchCopy:
    """Paged copies on one GPU: one Triton kernel launch per batch, after one small
    host-to-device copy of its launch table; ``copy_pages`` returns once it landed.

    The kernel is compiled, and probed byte by byte at every access width (16, 8
    and 1 bytes) through the launcher every copy uses, when the copier is built:
    no request ever compiles or meets an untested path. Thread-safe: each
    concurrent call takes a lane (stream, pinned and device table) of its own.
    """

    backend = "triton"

    def __init__(self, device: Optional[int] = None):
        """``device``: a CUDA device number; None: the current device."""
        torch = _torch()
        try:
            usable = torch.cuda.is_available()
        except Exception as exc:  # a driver that fails its own query
            raise BatchCopyError(f"CUDA is not usable: {exc}") from exc
        if not usable:
            raise BatchCopyError("no CUDA device is usable (torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        device = torch.cuda.current_device() if device is None else device
        if not isinstance(device, int) or not 0 <= device < count:
            raise BatchCopyError(f"CUDA device {device!r} does not exist ({count} visible)")
        try:
            from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel
        except Exception as exc:  # not installed, or a broken install
            raise BatchCopyError(f"the batched copy needs Triton, which does not import: {exc}") from exc
        self._torch = torch
        self.device = device
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        with torch.cuda.device(device):
            torch.cuda.init()
        self._context = DeviceContext(device)
        try:
            self._runtime = cuda_libs.process_runtime()
        except cuda_libs.CudaLibraryError as exc:
            raise BatchCopyError(str(exc)) from exc
        try:
            with torch.cuda.device(device):
                dummy = torch.empty(2, dtype=torch.int64, device=f"cuda:{device}")
                compiled = batch_copy_kernel.paged_copy_kernel.warmup(dummy, PAGED_CHUNK_BYTES, grid=(1,))
                compiled[(1, 1, 1)]  # loads the module: its function handle is set from here on
                # The compiled kernel's launcher, called as its own runner calls it minus that
                # wrapper's per-launch work (a closure, hook lookups), which showed in a request's
                # write. No Triton launch hooks run for it (profilers see no launch metadata).
                self._run = compiled.run
                self._function, self._metadata = compiled.function, compiled.packed_metadata
        except Exception as exc:  # no compiler, a Triton that refuses the kernel
            raise BatchCopyError(f"the batched copy's kernel does not compile: {exc}") from exc
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

    def copy_pages(self, copies: Sequence[PagedCopy]) -> None:
        """Every page pair of ``copies`` in one launch of the paged kernel (no block list)."""
        if not copies:
            return
        previous = self._context.enter()
        lane = None
        try:
            lane = self._take_lane()
            try:
                self._launch(lane, copies)
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
        err = self._runtime.lib.cudaStreamSynchronize(lane.stream_handle)
        if err:
            raise BatchCopyError(f"paged copy on cuda:{self.device} failed: {self._runtime.error(err)}")

    def _launch(self, lane: _Lane, copies: Sequence[PagedCopy]) -> None:
        """Fill and upload the lane's table, then launch (the caller waits).

        The table goes by the copy engine. (A one-program kernel reading it from
        pinned memory was tried instead: shorter on the GPU, slower end to end,
        its own launch costing more than the hand-over to the copy engine.)
        """
        programs, used = fill_paged_table(lane.reserve, copies, PAGED_CHUNK_BYTES)
        if not programs:
            return
        rt = self._runtime
        err = rt.lib.cudaMemcpyAsync(lane.device_ptr, lane.host_ptr, used, cuda_libs.MEMCPY_HOST_TO_DEVICE,
                                     lane.stream_handle)
        if err:
            rt.lib.cudaGetLastError()
            raise BatchCopyError(f"uploading the launch table failed: {rt.error(err)}")
        self._run(programs, 1, 1, lane.stream_handle, self._function, self._metadata, None, None, None,
                  lane.device_ptr, PAGED_CHUNK_BYTES)

