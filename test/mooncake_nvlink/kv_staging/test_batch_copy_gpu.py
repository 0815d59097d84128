"""CudaBatchCopy on a real GPU (skips without CUDA).

Byte-exact against per-entry torch copies: random block lists (1..2,000
blocks, 1 B..5 MiB, aligned and unaligned; each block a buffer of one page in
one paged copy), random paged copies, buffers of every access width in one
launch, blocks touching allocation ends with guard bytes around them, four
threads at once, and a DeepSeek-V4.1 request gathered into one buffer and
scattered back out.

    PYTHONPATH=python python -m pytest test/mooncake_nvlink/kv_staging/test_batch_copy_gpu.py -q
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from host_peer import expand_paged  # noqa: E402
from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import BatchCopyError, CudaBatchCopy, paged_copy  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

MiB = 1 << 20
SRC_POOL = 256 * MiB
DST_POOL = 1024 * MiB


@pytest.fixture(scope="module")
def copier():
    return CudaBatchCopy(0)


@pytest.fixture(scope="module")
def pools():
    gen = torch.Generator(device="cuda").manual_seed(1234)
    src = torch.randint(0, 256, (SRC_POOL,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.empty(DST_POOL, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    return src, dst


def device_buffer(nbytes: int):
    """Zeroed device memory as (ptr, nbytes, (tensor,))."""
    from types import SimpleNamespace

    tensor = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    return SimpleNamespace(ptr=tensor.data_ptr(), nbytes=nbytes, keepalive=(tensor,))


def random_entries(rng, entries: int, align: int, src_size: int, dst_size: int, max_len: int = 5 * MiB):
    """Offsets and lengths with disjoint destinations; lengths log-uniform in 1 B..max_len."""
    lengths = np.exp(rng.uniform(0, np.log(max_len), size=entries)).astype(np.int64)
    lengths = np.clip(lengths // align * align, align, max_len)
    budget = dst_size // 2
    if lengths.sum() > budget:  # keep the batch inside the destination pool
        lengths = np.maximum(lengths * budget // lengths.sum() // align * align, align)
    gaps = rng.integers(0, 3, size=entries) * align
    dst_off = np.cumsum(gaps + lengths) - lengths
    assert dst_off[-1] + lengths[-1] <= dst_size
    perm = rng.permutation(entries)
    dst_off, lengths = dst_off[perm], lengths[perm]
    src_off = rng.integers(0, (src_size - lengths) // align + 1) * align
    if align == 1:  # unaligned: shift pointers off every boundary as well
        src_off = np.minimum(src_off + rng.integers(0, 16, size=entries), src_size - lengths)
    return src_off, dst_off, lengths


def reference(dst_before, src, src_off, dst_off, lengths):
    want = dst_before.clone()
    for a, b, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist()):
        want[b:b + n] = src[a:a + n]
    return want


def copy_blocks(copier, srcs, dsts, lengths):
    """A block list as one paged copy: each block a buffer of one page, page 0 to page 0."""
    rows = np.stack([np.asarray(a, dtype=np.uint64) for a in (srcs, dsts, lengths)], axis=1).astype(np.int64)
    copier.copy_pages([paged_copy(rows, np.array([0]), np.array([0]))])


def check_batch(copier, src, dst, src_off, dst_off, lengths):
    dst.random_(0, 256)
    torch.cuda.synchronize()
    want = reference(dst, src, src_off, dst_off, lengths)
    torch.cuda.synchronize()
    copy_blocks(copier, src.data_ptr() + src_off.astype(np.uint64),
                dst.data_ptr() + dst_off.astype(np.uint64), lengths.astype(np.uint64))
    # copy_pages() returned: the bytes are there without any further synchronization on our side.
    assert torch.equal(dst, want)


@pytest.mark.parametrize("align", [16, 8, 1])
@pytest.mark.parametrize("seed", range(3))
def test_random_batches_are_byte_exact(copier, pools, align, seed):
    src, dst = pools
    rng = np.random.default_rng(seed * 100 + align)
    entries = int(rng.choice([1, 2, 7, 300, 1068, 2000]) if seed else 2000)
    check_batch(copier, src, dst, *random_entries(rng, entries, align, src.numel(), dst.numel()))


def test_one_unaligned_entry_among_aligned_ones(copier, pools):
    src, dst = pools
    rng = np.random.default_rng(7)
    src_off, dst_off, lengths = random_entries(rng, 500, 16, src.numel(), dst.numel(), max_len=64 * 1024)
    lengths[250] -= 3  # this block now takes the byte-wise path, the others stay wide
    check_batch(copier, src, dst, src_off, dst_off, lengths)


def test_entries_touching_allocation_ends(copier):
    """Exactly at the first and last byte of allocations, with guard bytes around the targets."""
    for size in (4096, 65537, 5 * MiB + 3):
        src = device_buffer(size)
        dst = device_buffer(size + 2 * 4096)
        s_t, d_t = src.keepalive[0], dst.keepalive[0]
        s_t.copy_(torch.randint(1, 256, (size,), dtype=torch.uint8, device=s_t.device))
        d_t.fill_(0xA5)
        torch.cuda.synchronize()
        body = dst.ptr + 4096
        half = size // 2
        # Whole buffer end to end, then the two halves swapped, then single bytes at both ends.
        copy_blocks(copier, [src.ptr], [body], [size])
        assert torch.equal(d_t[4096:4096 + size], s_t)
        copy_blocks(copier, [src.ptr + half, src.ptr], [body, body + size - half], [size - half, half])
        assert torch.equal(d_t[4096:4096 + size - half], s_t[half:])
        assert torch.equal(d_t[4096 + size - half:4096 + size], s_t[:half])
        copy_blocks(copier, [src.ptr + size - 1, src.ptr], [body, body + size - 1], [1, 1])
        assert d_t[4096].item() == s_t[size - 1].item() and d_t[4096 + size - 1].item() == s_t[0].item()
        assert (d_t[:4096] == 0xA5).all().item() and (d_t[4096 + size:] == 0xA5).all().item(), \
            "bytes outside the entries were written"


def test_four_threads_at_once(copier, pools):
    src, dst = pools
    slice_size = dst.numel() // 4
    dst.zero_()
    torch.cuda.synchronize()
    errors, done = [], []

    def worker(k):
        try:
            rng = np.random.default_rng(1000 + k)
            base = k * slice_size
            for round_ in range(6):
                align = (16, 8, 1)[round_ % 3]
                so, do, n = random_entries(rng, int(rng.integers(1, 1200)), align, src.numel(), slice_size,
                                           max_len=2 * MiB)
                copy_blocks(copier, src.data_ptr() + so.astype(np.uint64),
                            dst.data_ptr() + base + do.astype(np.uint64), n.astype(np.uint64))
                # Only this thread writes its slice: what it reads back must be exactly its batch.
                for a, b, m in zip(so.tolist(), do.tolist(), n.tolist()):
                    got = dst[base + b:base + b + m]
                    if not torch.equal(got, src[a:a + m]):
                        raise AssertionError(f"thread {k} round {round_}: entry at {b} differs")
            done.append(k)
        except Exception as exc:  # reported by the main thread
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert len(done) == 4


def dsv41_request(tokens: int, layout: str):
    """A DeepSeek-V4.1 request's blocks, as the PD benchmarks send them."""
    import dsv41_kv_pattern as geometry

    spans = [span for batch in geometry.dsv41_batches(tokens, layout) for span in batch]
    return spans, geometry.dsv41_buffer_sizes()


def test_dsv41_gather_then_scatter(copier):
    spans, sizes = dsv41_request(32768, "fragmented")
    assert len(spans) == 2 * 8 * 64 + 43 + 3  # two 16k chunks x 8 KV buffers x 64 lone pages, state
    total = sum(span[3] for span in spans)
    assert 34e6 < total < 36e6
    gen = torch.Generator(device="cuda").manual_seed(41)
    prefill = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen) for n in sizes]
    decode = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    staging = device_buffer(total)
    torch.cuda.synchronize()
    buf, src_off, dst_off, lengths = zip(*spans)
    staged_at = np.cumsum([0, *lengths[:-1]]).astype(np.uint64)
    src = np.array([prefill[b].data_ptr() for b in buf], dtype=np.uint64) + np.array(src_off, np.uint64)
    dst = np.array([decode[b].data_ptr() for b in buf], dtype=np.uint64) + np.array(dst_off, np.uint64)
    n = np.array(lengths, dtype=np.uint64)

    copy_blocks(copier, src, staging.ptr + staged_at, n)  # gather on the prefill side
    want = torch.cat([prefill[b][o:o + k] for b, o, _, k in spans])
    assert torch.equal(staging.keepalive[0], want)
    copy_blocks(copier, staging.ptr + staged_at, dst, n)  # scatter on the decode side
    for b, s_o, d_o, k in spans:
        assert torch.equal(decode[b][d_o:d_o + k], prefill[b][s_o:s_o + k])
    touched = sum(k for b, _, _, k in spans)
    assert sum(int(t.count_nonzero()) for t in decode) <= touched  # nothing outside the spans


def test_bad_copies_raise_not_crash(copier, pools):
    src, dst = pools
    with pytest.raises(BatchCopyError):
        copier.copy_pages([paged_copy([(src.data_ptr(), dst.data_ptr(), 4)], [0, 1], [0])])
    with pytest.raises(BatchCopyError):
        copier.copy_pages([paged_copy([(src.data_ptr(), dst.data_ptr(), 4)], [-1], [0])])
    with pytest.raises(BatchCopyError):
        copier.copy_pages([paged_copy([(2 ** 62, dst.data_ptr(), 16)], [0], [0])])
    copier.copy_pages([])  # nothing to do is fine
    copier.copy_pages([paged_copy([(src.data_ptr(), dst.data_ptr(), 4)], np.array([], np.int64), np.array([], np.int64))])


def test_copier_choice():
    chosen = CudaBatchCopy(None)
    assert chosen.backend == "triton" and chosen.device == torch.cuda.current_device()
    with pytest.raises(BatchCopyError, match="does not exist"):
        CudaBatchCopy(torch.cuda.device_count())


def test_a_launcher_that_takes_other_arguments_stops_the_build(monkeypatch):
    """The copier calls Triton's compiled launcher directly; a Triton whose launcher changed
    its arguments fails the build's probe, with the launcher's own error, never a request."""
    from triton.compiler.compiler import CompiledKernel

    def refuse(*args):
        raise TypeError("launcher takes other arguments")

    monkeypatch.setattr(CompiledKernel, "run", property(lambda self: refuse))
    with pytest.raises(BatchCopyError, match="probe failed: .*launcher takes other arguments"):
        CudaBatchCopy(0)


# --- the paged kernel


def _random_paged_offsets(rng, align: int, calls: int, max_pages: int, pool: int):
    """(entries as offsets, src pages, dst pages) per call over disjoint destination buffers."""
    out, src_at, dst_at = [], 0, 0
    for _ in range(calls):
        pages = int(rng.integers(1, max_pages + 1))
        span = pages + int(rng.integers(0, 8))
        rows = []
        for _ in range(int(rng.integers(1, 21))):
            item = max(align, int(np.exp(rng.uniform(np.log(16), np.log(100_000)))) // align * align)
            rows.append((src_at % (SRC_POOL - span * item), dst_at, item))
            src_at += span * item + align
            dst_at += span * item + 3 * align
        assert dst_at <= pool, "destination pool too small for the random copies"
        out.append((rows, rng.permutation(span)[:pages], rng.permutation(span)[:pages]))
    return out


def random_copies(src, dst, seed: int, calls: int, max_pages: int, align: int = 16):
    specs = _random_paged_offsets(np.random.default_rng(seed), align, calls, max_pages, pool=dst.numel())
    return [paged_copy([(src.data_ptr() + s, dst.data_ptr() + d, n) for s, d, n in rows], sp, dp)
            for rows, sp, dp in specs]


def expected_after(src, dst, copies):
    """``dst`` filled with noise, and what it must hold once ``copies`` landed (torch, block by block)."""
    dst.random_(0, 256)
    s, d, n = expand_paged(copies)
    want = reference(dst, src, (s - np.uint64(src.data_ptr())).astype(np.int64),
                     (d - np.uint64(dst.data_ptr())).astype(np.int64), n.astype(np.int64))
    torch.cuda.synchronize()
    return want


def check_paged(copier, src, dst, copies):
    """The paged copy against the block list it stands for, copied one block at a time by torch."""
    want = expected_after(src, dst, copies)
    copier.copy_pages(copies)
    assert torch.equal(dst, want)


@pytest.mark.parametrize("align", [16, 8, 1])
def test_random_paged_copies_are_byte_exact(copier, pools, align):
    src, dst = pools
    check_paged(copier, src, dst, random_copies(src, dst, align, calls=4, max_pages=64, align=align))


def test_a_long_page_list_is_copied_whole_in_one_launch(copier, pools):
    src, dst = pools
    pages = 70_000  # one program each: more than a grid's y dimension takes (the paged grid is 1-D)
    rng = np.random.default_rng(3)
    sp, dp = rng.permutation(pages), rng.permutation(pages)
    dst.zero_()
    torch.cuda.synchronize()
    copier.copy_pages([paged_copy([(src.data_ptr(), dst.data_ptr(), 1024)], sp, dp)])
    got = dst[:pages * 1024].view(pages, 1024)
    want = src[:pages * 1024].view(pages, 1024)[torch.from_numpy(sp).cuda()]
    assert torch.equal(got[torch.from_numpy(dp).cuda()], want)


def test_one_launch_takes_buffers_of_every_width(copier, pools):
    """KV pages (16-byte), DSpark's request rows (8-byte) and odd rows in one launch, as a held write sends them."""
    src, dst = pools
    third = dst.numel() // 3
    copies = []
    for k, align in enumerate((16, 8, 1)):
        skew = 0 if align == 16 else align  # the first buffer really is only that wide
        part = dst[k * third + skew:(k + 1) * third]
        copies += random_copies(src, part, 20 + k, calls=2, max_pages=30, align=align)
    for _ in range(3):  # lanes reused
        check_paged(copier, src, dst, copies)


def test_a_thread_that_made_no_cuda_call_copies(copier, pools):
    src, dst = pools
    copies = random_copies(src, dst, 12, calls=2, max_pages=20)
    want = expected_after(src, dst, copies)
    errors = []

    def fresh_thread():  # its first CUDA call is the copy's launch
        try:
            copier.copy_pages(copies)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join(120)
    assert not worker.is_alive() and not errors, errors
    assert torch.equal(dst, want)


def _current_context(driver) -> int:
    current = ctypes.c_void_p()
    assert driver.cuCtxGetCurrent(ctypes.byref(current)) == 0
    return current.value or 0


def test_a_thread_gets_its_own_context_back_and_a_fresh_thread_keeps_the_device_s(copier, pools):
    """The copy makes the device's primary context current; a thread that had another one gets it
    back (never one it did not have: that would be a new context on some other GPU)."""
    driver = ctypes.CDLL("libcuda.so.1")
    create = getattr(driver, "cuCtxCreate_v2", None)
    if create is None:
        pytest.skip("this driver exports no cuCtxCreate_v2")
    driver.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    driver.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    driver.cuCtxDestroy_v2.argtypes = [ctypes.c_void_p]
    src, dst = pools
    copies = random_copies(src, dst, 13, calls=2, max_pages=20)
    seen, errors = {}, []

    def thread(own_context: bool):
        try:
            mine = ctypes.c_void_p()
            if own_context:  # a context of the thread's own, current (not the device's primary one)
                assert create(ctypes.byref(mine), 0, 0) == 0 and _current_context(driver) == mine.value
            copier.copy_pages(copies)
            seen[own_context] = _current_context(driver), mine.value
            if own_context:
                driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
                driver.cuCtxDestroy_v2(mine)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    for own_context in (True, False):
        want = expected_after(src, dst, copies)
        worker = threading.Thread(target=thread, args=(own_context,))
        worker.start()
        worker.join(120)
        assert not worker.is_alive() and not errors, errors
        assert torch.equal(dst, want)
    current, mine = seen[True]
    assert mine and current == mine
    assert seen[False][0] == copier._context.context
