"""The native paged writer built with this machine's C compiler, driven with a stand-in driver.

The stand-in's launch reads the table the kernel would get as its parameter,
so every byte the native code writes is compared with the table
``fill_paged_table`` writes for the same copies; the page check, the kernel
chosen by table size, the context given back and every failure status are
checked without a GPU. The same writer on a GPU is in
test/mooncake_nvlink/kv_staging/test_batch_copy_gpu.py.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from sglang_dsv41.mooncake_nvlink.kv_staging import batch_copy_native as native
from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import PAGED_CHUNK_BYTES, fill_paged_table, paged_copy, paged_plan

pytestmark = pytest.mark.timeout(120)

OURS, OTHER = 0x5000, 0x7000
KERNELS = ((4096, 0x1111), (16384, 0x2222), (32752, 0x3333))
THREADS = 256
STREAM = 0xABC


@pytest.fixture(scope="module")
def module():
    try:
        return native.build()
    except native.NativeWriteError as exc:
        pytest.skip(f"no native writer on this machine: {exc}")


class StandInDriver:
    """cuCtxGetCurrent, cuCtxSetCurrent, cuLaunchKernel, cuStreamSynchronize as C callbacks."""

    def __init__(self, current=None, set_error=0, launch_error=0, sync_error=0):
        self.current, self.set_error, self.launch_error, self.sync_error = current, set_error, launch_error, sync_error
        self.sets, self.launches, self.syncs = [], [], []
        self.table_bytes = 0  # how much of the parameter to read back
        vp, ui, ci = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        self._calls = (
            ctypes.CFUNCTYPE(ci, ctypes.POINTER(vp))(self._get),
            ctypes.CFUNCTYPE(ci, vp)(self._set),
            ctypes.CFUNCTYPE(ci, vp, ui, ui, ui, ui, ui, ui, ui, vp, ctypes.POINTER(vp), vp)(self._launch),
            ctypes.CFUNCTYPE(ci, vp)(self._sync),
        )
        self.addresses = tuple(ctypes.cast(c, vp).value for c in self._calls)

    def _get(self, out):
        out[0] = self.current
        return 0

    def _set(self, context):
        self.sets.append(context)
        if self.set_error:
            return self.set_error
        self.current = context
        return 0

    def _launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        table = ctypes.string_at(params[0], self.table_bytes)
        self.launches.append((fn, (gx, gy, gz), (bx, by, bz), shared, stream, table, self.current))
        return self.launch_error

    def _sync(self, stream):
        self.syncs.append(stream)
        return self.sync_error


def random_copies(rng, calls: int, max_pages: int, dtype=np.int32):
    copies = []
    for c in range(calls):
        rows = [((c + 1) << 32 | k << 20, (c + 9) << 32 | k << 20, 16 * int(rng.integers(1, 5000)))
                for k in range(int(rng.integers(1, 9)))]
        n = int(rng.integers(1, max_pages + 1))
        copies.append(paged_copy(rows, rng.permutation(4 * n)[:n].astype(dtype),
                                 rng.permutation(4 * n)[:n].astype(dtype)))
    return copies


def write(module, driver, copies, table=None):
    plan = paged_plan(copies, PAGED_CHUNK_BYTES)
    table = np.zeros(8192, np.uint64) if table is None else table
    driver.table_bytes = 8 * plan.words
    pages = tuple(a for c in copies for a in (c.src_pages, c.dst_pages))
    status, detail = module.write_pages(plan.head, pages, plan.array_limits, table.ctypes.data, table.nbytes,
                                        plan.words, KERNELS, plan.programs, THREADS, STREAM, OURS, driver.addresses)
    return status, detail, plan


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
@pytest.mark.parametrize("seed", range(4))
def test_the_native_table_is_the_python_table_and_the_smallest_kernel_holding_it_runs(module, dtype, seed):
    rng = np.random.default_rng(seed)
    copies = random_copies(rng, calls=int(rng.integers(1, 5)), max_pages=300, dtype=dtype)
    want = np.zeros(8192, np.uint64)
    used = fill_paged_table(lambda n: want, copies, PAGED_CHUNK_BYTES)[2]
    driver = StandInDriver(current=OURS)
    status, detail, plan = write(module, driver, copies)
    assert (status, detail) == (native.WRITTEN, used)
    [(fn, grid, block, shared, stream, table, context)] = driver.launches
    assert table == want.tobytes()[:used]
    assert fn == next(f for size, f in KERNELS if used <= size)
    assert (grid, block, shared, stream, context) == ((plan.programs, 1, 1), (THREADS, 1, 1), 0, STREAM, OURS)
    assert driver.syncs == [STREAM] and driver.sets == []  # the context was current: left alone


@pytest.mark.parametrize("side, page", [(0, "limit"), (1, "limit"), (0, -1), (1, -7)])
def test_a_page_outside_its_buffers_launches_nothing_and_names_its_array(module, side, page):
    rng = np.random.default_rng(3)
    copies = random_copies(rng, calls=3, max_pages=20)
    bad = copies[1]
    limits = (1 << 20, 1 << 21)
    bad = bad._replace(src_limit=limits[0], dst_limit=limits[1])
    pages = [bad.src_pages.copy(), bad.dst_pages.copy()]
    pages[side][len(pages[side]) // 2] = limits[side] if page == "limit" else page
    copies[1] = bad._replace(src_pages=pages[0], dst_pages=pages[1])
    driver = StandInDriver(current=OURS)
    status, detail, _ = write(module, driver, copies)
    assert (status, detail) == (native.PAGE_OUTSIDE, 2 + side) and driver.launches == []
    # one below the limit is inside
    pages[side][len(pages[side]) // 2] = limits[side] - 1
    copies[1] = bad._replace(src_pages=pages[0], dst_pages=pages[1])
    assert write(module, StandInDriver(current=OURS), copies)[0] == native.WRITTEN


@pytest.mark.parametrize("before, sets, after", [
    (None, [OURS], OURS),  # no context: ours stays
    (OTHER, [OURS, OTHER], OTHER),  # another context: given back after the synchronize
])
def test_the_write_runs_in_our_context_and_gives_back_only_a_context_the_thread_had(module, before, sets, after):
    copies = random_copies(np.random.default_rng(1), calls=2, max_pages=10)
    driver = StandInDriver(current=before)
    assert write(module, driver, copies)[0] == native.WRITTEN
    assert driver.launches[0][-1] == OURS and driver.sets == sets and driver.current == after


@pytest.mark.parametrize("failing, status", [("set_error", native.CONTEXT_FAILED),
                                             ("launch_error", native.LAUNCH_FAILED),
                                             ("sync_error", native.SYNC_FAILED)])
def test_driver_failures_come_back_as_their_status_with_the_error(module, failing, status):
    copies = random_copies(np.random.default_rng(2), calls=2, max_pages=10)
    driver = StandInDriver(current=OTHER, **{failing: 719})
    assert write(module, driver, copies)[:2] == (status, 719)
    assert len(driver.launches) == (0 if failing == "set_error" else 1)
    assert driver.syncs == ([STREAM] if failing == "sync_error" else [])
    if failing != "set_error":
        assert driver.current == OTHER  # given back after a failed launch or synchronize too


def test_arrays_it_cannot_read_and_tables_no_kernel_holds_launch_nothing(module):
    copies = random_copies(np.random.default_rng(4), calls=2, max_pages=10)
    floats = copies[:1] + [copies[1]._replace(src_pages=copies[1].src_pages.astype(np.float64))]
    driver = StandInDriver(current=OURS)
    assert write(module, driver, floats)[:2] == (native.NOT_PAGES, 2)
    swapped = copies[:1] + [copies[1]._replace(dst_pages=copies[1].dst_pages.astype(">i4"))]
    assert write(module, driver, swapped)[:2] == (native.NOT_PAGES, 3)  # left to NumPy, which converts it
    plan = paged_plan(copies, PAGED_CHUNK_BYTES)
    pages = tuple(a for c in copies for a in (c.src_pages, c.dst_pages))
    table = np.zeros(8192, np.uint64)
    short = module.write_pages(plan.head, pages, plan.array_limits, table.ctypes.data, table.nbytes,
                               plan.words + 1, KERNELS, plan.programs, THREADS, STREAM, OURS, driver.addresses)
    assert short == (native.NOT_PAGES, -1)  # the page arrays do not fill the table the plan says
    big = random_copies(np.random.default_rng(5), calls=1, max_pages=1)
    many = np.arange(2100, dtype=np.int64)
    big = [big[0]._replace(src_pages=many, dst_pages=many)]
    status, detail, plan = write(module, driver, big, table=np.zeros(16384, np.uint64))
    assert (status, detail) == (native.TABLE_TOO_LARGE, 8 * plan.words) and detail > KERNELS[-1][0]
    assert driver.launches == []
