"""Many local copies in one call: what KV staging gathers and scatters with.

A batch is three equal-length uint64 arrays: source pointers, destination
pointers, lengths in bytes. Every pointer is local to this process. ``copy``
returns only when every byte has landed (device work synchronized), because
the caller hands the destination to a transfer engine or marks it complete
right after.

``HostBatchCopy`` copies plain host memory (tests and CPU-only machines);
``CudaBatchCopy`` copies on one GPU and is chosen with ``batch_copy_for``:
one Triton kernel launch for the whole batch ("triton"), or, where Triton is
missing, one cudaMemcpyAsync per entry ("memcpy-async"). Entries must not
overlap. A CUDA copy is ordered after nothing the caller queued on other
streams: the sources must be complete when ``copy`` is called.
Nothing here imports sglang; torch and triton are imported on first use.
"""

from __future__ import annotations

import ctypes
import operator
import threading
import time
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np


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


def as_batch(srcs, dsts, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert a batch to three contiguous uint64 arrays.

    Refuses negative or non-integer values, arrays of different shapes, a
    range that wraps past 2**64, and a null pointer with a non-zero length.
    """
    s = _as_uint64(srcs, "source pointers")
    d = _as_uint64(dsts, "destination pointers")
    n = _as_uint64(lengths, "lengths")
    if not (s.ndim == d.ndim == n.ndim == 1) or not (len(s) == len(d) == len(n)):
        raise BatchCopyError(
            f"batch arrays differ in shape: {s.shape}, {d.shape}, {n.shape}"
        )
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


# --- CUDA ---------------------------------------------------------------------

BACKENDS = ("triton", "memcpy-async")
_MAX_PROGRAMS = (1 << 31) - 1  # a 1-D grid's limit
_CUDA_MEMCPY_DEFAULT = 4  # direction inferred from the pointers (unified addressing)


def batch_word(srcs: np.ndarray, dsts: np.ndarray, lengths: np.ndarray) -> int:
    """The widest access every entry allows: 16, 8 or 1 bytes."""
    if not len(lengths):
        return 16
    bits = int(np.bitwise_or.reduce(srcs | dsts | lengths))
    if bits & 15 == 0:
        return 16
    return 8 if bits & 7 == 0 else 1


_ENTRY_LIMIT = 1 << 62  # the CUDA path's largest entry: keeps its int64 arithmetic exact


def launch_programs(lengths: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Programs per entry (int64): one per ``chunk_bytes`` piece; lengths below 2**62."""
    shift = chunk_bytes.bit_length() - 1
    return (lengths.view(np.int64) + (chunk_bytes - 1)) >> shift


def launch_table_bytes(entries: int, programs: int) -> int:
    """Size of the launch table the kernel reads (see ``batch_copy_kernel``)."""
    return 32 * entries + 4 * programs


_entry_ids = np.arange(0, dtype=np.int32)


def write_launch_table(table: np.ndarray, srcs, dsts, lengths, per_entry: np.ndarray,
                       ends: Optional[np.ndarray] = None) -> int:
    """Fill ``table`` (uint8, 8-byte aligned, large enough) for the kernel; returns bytes used.

    ``ends`` is ``np.cumsum(per_entry)`` when the caller has it already.
    """
    global _entry_ids
    n = len(lengths)
    if ends is None:
        ends = np.cumsum(per_entry)
    programs = int(ends[-1]) if n else 0
    used = launch_table_bytes(n, programs)
    words = table[: 32 * n].view(np.uint64)
    words[:n] = srcs
    words[n:2 * n] = dsts
    words[2 * n:3 * n] = lengths
    np.subtract(ends, per_entry, out=words[3 * n:4 * n].view(np.int64))  # each entry's first program
    if len(_entry_ids) < n:
        _entry_ids = np.arange(max(n, 2 * len(_entry_ids), 4096), dtype=np.int32)
    table[32 * n:used].view(np.int32)[:] = np.repeat(_entry_ids[:n], per_entry)
    return used


def _torch():
    try:
        import torch
    except Exception as exc:  # not installed, or a broken install
        raise BatchCopyError(f"CUDA batch copy needs torch, which does not import: {exc}") from exc
    return torch


def _triton_kernel():
    """The kernel module, or the reason it cannot be used."""
    try:
        from sglang_dsv41.core import batch_copy_kernel
    except Exception as exc:
        return None, f"triton does not import: {exc}"
    return batch_copy_kernel, None


class _CudaRuntime:
    """The few CUDA runtime calls the memcpy-async path needs, through ctypes."""

    def __init__(self):
        from sglang_dsv41.core.memory_access import _libcudart_candidates

        errors = []
        for candidate in _libcudart_candidates():
            try:
                lib = ctypes.CDLL(candidate)
                lib.cudaMemcpyAsync  # noqa: B018 (probe the symbol)
            except (OSError, AttributeError) as exc:
                errors.append(f"{candidate}: {exc}")
                continue
            self.lib, self.path = lib, candidate
            break
        else:
            raise BatchCopyError("no CUDA runtime library found (" + "; ".join(errors[:3]) + ")")
        vp, sz, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for name, args in (("cudaMemcpyAsync", [vp, vp, sz, ci, vp]),
                           ("cudaStreamSynchronize", [vp]),
                           ("cudaSetDevice", [ci]),
                           ("cudaGetDevice", [ctypes.POINTER(ci)]),
                           ("cudaGetLastError", [])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ci
        lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [ci], ctypes.c_char_p

    def error(self, code: int) -> str:
        text = self.lib.cudaGetErrorString(code)
        return f"{code} ({text.decode(errors='replace') if text else 'unknown'})"


class _Lane:
    """One caller's stream and launch-table buffers; lanes are never shared at once."""

    def __init__(self, torch, device: int, capacity: int):
        self.stream = torch.cuda.Stream(device=device)
        self.stream_handle = self.stream.cuda_stream
        self.capacity = 0
        self.reserve(torch, device, capacity)

    def reserve(self, torch, device: int, nbytes: int) -> None:
        if nbytes <= self.capacity:
            return
        capacity = max(nbytes, 2 * self.capacity, 64 << 10)
        capacity = (capacity + 4095) & ~4095
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.host_np = self.host.numpy()
        self.device_table = torch.empty(capacity // 8, dtype=torch.int64, device=f"cuda:{device}")
        self.device_bytes = self.device_table.view(torch.uint8)
        self.device_ptr = self.device_table.data_ptr()
        self.capacity = capacity


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
        self._kernels = None
        self._runtime = None
        self.last_submit_s = 0.0  # diagnostics: CPU time of the last call up to its synchronize
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
        if self._kernels is None:
            self._runtime = _CudaRuntime()
        self.backend = "triton" if self._kernels is not None else "memcpy-async"

    # -- memory

    def allocate(self, nbytes: int) -> Allocation:
        try:
            nbytes = operator.index(nbytes)
        except TypeError:
            raise BatchCopyError(f"cannot allocate {nbytes!r} bytes") from None
        if nbytes <= 0:
            raise BatchCopyError(f"cannot allocate {nbytes} bytes")
        torch = self._torch
        try:
            tensor = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
            # Zeroed on the device's current stream; our streams do not wait for it.
            torch.cuda.current_stream(self.device).synchronize()
        except Exception as exc:  # out of memory, device failure
            raise BatchCopyError(f"cannot allocate {nbytes} bytes on cuda:{self.device}: {exc}") from exc
        return Allocation(tensor.data_ptr(), nbytes, tensor)

    # -- copying

    def copy(self, srcs, dsts, lengths) -> None:
        started = time.perf_counter()
        s, d, n = as_batch(srcs, dsts, lengths)
        if not len(n) or not n.any():
            return
        with self._lock:
            lane = self._lanes.pop() if self._lanes else None
        try:
            if lane is None:
                with self._torch.cuda.device(self.device):
                    lane = _Lane(self._torch, self.device, 64 << 10)
            if self._kernels is not None:
                self._copy_kernel(lane, s, d, n, started)
            else:
                self._copy_memcpy(lane, s, d, n, started)
        except BatchCopyError:
            raise
        except Exception as exc:  # CUDA errors surface from torch or triton as RuntimeError
            raise BatchCopyError(f"batch copy of {len(n)} entries on cuda:{self.device} failed: {exc}") from exc
        finally:
            if lane is not None:
                with self._lock:
                    self._lanes.append(lane)

    def _compile(self, kernels, word: int):
        compiled = self._compiled.get(word)
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get(word)
                if compiled is None:
                    dummy = self._torch.empty(2, dtype=self._torch.int64, device=f"cuda:{self.device}")
                    # 3: an entry count of no special value (not 1, not a multiple of 16)
                    compiled = kernels.batch_copy_kernel.warmup(
                        dummy, 3, WORD=word, CHUNK=kernels.CHUNK_BYTES,
                        BLOCK=kernels.BLOCK_ELEMENTS[word], grid=(1,))
                    self._compiled[word] = compiled
        return compiled

    def _copy_kernel(self, lane: _Lane, s, d, n, started: float) -> None:
        kernels = self._kernels
        torch = self._torch
        chunk = kernels.CHUNK_BYTES
        if int(n.max()) >= _ENTRY_LIMIT:
            raise BatchCopyError(f"batch entry of {int(n.max())} bytes is beyond any GPU's memory")
        per_entry = launch_programs(n, chunk)
        ends = np.cumsum(per_entry)
        programs = int(ends[-1])
        if programs > _MAX_PROGRAMS:
            raise BatchCopyError(f"batch needs {programs} kernel programs, more than one launch allows")
        word = batch_word(s, d, n)
        entries = len(n)
        with torch.cuda.device(self.device):
            lane.reserve(torch, self.device, launch_table_bytes(entries, programs))
            used = write_launch_table(lane.host_np, s, d, n, per_entry, ends)
            compiled = self._compile(kernels, word)
            with torch.cuda.stream(lane.stream):
                lane.device_bytes[:used].copy_(lane.host[:used], non_blocking=True)
                block = kernels.BLOCK_ELEMENTS[word]
                if self._fast_launch:
                    try:
                        # The compiled kernel's own launcher: skips the JIT's per-call argument binding.
                        compiled[(programs, 1, 1)](lane.device_ptr, entries, word, chunk, block,
                                                   stream=lane.stream_handle)
                    except (TypeError, AttributeError):  # a Triton whose launcher differs
                        self._fast_launch = False
                if not self._fast_launch:
                    kernels.batch_copy_kernel[(programs,)](
                        lane.device_table, entries, WORD=word, CHUNK=chunk, BLOCK=block)
            self.last_submit_s = time.perf_counter() - started
            lane.stream.synchronize()

    def _copy_memcpy(self, lane: _Lane, s, d, n, started: float) -> None:
        rt = self._runtime
        lib = rt.lib
        current = ctypes.c_int(-1)
        lib.cudaGetDevice(ctypes.byref(current))
        err = lib.cudaSetDevice(self.device)
        if err:
            raise BatchCopyError(f"cudaSetDevice({self.device}) failed: {rt.error(err)}")
        try:
            memcpy, stream, failed = lib.cudaMemcpyAsync, lane.stream_handle, None
            for i, (dst, src, length) in enumerate(zip(d.tolist(), s.tolist(), n.tolist())):
                if length:
                    err = memcpy(dst, src, length, _CUDA_MEMCPY_DEFAULT, stream)
                    if err:
                        failed = (i, err)
                        lib.cudaGetLastError()
                        break
            self.last_submit_s = time.perf_counter() - started
            # Wait even after a failure: queued copies must not land after we return.
            err = lib.cudaStreamSynchronize(stream)
            if failed:
                i, code = failed
                raise BatchCopyError(
                    f"cudaMemcpyAsync of batch entry {i} ({n[i]} bytes, {int(s[i]):#x} -> {int(d[i]):#x}) "
                    f"failed: {rt.error(code)}")
            if err:
                raise BatchCopyError(f"cudaStreamSynchronize after a batch copy failed: {rt.error(err)}")
        finally:
            if current.value >= 0 and current.value != self.device:
                lib.cudaSetDevice(current.value)


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
