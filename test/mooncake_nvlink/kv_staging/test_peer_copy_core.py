"""Peer writes without a GPU: wire format, translation, lifetime, held writes, host transport.

The host transport (test/helpers/host_peer.py) writes another real process's
memory (process_vm_writev), so the write path, partial writes and refusal are
exercised for real; the CUDA IPC transport runs in test_peer_copy_gpu.py.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os

import numpy as np
import pytest

from _paged import runs_of, runs_of_paged
from host_peer import HostCmaTransport
from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import PagesOutsideBuffers
from sglang_dsv41.mooncake_nvlink.kv_staging.peer import (
    FALLBACK_NO_PEER_MAP,
    FALLBACK_OUTSIDE_PEER_MAP,
    HANDLE_BYTES,
    PEER_MAP_TAG,
    PagedLayout,
    PeerMap,
    PeerMapError,
    PeerRegion,
    PeerTarget,
    PeerWrites,
    encode_peer_map,
    find_peer_map,
    bind_layout,
    host_identity,
)

pytestmark = pytest.mark.timeout(60)


def _map(*regions, kind="host-cma", host=None):
    handle = b"h" * HANDLE_BYTES
    return PeerMap(kind, host or host_identity(),
                   tuple(PeerRegion(p, n, o, handle) for p, n, o in regions))


class _Recorder:
    """A transport that records writes and closes (lifetime and translation tests)."""

    kind = "host-cma"

    def __init__(self):
        self.writes, self.closed = [], []

    def write_pages(self, target, copies):  # recorded as the runs upstream's block list would hold
        self.writes.append(tuple(map(list, zip(*runs_of_paged(copies)))))

    def close(self, opened):
        self.closed.append(list(opened))


# --- wire format


def test_peer_map_round_trips_behind_other_frames():
    peer = _map((0x1000, 0x800, 0), (0x9000, 0x100, 0x40))
    frames = [b"registration", b"x", *encode_peer_map(peer)]
    assert find_peer_map(frames) == peer
    assert find_peer_map([b"registration", b"x"]) is None


@pytest.mark.parametrize("tail, needle", [
    ([b"host-cma", b"boot"], "frames"),
    ([b"gpu-magic", b"boot", b"\0" * 88], "unknown kind"),
    ([b"host-cma", b"", b"\0" * 88], "host identity"),
    ([b"host-cma", b"boot", b"\0" * 87], r"not n\*88"),
    ([b"host-cma", b"boot", b""], r"not n\*88"),
    ([b"host-cma", b"boot", b"\0" * 88], "empty or wraps"),
    ([b"host-cma", b"\xff", b"\0" * 88], "ASCII"),
])
def test_malformed_peer_maps_are_refused(tail, needle):
    with pytest.raises(PeerMapError, match=needle):
        find_peer_map([b"reg", PEER_MAP_TAG, *tail])


def test_a_region_that_wraps_the_address_space_is_refused():
    table = encode_peer_map(_map((2**64 - 0x100, 0x200, 0)))
    with pytest.raises(PeerMapError, match="wraps"):
        find_peer_map(table)


# --- translation


def test_translation_maps_each_address_into_its_own_region():
    peer = _map((0x10000, 0x1000, 0), (0x20000, 0x1000, 0), (0x30000, 0x800, 0))
    target = PeerTarget(peer, [0xA0000, 0xB0000, 0xC0000], _Recorder(), [])
    assert [target.locate(d) for d in (0x20010, 0x10000, 0x307F0, 0x10FFF)] == [
        (0xB0010, 0xFF0), (0xA0000, 0x1000), (0xC07F0, 0x10), (0xA0FFF, 1)]


@pytest.mark.parametrize("dst, length", [
    (0x0FFFF, 2),  # starts before the first region
    (0x10FFF, 2),  # runs past its region's end into the gap
    (0x11000, 1),  # in the gap between regions
    (0x30800, 1),  # just past the last region
    (0x1FFFF, 2),  # straddles a gap into the next region
    (2**64 - 1, 2),  # wraps
])
def test_a_span_outside_every_region_is_reported(dst, length):
    peer = _map((0x10000, 0x1000, 0), (0x20000, 0x1000, 0), (0x30000, 0x800, 0))
    target = PeerTarget(peer, [0xA0000, 0xB0000, 0xC0000], _Recorder(), [])
    found = target.locate(dst)
    assert found is None or found[1] < length


def test_retire_waits_for_the_batch_in_flight_and_then_refuses_new_ones():
    rec = _Recorder()
    target = PeerTarget(_map((0x10000, 0x1000, 0)), [0xA0000], rec, [b"handle"])
    assert target.acquire()
    target.retire()
    assert rec.closed == []  # a batch is still writing through the mapping
    target.release()
    assert rec.closed == [[b"handle"]]
    assert not target.acquire()
    target.retire()
    assert rec.closed == [[b"handle"]]  # closed once


# --- one call from page lists


def _reference_blocks(layout_entries, src_pages, dst_pages):
    """The block list one page run and buffer at a time, as the engine would get it."""
    return runs_of(layout_entries, src_pages, dst_pages)


def _device(*regions):
    """device_bytes_from over these (start, length) regions."""
    def bytes_from(addr):
        return next((p + n - addr for p, n in regions if p <= addr < p + n), 0)
    return bytes_from


def _write_now(bound, src_pages, dst_pages):
    """One send written at once, as the hook does off a last chunk: None, or why not."""
    writes = PeerWrites()
    why_not = writes.add_pages(bound, src_pages, dst_pages)
    if why_not is None:
        writes.flush()
    return why_not


@pytest.mark.parametrize("repeat", [1, 40], ids=["short", "long"])
def test_a_paged_call_writes_exactly_the_block_list_it_replaces(repeat):
    rec = _Recorder()
    # two peer regions, mapped elsewhere here; three entries of different page sizes
    peer = _map((0x1000000, 0x100000, 0), (0x2000000, 0x200000, 0))
    target = PeerTarget(peer, [0x7000000, 0x9000000], rec, [])
    entries = [(0x50000, 0x1000000, 0x100), (0x60000, 0x2000000, 0x200), (0x70000, 0x2100000, 0x80)]
    bound, why_not = bind_layout(PagedLayout.of(entries), target, _device((0x50000, 0x100000)))
    assert why_not is None
    # runs, a broken run, then (long) the same shape again above page 30
    src = [3, 4, 5, 9, 10] + [31 + 3 * i for i in range(6 * (repeat - 1))] + [30]
    dst = [8, 9, 10, 2, 40] + [45 + i for i in range(6 * (repeat - 1))] + [41]
    writes = PeerWrites()
    assert writes.add_pages(bound, np.array(src), np.array(dst)) is None
    expected = _reference_blocks(entries, src, dst)
    assert writes.flush() == sum(n for *_, n in expected)
    (srcs, dsts, lengths), = rec.writes
    local = {0x1000000: 0x7000000, 0x2000000: 0x9000000}
    translated = [(s, d - base + local[base], n) for s, d, n in expected
                  for base in [0x2000000 if d >= 0x2000000 else 0x1000000]]
    assert list(zip(srcs, dsts, lengths)) == translated


def test_binding_checks_every_buffer_once_and_each_call_against_the_smallest():
    rec = _Recorder()
    target = PeerTarget(_map((0x100000, 0x10000, 0)), [0x7000000], rec, [b"handle"])
    # entry 0: 0x100 pages of 0x100 on both sides; entry 1: 0x40 destination pages (0xC000 left of the region)
    layout = PagedLayout.of([(0x50000, 0x100000, 0x100), (0x60000, 0x104000, 0x100)])
    device = _device((0x50000, 0x10000), (0x60000, 0x10000))
    bound, _ = bind_layout(layout, target, device)
    assert (bound.src_pages, bound.dst_pages) == (0x100, 0xC0)
    pages = np.array([1, 3, 5])
    # the second entry's page 0xc0 ends past the region's end (the first entry's does not)
    with pytest.raises(PagesOutsideBuffers, match="destination page 192"):
        _write_now(bound, pages, np.array([1, 3, 0xC0]))
    assert _write_now(bound, pages, np.array([1, 3, 0xBF])) is None
    with pytest.raises(PagesOutsideBuffers, match="source page 256"):
        _write_now(bound, np.array([1, 3, 0x100]), pages)
    assert _write_now(bound, pages, pages[:2]) == "not_pages"
    assert len(rec.writes) == 1
    target.retire()
    assert _write_now(bound, pages, pages) == FALLBACK_NO_PEER_MAP
    assert len(rec.writes) == 1
    # layouts the page path cannot serve at all
    assert bind_layout(layout, target, _device((0x50000, 0x10000)))[1] == "source_not_device"
    assert bind_layout(layout, target, _device((0x50000, 0x100)))[1] == "source_not_device"  # not one page
    outside = PagedLayout.of([(0x50000, 0x110000, 0x100)])
    assert bind_layout(outside, target, device)[1] == FALLBACK_OUTSIDE_PEER_MAP
    last_bytes = PagedLayout.of([(0x50000, 0x10FF80, 0x100)])  # page 0 runs past the region
    assert bind_layout(last_bytes, target, device)[1] == FALLBACK_OUTSIDE_PEER_MAP
    assert bind_layout(PagedLayout.of([(0x50000, 0x100000, 0)]), target, device)[1] == "not_pages"
    assert bind_layout(PagedLayout.of([(1 << 63, 0x100000, 0x100)]), target, lambda a: 1 << 20)[1] == "not_pages"


def _kv_and_state():
    """A recording target and two layouts bound to it: KV (two buffers of 0x100-byte pages,
    0xC0 destination pages in the second) and a one-buffer state of 0x40-byte pages."""
    rec = _Recorder()
    target = PeerTarget(_map((0x100000, 0x10000, 0)), [0x7000000], rec, [b"handle"])
    device = _device((0x50000, 0x10000), (0x60000, 0x10000))
    kv, _ = bind_layout(PagedLayout.of([(0x50000, 0x100000, 0x100), (0x60000, 0x104000, 0x100)]), target, device)
    state, _ = bind_layout(PagedLayout.of([(0x58000, 0x10C000, 0x40)]), target, device)
    return rec, target, device, kv, state


def test_held_writes_go_as_one_batch_and_keep_their_map_open_until_then():
    rec, target, device, kv, state = _kv_and_state()
    held = PeerWrites()
    src, dst = np.array([1, 2, 3], np.int32), np.array([7, 8, 20], np.int32)
    assert held.add_pages(kv, src, dst) is None
    assert held.add_pages(state, np.array([5]), np.array([9])) is None
    src[:] = 0  # the caller's arrays change after the call: what is held does not
    # refused without holding anything: not two page lists of one length
    assert held.add_pages(kv, src, dst[:2]) == "not_pages"
    assert held.add_pages(kv, src.astype(np.float32), dst) == "not_pages"
    assert len(held) == 2 and held.calls == 2 and held.nbytes == 3 * 0x200 + 0x40
    target.retire()  # a newer map arrived: the mapping stays open for what is held
    assert rec.closed == [] and rec.writes == []
    assert held.flush() == 3 * 0x200 + 0x40
    (srcs, dsts, lengths), = rec.writes  # one batch: both calls
    assert list(zip(srcs, dsts, lengths)) == [
        (0x50100, 0x7000700, 0x200), (0x50300, 0x7001400, 0x100),  # entry 0: pages 1-2 -> 7-8, 3 -> 20
        (0x60100, 0x7004700, 0x200), (0x60300, 0x7005400, 0x100),  # entry 1
        (0x58000 + 5 * 0x40, 0x700C000 + 9 * 0x40, 0x40)]  # the state call
    assert rec.closed == [[b"handle"]] and len(held) == 0
    assert held.add_pages(kv, src, dst) == FALLBACK_NO_PEER_MAP  # retired: nothing more held
    # discard: nothing written, the map released
    target2 = PeerTarget(_map((0x100000, 0x10000, 0)), [0x7000000], rec, [b"second"])
    kv2, _ = bind_layout(PagedLayout.of([(0x50000, 0x100000, 0x100)]), target2, device)
    assert held.add_pages(kv2, src, dst) is None
    held.discard()
    target2.retire()
    assert len(rec.writes) == 1 and rec.closed[-1] == [b"second"]


@pytest.mark.parametrize("src_pages, dst_pages, side, page", [
    ([1, 2, 3], [1, 2, 0xC0], "destination", 0xC0),  # past the second buffer's exported pages
    ([1, 0x100, 3], [1, 2, 3], "source", 0x100),  # past the source buffers
    ([-1, 2, 3], [1, 2, 3], "source", -1),
])
def test_a_held_page_outside_its_buffers_fails_the_whole_flush_unwritten(src_pages, dst_pages, side, page):
    rec, target, device, kv, state = _kv_and_state()
    held = PeerWrites()
    assert held.add_pages(state, np.array([5]), np.array([9])) is None  # a good call held first
    assert held.add_pages(kv, np.array(src_pages, np.int32), np.array(dst_pages, np.int64)) is None
    with pytest.raises(PagesOutsideBuffers, match=f"{side} page {page}") as refused:
        held.flush()
    assert (refused.value.copy_index, refused.value.side, refused.value.page) == (1, side, page)
    assert rec.writes == [] and len(held) == 0  # nothing of the request written, nothing left held
    target.retire()
    assert rec.closed == [[b"handle"]]  # and the map released


def test_a_failed_held_write_raises_and_releases_its_map():
    class Failing(_Recorder):
        def write_pages(self, target, copies):
            raise OSError("device lost")

    rec = Failing()
    target = PeerTarget(_map((0x100000, 0x10000, 0)), [0x7000000], rec, [b"handle"])
    bound, _ = bind_layout(PagedLayout.of([(0x50000, 0x100000, 0x100)]), target, _device((0x50000, 0x10000)))
    held = PeerWrites()
    assert held.add_pages(bound, np.array([1]), np.array([2])) is None
    target.retire()
    with pytest.raises(OSError):
        held.flush()
    assert rec.closed == [[b"handle"]] and len(held) == 0 and held.nbytes == 0


# --- the host transport, against a real second process


def _owner(conn):
    """Owns a buffer, exports it, answers with its contents when asked."""
    buf = ctypes.create_string_buffer(1 << 20)
    transport = HostCmaTransport()
    conn.send(encode_peer_map(transport.export([(ctypes.addressof(buf), 1 << 19),
                                                (ctypes.addressof(buf) + (1 << 19), 1 << 19)])))
    while conn.recv() == "read":
        conn.send(buf.raw)


@pytest.fixture()
def owner():
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child,), daemon=True)
    proc.start()
    yield parent, find_peer_map(parent.recv())
    parent.send("stop")
    proc.join(10)


def test_host_transport_writes_another_process_byte_exact(owner):
    conn, peer = owner
    transport = HostCmaTransport()
    target = transport.open(peer)
    base = peer.regions[0].ptr
    rng = np.random.default_rng(5)
    payload = rng.integers(0, 256, 3000 * 100, dtype=np.uint8)
    # 3000 pages of 100 bytes to random places: more than one process_vm_writev call (1024 vectors each)
    slots = rng.permutation(peer.regions[0].length // 100)[:3000]
    bound, _ = bind_layout(PagedLayout.of([(payload.ctypes.data, base, 100)]), target, lambda addr: 1 << 40)
    assert _write_now(bound, np.arange(3000), slots) is None
    conn.send("read")
    image = conn.recv()
    for i, s in enumerate(slots):
        assert image[int(s) * 100:int(s) * 100 + 100] == payload[i * 100:(i + 1) * 100].tobytes()
    assert transport.open_mappings == 1
    target.retire()
    assert transport.open_mappings == 0


def test_a_paged_call_writes_another_process_byte_exact(owner):
    conn, peer = owner
    transport = HostCmaTransport()
    target = transport.open(peer)
    item, pages = 4096, 128  # each of the two regions is one buffer of 128 pages
    rng = np.random.default_rng(7)
    payload = rng.integers(0, 256, 2 * pages * item, dtype=np.uint8)
    src_base = payload.ctypes.data
    entries = [(src_base + k * pages * item, peer.regions[k].ptr, item) for k in range(2)]
    src_pages = rng.permutation(pages)[:90]
    dst_pages = np.concatenate((np.arange(10, 50), rng.permutation(np.arange(60, pages))[:50]))
    bound, _ = bind_layout(PagedLayout.of(entries), target, lambda addr: 1 << 40)
    assert _write_now(bound, src_pages, dst_pages) is None
    conn.send("read")
    image = np.frombuffer(conn.recv(), dtype=np.uint8)
    expect = np.zeros(1 << 20, dtype=np.uint8)
    for k in range(2):
        for s, d in zip(src_pages, dst_pages):
            at = k * pages * item
            expect[at + d * item:at + (d + 1) * item] = payload[at + s * item:at + (s + 1) * item]
    assert np.array_equal(image, expect)
    target.retire()


def test_host_transport_refuses_a_foreign_host_and_its_own_process(owner):
    _, peer = owner
    transport = HostCmaTransport()
    with pytest.raises(PeerMapError, match="another host"):
        transport.open(PeerMap(peer.kind, "not-this-boot-id", peer.regions))
    with pytest.raises(PeerMapError, match="writes with host-cma"):
        transport.open(PeerMap("cuda-ipc", peer.host, peer.regions))
    own = transport.export([(0x1000, 16)])
    with pytest.raises(PeerMapError, match="this very process"):
        transport.open(own)


def test_host_transport_refuses_a_process_that_is_gone():
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=os._exit, args=(0,))
    proc.start()
    proc.join(10)
    handle = proc.pid.to_bytes(8, "little").ljust(HANDLE_BYTES, b"\0")
    peer = PeerMap("host-cma", host_identity(), (PeerRegion(0x1000, 16, 0, handle),))
    with pytest.raises(PeerMapError, match="cannot be written"):
        HostCmaTransport().open(peer)
