"""Batched local copies on the CPU: host copier, validation, launch table, kernel logic.

The CUDA kernel's logic (launch table, program-to-entry mapping, word sizes,
tail masks) runs here in Triton's interpreter on host memory; the same kernel
on a GPU is in test/mooncake_nvlink/kv_staging/test_batch_copy_gpu.py.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys

import numpy as np
import pytest
from _batches import expected_bytes, random_batch, random_paged

from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import (
    BatchCopyError,
    HostBatchCopy,
    PagesOutsideBuffers,
    as_batch,
    batch_word,
    expand_paged,
    fill_launch_table,
    fill_paged_table,
    paged_copy,
    plan_pieces,
)

pytestmark = pytest.mark.timeout(120)

HAS_TRITON = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None






def host_view(alloc) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * alloc.nbytes).from_address(alloc.ptr))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("align", [1, 8, 16])
def test_host_batch_copy_is_byte_exact(seed, align):
    rng = np.random.default_rng(seed * 10 + align)
    copier = HostBatchCopy()
    src_alloc, dst_alloc = copier.allocate(1 << 20), copier.allocate(4 << 20)
    src, dst = host_view(src_alloc), host_view(dst_alloc)
    assert not dst.any(), "allocate must hand out zeroed memory"
    src[:] = rng.integers(0, 256, size=src.size, dtype=np.uint8)
    dst[:] = rng.integers(0, 256, size=dst.size, dtype=np.uint8)
    s, d, n = random_batch(rng, src_alloc.ptr, src.size, dst_alloc.ptr, dst.size,
                           entries=int(rng.integers(1, 300)), max_len=8000, align=align)
    want = expected_bytes(src, dst, src_alloc.ptr, dst_alloc.ptr, s, d, n)
    copier.copy(s, d, n)
    assert np.array_equal(dst, want)
    # Python lists are accepted too, and zero-length entries are skipped.
    copier.copy(list(s[:3]), list(d[:3]), [0, 0, 0])
    assert np.array_equal(dst, want)


BAD_BATCHES = [
    ("differ in shape", [1, 2], [1], [1]),
    ("differ in shape", np.ones((2, 2), np.uint64), np.ones((2, 2), np.uint64), np.ones((2, 2), np.uint64)),
    ("negative", np.array([-1, 5]), [16, 32], [1, 1]),
    ("negative", [-1], [16], [1]),
    ("negative", [16], [32], np.array([-8])),
    ("not unsigned 64-bit", [16.0], [32], [1]),
    ("not unsigned 64-bit", [16], [32], ["1"]),
    ("not unsigned 64-bit", [16], [32], [None]),
    ("not unsigned 64-bit", [2 ** 64], [32], [1]),
    ("past the end of the address space", [2 ** 64 - 4], [32], [8]),
    ("past the end of the address space", [32], [2 ** 64 - 1], [2]),
    ("null pointer", [0], [32], [8]),
    ("null pointer", [32], [0], [8]),
]


@pytest.mark.parametrize("needle, srcs, dsts, lengths", BAD_BATCHES)
def test_bad_batches_raise_batch_copy_error(needle, srcs, dsts, lengths):
    with pytest.raises(BatchCopyError, match=needle):
        as_batch(srcs, dsts, lengths)
    with pytest.raises(BatchCopyError, match=needle):
        HostBatchCopy().copy(srcs, dsts, lengths)


def test_edge_batches_that_are_valid():
    s, d, n = as_batch([], [], [])
    assert s.dtype == d.dtype == n.dtype == np.uint64 and len(n) == 0
    HostBatchCopy().copy([], [], [])
    as_batch([0], [0], [0])  # a null pointer with nothing to copy is harmless
    as_batch([2 ** 64 - 9], [16], [8])  # ends exactly at the top of the address space
    as_batch(np.array([16], np.int64), np.array([32], np.int32), np.array([4], np.uint8))


def test_allocate_refuses_nonsense():
    for bad in (0, -1):
        with pytest.raises(BatchCopyError):
            HostBatchCopy().allocate(bad)


def test_batch_word_takes_the_widest_access_every_entry_allows():
    def word(s, d, n):
        return batch_word(*as_batch(s, d, n))

    assert word([4096, 64], [8192, 128], [32, 4096]) == 16
    assert word([4096, 64], [8192, 136], [32, 4096]) == 8  # one destination only 8-aligned
    assert word([4096, 64], [8192, 128], [32, 4100]) == 1  # one length not a multiple of 8
    assert word([4097], [8192], [32]) == 1
    assert word([], [], []) == 16


class GrowingTable:
    """A ``reserve`` for fill_launch_table: grows like the CUDA lanes do, counts growths."""

    def __init__(self, nbytes: int):
        self.words = np.full(nbytes // 8, 0xEE, dtype=np.uint64)
        self.growths = 0

    def __call__(self, nbytes: int) -> np.ndarray:
        if nbytes > self.words.nbytes:
            self.words = np.full(-(-nbytes // 8), 0xEE, dtype=np.uint64)
            self.growths += 1
        return self.words


CHUNK = 32768


@pytest.mark.parametrize("start_bytes", [8, 1 << 16])
def test_launch_table_layout(start_bytes):
    reserve = GrowingTable(start_bytes)
    s, d, n = as_batch([1008, 2000, 3000, 4000], [5008, 6000, 7000, 8000], [CHUNK * 2 + 1, 0, 5, CHUNK])
    table, word, chunk, pieces, used = fill_launch_table(reserve, s, d, n, CHUNK)
    assert table is reserve.words and reserve.growths == (1 if start_bytes == 8 else 0)
    assert (word, chunk, pieces, used) == (1, CHUNK, 3, 24 * 4)  # lengths 5 and 2 * CHUNK + 1: bytes
    assert table[:4].tolist() == s.tolist() and table[4:8].tolist() == d.tolist()
    assert table[8:12].tolist() == n.tolist()


def test_pieces_cover_the_longest_entry_and_bound_the_grid():
    # Typical KV batches: the smallest chunk, pieces enough for the longest entry.
    assert plan_pieces(1070, 135168, 35_000_000, CHUNK) == (CHUNK, 5)
    assert plan_pieces(62, 4_718_592, 35_000_000, CHUNK) == (CHUNK, 144)
    assert plan_pieces(1, 5, 5, CHUNK) == (CHUNK, 1)
    # One huge entry among many small ones: larger chunks, so idle programs stay few.
    entries, longest = 2000, 5 << 20
    total = longest + (entries - 1) * 8192
    chunk, pieces = plan_pieces(entries, longest, total, CHUNK)
    assert chunk > CHUNK and chunk & (chunk - 1) == 0 and pieces * chunk >= longest
    assert entries * pieces <= 8 * (entries + total // chunk) + 8192
    # Never more pieces than a grid's y dimension takes.
    chunk, pieces = plan_pieces(1, 1 << 45, 1 << 45, CHUNK)  # the longest entry the CUDA path takes
    assert pieces <= 65535 and pieces * chunk >= 1 << 45 and chunk < 1 << 31  # chunk is an int32 argument


def test_all_empty_entries_need_no_program():
    s, d, n = as_batch([16, 0], [32, 0], [0, 0])
    assert fill_launch_table(GrowingTable(64), s, d, n, CHUNK)[1:4] == (16, 0, 0)


@pytest.mark.parametrize("needle, srcs, dsts, lengths", [b for b in BAD_BATCHES if "shape" not in b[0]
                                                         and "not unsigned" not in b[0]
                                                         and "negative" not in b[0]])
def test_launch_table_refuses_what_as_batch_refuses(needle, srcs, dsts, lengths):
    s, d, n = (np.array(v, dtype=np.uint64) for v in (srcs, dsts, lengths))
    with pytest.raises(BatchCopyError, match=needle):
        fill_launch_table(GrowingTable(64), s, d, n, CHUNK)


def test_launch_table_refuses_what_no_gpu_has():
    s, d, n = as_batch([1 << 62], [4096], [16])
    with pytest.raises(BatchCopyError, match="no GPU address range"):
        fill_launch_table(GrowingTable(64), s, d, n, CHUNK)
    s, d, n = as_batch([4096], [1 << 50], [(1 << 45) + 1])
    with pytest.raises(BatchCopyError, match="beyond any GPU"):
        fill_launch_table(GrowingTable(64), s, d, n, CHUNK)


def run_in_subprocess(code: str, env: dict | None = None):
    import os
    import subprocess
    import textwrap

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=110)


def test_module_needs_neither_torch_nor_triton_nor_cuda():
    proc = run_in_subprocess("""
        import sys
        sys.modules["torch"] = None  # any import of torch or triton now fails
        sys.modules["triton"] = None
        import numpy as np
        from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import BatchCopyError, HostBatchCopy, batch_copy_for, CudaBatchCopy
        host = HostBatchCopy()
        a, b = host.allocate(64), host.allocate(64)
        import ctypes
        ctypes.memset(a.ptr, 7, 64)
        host.copy([a.ptr], [b.ptr], [64])
        assert ctypes.string_at(b.ptr, 64) == bytes([7]) * 64
        for make in (lambda: batch_copy_for(None), lambda: CudaBatchCopy(0)):
            try:
                make()
            except BatchCopyError as exc:
                print("REFUSED", exc)
            else:
                raise SystemExit("a CUDA copier without torch")
    """)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REFUSED")]
    assert len(lines) == 2 and all("torch" in l for l in lines), proc.stdout


def test_importing_loads_no_gpu_library():
    proc = run_in_subprocess("""
        import sys
        import sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy
        print(sorted(m for m in ("torch", "triton") if m in sys.modules))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_batch_copy_for_without_a_gpu_says_why():
    proc = run_in_subprocess("""
        from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import BatchCopyError, batch_copy_for
        for args in ((None,), (0, "triton"), (0, "memcpy-async"), (0, "cuda-graphs")):
            try:
                batch_copy_for(*args)
            except BatchCopyError as exc:
                print("REFUSED", exc)
            else:
                raise SystemExit(f"batch_copy_for{args} gave a copier without a GPU")
    """, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REFUSED")]
    assert len(lines) == 4, proc.stdout
    assert all("no CUDA device" in l for l in lines[:3]), lines
    assert "unknown batch copy backend 'cuda-graphs'" in lines[3]


INTERPRETED_KERNEL = """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    import numpy as np, torch
    sys.path.insert(0, {test_dir!r})
    from _batches import random_batch, expected_bytes
    from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel as k
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import as_batch, fill_launch_table

    def run(seed, align, entries, max_len):
        rng = np.random.default_rng(seed)
        src = torch.from_numpy(rng.integers(0, 256, size=600_000, dtype=np.uint8))
        dst = torch.from_numpy(rng.integers(0, 256, size=3_000_000, dtype=np.uint8))
        sb, db = src.data_ptr(), dst.data_ptr()
        s, d, n = random_batch(rng, sb, src.numel(), db, dst.numel(), entries, max_len, align)
        n[rng.integers(0, entries)] = 0  # an entry with nothing to copy owns no program
        s, d, n = as_batch(s, d, n)
        want = expected_bytes(src.numpy(), dst.numpy(), sb, db, s, d, n)
        table, word, chunk, pieces, used = fill_launch_table(
            lambda nbytes: np.zeros(nbytes // 8, np.uint64), s, d, n, k.MIN_CHUNK_BYTES)
        k.batch_copy_kernel[(len(n), pieces)](torch.from_numpy(table).view(torch.int64), len(n), chunk,
                                              WORD=word, BLOCK=k.BLOCK_ELEMENTS[word])
        ok = np.array_equal(dst.numpy(), want)
        print("CASE", seed, align, word, len(n), pieces, "ok" if ok else "MISMATCH")

    for seed, align, entries, max_len in ((1, 16, 40, 100_000), (2, 8, 40, 70_000), (3, 1, 25, 70_000),
                                          (4, 16, 200, 9_000), (5, 1, 60, 5_000)):
        run(seed, align, entries, max_len)
"""


def numpy_takes_int_of_one_element_arrays() -> bool:
    try:
        int(np.array([1]))
    except TypeError:
        return False
    return True


@pytest.mark.skipif(not HAS_TRITON, reason="triton or torch not installed")
@pytest.mark.skipif(not numpy_takes_int_of_one_element_arrays(),
                    reason="Triton's interpreter turns a loop bound loaded from memory into int(1-element array), "
                           "which this numpy refuses (seen with numpy 2.5 and Triton 3.6)")
def test_kernel_is_byte_exact_in_the_triton_interpreter():
    from pathlib import Path

    proc = run_in_subprocess(INTERPRETED_KERNEL.format(test_dir=str(Path(__file__).parent)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [l.split() for l in proc.stdout.splitlines() if l.startswith("CASE")]
    assert len(cases) == 5, proc.stdout
    assert {c[3] for c in cases} == {"16", "8", "1"}, cases  # every access width ran
    assert all(c[-1] == "ok" for c in cases), proc.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton or torch not installed")
def test_kernel_compiles_for_hopper_with_wide_accesses():
    """No GPU needed: Triton's own compiler and ptxas, for sm_90."""
    import re

    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:  # a Triton without these entry points
        pytest.skip(f"triton compile API unavailable: {exc}")
    from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel as k

    accesses = {}
    for word in (16, 1):
        source = ASTSource(
            k.batch_copy_kernel,
            signature={"table": "*i64", "n_entries": "i32", "chunk": "i32", "WORD": "constexpr",
                       "BLOCK": "constexpr"},
            constexprs={"WORD": word, "BLOCK": k.BLOCK_ELEMENTS[word]})
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        except Exception as exc:  # no bundled ptxas on this platform
            pytest.skip(f"cannot compile for sm_90 here: {exc}")
        accesses[word] = set(re.findall(r"(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]))
    # 16-byte batches move 128 bits per access; the byte path must not claim more than it may.
    assert "ld.global.v2.b64" in accesses[16] and "st.global.v2.b64" in accesses[16], accesses
    assert not any(".v2" in a or ".v4" in a for a in accesses[1]), accesses


# --- page-addressed copies ------------------------------------------------------------




@pytest.mark.parametrize("align", [1, 8, 16])
def test_paged_copies_move_exactly_their_block_list(align):
    rng = np.random.default_rng(align)
    copier = HostBatchCopy()
    src_alloc, dst_alloc = copier.allocate(2 << 20), copier.allocate(3 << 20)
    src, dst = host_view(src_alloc), host_view(dst_alloc)
    src[:] = rng.integers(0, 256, size=src.size, dtype=np.uint8)
    copies = random_paged(rng, src_alloc.ptr, src.size, dst_alloc.ptr, dst.size, align)
    s, d, n = expand_paged(copies)
    # the block list by hand: entry by entry, pages in order
    want_blocks = [(int(r[0]) + int(p) * int(r[2]), int(r[1]) + int(q) * int(r[2]), int(r[2]))
                   for c in copies for r in c.entries for p, q in zip(c.src_pages, c.dst_pages)]
    assert list(zip(s.tolist(), d.tolist(), n.tolist())) == want_blocks
    want = expected_bytes(src, dst, src_alloc.ptr, dst_alloc.ptr, s, d, n)
    copier.copy_pages(copies)
    assert np.array_equal(dst, want)
    assert all(c.word >= align for c in copies)


BAD_PAGED = [
    ("page lists", [(4096, 8192, 64)], [1, 2], [1]),
    ("page lists", [(4096, 8192, 64)], [1.0], [1]),
    ("page lists", [(4096, 8192, 64)], np.ones((1, 1), np.int32), np.ones((1, 1), np.int32)),
    ("negative", [(4096, 8192, 64)], [-1], [1]),
    ("negative", [(4096, 8192, 64)], [1], np.array([-3], np.int64)),
    ("positive bytes per page", [(4096, 8192, 0)], [1], [1]),
    ("non-null", [(0, 8192, 64)], [1], [1]),
    ("no GPU address range", [(4096, 8192, 1 << 40)], [1 << 22], [1]),
    ("rows", [(1, 2)], [1], [1]),
]


@pytest.mark.parametrize("needle, entries, sp, dp", BAD_PAGED)
def test_bad_paged_copies_are_refused(needle, entries, sp, dp):
    with pytest.raises(BatchCopyError, match=needle):
        paged_copy(entries, sp, dp)


def pieces_of_table(t: np.ndarray, programs: int, chunk: int) -> list[tuple[int, int, int]]:
    """What each program of the paged kernel copies, read from its table as the kernels read it."""
    segments = int(t[0])
    assert int(t[1]) == chunk
    ends = [int(x) for x in t[2:2 + segments]]
    out = []
    for p in range(programs):
        lo, hi = 0, segments - 1
        while lo < hi:  # the first segment whose end is past p
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if p < ends[mid] else (mid + 1, hi)
        unit = p - (ends[lo - 1] if lo else 0)
        row = 2 + segments + 5 * lo
        src0, dst0, nbytes, at, n = (int(x) for x in t[row:row + 5])
        pieces = -(-nbytes // chunk)
        page, first = unit // pieces, unit % pieces * chunk
        out.append((src0 + int(t[at + page]) * nbytes + first, dst0 + int(t[at + n + page]) * nbytes + first,
                    min(chunk, nbytes - first)))
    return out


def pieces_of_blocks(s, d, n, chunk: int) -> list[tuple[int, int, int]]:
    return [(int(a) + k, int(b) + k, min(chunk, int(length) - k))
            for a, b, length in zip(s, d, n) for k in range(0, int(length), chunk)]


def test_paged_table_layout():
    c = paged_copy([(4096, 65536, 1024), (8192, 131072, 40000)], np.array([5, 1], np.int32), [0, 7])
    table = np.zeros(64, np.uint64)
    word, programs, used = fill_paged_table(lambda nbytes: table, [c], CHUNK)
    t = table.view(np.int64)
    # two segments; programs: 2 pages x 1 piece, then 2 pages x 2 pieces; rows at 4 and 9; pages at 14
    assert (word, programs, used) == (16, 6, 8 * 18)
    assert t[:4].tolist() == [2, CHUNK, 2, 6]
    assert t[4:14].tolist() == [4096, 65536, 1024, 14, 2, 8192, 131072, 40000, 14, 2]
    assert t[14:18].tolist() == [5, 1, 0, 7]
    assert pieces_of_table(t, programs, CHUNK) == pieces_of_blocks(*expand_paged([c]), CHUNK)


@pytest.mark.parametrize("align", [1, 8, 16])
def test_paged_tables_name_exactly_the_pieces_of_their_block_list(align):
    rng = np.random.default_rng(10 + align)
    copies = random_paged(rng, 1 << 30, 2 << 20, 1 << 32, 3 << 20, align, calls=4)
    table = np.zeros(1 << 14, np.uint64)
    for chunk in (1024, 4096, CHUNK):
        word, programs, used = fill_paged_table(lambda n: table, copies, chunk)
        assert word >= align
        want = pieces_of_blocks(*expand_paged(copies), chunk)
        assert pieces_of_table(table.view(np.int64), programs, chunk) == want
        assert used == 8 * (2 + 6 * sum(len(c.segments) for c in copies)
                            + 2 * sum(len(c.src_pages) for c in copies))


def test_paged_tables_reuse_their_plan_but_always_carry_this_calls_pages():
    from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy

    kv = paged_copy([(4096, 65536, 1024), (8192, 131072, 2048)], [5, 1], [0, 7])
    state = paged_copy([(1 << 20, 1 << 21, 512)], [3], [4])
    table = np.zeros(64, np.uint64)
    assert not kv.segments.flags.writeable  # plans are keyed by the template's identity
    _, programs, used = fill_paged_table(lambda n: table, [kv, state], CHUNK)
    first = table.copy()
    plans = len(batch_copy.LAUNCH_PLANS)
    head = 2 + 6 * 3  # three segments
    # same shape, other pages: the cached plan, this call's pages
    other = [kv._replace(src_pages=np.array([9, 8]), dst_pages=np.array([2, 3])),
             state._replace(dst_pages=np.array([6], np.uint64))]
    fill_paged_table(lambda n: table, other, CHUNK)
    assert len(batch_copy.LAUNCH_PLANS) == plans
    t = table.view(np.int64)
    assert t[:head].tolist() == first.view(np.int64)[:head].tolist()
    assert t[head:head + 6].tolist() == [9, 8, 2, 3, 3, 6]
    assert pieces_of_table(t, programs, CHUNK) == pieces_of_blocks(*expand_paged(other), CHUNK)
    # another page count is another shape
    shorter = [kv._replace(src_pages=np.array([1]), dst_pages=np.array([2])), state]
    _, programs, _ = fill_paged_table(lambda n: table, shorter, CHUNK)
    assert len(batch_copy.LAUNCH_PLANS) == plans + 1
    assert pieces_of_table(t, programs, CHUNK) == pieces_of_blocks(*expand_paged(shorter), CHUNK)


def test_long_page_lists_go_in_one_table_and_impossible_ones_are_refused():
    many = 70_000
    long = paged_copy([(4096, 8192, 16)], np.arange(many), np.arange(many)[::-1])
    table = np.zeros(4 * many, np.uint64)
    _, programs, _ = fill_paged_table(lambda n: table, [long], CHUNK)
    assert programs == many
    assert pieces_of_table(table.view(np.int64), programs, CHUNK)[-1] == (4096 + 16 * (many - 1), 8192, 16)
    huge = paged_copy([(4096, 8192, 1 << 40)], np.arange(256), np.arange(256))  # 2^33 pieces in one buffer
    with pytest.raises(BatchCopyError, match="beyond one launch"):
        fill_paged_table(lambda n: table, [huge], CHUNK)


@pytest.mark.parametrize("pages, side, page", [
    (([1, 4], [0, 2]), "source", 4),  # the source buffers hold pages 0-3
    (([1, 2], [0, 3]), "destination", 3),  # the destination buffers hold pages 0-2
    ((np.array([1, -2], np.int32), [0, 1]), "source", -2),
    (([1, 2], np.array([0, 1 << 63], np.uint64)), "destination", -(1 << 63)),  # as the int64 table reads it
])
def test_pages_outside_their_buffers_are_refused_before_any_byte_moves(pages, side, page):
    copier = HostBatchCopy()
    src_alloc, dst_alloc = copier.allocate(8192), copier.allocate(8192)
    host_view(src_alloc)[:] = 7
    c = paged_copy([(src_alloc.ptr, dst_alloc.ptr, 1024)], [0], [0])
    good = c._replace(src_limit=4, dst_limit=3)
    bad = c._replace(src_pages=np.asarray(pages[0]), dst_pages=np.asarray(pages[1]), src_limit=4, dst_limit=3)
    table = np.zeros(64, np.uint64)
    for refuse in (lambda: fill_paged_table(lambda n: table, [good, bad], CHUNK),
                   lambda: copier.copy_pages([good, bad])):
        with pytest.raises(PagesOutsideBuffers, match=f"{side} page {page}") as refused:
            refuse()
        assert (refused.value.copy_index, refused.value.side, refused.value.page) == (1, side, page)
        assert refused.value.negative == (page < 0)
    assert not host_view(dst_alloc).any()  # the good copy was not written either
    fill_paged_table(lambda n: table, [good, good._replace(src_pages=np.array([3]), dst_pages=np.array([2]))],
                     CHUNK)  # the last page on each side is inside


INTERPRETED_PAGED_KERNEL = """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np, torch
    sys.path.insert(0, {test_dir!r})
    from _batches import random_paged, expected_bytes
    from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel as k
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import PAGED_CHUNK_BYTES, expand_paged, fill_paged_table

    for seed, align in ((1, 16), (2, 8), (3, 1), (4, 16)):
        rng = np.random.default_rng(seed)
        src = torch.from_numpy(rng.integers(0, 256, size=1_500_000, dtype=np.uint8))
        dst = torch.from_numpy(rng.integers(0, 256, size=2_500_000, dtype=np.uint8))
        sb, db = src.data_ptr(), dst.data_ptr()
        copies = random_paged(rng, sb, src.numel(), db, dst.numel(), align, calls=3)
        want = expected_bytes(src.numpy(), dst.numpy(), sb, db, *expand_paged(copies))
        table = np.zeros(1 << 14, np.uint64)
        word, programs, used = fill_paged_table(lambda n: table, copies, PAGED_CHUNK_BYTES)
        k.paged_copy_kernel[(programs,)](torch.from_numpy(table).view(torch.int64), PAGED_CHUNK_BYTES,
                                         WORD=word, BLOCK=k.BLOCK_ELEMENTS[word])
        ok = np.array_equal(dst.numpy(), want)
        print("CASE", seed, word, programs, "ok" if ok else "MISMATCH")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton or torch not installed")
@pytest.mark.skipif(not numpy_takes_int_of_one_element_arrays(),
                    reason="Triton's interpreter turns a loop bound loaded from memory into int(1-element array), "
                           "which this numpy refuses (seen with numpy 2.5 and Triton 3.6)")
def test_paged_kernel_is_byte_exact_in_the_triton_interpreter():
    from pathlib import Path

    proc = run_in_subprocess(INTERPRETED_PAGED_KERNEL.format(test_dir=str(Path(__file__).parent)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [l.split() for l in proc.stdout.splitlines() if l.startswith("CASE")]
    assert len(cases) == 4, proc.stdout
    assert {c[2] for c in cases} == {"16", "8", "1"}, cases
    assert all(c[-1] == "ok" for c in cases), proc.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton or torch not installed")
def test_paged_kernel_compiles_for_hopper_with_wide_accesses():
    import re

    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:
        pytest.skip(f"triton compile API unavailable: {exc}")
    from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel as k

    source = ASTSource(k.paged_copy_kernel,
                       signature={"table": "*i64", "chunk": "i32", "WORD": "constexpr", "BLOCK": "constexpr"},
                       constexprs={"WORD": 16, "BLOCK": k.BLOCK_ELEMENTS[16]})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except Exception as exc:
        pytest.skip(f"cannot compile for sm_90 here: {exc}")
    accesses = set(re.findall(r"(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]))
    assert "ld.global.v2.b64" in accesses and "st.global.v2.b64" in accesses, accesses


class _FakeDriver:
    """The four context calls of libcuda on one thread: device 3's primary context is 0x3000."""

    PRIMARY = 0x3000

    def __init__(self, current=None, fail_get=0, fail_set=0):
        self.current, self.fail_get, self.fail_set = current, fail_get, fail_set
        self.sets: list = []

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0 if ordinal == 3 else 101  # CUDA_ERROR_INVALID_DEVICE

    def cuDevicePrimaryCtxRetain(self, out, device):
        out._obj.value = self.PRIMARY
        return 0

    def cuCtxGetCurrent(self, out):
        out._obj.value = self.current
        return self.fail_get

    def cuCtxSetCurrent(self, context):
        self.sets.append(context)
        if not self.fail_set:
            self.current = context
        return self.fail_set


@pytest.mark.parametrize("before, switched, after", [
    (_FakeDriver.PRIMARY, [], _FakeDriver.PRIMARY),  # already current: no call that changes anything
    (None, [_FakeDriver.PRIMARY], _FakeDriver.PRIMARY),  # no context: ours stays, nothing is created
    (0x7000, [_FakeDriver.PRIMARY, 0x7000], 0x7000),  # another context: given back
])
def test_a_copy_makes_its_context_current_and_gives_back_only_a_context_the_thread_had(before, switched, after):
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import DeviceContext

    driver = _FakeDriver(current=before)
    scope = DeviceContext(3, driver)
    previous = scope.enter()
    assert driver.current == _FakeDriver.PRIMARY
    scope.leave(previous)
    assert driver.sets == switched and driver.current == after


def test_context_failures_are_batch_copy_errors():
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import DeviceContext

    with pytest.raises(BatchCopyError, match="no primary CUDA context for device 5"):
        DeviceContext(5, _FakeDriver())
    for driver in (_FakeDriver(fail_get=4), _FakeDriver(current=0x7000, fail_set=201)):
        with pytest.raises(BatchCopyError, match="cannot make the copy's CUDA context current"):
            DeviceContext(3, driver).enter()
