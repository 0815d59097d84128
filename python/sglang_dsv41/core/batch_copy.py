"""Many local copies in one call: what KV staging gathers and scatters with.

A batch is three equal-length uint64 arrays: source pointers, destination
pointers, lengths in bytes. Every pointer is local to this process. ``copy``
returns only when every byte has landed (device work synchronized), because
the caller hands the destination to a transfer engine or marks it complete
right after.

``HostBatchCopy`` copies plain host memory (tests and CPU-only machines);
the CUDA implementation lives beside it and is chosen with ``batch_copy_for``.
Nothing here imports sglang.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Protocol

import numpy as np


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


def as_batch(srcs, dsts, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert a batch to three contiguous uint64 arrays."""
    try:
        s = np.ascontiguousarray(srcs, dtype=np.uint64)
        d = np.ascontiguousarray(dsts, dtype=np.uint64)
        n = np.ascontiguousarray(lengths, dtype=np.uint64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BatchCopyError(f"batch arrays are not unsigned 64-bit integers: {exc}") from exc
    if not (s.ndim == d.ndim == n.ndim == 1) or not (len(s) == len(d) == len(n)):
        raise BatchCopyError(
            f"batch arrays differ in shape: {s.shape}, {d.shape}, {n.shape}"
        )
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
