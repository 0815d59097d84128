"""Unit tests of mooncake_nvlink.routing and mooncake_nvlink.memory (no sglang, no Mooncake)."""

from __future__ import annotations

import ctypes
import logging
import struct

import pytest

from sglang_dsv41.mooncake_nvlink import memory as memory_access
from sglang_dsv41.mooncake_nvlink.memory import CudaMemory, HostMemory, InjectedKinds
from sglang_dsv41.mooncake_nvlink.routing import (
    AUX_DATA_HEADER,
    HOST_BLOCKS_TAG,
    HOST_LEFT_OUT_REASON,
    HostBlockFrameError,
    HostBlockReceiver,
    KindTable,
    MemoryAccessError,
    MemoryKind,
    NoSideChannel,
    RegionTable,
    SideChannel,
    TransferRouter,
    chunk_host_blocks,
    encode_host_blocks,
    is_host_block_message,
    nvlink_intra_active,
    nvlink_intra_reason,
    parse_host_blocks,
    plan_registration,
    split_by_source,
)

D, H = MemoryKind.DEVICE, MemoryKind.HOST


# --- when the transport is active

@pytest.mark.parametrize(
    "env, active",
    [
        ({}, False),
        ({"MC_INTRANODE_NVLINK": "1"}, True),
        ({"MC_INTRANODE_NVLINK": ""}, True),  # Mooncake checks presence, not value
        ({"MC_INTRANODE_NVLINK": "0"}, True),
        ({"MC_INTRA_NVLINK": "true"}, True),
        ({"MOONCAKE_PROTOCOL": "nvlink_intra"}, True),
        ({"MOONCAKE_PROTOCOL": " NVLINK-INTRA "}, True),
        ({"MOONCAKE_PROTOCOL": "intra_nvlink"}, True),
        ({"MOONCAKE_PROTOCOL": "rdma"}, False),
        ({"MOONCAKE_PROTOCOL": "tcp"}, False),
        ({"MOONCAKE_PROTOCOL": "nvlink"}, False),  # cross-node NVLink: another transport
        ({"MC_FORCE_MNNVL": "1"}, False),
    ],
)
def test_nvlink_intra_active(env, active):
    assert nvlink_intra_active(env) is active
    assert (nvlink_intra_reason(env) is not None) is active


def test_nvlink_intra_reason_names_the_variable():
    assert nvlink_intra_reason({"MC_INTRA_NVLINK": "1"}) == "MC_INTRA_NVLINK is set"
    assert nvlink_intra_reason({"MOONCAKE_PROTOCOL": "nvlink_intra"}) == "MOONCAKE_PROTOCOL=nvlink_intra"


def test_nvlink_intra_reads_os_environ_by_default(monkeypatch):
    for name in ("MC_INTRANODE_NVLINK", "MC_INTRA_NVLINK", "MOONCAKE_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    assert not nvlink_intra_active()
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    assert nvlink_intra_active()


# --- regions

def test_region_table_containment_with_overlaps_and_duplicates():
    t = RegionTable([(100, 50), (120, 100), (100, 50), (400, 0), (500, 10)])
    assert len(t) == 4  # the zero-length region is dropped
    assert t.containing(100, 50) == (100, 50)
    assert t.containing(130, 90) == (120, 100)  # only the second holds all of it
    assert t.containing(149, 2) == (120, 100)
    assert t.containing(99, 2) is None
    assert t.containing(219, 1) == (120, 100)
    assert t.containing(219, 2) is None  # crosses the end
    assert t.containing(505, 5) == (500, 10)
    assert t.containing(505, 6) is None
    assert t.containing(300, 1) is None
    assert t.containing(100, 0) is None  # empty spans are never "inside"
    assert t.containing(-5, 1) is None


def test_region_table_nested_region_does_not_hide_the_outer_one():
    t = RegionTable([(0, 1000), (10, 5)])
    assert t.containing(12, 500) == (0, 1000)


def test_plan_registration_keeps_device_regions_and_says_why_host_left_out():
    kinds = {1000: D, 2000: H, 3000: D}
    plan = plan_registration([(1000, 10), (2000, 20), (3000, 30)], kinds.__getitem__)
    assert plan.register == [(1000, 10), (3000, 30)]
    assert plan.left_out == [(2000, 20, HOST_LEFT_OUT_REASON)]
    text = plan.describe_left_out()
    assert "left 1 of 3 regions" in text and "0x7d0+20" in text and "device memory only" in text
    assert plan_registration([(1, 1)], lambda p: D).describe_left_out() == "no region left out"


def test_plan_registration_fails_closed_when_a_pointer_cannot_be_classified():
    def kind_of(ptr):
        raise MemoryAccessError("no driver")

    with pytest.raises(MemoryAccessError):
        plan_registration([(1000, 10)], kind_of)


def test_kind_table_uses_registration_classes_and_asks_fallback_elsewhere():
    asked = []

    def fallback(ptr):
        asked.append(ptr)
        return D

    table = KindTable([(1000, 100, H), (5000, 100, D)], fallback)
    assert table.kind_of(1000) is H and table.kind_of(1099) is H
    assert table.kind_of(5050) is D
    assert asked == []
    assert table.kind_of(1100) is D and asked == [1100]


def test_split_by_source_classifies_the_local_source_only():
    seen = []

    def kind_of(ptr):
        seen.append(ptr)
        return D if ptr < 100 else H

    blocks = [(1, 9001, 4), (200, 9002, 4), (50, 9003, 4)]
    device, host = split_by_source(blocks, kind_of)
    assert device == [(1, 9001, 4), (50, 9003, 4)] and host == [(200, 9002, 4)]
    assert seen == [1, 200, 50]  # never the peer's destination addresses


# --- frames

def test_frames_round_trip():
    frames = encode_host_blocks(123, [(0x1000, b"abc"), (0x2000, b"defgh")])
    assert frames[0] == AUX_DATA_HEADER and frames[2] == HOST_BLOCKS_TAG
    assert is_host_block_message(frames)
    msg = parse_host_blocks(frames)
    assert msg.room == 123 and msg.payload == b"abcdefgh"
    assert [(e.dst, e.length, e.offset) for e in msg.entries] == [(0x1000, 3, 0), (0x2000, 5, 3)]


def test_the_tag_makes_an_unpatched_receiver_fail_to_parse():
    """Upstream's aux handler reads frame 2 as an integer buffer index."""
    frames = encode_host_blocks(1, [(0x1000, b"x")])
    with pytest.raises(ValueError):
        int(frames[2].decode("ascii"))


def test_upstream_aux_frames_are_not_host_block_messages():
    upstream = [AUX_DATA_HEADER, b"7", b"0", b"3", struct.pack(">I", 4), b"abcd"]
    assert not is_host_block_message(upstream)
    assert not is_host_block_message([AUX_DATA_HEADER])


@pytest.mark.parametrize(
    "frames, message",
    [
        ([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 4)], "expected 5 frames"),
        ([b"AUX_DATX", b"1", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 1), b"x"], "wrong header"),
        ([AUX_DATA_HEADER, b"1", b"0", struct.pack(">QQ", 16, 1), b"x"], "wrong tag"),
        ([AUX_DATA_HEADER, b"", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 1), b"x"], "room"),
        ([AUX_DATA_HEADER, b"+1", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 1), b"x"], "room"),
        ([AUX_DATA_HEADER, b" 1", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 1), b"x"], "room"),
        ([AUX_DATA_HEADER, b"1" * 21, HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 1), b"x"], "room"),
        ([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, b"", b""], r"not n\*16"),
        ([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, b"\0" * 17, b"x"], r"not n\*16"),
        ([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 0), b""], "length 0"),
        ([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 2), b"x"], "only 1 remain"),
        ([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, 1), b"xy"], "payload is 2"),
        ([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, struct.pack(">QQ", (1 << 64) - 1, 2), b"xy"],
         "wraps"),
        ([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, struct.pack(">QQ", 16, (1 << 64) - 17), b"x"],
         "remain"),
    ],
)
def test_parser_is_strict(frames, message):
    with pytest.raises(HostBlockFrameError, match=message):
        parse_host_blocks(frames)


def test_parser_refuses_too_many_blocks():
    from sglang_dsv41.mooncake_nvlink.routing import MAX_BLOCKS_PER_MESSAGE

    n = MAX_BLOCKS_PER_MESSAGE + 1
    table = struct.pack(">QQ", 16, 1) * n
    with pytest.raises(HostBlockFrameError, match="exceed"):
        parse_host_blocks([AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, table, b"x" * n])


@pytest.mark.parametrize("blocks", [[], [(16, b"")], [(-1, b"x")], [((1 << 64) - 1, b"xy")]])
def test_encoder_refuses_what_the_parser_would_refuse(blocks):
    with pytest.raises(ValueError):
        encode_host_blocks(1, blocks)


# --- receiver over real host memory

def _buffer(size):
    buf = ctypes.create_string_buffer(size)
    return buf, ctypes.addressof(buf)


def test_receiver_writes_exact_blocks_into_published_regions():
    a, pa = _buffer(64)
    b, pb = _buffer(32)
    rx = HostBlockReceiver(RegionTable([(pa, 64), (pb, 32)]), HostMemory())
    verdict = rx.handle(encode_host_blocks(9, [(pa + 8, b"hello"), (pb + 30, b"!!")]))
    assert verdict.written and verdict.blocks == 2 and verdict.nbytes == 7 and verdict.room == 9
    assert a.raw == bytes(8) + b"hello" + bytes(51)
    assert b.raw == bytes(30) + b"!!"
    assert (rx.messages_written, rx.messages_dropped) == (1, 0)


def test_receiver_writes_nothing_when_one_block_is_outside(caplog):
    a, pa = _buffer(64)
    rx = HostBlockReceiver(RegionTable([(pa, 64)]), HostMemory())
    with caplog.at_level(logging.ERROR, logger="sglang_dsv41.mooncake"):
        verdict = rx.handle(encode_host_blocks(9, [(pa, b"ok"), (pa + 63, b"xx")]))
    assert not verdict.written and "block 1" in verdict.reason
    assert a.raw == bytes(64)
    assert "nothing written" in caplog.text and rx.messages_dropped == 1


def test_receiver_writes_only_for_rooms_a_request_still_waits_for():
    """A late or forged message for a room that is finished, failed, aborted or unknown
    would land in slots another request may hold by now: dropped, nothing written."""
    a, pa = _buffer(16)
    awaited = {7}
    rx = HostBlockReceiver(RegionTable([(pa, 16)]), HostMemory(), room_awaits_kv=awaited.__contains__)
    for room in (8, 0):
        verdict = rx.handle(encode_host_blocks(room, [(pa, b"late")]))
        assert not verdict.written and "no request here waits for this room" in verdict.reason
    assert a.raw == bytes(16)
    assert rx.handle(encode_host_blocks(7, [(pa, b"kept")])).written and a.raw[:4] == b"kept"

    def broken(room):
        raise KeyError(room)

    rx.room_awaits_kv = broken
    verdict = rx.handle(encode_host_blocks(7, [(pa, b"gone")]))
    assert not verdict.written and "cannot look its room up" in verdict.reason and a.raw[:4] == b"kept"


def test_receiver_reports_a_failing_write_and_keeps_going():
    class Failing(HostMemory):
        def write(self, dst, payload, offset, length):
            raise MemoryAccessError("cudaMemcpy failed")

    a, pa = _buffer(8)
    rx = HostBlockReceiver(RegionTable([(pa, 8)]), Failing())
    verdict = rx.handle(encode_host_blocks(1, [(pa, b"x")]))
    assert not verdict.written and "write failed at block 0 of 1" in verdict.reason
    rx.memory = HostMemory()
    assert rx.handle(encode_host_blocks(1, [(pa, b"y")])).written and a.raw[:1] == b"y"


def test_a_write_failing_midway_puts_back_what_the_earlier_blocks_wrote():
    class FailsThirdWrite(HostMemory):
        """The third block's write lands half of itself, then fails (a device copy error)."""

        writes = 0

        def write(self, dst, payload, offset, length):
            type(self).writes += 1
            if type(self).writes == 3:
                super().write(dst, payload, offset, length // 2)
                raise MemoryAccessError("cudaMemcpy failed")
            return super().write(dst, payload, offset, length)

    a, pa = _buffer(64)
    ctypes.memmove(pa, b"K" * 64, 64)  # what the decode held before
    rx = HostBlockReceiver(RegionTable([(pa, 64)]), FailsThirdWrite())
    verdict = rx.handle(encode_host_blocks(4, [(pa, b"aaaa"), (pa + 8, b"bbbb"), (pa + 16, b"cccc"),
                                               (pa + 24, b"dddd")]))
    assert not verdict.written and verdict.blocks == 0
    assert "write failed at block 2 of 4" in verdict.reason and "restored" in verdict.reason
    assert a.raw == b"K" * 64  # nothing of the message remains


def test_receiver_handles_frames_that_are_not_bytes():
    rx = HostBlockReceiver(RegionTable([(4096, 8)]), HostMemory())
    verdict = rx.handle([AUX_DATA_HEADER, 5, HOST_BLOCKS_TAG, None, object()])
    assert not verdict.written and verdict.reason.startswith("malformed")


# --- router

class Recorder:
    def __init__(self, rc=0):
        self.rc = rc
        self.device_calls = []
        self.frames = []

    def send_device(self, blocks):
        self.device_calls.append(list(blocks))
        return self.rc

    def channel(self):
        return SideChannel(room=77, send=self.frames.append)


def test_router_sends_device_blocks_to_engine_and_host_blocks_as_frames():
    src_host, p_host = _buffer(16)
    src_host.raw = b"0123456789abcdef"
    memory = InjectedKinds([(0x10000, 0x1000)])
    rec = Recorder()
    router = TransferRouter(memory.kind_of, memory)
    blocks = [(0x10000, 0x90000, 256), (p_host + 4, 0x7000, 6), (0x10100, 0x90100, 256)]
    assert router.route(blocks, rec.send_device, rec.channel) == 0
    assert rec.device_calls == [[(0x10000, 0x90000, 256), (0x10100, 0x90100, 256)]]
    (msg,) = [parse_host_blocks(f) for f in rec.frames]
    assert msg.room == 77 and msg.payload == b"456789"
    assert [(e.dst, e.length) for e in msg.entries] == [(0x7000, 6)]


def test_router_all_device_batch_never_opens_the_side_channel():
    memory = InjectedKinds([(0, 1 << 40)])
    rec = Recorder()

    def no_channel():
        raise AssertionError("side channel opened")

    assert TransferRouter(memory.kind_of, memory).route([(10, 20, 4)], rec.send_device, no_channel) == 0


def test_router_engine_failure_skips_host_blocks():
    buf, p = _buffer(4)
    memory = InjectedKinds([(0x10000, 16)])
    rec = Recorder(rc=-1)
    rc = TransferRouter(memory.kind_of, memory).route(
        [(0x10000, 1, 4), (p, 2, 4)], rec.send_device, rec.channel
    )
    assert rc == -1 and rec.frames == []


@pytest.mark.parametrize("failure", ["no_channel", "send", "read", "classify"])
def test_router_turns_side_channel_failures_into_a_failed_transfer(failure, caplog):
    buf, p = _buffer(8)
    memory = InjectedKinds([])
    rec = Recorder()

    def channel():
        if failure == "no_channel":
            raise NoSideChannel("no transfer info")
        if failure == "send":
            return SideChannel(1, lambda frames: (_ for _ in ()).throw(OSError("zmq")))
        return rec.channel()

    if failure == "read":
        memory.read = lambda ptr, n: (_ for _ in ()).throw(MemoryAccessError("bad read"))
    def unclassifiable(ptr):
        raise MemoryAccessError("no driver")

    kind_of = unclassifiable if failure == "classify" else memory.kind_of
    with caplog.at_level(logging.ERROR, logger="sglang_dsv41.mooncake"):
        rc = TransferRouter(kind_of, memory).route([(p, 0x5000, 8)], rec.send_device, channel)
    assert rc == -1 and rec.frames == []
    assert caplog.records


def test_router_chunks_large_host_batches_in_order():
    buf, p = _buffer(100)
    buf.raw = bytes(range(100))
    memory = InjectedKinds([])
    rec = Recorder()
    router = TransferRouter(memory.kind_of, memory, max_message_payload=25)
    blocks = [(p + 10 * i, 0x1000 + 10 * i, 10) for i in range(10)]
    assert router.route(blocks, rec.send_device, rec.channel) == 0
    msgs = [parse_host_blocks(f) for f in rec.frames]
    assert [len(m.entries) for m in msgs] == [2, 2, 2, 2, 2]
    assert b"".join(m.payload for m in msgs) == bytes(range(100))


def test_chunking_keeps_an_oversized_block_alone():
    blocks = [(0, 0, 5), (0, 0, 50), (0, 0, 5), (0, 0, 5)]
    assert [len(c) for c in chunk_host_blocks(blocks, 20)] == [1, 1, 2]


# --- CUDA memory access with a stand-in runtime (the hardware)

class FakeRuntime:
    """Records CUDA runtime calls; pointers >= 1<<50 (above any host address) are device memory of device 3."""

    name = "fake"

    def __init__(self, current=3, fail_ptr=None):
        self.current = current
        self.fail_ptr = fail_ptr
        self.calls = []

    def get_device(self):
        return 0, self.current

    def set_device(self, device):
        self.calls.append(("set_device", device))
        self.current = device
        return 0

    def pointer_type(self, ptr):
        self.calls.append(("attr", ptr))
        if ptr == self.fail_ptr:
            return 1, -1, -1
        return (0, 2, 3) if ptr >= 1 << 50 else (0, 0, -1)

    def memcpy(self, dst, src, n):
        self.calls.append(("memcpy", dst, n))
        return 0


def test_cuda_memory_classifies_and_copies_device_pointers_with_memcpy():
    rt = FakeRuntime()
    mem = CudaMemory(rt)
    assert mem.device == 3 and mem.backend == "fake"
    assert mem.kind_of(1 << 50) is D and mem.kind_of(4096) is H
    mem.write(1 << 50, b"abcd", 1, 2)
    assert ("memcpy", 1 << 50, 2) in rt.calls
    buf, p = _buffer(4)
    mem.write(p, b"abcd", 1, 3)
    assert buf.raw == b"bcd\0"
    assert mem.read(p, 2) == b"bc"


def test_cuda_memory_moves_a_worker_thread_to_the_managers_device():
    rt = FakeRuntime(current=0)
    mem = CudaMemory(rt, device=5)
    mem.kind_of(4096)
    assert ("set_device", 5) in rt.calls and rt.current == 5


def test_cuda_memory_fails_closed_on_unclassifiable_pointers():
    mem = CudaMemory(FakeRuntime(fail_ptr=1234))
    with pytest.raises(MemoryAccessError):
        mem.kind_of(1234)


def test_cuda_memory_access_without_a_gpu_raises_memory_access_error():
    """On this CPU machine every CUDA runtime fails to give a device: a clear error."""
    try:
        mem = memory_access.cuda_memory_access()
    except MemoryAccessError as exc:
        assert "CUDA" in str(exc) or "cuda" in str(exc)
    else:  # a machine with a GPU
        assert mem.kind_of(ctypes.addressof(ctypes.c_int())) is H


# --- the fast split agrees with the plain one

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(
    regions=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 4096), st.booleans()),
                     min_size=1, max_size=8),
    srcs=st.lists(st.integers(0, (1 << 20) + 8192), min_size=0, max_size=80),
    fallback_device=st.booleans(),
)
def test_kind_table_split_matches_split_by_source(regions, srcs, fallback_device):
    # Overlapping regions of different kinds cannot happen physically; keep the first.
    classified = []
    for start, size, dev in regions:
        if all(not (start < s + n and s < start + size) for s, n, _ in classified):
            classified.append((start, size, D if dev else H))
    asked = []

    def fallback(ptr):
        asked.append(ptr)
        return D if fallback_device else H

    table = KindTable(classified, fallback)
    blocks = [(src, 1000 + i, 8) for i, src in enumerate(srcs)]
    device, host = table.split(blocks)
    want_device, want_host = split_by_source(blocks, table.kind_of)
    assert list(device) == want_device and host == want_host
    if not host:
        assert device is blocks  # an all-device batch is passed on uncopied



def test_kind_table_split_asks_fallback_for_unknown_pointers_each_time():
    asked = []
    table = KindTable([(1 << 30, 1 << 20, D)], lambda p: asked.append(p) or H)
    blocks = [((1 << 30) + 64 * i, 0, 64) for i in range(100)] + [(12345, 0, 8), (12345, 1, 8)]
    device, host = table.split(blocks)
    assert len(device) == 100 and host == [(12345, 0, 8), (12345, 1, 8)]
    assert asked == [12345]  # the second block sits in the remembered span of the first


@settings(max_examples=200, deadline=None)
@given(
    scale=st.sampled_from([0, 12, 15]),  # byte-sized buffers up to buffers of many granules
    regions=st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(1, 64), st.booleans()),
                     min_size=1, max_size=10),
    picks=st.lists(st.tuples(st.integers(0, 29), st.floats(-0.1, 1.1), st.integers(-2, 2)),
                   min_size=1, max_size=120),
)
def test_kind_table_split_hopping_between_buffers_matches_kind_of(scale, regions, picks):
    """Blocks hop from buffer to buffer (one page per layer), inside, at and across their
    edges, twice (the second time from remembered granules); buffers may touch, repeat or
    nest when they are of one kind."""
    classified = []
    for start, size, dev in regions:
        start, size, kind = start << scale, size << scale, D if dev else H
        if all(k is kind or not (start < s + n and s < start + size) for s, n, k in classified):
            classified.append((start, size, kind))
            if dev:  # a device buffer reported twice, and one starting where it ends
                classified += [(start, size, kind), (start + size, 64 << scale, kind)]
    table = KindTable(classified, lambda p: H if p % 3 else D)
    blocks = []
    for i, (which, where, nudge) in enumerate(picks):
        start, size, _ = classified[which % len(classified)]
        blocks.append((max(start + int(size * where) + nudge, 0), i, 8))
    want_device, want_host = split_by_source(blocks, table.kind_of)
    for _ in range(2):
        device, host = table.split(blocks)
        assert list(device) == want_device and host == want_host


def test_kind_table_remembers_a_bounded_number_of_granules(monkeypatch):
    from sglang_dsv41.mooncake_nvlink import routing as mooncake_routing

    monkeypatch.setattr(mooncake_routing, "MAX_REMEMBERED_GRANULES", 5)
    shift = mooncake_routing.GRANULE_SHIFT
    buffers = [((i + 1) << 30, 8 << shift, D) for i in range(8)]
    table = KindTable(buffers + [(1 << 40, 1 << shift, H)], lambda p: pytest.fail("asked"))
    blocks = [(p + (j << shift), 0, 64) for p, _, _ in buffers for j in range(8)]
    blocks = blocks[::3] + [(1 << 40, 1, 64)]
    for _ in range(2):
        device, host = table.split(blocks)
        assert host == [(1 << 40, 1, 64)] and device == blocks[:-1]
    assert len(table._granules) == 5


def test_kind_table_batch_across_many_buffers_classifies_each_block():
    """43 one-page blocks, each from its own buffer, with a host buffer between two of them."""
    buffers = [((i + 1) << 24, 1 << 20, D) for i in range(43)]
    host_buffer = ((44 << 24), 1 << 20, H)
    table = KindTable(buffers + [host_buffer], lambda p: pytest.fail(f"asked about {p:#x}"))
    blocks = [(p + 4096, 0, 4096) for p, _, _ in buffers]
    blocks.insert(20, (host_buffer[0] + 8, 1, 64))
    device, host = table.split(blocks)
    assert host == [(host_buffer[0] + 8, 1, 64)]
    assert device == [b for b in blocks if b[1] == 0]
    first = blocks[:20]
    assert table.split(first) == (first, []) and table.split(first)[0] is first


def test_kind_table_checks_a_remembered_one_page_per_buffer_shape_without_look_ups(monkeypatch):
    """The sliding-window state's shape: one page from each of 43 buffers, every request."""
    from sglang_dsv41.mooncake_nvlink import routing as mooncake_routing

    buffers = [((i + 1) << 24, 1 << 20, D) for i in range(43)]
    host_buffer = ((44 << 24), 1 << 20, H)
    asked = []
    table = KindTable(buffers + [host_buffer], lambda p: asked.append(p) or D)
    request = lambda page: [(p + page * 4096, i, 4096) for i, (p, _, _) in enumerate(buffers)]  # noqa: E731
    assert table.split(request(1)) == (request(1), [])
    classify = table._host_positions
    monkeypatch.setattr(table, "_host_positions", lambda blocks: pytest.fail("looked up"))
    for page in (2, 7):  # later requests, other pages of the same buffers
        blocks = request(page)
        device, host = table.split(blocks)
        assert device is blocks and host == []
    monkeypatch.setattr(table, "_host_positions", classify)
    with_host = request(3)
    with_host[20] = (host_buffer[0] + 8, 20, 64)  # same length, a host source in one place
    device, host = table.split(with_host)
    assert host == [with_host[20]] and device == with_host[:20] + with_host[21:]
    unknown = request(4)
    unknown[5] = (7 << 40, 5, 64)  # outside known memory: its kind is asked every time
    for _ in range(2):
        assert table.split(unknown) == (unknown, [])
    assert asked == [7 << 40, 7 << 40] and len(table._shapes[43]) == 1
    for turn in range(6):  # the buffers in other orders: a few shapes per length, the newest first
        rotated = request(1)[turn:] + request(1)[:turn]
        assert table.split(rotated) == (rotated, [])
    assert len(table._shapes[43]) == mooncake_routing.SHAPES_PER_LENGTH
    assert table._shapes[43][0][0][0] == buffers[5][0]
    longest = mooncake_routing.MAX_SHAPE_BLOCKS
    many = [((i + 100) << 24, 1 << 20, D) for i in range(longest + 1)]
    table = KindTable(many, lambda p: pytest.fail("asked"))
    for n in (longest, longest + 1):
        table.split([(p, 0, 64) for p, _, _ in many[:n]])
    assert list(table._shapes) == [longest]
