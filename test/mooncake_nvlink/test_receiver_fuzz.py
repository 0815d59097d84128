"""Property and fuzz tests of the host-block receiver over a bytearray arena.

The arena stands in for the decode process's memory: its MemoryAccess maps
addresses into a bytearray and records any write that leaves the arena. The
invariants: nothing is ever written outside the published regions; a message
is written completely (exact blocks, exact lengths) or not at all; ``handle``
never raises, so the decode thread calling it keeps serving.
"""

from __future__ import annotations

import queue
import struct
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_dsv41.mooncake_nvlink.routing import (
    AUX_DATA_HEADER,
    HOST_BLOCKS_TAG,
    HostBlockReceiver,
    MemoryKind,
    RegionTable,
    encode_host_blocks,
)

BASE = 0x7F00_0000_0000
ARENA = 8192
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class ArenaMemory:
    """Host memory = one bytearray at BASE. Writes outside it are recorded, never done."""

    def __init__(self):
        self.arena = bytearray((i * 37 + 11) % 256 for i in range(ARENA))
        self.violations: list[tuple[int, int]] = []

    def kind_of(self, ptr: int) -> MemoryKind:
        return MemoryKind.HOST

    def read(self, ptr: int, length: int) -> bytes:
        return bytes(self.arena[ptr - BASE:ptr - BASE + length])

    def write(self, dst: int, payload: bytes, offset: int, length: int) -> None:
        if dst < BASE or dst + length > BASE + ARENA:
            self.violations.append((dst, length))
            raise RuntimeError("write outside the arena")
        self.arena[dst - BASE:dst - BASE + length] = payload[offset:offset + length]


regions_st = st.lists(
    st.tuples(st.integers(0, ARENA - 1), st.integers(1, 2048)).map(
        lambda r: (BASE + r[0], min(r[1], ARENA - r[0]))
    ),
    min_size=1, max_size=5,
)

# Destinations near region edges, anywhere in the arena, outside it, or absurd.
addr_st = st.one_of(
    st.integers(BASE - 64, BASE + ARENA + 64),
    st.integers(0, (1 << 64) - 1),
    st.sampled_from([0, 1, BASE - 1, BASE + ARENA, (1 << 64) - 1, (1 << 64) - 8]),
)
len_st = st.one_of(st.integers(1, 96), st.sampled_from([1, 4096, ARENA, ARENA + 1]))


def _outside_regions_unchanged(before: bytes, after: bytes, regions) -> bool:
    cursor = 0
    for start, length in sorted((s - BASE, n) for s, n in regions):
        if start > cursor and before[cursor:start] != after[cursor:start]:
            return False
        cursor = max(cursor, start + length)
    return before[cursor:] == after[cursor:]


def _check(regions, frames, declared=None):
    memory = ArenaMemory()
    rx = HostBlockReceiver(RegionTable(regions), memory)
    before = bytes(memory.arena)
    verdict = rx.handle(frames)  # must not raise
    after = bytes(memory.arena)
    assert memory.violations == []
    assert _outside_regions_unchanged(before, after, regions)
    if not verdict.written:
        assert after == before, "a dropped message wrote something"
    elif declared is not None:
        expected = bytearray(before)
        for dst, data in declared:
            expected[dst - BASE:dst - BASE + len(data)] = data
        assert after == bytes(expected)
    return verdict


@FUZZ
@given(regions=regions_st, blocks=st.lists(st.tuples(addr_st, len_st), min_size=1, max_size=6),
       room=st.integers(0, 2**63 - 1), seed=st.integers(0, 255))
def test_well_formed_messages_are_written_exactly_or_not_at_all(regions, blocks, room, seed):
    declared = [(dst, bytes((seed + i + j) % 256 for j in range(n)))
                for i, (dst, n) in enumerate(blocks) if dst + n <= (1 << 64)]
    if not declared:
        return
    table = RegionTable(regions)
    verdict = _check(regions, encode_host_blocks(room, declared), declared)
    all_inside = all(table.containing(d, len(data)) for d, data in declared)
    assert verdict.written == all_inside


@FUZZ
@given(regions=regions_st, data=st.data())
def test_a_region_end_crossed_by_one_byte_is_refused(regions, data):
    start, length = data.draw(st.sampled_from(regions))
    n = data.draw(st.integers(1, 64))
    dst = start + length - n + 1  # last byte one past the region's end
    verdict = _check(regions, encode_host_blocks(1, [(dst, b"\xee" * n)]))
    if not RegionTable(regions).containing(dst, n):  # another region may hold it
        assert not verdict.written


@FUZZ
@given(regions=regions_st, data=st.data())
def test_length_mismatch_and_truncation_are_refused(regions, data):
    start, length = data.draw(st.sampled_from(regions))
    n = data.draw(st.integers(1, length))
    frames = encode_host_blocks(5, [(start, b"\x5a" * n)])
    cut = data.draw(st.integers(-n, n + 8).filter(lambda c: c != 0))
    payload = frames[4][:cut] if cut < 0 else frames[4] + b"\x01" * cut
    verdict = _check(regions, frames[:4] + [payload])
    assert not verdict.written
    truncated_table = frames[3][: data.draw(st.integers(0, len(frames[3]) - 1))]
    assert not _check(regions, frames[:3] + [truncated_table, frames[4]]).written
    assert not _check(regions, frames[: data.draw(st.integers(0, 4))]).written


@FUZZ
@given(regions=regions_st, dst=addr_st, declared=st.integers(ARENA, (1 << 64) - 1),
       actual=st.integers(0, 64))
def test_huge_declared_lengths_are_refused_without_writing(regions, dst, declared, actual):
    frames = [AUX_DATA_HEADER, b"3", HOST_BLOCKS_TAG, struct.pack(">QQ", dst, declared),
              b"\x42" * actual]
    assert not _check(regions, frames).written


frame_st = st.one_of(st.binary(max_size=48), st.sampled_from([AUX_DATA_HEADER, HOST_BLOCKS_TAG]))


@FUZZ
@given(regions=regions_st, tail=st.lists(frame_st, max_size=6), mutate=st.data())
def test_arbitrary_frames_never_raise_or_write_outside(regions, tail, mutate):
    frames = [AUX_DATA_HEADER] + tail
    _check(regions, frames)
    # Valid message with one random byte of the table or payload flipped.
    start, length = mutate.draw(st.sampled_from(regions))
    good = encode_host_blocks(9, [(start, b"\x11" * min(length, 16))])
    which = mutate.draw(st.sampled_from([1, 3, 4]))
    raw = bytearray(good[which])
    pos = mutate.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= mutate.draw(st.integers(1, 255))
    good[which] = bytes(raw)
    _check(regions, good)


def test_the_receiving_thread_keeps_serving_after_garbage():
    """A decode-thread-like loop fed fuzz then one valid message writes the valid one."""
    memory = ArenaMemory()
    regions = [(BASE + 100, 200)]
    rx = HostBlockReceiver(RegionTable(regions), memory)
    inbox: queue.Queue = queue.Queue()
    handled = []

    def loop():
        while True:
            frames = inbox.get()
            if frames is None:
                return
            handled.append(rx.handle(frames))

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    garbage = [
        [AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, b"\xff" * 16, b""],
        [AUX_DATA_HEADER, b"x", HOST_BLOCKS_TAG, struct.pack(">QQ", BASE + 100, 4), b"abcd"],
        encode_host_blocks(1, [(BASE + 299, b"ab")]),
        encode_host_blocks(1, [(0, b"ab")]),
        [AUX_DATA_HEADER, None, HOST_BLOCKS_TAG, 3.5, object()],
        [AUX_DATA_HEADER, b"1", HOST_BLOCKS_TAG, struct.pack(">QQ", BASE + 100, 1 << 62), b"a"],
    ]
    for frames in garbage:
        inbox.put(frames)
    inbox.put(encode_host_blocks(2, [(BASE + 100, b"valid!")]))
    inbox.put(None)
    worker.join(10)
    assert not worker.is_alive() and len(handled) == len(garbage) + 1
    assert [v.written for v in handled] == [False] * len(garbage) + [True]
    assert memory.arena[100:106] == b"valid!" and memory.violations == []
    assert rx.messages_dropped == len(garbage) and rx.messages_written == 1
