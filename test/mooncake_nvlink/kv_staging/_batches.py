"""Random copy batches and the bytes a correct copy leaves: shared by the batch-copy tests."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np

from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import paged_copy


class HostBuffer(NamedTuple):
    ptr: int
    nbytes: int
    keepalive: object


def host_buffer(nbytes: int) -> HostBuffer:
    """Zeroed host memory and its address."""
    buf = ctypes.create_string_buffer(nbytes)
    return HostBuffer(ctypes.addressof(buf), nbytes, buf)


def expected_bytes(src: np.ndarray, dst_before: np.ndarray, src_base, dst_base, s, d, n) -> np.ndarray:
    out = dst_before.copy()
    for a, b, k in zip(s.tolist(), d.tolist(), n.tolist()):
        out[b - dst_base:b - dst_base + k] = src[a - src_base:a - src_base + k]
    return out


def random_paged(rng, src_base: int, src_size: int, dst_base: int, dst_size: int, align: int,
                 calls: int = 3):
    """Paged copies over disjoint buffers: per call a few buffers, a page size each, shuffled page pairs."""
    copies, src_at, dst_at = [], 0, 0
    for _ in range(calls):
        buffers = int(rng.integers(1, 6))
        n_pages = int(rng.integers(1, 12))
        pool_pages = n_pages + int(rng.integers(0, 6))
        rows = []
        for _ in range(buffers):
            item = max(align, int(rng.integers(1, 9000)) // align * align)
            rows.append((src_base + src_at, dst_base + dst_at, item))
            src_at += pool_pages * item + align
            dst_at += pool_pages * item + 3 * align
        assert src_at <= src_size and dst_at <= dst_size, "buffers too small for the random copies"
        sp = rng.permutation(pool_pages)[:n_pages].astype(np.int32)  # src pages may repeat only across calls
        dp = rng.permutation(pool_pages)[:n_pages]  # distinct: no two pairs write one page
        copies.append(paged_copy(rows, sp, dp))
    return copies
