"""Peer writes without a GPU: the tests' and the CPU benchmark's stand-in for CUDA.

``HostCmaTransport`` exports host memory and writes another process's memory
with ``process_vm_writev`` (peer maps of kind ``host-cma``), so the peer-write
protocol runs between two real processes; ``HostBatchCopy`` copies host memory
in this process. Both take the package's ``PagedCopy`` and refuse pages outside
their buffers before anything moves, as the GPU copy does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import threading
from typing import Sequence

import numpy as np

from sglang_dsv41.mooncake_nvlink.cuda_libs import HANDLE_BYTES
from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import BatchCopyError, PagedCopy, pages_outside
from sglang_dsv41.mooncake_nvlink.kv_staging.peer import (
    PeerMap,
    PeerMapError,
    PeerRegion,
    PeerTarget,
    check_peer,
    host_identity,
)


def expand_paged(copies: Sequence[PagedCopy], merge_runs: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (srcs, dsts, lengths) block list of ``copies``: entry by entry, pages in order;
    ``merge_runs``: pages consecutive on both sides as one block. Raises
    ``PagesOutsideBuffers`` before anything is built, as the device copy does."""
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
        parts.append(((c.entries[:, 0:1] + sp[None, :] * item).ravel(),
                      (c.entries[:, 1:2] + dp[None, :] * item).ravel(), (pages[None, :] * item).ravel()))
    if not parts:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    return tuple(np.ascontiguousarray(np.concatenate([p[k] for p in parts])).view(np.uint64) for k in range(3))


class HostBatchCopy:
    """Host memory of this process, one memmove per run of pages."""

    backend = "host"

    def copy_pages(self, copies: Sequence[PagedCopy]) -> None:
        for src, dst, length in zip(*(a.tolist() for a in expand_paged(copies, merge_runs=True))):
            ctypes.memmove(dst, src, length)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_IOV_MAX = 1024
_PID = struct.Struct("<Q")  # a host-cma handle: the exporting pid, zero padded


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

    @staticmethod
    def pid_of(peer: PeerMap) -> int:
        return _PID.unpack(peer.regions[0].handle[:_PID.size])[0]

    def open(self, peer: PeerMap) -> PeerTarget:
        check_peer(peer, self.kind)
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
        return PeerTarget(peer, [r.ptr for r in peer.regions], self, [peer.regions[0].handle])

    def write_pages(self, target: PeerTarget, copies: Sequence[PagedCopy]) -> None:
        self.write_blocks(self.pid_of(target.peer), *expand_paged(copies, merge_runs=True))

    def write_blocks(self, pid: int, s: np.ndarray, d: np.ndarray, n: np.ndarray) -> None:
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

    def close(self, opened: Sequence[bytes]) -> None:
        with self._lock:
            self._opened -= 1

    @property
    def open_mappings(self) -> int:
        with self._lock:
            return self._opened
