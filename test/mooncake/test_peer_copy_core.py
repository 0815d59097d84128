"""core.peer_copy without a GPU: wire format, translation, lifetime, host transport.

The host transport writes another real process's memory (process_vm_writev),
so the write path, partial writes and refusal are exercised for real; the
CUDA IPC transport runs in test/gpu/test_peer_copy_gpu.py.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os

import numpy as np
import pytest

from sglang_dsv41.core.peer_copy import (
    FALLBACK_NO_PEER_MAP,
    FALLBACK_OUTSIDE_PEER_MAP,
    HANDLE_BYTES,
    PEER_MAP_TAG,
    HostCmaTransport,
    PeerMap,
    PeerMapError,
    PeerRegion,
    PeerTarget,
    encode_peer_map,
    find_peer_map,
    host_identity,
    send_peer_batch,
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

    def write(self, target, srcs, dsts, lengths):
        self.writes.append((srcs.tolist(), dsts.tolist(), lengths.tolist()))

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


def test_translation_maps_each_span_into_its_own_region():
    peer = _map((0x10000, 0x1000, 0), (0x20000, 0x1000, 0), (0x30000, 0x800, 0))
    target = PeerTarget(peer, [0xA0000, 0xB0000, 0xC0000], _Recorder(), [])
    dsts = np.array([0x20010, 0x10000, 0x307F0, 0x10FFF], dtype=np.uint64)
    lengths = np.array([0x10, 0x1000, 0x10, 1], dtype=np.uint64)
    local, outside = target.translate(dsts, lengths)
    assert outside is None
    assert local.tolist() == [0xB0010, 0xA0000, 0xC07F0, 0xA0FFF]


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
    dsts = np.array([0x10000, dst], dtype=np.uint64)
    local, outside = target.translate(dsts, np.array([8, length], dtype=np.uint64))
    assert local is None and outside == 1


def test_send_peer_batch_paths():
    rec = _Recorder()
    target = PeerTarget(_map((0x10000, 0x1000, 0)), [0xA0000], rec, [])
    direct = []

    def write_direct(blocks):
        direct.append(blocks)
        return 0

    blocks = [(0x500, 0x10000, 0x10), (0x600, 0x10100, 0x20)]
    assert send_peer_batch(blocks, target, 3, write_direct).fallback == "few_blocks"
    assert send_peer_batch(blocks, None, 1, write_direct).fallback == FALLBACK_NO_PEER_MAP
    out = send_peer_batch(blocks + [(0x700, 0x20000, 1)], target, 1, write_direct)
    assert out.fallback == FALLBACK_OUTSIDE_PEER_MAP and len(direct) == 3
    out = send_peer_batch(blocks, target, 1, write_direct)
    assert out == type(out)(0, None, 0x30)
    assert rec.writes == [([0x500, 0x600], [0xA0000, 0xA0100], [0x10, 0x20])]


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
    out = send_peer_batch([(0x500, 0x10000, 0x10)], target, 1, lambda b: 0)
    assert out.fallback == FALLBACK_NO_PEER_MAP and rec.writes == []


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
    src = payload.ctypes.data
    # 3000 blocks of 100 bytes at random disjoint places: more than one
    # process_vm_writev call (1024 vectors each)
    slots = rng.permutation((1 << 20) // 100)[:3000]
    blocks = [(src + i * 100, base + int(s) * 100, 100) for i, s in enumerate(slots)]
    out = send_peer_batch(blocks, target, 1, lambda b: pytest.fail("went direct"))
    assert out.rc == 0 and out.nbytes == 300000
    conn.send("read")
    image = conn.recv()
    for i, s in enumerate(slots):
        assert image[int(s) * 100:int(s) * 100 + 100] == payload[i * 100:(i + 1) * 100].tobytes()
    assert transport.open_mappings == 1
    target.retire()
    assert transport.open_mappings == 0


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
