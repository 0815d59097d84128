"""The paged copy on the CPU: validation, launch table, page checks, kernel logic.

The CUDA kernel's logic (launch table, program-to-page mapping, the access
width each buffer takes, tail masks) runs here in Triton's interpreter on host
memory; the same kernel on a GPU is in test_batch_copy_gpu.py.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys

import numpy as np
import pytest
from _batches import expected_bytes, host_buffer, random_paged
from host_peer import HostBatchCopy, expand_paged

from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import (
    BatchCopyError,
    PagesOutsideBuffers,
    fill_paged_table,
    paged_copy,
)

pytestmark = pytest.mark.timeout(120)

HAS_TRITON = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None


def host_view(alloc) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * alloc.nbytes).from_address(alloc.ptr))


CHUNK = 32768


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
        from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import (BatchCopyError, CudaBatchCopy,
                                                                        paged_copy)
        assert paged_copy([(4096, 8192, 64)], np.array([1]), np.array([2])).page_bytes == 64
        for make in (lambda: CudaBatchCopy(None), lambda: CudaBatchCopy(0)):
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
def test_copier_without_a_gpu_says_why():
    proc = run_in_subprocess("""
        from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import BatchCopyError, CudaBatchCopy
        for args in ((None,), (0,)):
            try:
                CudaBatchCopy(*args)
            except BatchCopyError as exc:
                print("REFUSED", exc)
            else:
                raise SystemExit(f"CudaBatchCopy{args} gave a copier without a GPU")
    """, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REFUSED")]
    assert len(lines) == 2 and all("no CUDA device" in l for l in lines), lines


def numpy_takes_int_of_one_element_arrays() -> bool:
    try:
        int(np.array([1]))
    except TypeError:
        return False
    return True



# --- page-addressed copies ------------------------------------------------------------




@pytest.mark.parametrize("align", [1, 8, 16])
def test_paged_copies_move_exactly_their_block_list(align):
    rng = np.random.default_rng(align)
    copier = HostBatchCopy()
    src_alloc, dst_alloc = host_buffer(2 << 20), host_buffer(3 << 20)
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
    programs, used = fill_paged_table(lambda nbytes: table, [c], CHUNK)
    t = table.view(np.int64)
    # two segments; programs: 2 pages x 1 piece, then 2 pages x 2 pieces; rows at 4 and 9; pages at 14
    assert (programs, used) == (6, 8 * 18)
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
        programs, used = fill_paged_table(lambda n: table, copies, chunk)
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
    programs, used = fill_paged_table(lambda n: table, [kv, state], CHUNK)
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
    programs, _ = fill_paged_table(lambda n: table, shorter, CHUNK)
    assert len(batch_copy.LAUNCH_PLANS) == plans + 1
    assert pieces_of_table(t, programs, CHUNK) == pieces_of_blocks(*expand_paged(shorter), CHUNK)


def test_long_page_lists_go_in_one_table_and_impossible_ones_are_refused():
    many = 70_000
    long = paged_copy([(4096, 8192, 16)], np.arange(many), np.arange(many)[::-1])
    table = np.zeros(4 * many, np.uint64)
    programs, _ = fill_paged_table(lambda n: table, [long], CHUNK)
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
    src_alloc, dst_alloc = host_buffer(8192), host_buffer(8192)
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
    assert not host_view(dst_alloc).any()  # the good copy was not written either
    fill_paged_table(lambda n: table, [good, good._replace(src_pages=np.array([3]), dst_pages=np.array([2]))],
                     CHUNK)  # the last page on each side is inside


INTERPRETED_PAGED_KERNEL = """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np, torch
    sys.path[:0] = [{test_dir!r}, {helpers_dir!r}]
    from _batches import random_paged, expected_bytes
    from host_peer import expand_paged
    from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel as k
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import PAGED_CHUNK_BYTES, fill_paged_table

    def launch(copies):
        table = np.zeros(1 << 16, np.uint64)
        programs, used = fill_paged_table(lambda n: table, copies, PAGED_CHUNK_BYTES)
        k.paged_copy_kernel[(programs,)](torch.from_numpy(table).view(torch.int64), PAGED_CHUNK_BYTES)

    for seed, aligns in ((1, [16]), (2, [8]), (3, [1]), (4, [16, 8, 1]), (5, [8, 16, 16])):
        rng = np.random.default_rng(seed)
        src = torch.from_numpy(rng.integers(0, 256, size=2_000_000 * len(aligns), dtype=np.uint8))
        dst = torch.from_numpy(rng.integers(0, 256, size=3_000_000 * len(aligns), dtype=np.uint8))
        sb, db = src.data_ptr(), dst.data_ptr()
        copies = []
        for part, align in enumerate(aligns):  # one launch: buffers of every width side by side
            # 1 or 8 bytes past a 16-byte boundary: the first buffer really is only that wide
            skew = 0 if align == 16 else align
            copies += random_paged(rng, sb + part * 2_000_000 + skew, 1_999_000,
                                   db + part * 3_000_000 + skew, 2_999_000, align, calls=2)
        want = expected_bytes(src.numpy(), dst.numpy(), sb, db, *expand_paged(copies))
        launch(copies)
        print("CASE paged", seed, ",".join(map(str, aligns)), "ok" if np.array_equal(dst.numpy(), want) else "MISMATCH")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton or torch not installed")
@pytest.mark.skipif(not numpy_takes_int_of_one_element_arrays(),
                    reason="Triton's interpreter turns a loop bound loaded from memory into int(1-element array), "
                           "which this numpy refuses (seen with numpy 2.5 and Triton 3.6)")
def test_paged_kernel_is_byte_exact_in_the_triton_interpreter():
    from pathlib import Path

    here = Path(__file__).parent
    proc = run_in_subprocess(INTERPRETED_PAGED_KERNEL.format(test_dir=str(here),
                                                             helpers_dir=str(here.parents[1] / "helpers")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [l.split() for l in proc.stdout.splitlines() if l.startswith("CASE")]
    assert len(cases) == 5, proc.stdout
    assert all(c[-1] == "ok" for c in cases), proc.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton or torch not installed")
def test_one_compiled_kernel_holds_every_access_width():
    """No GPU needed: Triton's own compiler and ptxas, for sm_90."""
    import re

    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as exc:
        pytest.skip(f"triton compile API unavailable: {exc}")
    from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_kernel as k

    source = ASTSource(k.paged_copy_kernel, signature={"table": "*i64", "chunk": "i32"})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except Exception as exc:
        pytest.skip(f"cannot compile for sm_90 here: {exc}")
    accesses = set(re.findall(r"(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]))
    # 16-byte pages move 128 bits per access, 8-byte rows 64, odd ones a byte at a time
    for width in ("v2.b64", "b64", "b8"):
        assert any(a.endswith(width) and a.startswith("ld") for a in accesses), (width, accesses)
        assert any(a.endswith(width) and a.startswith("st") for a in accesses), (width, accesses)


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
