"""Peer writes over CUDA IPC between two real processes (skips without CUDA).

A spawned "decode" process allocates KV-like buffers with torch (regions
inside one allocation, at offsets from its start), exports them
with ``CudaIpcTransport``, and checks what lands. This process opens the map
and writes a fragmented DeepSeek-V4.1-sized batch with one batched copy.
With two GPUs visible the decode process uses the second one (cross-GPU);
with one, both share GPU 0.

    PYTHONPATH=python python -m pytest test/mooncake_nvlink/kv_staging/test_peer_copy_gpu.py -q
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import PagesOutsideBuffers, CudaBatchCopy  # noqa: E402
from sglang_dsv41.mooncake_nvlink.kv_staging.peer import (  # noqa: E402
    FALLBACK_OUTSIDE_PEER_MAP,
    CudaIpcTransport,
    PagedLayout,
    PeerMap,
    PeerMapError,
    PeerRegion,
    PeerWrites,
    bind_layout,
    encode_peer_map,
    find_peer_map,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

MiB = 1 << 20
PAGE = 64 << 10
BUFFERS = 4
BUFFER_BYTES = 64 * MiB


def _decode_side(device: int, conn) -> None:
    """Own buffers, export them, then answer 'checksum' requests until told to stop."""
    torch.cuda.set_device(device)
    # Regions inside one allocation, none at its start: the handle names the
    # allocation and each region travels as an offset into it.
    lead = 3 * MiB + 4096
    pool = torch.zeros(lead + BUFFERS * BUFFER_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
    buffers = [pool[lead + i * BUFFER_BYTES:lead + (i + 1) * BUFFER_BYTES] for i in range(BUFFERS)]
    torch.cuda.synchronize()
    copier = CudaBatchCopy(device)
    transport = CudaIpcTransport(copier, device)
    peer = transport.export([(b.data_ptr(), b.numel()) for b in buffers])
    conn.send(encode_peer_map(peer))
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        kind, payload = msg
        if kind == "read":  # (buffer index, offset, length) -> bytes
            i, off, n = payload
            conn.send(buffers[i][off:off + n].cpu().numpy().tobytes())
        elif kind == "zero":
            pool.zero_()
            torch.cuda.synchronize()
            conn.send("ok")


@pytest.fixture(scope="module")
def decode():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    device = 1 if torch.cuda.device_count() > 1 else 0
    proc = ctx.Process(target=_decode_side, args=(device, child), daemon=True)
    proc.start()
    assert parent.poll(120), "decode process did not export its buffers"
    frames = parent.recv()
    yield parent, frames, device
    parent.send("stop")
    proc.join(30)


@pytest.fixture(scope="module")
def transport():
    return CudaIpcTransport(CudaBatchCopy(0), 0)


def _bound(target, entries, src):
    """``entries`` bound to ``target``, every source inside the tensor ``src``."""
    src_end = src.data_ptr() + src.numel()
    bound, why_not = bind_layout(PagedLayout.of(entries), target, lambda addr: src_end - addr)
    assert why_not is None
    return bound


def _write(*calls) -> int:
    """(bound layout, source pages, destination pages) calls as one write; the bytes written."""
    writes = PeerWrites()
    for bound, src_pages, dst_pages in calls:
        assert writes.add_pages(bound, np.asarray(src_pages), np.asarray(dst_pages)) is None
    return writes.flush()


def test_fragmented_batch_lands_byte_exact(decode, transport):
    conn, frames, _ = decode
    peer = find_peer_map([b"registration", *frames])
    assert len(peer.handles) == 1 and len(peer.regions) == BUFFERS
    assert [r.offset for r in peer.regions] == [3 * MiB + 4096 + i * BUFFER_BYTES for i in range(BUFFERS)]
    target = transport.open(peer)
    rng = np.random.default_rng(7)
    pages = BUFFER_BYTES // PAGE
    src = torch.randint(0, 256, (BUFFERS * BUFFER_BYTES,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    calls, expect = [], []
    for b, region in enumerate(peer.regions):  # each buffer its own call: its own page order
        dst_pages = rng.permutation(pages)[: pages // 2]
        calls.append((_bound(target, [(src.data_ptr() + b * pages * PAGE, region.ptr, PAGE)], src),
                      np.arange(pages // 2), dst_pages))
        expect += [(b, int(page) * PAGE, (b * pages + j) * PAGE) for j, page in enumerate(dst_pages)]
    assert _write(*calls) == len(expect) * PAGE
    host = src.cpu().numpy()
    for b, off, src_off in expect[:: max(1, len(expect) // 64)]:
        conn.send(("read", (b, off, PAGE)))
        assert conn.recv() == host[src_off:src_off + PAGE].tobytes()
    # untouched pages stay zero
    written = {(b, off) for b, off, _ in expect}
    untouched = next((b, p * PAGE) for b in range(BUFFERS) for p in range(pages) if (b, p * PAGE) not in written)
    conn.send(("read", (untouched[0], untouched[1], PAGE)))
    assert conn.recv() == bytes(PAGE)
    target.retire()


@pytest.mark.parametrize("pages_sent", [24, 600], ids=["short", "long"])
def test_a_paged_call_lands_byte_exact(decode, transport, pages_sent):
    """One send call from page lists (every buffer, runs and single pages) as one peer write."""
    conn, frames, _ = decode
    conn.send(("zero", None))
    assert conn.recv() == "ok"
    target = transport.open(find_peer_map(frames))
    item = [PAGE, PAGE // 2, PAGE // 4, PAGE]  # bytes per page differ between buffers
    pages = BUFFER_BYTES // PAGE
    src = torch.randint(0, 256, (BUFFERS * BUFFER_BYTES,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    rng = np.random.default_rng(11)
    src_pages = rng.permutation(pages)[:pages_sent].astype(np.int32)
    src_pages[: pages_sent // 3] = np.arange(5, 5 + pages_sent // 3)  # a run on both sides
    dst_pages = np.concatenate((np.arange(100, 100 + pages_sent // 3),
                                rng.permutation(np.arange(pages // 2, pages))[: pages_sent - pages_sent // 3]))
    entries = [(src.data_ptr() + b * BUFFER_BYTES, target.peer.regions[b].ptr, item[b]) for b in range(BUFFERS)]
    assert _write((_bound(target, entries, src), src_pages, dst_pages.astype(np.int32))) == pages_sent * sum(item)
    host = src.cpu().numpy()
    for b in range(BUFFERS):
        for k in list(range(0, pages_sent, max(1, pages_sent // 16))) + [pages_sent - 1]:
            s_off = b * BUFFER_BYTES + int(src_pages[k]) * item[b]
            conn.send(("read", (b, int(dst_pages[k]) * item[b], item[b])))
            assert conn.recv() == host[s_off:s_off + item[b]].tobytes(), f"buffer {b}, page {k}"
        conn.send(("read", (b, 99 * item[b], item[b])))  # the page before the run: untouched
        assert conn.recv() == bytes(item[b])
    target.retire()


def test_a_destination_outside_the_map_is_refused_and_nothing_is_written(decode, transport):
    conn, frames, _ = decode
    conn.send(("zero", None))
    assert conn.recv() == "ok"
    peer = find_peer_map(frames)
    target = transport.open(peer)
    try:
        region = peer.regions[0]
        past_all = max(r.ptr + r.length for r in peer.regions)
        src = torch.ones(2 * PAGE, dtype=torch.uint8, device="cuda:0")
        src_end = src.data_ptr() + src.numel()
        outside = PagedLayout.of([(src.data_ptr(), past_all, PAGE)])
        assert bind_layout(outside, target, lambda addr: src_end - addr)[1] == FALLBACK_OUTSIDE_PEER_MAP
        inside = _bound(target, [(src.data_ptr(), region.ptr, PAGE)], src)
        with pytest.raises(PagesOutsideBuffers, match="destination page"):  # a page past the region
            _write((inside, [0, 1], [0, region.length // PAGE]))
        conn.send(("read", (0, 0, PAGE)))
        assert conn.recv() == bytes(PAGE)  # the good page of the refused write was not written either
    finally:
        target.retire()


def test_retire_closes_the_mappings_after_the_last_user(decode, transport):
    _, frames, _ = decode
    peer = find_peer_map(frames)
    before = transport.open_mappings
    first, second = transport.open(peer), transport.open(peer)
    assert transport.open_mappings == before + len(peer.handles)  # shared, not opened twice
    assert first.acquire()
    first.retire()
    second.retire()
    assert transport.open_mappings == before + len(peer.handles)  # a batch still holds it
    first.release()
    assert transport.open_mappings == before
    assert not first.acquire()


def test_own_export_cannot_be_opened_in_the_same_process(transport):
    buf = torch.zeros(MiB, dtype=torch.uint8, device="cuda:0")
    peer = transport.export([(buf.data_ptr(), MiB)])
    with pytest.raises(PeerMapError):
        transport.open(peer)


def test_repeated_writes_stay_exact_and_their_times_are_printed(decode, transport):
    """Many writes through one mapping stay byte-exact; prints their times (no speed check)."""
    conn, frames, _ = decode
    target = transport.open(find_peer_map(frames))
    region = target.peer.regions[0]
    n_blocks, size = 1068, 32 << 10
    src = torch.randint(0, 256, (n_blocks * size,), dtype=torch.uint8, device="cuda:0")
    order = np.random.default_rng(3).permutation(region.length // size)[:n_blocks]
    fragmented = (_bound(target, [(src.data_ptr(), region.ptr, size)], src), np.arange(n_blocks), order)
    whole = (_bound(target, [(src.data_ptr(), region.ptr, n_blocks * size)], src), [0], [0])
    small = (_bound(target, [(src.data_ptr(), region.ptr, 64 << 10)], src), [0], [0])
    timings = {}
    for name, call in (("fragmented", fragmented), ("contiguous", whole), ("one 64 KiB block", small)):
        for _ in range(3):
            _write(call)
        t = []
        for _ in range(20):
            t0 = time.perf_counter()
            _write(call)
            t.append(time.perf_counter() - t0)
        timings[name] = float(np.median(t))
    print(f"\npeer write, {n_blocks} x {size >> 10} KiB: fragmented {timings['fragmented'] * 1e6:.0f} us, "
          f"one contiguous {timings['contiguous'] * 1e6:.0f} us, one 64 KiB block (the fixed cost of a "
          f"call) {timings['one 64 KiB block'] * 1e6:.0f} us (pid {os.getpid()})")
    _write(fragmented)  # the fragmented layout last: it is what must be there
    host = src.cpu().numpy()
    for i in range(0, n_blocks, 97):
        conn.send(("read", (0, int(order[i]) * size, size)))
        assert conn.recv() == host[i * size:(i + 1) * size].tobytes(), f"block {i}"
    target.retire()


def test_held_sends_land_as_one_write_byte_exact(decode, transport):
    """A last chunk's KV call and its state call held, then one write."""
    conn, frames, _ = decode
    conn.send(("zero", None))
    assert conn.recv() == "ok"
    target = transport.open(find_peer_map(frames))
    src = torch.randint(0, 256, (BUFFERS * BUFFER_BYTES,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    src_end = src.data_ptr() + src.numel()
    kv = [(src.data_ptr() + b * BUFFER_BYTES, target.peer.regions[b].ptr, PAGE) for b in range(BUFFERS)]
    state = [(src.data_ptr() + b * BUFFER_BYTES + BUFFER_BYTES // 2,
              target.peer.regions[b].ptr + BUFFER_BYTES // 2, PAGE // 2) for b in range(BUFFERS)]
    kv_bound, _ = bind_layout(PagedLayout.of(kv), target, lambda addr: src_end - addr)
    state_bound, _ = bind_layout(PagedLayout.of(state), target, lambda addr: src_end - addr)
    held = PeerWrites()
    kv_src, kv_dst = np.arange(10, 74, 2, dtype=np.int32), np.arange(200, 232, dtype=np.int32)
    assert held.add_pages(kv_bound, kv_src, kv_dst) is None
    assert held.add_pages(state_bound, np.array([3], np.int32), np.array([7], np.int32)) is None
    kv_src[:] = 0  # the caller reuses its arrays: what was held is a copy
    conn.send(("read", (0, 200 * PAGE, PAGE)))
    assert conn.recv() == bytes(PAGE)  # nothing written before the flush
    assert held.flush() == 32 * BUFFERS * PAGE + BUFFERS * PAGE // 2
    host = src.cpu().numpy()
    for b in range(BUFFERS):
        for k in (0, 17, 31):
            s_off = b * BUFFER_BYTES + (10 + 2 * k) * PAGE
            conn.send(("read", (b, (200 + k) * PAGE, PAGE)))
            assert conn.recv() == host[s_off:s_off + PAGE].tobytes(), f"KV buffer {b}, page {k}"
        s_off = b * BUFFER_BYTES + BUFFER_BYTES // 2 + 3 * PAGE // 2
        conn.send(("read", (b, BUFFER_BYTES // 2 + 7 * PAGE // 2, PAGE // 2)))
        assert conn.recv() == host[s_off:s_off + PAGE // 2].tobytes(), f"state buffer {b}"
    target.retire()


def test_a_region_the_decode_declares_past_its_allocation_is_refused_on_the_gpu(decode, transport):
    """The decode's word against the driver's: its pool is lead + 4 x 64 MiB; a region
    claimed at the last buffer's offset but twice as long would reach past it."""
    _, frames, _ = decode
    peer = find_peer_map([b"registration", *frames])
    before = transport.open_mappings
    honest = transport.open(peer)
    honest.retire()
    last = peer.regions[-1]
    lying = PeerMap(peer.kind, peer.host, peer.regions[:-1] + (PeerRegion(last.ptr, 2 * last.length,
                                                                          last.offset, last.handle),))
    with pytest.raises(PeerMapError, match="reaches past its mapped allocation"):
        transport.open(lying)
    assert transport.open_mappings == before  # nothing of the refused map stays open
