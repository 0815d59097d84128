"""The GPU's stand-in (test/helpers/host_peer.py): a paged copy as its runs of consecutive pages.

Its merged runs are what the host copiers write (every CPU PD test moves its KV
that way); they must move exactly the bytes the page-by-page expansion moves,
and refuse a page outside its buffers before anything is built.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host_peer import HostBatchCopy, expand_paged
from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import PagesOutsideBuffers, paged_copy


def merged_page_runs(copies):
    return expand_paged(copies, merge_runs=True)


PAGES = 24


def _apply(entries, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The bytes ``dst`` holds after the entries (addresses into ``src`` and ``dst``), on a copy of it."""
    out = dst.copy()
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    for s, d, n in zip(*(e.tolist() for e in entries)):
        assert base_s <= s and s + n <= base_s + src.nbytes and base_d <= d and d + n <= base_d + dst.nbytes
        ctypes.memmove(out.ctypes.data + (d - base_d), s, n)
    return out


@st.composite
def paged_copies(draw):
    items = draw(st.lists(st.integers(1, 48), min_size=1, max_size=4))
    count = draw(st.integers(0, PAGES))
    src_pages = draw(st.permutations(range(PAGES)))[:count]
    dst_pages = draw(st.permutations(range(PAGES)))[:count]
    if draw(st.booleans()):  # runs: consecutive on both sides
        start_s, start_d = draw(st.integers(0, PAGES - count)), draw(st.integers(0, PAGES - count))
        src_pages, dst_pages = range(start_s, start_s + count), range(start_d, start_d + count)
    return items, np.array(list(src_pages), dtype=np.int64), np.array(list(dst_pages), dtype=np.int64)


@settings(max_examples=150, deadline=None)
@given(st.lists(paged_copies(), min_size=1, max_size=3))
def test_merged_runs_move_exactly_the_bytes_the_page_by_page_list_moves(calls):
    rng = np.random.default_rng(len(calls))
    total = sum(sum(items) for items, _, _ in calls) * PAGES
    src = rng.integers(0, 256, size=total, dtype=np.uint8)
    dst = rng.integers(0, 256, size=total, dtype=np.uint8)
    copies, at = [], 0
    for items, sp, dp in calls:
        rows = []
        for item in items:
            rows.append((src.ctypes.data + at, dst.ctypes.data + at, item))
            at += item * PAGES
        copies.append(paged_copy(rows, sp, dp))
    merged = merged_page_runs(copies)
    assert np.array_equal(_apply(merged, src, dst), _apply(expand_paged(copies), src, dst))
    assert len(merged[2]) <= len(expand_paged(copies)[2])
    if all(len(sp) and np.all(np.diff(sp) == 1) and np.all(np.diff(dp) == 1) for _, sp, dp in calls):
        assert len(merged[2]) == sum(len(items) for items, _, _ in calls)  # one entry per buffer


def test_consecutive_pages_become_one_entry_per_buffer():
    copy = paged_copy([(1 << 20, 1 << 30, 100), (2 << 20, 2 << 30, 8)], np.arange(5, 37), np.arange(9, 41))
    s, d, n = merged_page_runs([copy])
    assert n.tolist() == [3200, 256]
    assert s.tolist() == [(1 << 20) + 500, (2 << 20) + 40] and d.tolist() == [(1 << 30) + 900, (2 << 30) + 72]


def test_a_page_outside_its_buffers_is_refused_before_any_entry_is_built():
    copy = paged_copy([(1 << 20, 1 << 30, 64)], np.array([0, 1]), np.array([3, 9]))._replace(dst_limit=8)
    with pytest.raises(PagesOutsideBuffers, match="destination page 9"):
        merged_page_runs([copy])


def test_the_host_copier_writes_paged_copies_by_their_runs():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    copy = paged_copy([(src.ctypes.data, dst.ctypes.data, 8)], np.array([0, 1, 5]), np.array([2, 3, 0]))
    HostBatchCopy().copy_pages([copy])
    assert dst[16:32].tolist() == list(range(16)) and dst[0:8].tolist() == list(range(40, 48))
    assert not dst[8:16].any() and not dst[32:].any()
