"""Many local copies in one call: what KV staging gathers and scatters with.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import ctypes
import operator
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, Sequence

import numpy as np

from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_native as native  # no torch, no compiler until a copier starts


_U64_MAX = (1 << 64) - 1


class BatchCopyError(RuntimeError):
    """A batch could not be copied (bad arrays, allocation or device failure)."""


@dataclass
class Allocation:
    """Memory a batch copier handed out; ``keepalive`` owns it."""

    ptr: int
    nbytes: int
    keepalive: object


class BatchCopy(Protocol):
    backend: str

    def allocate(self, nbytes: int) -> Allocation:
        """Zero-filled memory of the kind this copier works on."""

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

PAGED_SEGMENT_WORDS = 5  # one segment row of the paged kernels' table (batch_copy_kernel, batch_copy_ptx)
# The paged kernels' piece: they start no idle programs, so small pieces spread a
# request's few pages over many SMs. Two steps of the parameter-table kernel's
# threads: on an H200 a request's write took less GPU time than with one (16 KiB).
PAGED_CHUNK_BYTES = 32768
_MAX_PROGRAMS = (1 << 31) - 1  # a grid's x limit
NO_PAGE_LIMIT = 1 << 63  # page ids are compared as unsigned: this limit refuses only negative ones


class PagedCopy(NamedTuple):
    """Pages of several buffers moved with one list of page pairs.

    ``segments``: C-contiguous int64 rows, one per buffer, whose first three
    columns are (page-0 address at the source, page-0 address at the
    destination, bytes per page); the last two are the kernel table's page
    offset and count, filled in per launch (``paged_segments`` builds it).
    ``src_pages``/``dst_pages``: equal-length integer arrays. Page
    ``src_pages[k]`` of every buffer goes to its page ``dst_pages[k]``. Build it
    with ``paged_copy`` (which checks it) unless the caller checked the same
    facts (``core.peer_copy`` does, once per layout). A named tuple: one is
    made per send call.
    """

    segments: np.ndarray
    src_pages: np.ndarray
    dst_pages: np.ndarray
    word: int  # the widest access every address and page size allows
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


def paged_segments(rows: np.ndarray) -> np.ndarray:
    """The (buffers x PAGED_SEGMENT_WORDS) template of ``rows`` (buffers x 3, int64), read-only.

    Read-only because launch plans are remembered by the template's identity.
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
        return PagedCopy(paged_segments(rows), sp, dp, 16, 0, 0)
    if rows.min() <= 0:
        raise BatchCopyError("paged copy entries need non-null addresses and positive bytes per page")
    if min(int(sp.min()), int(dp.min())) < 0:
        raise BatchCopyError("paged copy page ids must not be negative")
    item = int(rows[:, 2].max())
    top = int(rows[:, :2].max()) + (max(int(sp.max()), int(dp.max())) + 1) * item
    if top >= _ADDRESS_LIMIT or item > _LENGTH_LIMIT:
        raise BatchCopyError(f"paged copy reaches {top:#x}: no GPU address range")
    return PagedCopy(paged_segments(rows), sp, dp, word_of(int(np.bitwise_or.reduce(rows.ravel()))), item,
                     int(rows[:, 2].sum()))


def expand_paged(copies: Sequence[PagedCopy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (srcs, dsts, lengths) block list of ``copies``: entry by entry, pages in order.

    Raises ``PagesOutsideBuffers`` as the device copy does.
    """
    outside = pages_outside(copies)
    if outside is not None:
        raise outside
    parts = []
    for c in copies:
        if not len(c.entries) or not len(c.src_pages):
            continue
        item = c.entries[:, 2:3]
        sp, dp = c.src_pages.astype(np.int64)[None, :], c.dst_pages.astype(np.int64)[None, :]
        parts.append(((c.entries[:, 0:1] + sp * item).ravel(), (c.entries[:, 1:2] + dp * item).ravel(),
                      np.broadcast_to(item, (len(item), sp.shape[1])).ravel()))
    if not parts:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    return tuple(np.concatenate([p[k] for p in parts]).view(np.uint64) for k in range(3))


class _PagedPlan(NamedTuple):
    """What a launch table holds besides the page ids, for one shape of copies."""

    head: np.ndarray  # flat int64: segment count, chunk, each segment's end, every segment row
    limits: np.ndarray  # uint64, one per page slot of the table: the first page its buffers lack
    words: int  # table length: the head, then each copy's source and destination pages
    word: int
    programs: int
    templates: tuple  # the copies' segment templates: kept alive, so their ids stay theirs
    array_limits: tuple  # per page array (each copy's source, then destination): its limit


PAGED_HEAD_WORDS = 2  # segment count, chunk; then one end per segment and the segment rows

# Launch plans by (chunk, per copy: template id, pages, word, limits). A transfer worker
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
    word = 16
    for c in copies:
        n = len(c.src_pages)
        places.append(at)
        limits += (c.src_limit, c.dst_limit)
        sizes += (n, n)
        at += 2 * n
        word = min(word, c.word)
    if segments:
        rows[:, 3] = np.repeat(np.array(places, dtype=np.int64), counts)
        rows[:, 4] = pages
    head = np.concatenate([np.array([segments, chunk], dtype=np.int64), np.cumsum(units), rows.ravel()])
    return _PagedPlan(head, np.repeat(np.array(limits, dtype=np.uint64), sizes), at, word, programs,
                      tuple(c.segments for c in copies), tuple(limits))


def paged_plan(copies: Sequence[PagedCopy], chunk: int) -> _PagedPlan:
    """The launch plan of ``copies`` (a table's head and page limits), cached by their shape."""
    global _plans_words
    key = (chunk, *[(id(c.segments), len(c.src_pages), c.word, c.src_limit, c.dst_limit) for c in copies])
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


def fill_paged_table(reserve, copies: Sequence[PagedCopy], chunk: int) -> tuple[int, int, int]:
    """Write the paged kernel's table; returns (word, programs, bytes used).

    ``reserve(nbytes)`` returns a uint64 array of at least ``nbytes`` bytes.
    Every page id is checked against its copy's limits in the table itself
    (``PagesOutsideBuffers``). A flush of a request's held sends lands here:
    besides the plan cache, one NumPy call writes the table and two check it,
    whatever the number of copies.
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
    return plan.word, plan.programs, 8 * plan.words


class HostBatchCopy:
    """Host memory through ctypes, one memmove per entry."""

    backend = "host"

    def allocate(self, nbytes: int) -> Allocation:
        if nbytes <= 0:
            raise BatchCopyError(f"cannot allocate {nbytes} bytes")
        buf = ctypes.create_string_buffer(int(nbytes))
        return Allocation(ctypes.addressof(buf), int(nbytes), buf)

    def copy(self, srcs, dsts, lengths) -> None:
        s, d, n = as_batch(srcs, dsts, lengths)
        for src, dst, length in zip(s.tolist(), d.tolist(), n.tolist()):
            if length:
                ctypes.memmove(dst, src, length)

    def copy_pages(self, copies: Sequence[PagedCopy]) -> None:
        self.copy(*merged_page_runs(copies))


# --- CUDA ---------------------------------------------------------------------

BACKENDS = ("triton", "memcpy-async")
_CUDA_MEMCPY_HOST_TO_DEVICE = 1
_CUDA_MEMCPY_DEFAULT = 4  # direction inferred from the pointers (unified addressing)


def word_of(bits: int) -> int:
    if bits & 15 == 0:
        return 16
    return 8 if bits & 7 == 0 else 1


def batch_word(srcs: np.ndarray, dsts: np.ndarray, lengths: np.ndarray) -> int:
    """The widest access every entry allows: 16, 8 or 1 bytes."""
    if not len(lengths):
        return 16
    return word_of(int(np.bitwise_or.reduce(srcs | dsts | lengths)))


_ADDRESS_LIMIT = 1 << 62  # no GPU pointer reaches it; below it int64 arithmetic is exact
_LENGTH_LIMIT = 1 << 45  # 32 TiB: keeps a piece of the largest entry within an int32 (grid y <= 65535)
_MAX_ENTRIES = 1 << 28  # keeps the kernel's int32 column offsets exact
_MAX_PIECES = 65535  # a grid's y limit


def plan_pieces(entries: int, longest: int, total: int, min_chunk: int) -> tuple[int, int]:
    """(chunk bytes, pieces per entry) for a grid of entries x pieces.

    Starts at ``min_chunk`` (many programs per large entry, spread over the
    SMs) and doubles while programs that find their entry already ended would
    outnumber the useful ones by far (one huge entry among many small ones).
    """
    chunk = min_chunk
    while True:
        pieces = -(-longest // chunk)
        useful = entries + total // chunk
        if pieces <= _MAX_PIECES and (pieces == 1 or entries * pieces <= 8 * useful + 8192):
            return chunk, pieces
        chunk *= 2


def fill_launch_table(reserve, srcs: np.ndarray, dsts: np.ndarray, lengths: np.ndarray,
                      min_chunk: int) -> tuple[np.ndarray, int, int, int, int]:
    """Write the kernel's launch table; returns (table, word, chunk, pieces, bytes used).

    ``srcs``, ``dsts``, ``lengths``: equal-length uint64 arrays (not empty).
    ``reserve(nbytes)`` returns a uint64 array of at least ``nbytes`` bytes.
    The table is the three columns one after the other. ``pieces`` 0: nothing
    to copy. Validates as ``as_batch`` does, with cheap bounds first (this is
    the transfer's hot path).
    """
    n = len(lengths)
    if n > _MAX_ENTRIES:
        raise BatchCopyError(f"batch of {n} entries is more than one launch takes ({_MAX_ENTRIES})")
    used = 24 * n
    table = reserve(used)
    words = table[:3 * n]
    np.concatenate((srcs, dsts, lengths), out=words)
    top = int(words.max())
    if top >= _ADDRESS_LIMIT or not table[:2 * n].min():
        as_batch(srcs, dsts, lengths)  # the exact checks, with their messages
        if top >= _ADDRESS_LIMIT:
            raise BatchCopyError(f"batch holds a pointer or length of {top:#x}: no GPU address range")
    word = word_of(int(np.bitwise_or.reduce(words)))
    longest = int(lengths.max())
    if not longest:
        return table, word, 0, 0, used
    if longest > _LENGTH_LIMIT:
        raise BatchCopyError(f"batch entry of {longest} bytes is beyond any GPU's memory")
    chunk, pieces = plan_pieces(n, longest, int(lengths.sum()), min_chunk)
    return table, word, chunk, pieces, used


def _torch():
    try:
        import torch
    except Exception as exc:  # not installed, or a broken install
        raise BatchCopyError(f"CUDA batch copy needs torch, which does not import: {exc}") from exc
    return torch


def _triton_kernel():
    """The kernel module, or the reason it cannot be used."""
    try:
        from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel
    except Exception as exc:
        return None, f"triton does not import: {exc}"
    return batch_copy_kernel, None


class CudaRuntime:
    """The few CUDA runtime calls this module makes itself, through ctypes."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib, self.path = lib, path
        vp, sz, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for name, args in (("cudaMemcpyAsync", [vp, vp, sz, ci, vp]),
                           ("cudaStreamSynchronize", [vp]),
                           ("cudaGetLastError", [])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ci
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [ci], ctypes.c_char_p

    @classmethod
    def find(cls, loaded_only: bool) -> "CudaRuntime":
        """The CUDA runtime; ``loaded_only``: only one already in the process (torch's own).

        Torch's own runtime shares torch's current device and streams, so
        calls through it need no torch context managers.
        """
        from sglang_dsv41.mooncake_nvlink.memory import libcudart_candidates

        mode = (os.RTLD_NOLOAD | os.RTLD_LAZY) if loaded_only else ctypes.DEFAULT_MODE
        errors = []
        for candidate in libcudart_candidates():
            try:
                lib = ctypes.CDLL(candidate, mode=mode)
                return cls(lib, candidate)
            except (OSError, AttributeError) as exc:
                errors.append(f"{candidate}: {exc}")
        raise BatchCopyError("no CUDA runtime library found (" + "; ".join(errors[:3]) + ")")

    def error(self, code: int) -> str:
        text = self.lib.cudaGetErrorString(code)
        return f"{code} ({text.decode(errors='replace') if text else 'unknown'})"


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
        vp, ci = ctypes.c_void_p, ctypes.c_int
        if driver is None:
            try:
                driver = ctypes.CDLL("libcuda.so.1")
                for name, args in (("cuDeviceGet", [ctypes.POINTER(ci), ci]),
                                   ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ci]),
                                   ("cuCtxGetCurrent", [ctypes.POINTER(vp)]),
                                   ("cuCtxSetCurrent", [vp])):
                    fn = getattr(driver, name)
                    fn.argtypes, fn.restype = args, ci
            except (OSError, AttributeError) as exc:
                raise BatchCopyError(f"the CUDA driver library does not serve context calls: {exc}") from exc
        handle, context = ci(-1), vp()
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
        self.direct_params: dict = {}  # _DirectLaunch parameter storage of this lane
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


class _DirectLaunch:
    """A compiled Triton kernel launched with one cuLaunchKernel through ctypes.

    Triton's own launcher spends several microseconds in Python per launch;
    a request's held write pays it on its path to the status. Used only when
    the kernel's launch needs nothing that launcher adds: one CTA per cluster,
    no cooperative grid or programmatic launch, no scratch memory (Triton then
    passes null for its trailing scratch pointers), and kernel parameters, as
    the compiled PTX declares them, of exactly the expected types. Otherwise
    ``of`` returns None and the caller keeps Triton's launcher.
    """

    _ENTRY_PARAMS = re.compile(r"\.entry\s+\w+\s*\(([^)]*)\)", re.S)
    _PARAM_TYPE = re.compile(r"\.param\s+\.(\w+)")

    def __init__(self, lib, function: int, block: int, shared: int, user: tuple, extras: int):
        self._launch = lib.cuLaunchKernel
        self._function = ctypes.c_void_p(function)
        self._block, self._shared = block, shared
        self._user, self._extras = user, extras

    @classmethod
    def of(cls, compiled, user: tuple) -> tuple[Optional["_DirectLaunch"], str]:
        """(launcher, "") or (None, why not); ``user``: the expected PTX types of the kernel's own parameters."""
        md = compiled.metadata
        if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
                or getattr(md, "launch_pdl", False) or getattr(md, "global_scratch_size", 0)
                or getattr(md, "profile_scratch_size", 0) or getattr(md, "shared", 0) > 48 * 1024):
            return None, "the kernel's launch needs what Triton's launcher adds"
        found = cls._ENTRY_PARAMS.search(getattr(compiled, "asm", {}).get("ptx", "") or "")
        types = cls._PARAM_TYPE.findall(found.group(1)) if found else []
        if tuple(types[:len(user)]) != user or any(t != "u64" for t in types[len(user):]) or len(types) > len(user) + 4:
            return None, f"unexpected kernel parameters {types}"
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernel
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            compiled._init_handles()
            function = int(compiled.function)
        except Exception as exc:  # no driver library, a Triton without these attributes
            return None, f"no driver entry point: {exc}"
        return cls(lib, function, 32 * int(md.num_warps), int(getattr(md, "shared", 0)), user,
                   len(types) - len(user)), ""

    def params_for(self, lane) -> tuple:
        """This lane's parameter storage: (values, pointer array), reused launch after launch."""
        cached = lane.direct_params.get(id(self))
        if cached is None:
            kinds = {"u64": ctypes.c_uint64, "u32": ctypes.c_uint32}
            values = [kinds[t]() for t in self._user] + [ctypes.c_uint64(0) for _ in range(self._extras)]
            pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            cached = lane.direct_params[id(self)] = (values, pointers)
        return cached

    def __call__(self, lane, grid, args) -> int:
        values, pointers = self.params_for(lane)
        for v, a in zip(values, args):
            v.value = a
        return self._launch(self._function, grid[0], grid[1], grid[2], self._block, 1, 1, self._shared,
                            lane.stream_handle, pointers, None)


def allocate_on(torch, device: int, nbytes: int) -> Allocation:
    """``nbytes`` of zeroed device memory that is the base of its own CUDA allocation."""
    try:
        nbytes = operator.index(nbytes)
    except TypeError:
        raise BatchCopyError(f"cannot allocate {nbytes!r} bytes") from None
    if nbytes <= 0:
        raise BatchCopyError(f"cannot allocate {nbytes} bytes")
    try:
        # A pool of its own: the first allocation in a fresh pool is a fresh
        # segment, so the pointer is an allocation base, which is what the
        # transfer engine registers (a block split off a cached segment
        # would not be).
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool, device=device):
            tensor = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        # Zeroed on the device's current stream; our streams do not wait for it.
        torch.cuda.current_stream(device).synchronize()
    except Exception as exc:  # out of memory, device failure
        raise BatchCopyError(f"cannot allocate {nbytes} bytes on cuda:{device}: {exc}") from exc
    return Allocation(tensor.data_ptr(), nbytes, (tensor, pool))


def merged_page_runs(copies: Sequence[PagedCopy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(srcs, dsts, lengths) of ``copies`` with pages consecutive on both sides merged into one entry
    (what the host copier writes: one memmove per run).

    Raises ``PagesOutsideBuffers`` before anything is built, as every copier does.
    """
    outside = pages_outside(copies)
    if outside is not None:
        raise outside
    parts = []
    for c in copies:
        if not len(c.entries) or not len(c.src_pages):
            continue
        sp, dp = c.src_pages.astype(np.int64), c.dst_pages.astype(np.int64)
        starts = np.flatnonzero(np.r_[True, (sp[1:] != sp[:-1] + 1) | (dp[1:] != dp[:-1] + 1)])
        pages = np.diff(np.r_[starts, len(sp)])
        item = c.entries[:, 2:3]
        parts.append(((c.entries[:, 0:1] + sp[starts] * item).ravel(), (c.entries[:, 1:2] + dp[starts] * item).ravel(),
                      (pages[None, :] * item).ravel()))
    if not parts:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    return tuple(np.ascontiguousarray(np.concatenate([p[k] for p in parts])).view(np.uint64) for k in range(3))


class CudaBatchCopy:
    """Batched copies on one GPU, on dedicated streams; ``copy`` returns once they landed.

    ``backend`` is "triton" (one kernel launch per batch, after one small
    host-to-device copy of the launch table) or "memcpy-async" (one
    cudaMemcpyAsync per entry). Thread-safe: each concurrent call takes a lane
    (stream, pinned and device table buffers) of its own, reused afterwards.
    """

    def __init__(self, device: int, prefer: Optional[str] = None):
        if prefer not in (None, *BACKENDS):
            raise BatchCopyError(f"unknown batch copy backend {prefer!r} (one of {', '.join(BACKENDS)})")
        torch = _torch()
        if not torch.cuda.is_available():
            raise BatchCopyError("no CUDA device is usable (torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        if not isinstance(device, int) or not 0 <= device < count:
            raise BatchCopyError(f"CUDA device {device!r} does not exist ({count} visible)")
        self._torch = torch
        self.device = device
        self.fallback_reason: Optional[str] = None
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        self._compiled: dict[int, object] = {}
        self._fast_launch = True
        self._use_direct = True  # paged kernel through _DirectLaunch, once it proved itself
        self._direct: dict[int, Optional[_DirectLaunch]] = {}
        self.launcher_reason: Optional[str] = None  # why Triton's launcher is used for the paged kernel
        self._param = None  # batch_copy_ptx.ParamTableKernel, once it proved itself (None: not used)
        self._param_loaded = None
        self.param_reason: Optional[str] = None  # why small paged copies do not take it
        self._native = None  # batch_copy_native's module, once it proved itself (None: not used)
        self._native_loaded = None
        self._native_args: tuple = ()
        self.native_reason: Optional[str] = None  # why the parameter-table kernel is launched from Python
        self._kernels = None
        # diagnostics: CPU time of the last call up to its synchronize (None: the native writer's
        # one call did both)
        self.last_submit_s: Optional[float] = 0.0
        with torch.cuda.device(device):
            torch.cuda.init()
        self._context = DeviceContext(device)
        try:
            self._runtime: Optional[CudaRuntime] = CudaRuntime.find(loaded_only=True)
        except BatchCopyError:
            self._runtime = None  # the triton path then uploads and waits through torch
        if prefer in (None, "triton"):
            kernels, reason = _triton_kernel()
            if kernels is not None:
                try:
                    with torch.cuda.device(device):
                        self._compile(kernels, 16)  # probe: a compiler problem shows here, not mid-transfer
                    self._kernels = kernels
                except Exception as exc:
                    reason = f"the triton kernel does not compile: {exc}"
            if self._kernels is None:
                if prefer == "triton":
                    raise BatchCopyError(f"batch copy backend 'triton' is unusable: {reason}")
                self.fallback_reason = reason
        if self._kernels is None and self._runtime is None:
            self._runtime = CudaRuntime.find(loaded_only=False)
        self.backend = "triton" if self._kernels is not None else "memcpy-async"
        if self._kernels is not None:
            self._check_direct_launch()
        if prefer != "memcpy-async":
            self._load_param_kernel()

    def _probe_paged(self) -> Optional[str]:
        """One small paged copy, checked byte by byte: None, or what went wrong."""
        torch = self._torch
        device = f"cuda:{self.device}"
        try:
            src = torch.arange(256, dtype=torch.uint8, device=device)
            dst = torch.zeros(512, dtype=torch.uint8, device=device)
            torch.cuda.synchronize(self.device)
            self.copy_pages([paged_copy([(src.data_ptr(), dst.data_ptr(), 64)], np.array([0, 3]), np.array([5, 1]))])
            want = torch.zeros(512, dtype=torch.uint8, device=device)
            want[320:384], want[64:128] = src[0:64], src[192:256]
            return None if torch.equal(dst, want) else "copy differed"
        except Exception as exc:
            return f"failed: {exc}"

    def _check_direct_launch(self) -> None:
        """The Triton paged kernel through the direct launch, probed; Triton's launcher if that fails."""
        why = self._probe_paged()
        if why is not None and self._use_direct:
            self._use_direct, self.launcher_reason = False, f"the direct launch's probe {why}"
            why = self._probe_paged()
        if why is not None:
            raise BatchCopyError(f"the paged copy kernel does not run: its probe {why}")
        if not self._use_direct:
            self._direct.clear()

    def _load_param_kernel(self) -> None:
        """The parameter-table kernel for small paged copies, probed; without it they take the Triton kernel."""
        from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy_ptx import ParamKernelError, ParamTableKernel

        if self._runtime is None:
            self.param_reason = "torch's CUDA runtime library is not reachable (needed to wait for the copy)"
            return
        try:
            with self._torch.cuda.device(self.device):
                self._param = ParamTableKernel()
        except ParamKernelError as exc:
            self.param_reason = str(exc)
            return
        why = self._probe_paged()
        if why is not None:
            self._param, self.param_reason = None, f"the parameter-table kernel's probe {why}"
            return
        self._param_loaded = self._param
        self._load_native()

    def _load_native(self) -> None:
        """The native writer for the parameter-table kernel, probed; without it Python fills and launches."""
        try:
            module = native.build()
            driver = native.driver_calls()
        except native.NativeWriteError as exc:
            self.native_reason = str(exc)
            return
        self._native_args = (self._param.kernels, self._param.threads, self._context.context, driver)
        self._native = module
        why = self._probe_paged()
        if why is not None:
            self._native, self.native_reason = None, f"the native writer's probe {why}"
        self._native_loaded = self._native

    def use_table_as_parameter(self, on: bool) -> bool:
        """Whether small paged copies pass their table as the kernel's parameter (else they upload
        it, as large ones do); for comparing the two. Returns what is in effect: False when the
        kernel is not loaded here."""
        self._param = self._param_loaded if on else None
        self._native = self._native_loaded if on else None
        return self._param is not None

    def use_native_writer(self, on: bool) -> bool:
        """Whether the parameter-table kernel's writes are filled and launched natively (else from
        Python); for comparing the two. Returns what is in effect."""
        self._native = self._native_loaded if on and self._param is not None else None
        return self._native is not None

    @property
    def launcher(self) -> str:
        """How a small paged copy is launched: "native" (table as the kernel's parameter, filled,
        checked, launched and waited for in one native call), "parameter" (the same from Python),
        "direct" (table uploaded, one cuLaunchKernel), "triton" (Triton's launcher) or
        "per-entry" (no kernel: one cudaMemcpyAsync per block)."""
        if self._native is not None:
            return "native"
        if self._param is not None:
            return "parameter"
        if self._kernels is None:
            return "per-entry"
        return "direct" if self._use_direct and self._direct else "triton"

    # -- memory

    def allocate(self, nbytes: int) -> Allocation:
        return allocate_on(self._torch, self.device, nbytes)

    # -- copying

    def copy(self, srcs, dsts, lengths) -> None:
        started = time.perf_counter()
        s, d, n = converted(srcs, dsts, lengths)
        if not len(n):
            return
        if self._kernels is not None:
            self._on_lane(lambda lane: self._copy_kernel(lane, s, d, n, started), f"{len(n)} entries")
        else:
            as_batch(s, d, n)
            self._on_lane(lambda lane: self._copy_memcpy(lane, s, d, n, started), f"{len(n)} entries")

    def copy_pages(self, copies: Sequence[PagedCopy]) -> None:
        """Every page pair of ``copies`` in one launch of a paged kernel (no block list)."""
        started = time.perf_counter()
        if not copies:
            return
        if self._native is not None and self._write_native(copies):
            return
        if self._kernels is None and self._param is None:
            self.copy(*expand_paged(copies))
            return
        self._on_lane(lambda lane: self._copy_paged(lane, copies, started), "paged copies")

    def _write_native(self, copies: Sequence[PagedCopy]) -> bool:
        """The whole write in one native call; False (nothing written) when it is not for this one."""
        plan = paged_plan(copies, PAGED_CHUNK_BYTES)
        if plan.word != 16 or 8 * plan.words > self._param.max_bytes:
            return False
        if not plan.programs:
            return True
        pages = []
        for c in copies:
            pages += (c.src_pages, c.dst_pages)
        kernels, threads, context, driver = self._native_args
        lane = None
        try:
            lane = self._take_lane()
            status, detail = self._native.write_pages(
                plan.head, tuple(pages), plan.array_limits, lane.host_ptr, lane.capacity, plan.words, kernels,
                plan.programs, threads, lane.stream_handle, context, driver)
        except Exception as exc:  # a lane that cannot be made, arguments the module refuses
            raise BatchCopyError(f"paged write on cuda:{self.device} failed: {exc}") from exc
        finally:
            if lane is not None:
                self._give_back_lane(lane)
        if status == native.WRITTEN:
            self.last_submit_s = None
            return True
        if status == native.PAGE_OUTSIDE:
            raise pages_outside(copies) or BatchCopyError("paged copy page check disagrees with itself")
        if status in (native.NOT_PAGES, native.TABLE_TOO_LARGE):
            return False
        stage = {native.CONTEXT_FAILED: "making its context current", native.LAUNCH_FAILED: "the launch",
                 native.SYNC_FAILED: "waiting for the copy"}.get(status, f"status {status}")
        raise BatchCopyError(f"paged write on cuda:{self.device} failed in {stage}: CUDA driver error {detail}")

    def _on_lane(self, work, what: str) -> None:
        """Run ``work`` (which launches) on a lane of its own, then wait for the lane's stream."""
        previous = self._context.enter()
        lane = None
        try:
            lane = self._take_lane()
            try:
                work(lane)
            finally:  # even after a failure: nothing queued may land after we return
                self._sync(lane)
        except BatchCopyError:
            raise
        except Exception as exc:  # CUDA errors surface from torch or triton as RuntimeError
            raise BatchCopyError(f"batch copy of {what} on cuda:{self.device} failed: {exc}") from exc
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
            raise BatchCopyError(f"batch copy kernel on cuda:{self.device} failed: {rt.error(err)}")

    def _compile(self, kernels, word: int, paged: bool = False):
        compiled = self._compiled.get((paged, word))
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get((paged, word))
                if compiled is None:
                    dummy = self._torch.empty(2, dtype=self._torch.int64, device=f"cuda:{self.device}")
                    block = kernels.BLOCK_ELEMENTS[word]
                    if paged:
                        compiled = kernels.paged_copy_kernel.warmup(
                            dummy, PAGED_CHUNK_BYTES, WORD=word, BLOCK=block, grid=(1,))
                    else:
                        compiled = kernels.batch_copy_kernel.warmup(
                            dummy, 3, kernels.MIN_CHUNK_BYTES, WORD=word, BLOCK=block, grid=(1,))
                    self._compiled[(paged, word)] = compiled
                    if paged and self._use_direct:
                        launcher, why_not = _DirectLaunch.of(compiled, ("u64", "u32"))
                        self._direct[word] = launcher
                        if launcher is None:
                            self._use_direct, self.launcher_reason = False, why_not
        return compiled

    def _copy_kernel(self, lane: _Lane, s, d, n, started: float) -> None:
        kernels = self._kernels
        _, word, chunk, pieces, used = fill_launch_table(lane.reserve, s, d, n, kernels.MIN_CHUNK_BYTES)
        if not pieces:
            return
        entries = len(n)
        block = kernels.BLOCK_ELEMENTS[word]
        self._launch(lane, used, self._compile(kernels, word), (entries, pieces, 1),
                     (lane.device_ptr, entries, chunk, word, block),
                     lambda: kernels.batch_copy_kernel[(entries, pieces)](
                         lane.device_table, entries, chunk, WORD=word, BLOCK=block),
                     started)

    def _copy_paged(self, lane: _Lane, copies, started: float) -> None:
        word, programs, used = fill_paged_table(lane.reserve, copies, PAGED_CHUNK_BYTES)
        if not programs:
            return
        if self._param is not None and word == 16 and used <= self._param.max_bytes:
            self._launch_param(lane, used, programs, started)
            return
        kernels = self._kernels
        if kernels is None:  # a table too large for a parameter, and no Triton
            self._copy_memcpy(lane, *expand_paged(copies), started)
            return
        chunk, block = PAGED_CHUNK_BYTES, kernels.BLOCK_ELEMENTS[word]
        compiled = self._compiled.get((True, word)) or self._compile(kernels, word, paged=True)
        direct = self._direct.get(word) if self._use_direct else None
        self._launch(lane, used, compiled, (programs, 1, 1),
                     (lane.device_ptr, chunk, word, block),
                     lambda: kernels.paged_copy_kernel[(programs,)](
                         lane.device_table, chunk, WORD=word, BLOCK=block),
                     started, direct, (lane.device_ptr, chunk))

    def _launch(self, lane: _Lane, used: int, compiled, grid, args, jit_launch, started: float,
                direct: Optional[_DirectLaunch] = None, direct_args: tuple = ()) -> None:
        """Upload the lane's table and launch (the caller waits).

        The table goes by the copy engine. (A one-program kernel reading it from
        pinned memory was tried instead: shorter on the GPU, slower end to end,
        its own launch costing more than the hand-over to the copy engine.)
        """
        rt = self._runtime
        if rt is not None:
            err = rt.lib.cudaMemcpyAsync(lane.device_ptr, lane.host_ptr, used, _CUDA_MEMCPY_HOST_TO_DEVICE,
                                         lane.stream_handle)
            if err:
                rt.lib.cudaGetLastError()
                raise BatchCopyError(f"uploading the launch table failed: {rt.error(err)}")
        else:
            with self._torch.cuda.stream(lane.stream):
                lane.device_bytes[:used].copy_(lane.host[:used], non_blocking=True)
        if direct is not None:
            err = direct(lane, grid, direct_args)
            if err:
                raise BatchCopyError(f"cuLaunchKernel of the paged copy failed: CUDA driver error {err}")
        elif self._fast_launch:
            try:
                # The compiled kernel's own launcher: skips the JIT's per-call argument binding.
                compiled[grid](*args, stream=lane.stream_handle)
            except (TypeError, AttributeError):  # a Triton whose launcher differs
                self._fast_launch = False
        if direct is None and not self._fast_launch:
            with self._torch.cuda.stream(lane.stream):
                jit_launch()
        self.last_submit_s = time.perf_counter() - started

    def _launch_param(self, lane: _Lane, used: int, programs: int, started: float) -> None:
        """The table as the kernel's parameter: one launch, which copies the table (the caller waits)."""
        err = self._param.launch(lane.host_ptr, used, programs, lane.stream_handle)
        if err:
            raise BatchCopyError(f"launching the paged copy (table as parameter) failed: CUDA error {err}")
        self.last_submit_s = time.perf_counter() - started

    def _copy_memcpy(self, lane: _Lane, s, d, n, started: float) -> None:
        rt = self._runtime  # the lane's context is current: any runtime library takes it as its device
        lib = rt.lib
        memcpy, stream, failed = lib.cudaMemcpyAsync, lane.stream_handle, None
        for i, (dst, src, length) in enumerate(zip(d.tolist(), s.tolist(), n.tolist())):
            if length:
                err = memcpy(dst, src, length, _CUDA_MEMCPY_DEFAULT, stream)
                if err:
                    failed = (i, err)
                    lib.cudaGetLastError()
                    break
        self.last_submit_s = time.perf_counter() - started
        if failed:  # what was queued before it still lands: the caller waits for the lane either way
            i, code = failed
            raise BatchCopyError(
                f"cudaMemcpyAsync of batch entry {i} ({n[i]} bytes, {int(s[i]):#x} -> {int(d[i]):#x}) "
                f"failed: {rt.error(code)}")


def batch_copy_for(device: Optional[int], prefer: Optional[str] = None) -> BatchCopy:
    """The CUDA batch copier for ``device`` (None: the current one).

    ``prefer`` picks "triton" or "memcpy-async"; None takes Triton when it
    imports and compiles, else memcpy-async (``fallback_reason`` says why).
    Raises BatchCopyError when no CUDA path is usable; the caller decides
    whether host copies are an acceptable fallback.
    """
    if prefer not in (None, *BACKENDS):
        raise BatchCopyError(f"unknown batch copy backend {prefer!r} (one of {', '.join(BACKENDS)})")
    torch = _torch()
    try:
        usable = torch.cuda.is_available()
    except Exception as exc:  # a driver that fails its own query
        raise BatchCopyError(f"CUDA is not usable: {exc}") from exc
    if not usable:
        raise BatchCopyError("no CUDA device is usable (torch.cuda.is_available() is False)")
    if device is None:
        device = torch.cuda.current_device()
    return CudaBatchCopy(int(device), prefer)
