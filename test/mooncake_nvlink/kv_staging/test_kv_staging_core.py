"""core.kv_staging alone: settings, wire formats, region checks, slot pool, sender and receiver.

Host memory through HostBatchCopy; the engine write, the side channel and the
acknowledgement are plain functions here, so every failure can be placed
exactly. The real managers and engines are in test_kv_staging_pd.py.
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import HostBatchCopy
from sglang_dsv41.mooncake_nvlink.kv_staging.slots import (
    FALLBACK_BLOCK_TOO_LARGE,
    FALLBACK_BUSY,
    FALLBACK_NO_GRANT,
    FALLBACK_POISONED,
    FALLBACK_SMALL,
    Grant,
    GrantState,
    LocalBuffers,
    SlotPool,
    SpanChecker,
    StagedReceiver,
    StagedSender,
    StagingConfig,
    StagingConfigError,
    StagingFrameError,
    StagingRefused,
    encode_ack,
    encode_grant,
    encode_staged,
    find_grant,
    parse_ack,
    parse_staged,
    staging_config,
    strip_grant,
)

COPY = HostBatchCopy()


# --- settings


def test_staging_is_off_unless_asked_and_bad_values_are_refused():
    assert staging_config({}) is None
    assert staging_config({"SGLANG_DSV41_KV_STAGING": "0"}) is None
    cfg = staging_config({"SGLANG_DSV41_KV_STAGING": "1", "SGLANG_DSV41_KV_STAGING_SLOT_MB": "4"})
    assert cfg.slot_bytes == 4 << 20 and cfg.slots == 8
    for env in ({"SGLANG_DSV41_KV_STAGING": "yes"},
                {"SGLANG_DSV41_KV_STAGING": "1", "SGLANG_DSV41_KV_STAGING_SLOTS": "0"},
                {"SGLANG_DSV41_KV_STAGING": "1", "SGLANG_DSV41_KV_STAGING_SLOT_MB": "x"},
                {"SGLANG_DSV41_KV_STAGING": "1", "SGLANG_DSV41_KV_STAGING_ACK_TIMEOUT_S": "0"}):
        with pytest.raises(StagingConfigError) as exc:
            staging_config(env)
        assert "SGLANG_DSV41_KV_STAGING" in str(exc.value)


# --- wire formats


def test_grant_rides_at_the_end_of_a_registration_message_and_strips_off():
    message = [b"None", b"10.0.0.1", b"7000", b"sess"] + [b"x"] * 16
    grant = Grant(0x7000_0000, 32 << 20, 12345)
    sent = message + encode_grant(grant)
    assert find_grant(sent) == grant
    assert strip_grant(sent) == message
    assert find_grant(message) is None
    with pytest.raises(StagingFrameError):
        find_grant(message + [encode_grant(grant)[0], b"short"])


def _staged(dsts, lengths, grant=Grant(4096, 1 << 20, 7), nonce=99):
    return encode_staged(5, grant, nonce, np.array(dsts, dtype=np.uint64),
                         np.array(lengths, dtype=np.uint64), "tcp://127.0.0.1:5555")


def test_staged_message_round_trips_and_every_deviation_is_refused():
    frames = _staged([1000, 5000], [16, 32])
    msg = parse_staged(frames)
    assert (msg.room, msg.slot_ptr, msg.lease, msg.nonce, msg.total_bytes) == (5, 4096, 7, 99, 48)
    assert msg.dsts.tolist() == [1000, 5000] and msg.lengths.tolist() == [16, 32]
    bad = []
    f = list(frames); f[3] = f[3][:-1]; bad.append(f)  # short header
    f = list(frames); f[4] = f[4][:-1]; bad.append(f)  # table not n*16
    f = list(frames); f[4] = b""; bad.append(f)  # empty table
    f = list(frames); f[1] = b"-5"; bad.append(f)  # room
    f = list(frames); f[5] = b"ipc:///tmp/x"; bad.append(f)  # reply address
    bad.append(frames[:5])
    bad.append(_staged([1000], [0]))  # zero length
    f = list(frames)  # header total disagrees with the table
    f[3] = f[3][:24] + (47).to_bytes(8, "little"); bad.append(f)
    bad.append(_staged([1000], [(1 << 40) + 1]))  # huge entry
    # two entries whose 64-bit sum would wrap to a small number
    f = _staged([0, 0], [(1 << 63), (1 << 63) + 16]); f[3] = f[3][:24] + (16).to_bytes(8, "little")
    bad.append(f)
    for frames_bad in bad:
        with pytest.raises(StagingFrameError):
            parse_staged(frames_bad)


def test_acknowledgements_round_trip():
    assert parse_ack(encode_ack(3)) == (3, None)
    nonce, refusal = parse_ack(encode_ack(4, "scatter failed"))
    assert nonce == 4 and "scatter failed" in refusal
    with pytest.raises(StagingFrameError):
        parse_ack([b"other", b"12345678", b"ok"])


# --- region checks


def test_span_checker_matches_a_plain_rule_on_random_tables():
    rng = random.Random(5)
    for _ in range(200):
        regions = [(rng.randrange(0, 10_000), rng.randrange(1, 2_000)) for _ in range(rng.randrange(0, 6))]
        checker = SpanChecker(regions)
        spans = [(rng.randrange(0, 12_000), rng.randrange(1, 1_500)) for _ in range(rng.randrange(1, 30))]
        inside = [any(p <= d and d + n <= p + m for p, m in regions) for d, n in spans]
        want = None if all(inside) else inside.index(False)
        got = checker.first_outside(np.array([d for d, _ in spans], dtype=np.uint64),
                                    np.array([n for _, n in spans], dtype=np.uint64))
        assert got == want, (regions, spans)
    # a span wrapping the 64-bit address space is never inside
    wrap = SpanChecker([(0, 1 << 20)])
    assert wrap.first_outside(np.array([(1 << 64) - 8], dtype=np.uint64),
                              np.array([16], dtype=np.uint64)) == 0


# --- slot pool


def test_slot_pool_leases_one_stable_slot_per_peer_until_full():
    pool = SlotPool(COPY, StagingConfig(slots=2, slot_bytes=4096))
    a, b = pool.lease("p1:1"), pool.lease("p2:1")
    assert a.slot_ptr != b.slot_ptr and pool.lease("p1:1") == a
    assert pool.lease("p3:1") is None and pool.refused_peers == {"p3:1"}
    assert pool.holder(a.slot_ptr, a.lease) == 0 and pool.holder(b.slot_ptr, b.lease) == 1
    assert pool.holder(a.slot_ptr, b.lease) is None  # someone else's lease
    assert pool.holder(a.slot_ptr + 8, a.lease) is None  # not a slot start
    assert pool.holder(pool.slot_ptr(2), a.lease) is None  # past the pool


# --- sender and receiver end to end in one process


class Side:
    """A prefill and a decode buffer set, a slot pool, and the functions that join them."""

    def __init__(self, config=StagingConfig(slots=2, slot_bytes=64 << 10, min_blocks=2)):
        self.config = config
        self.src = COPY.allocate(256 << 10)
        self.dst = COPY.allocate(256 << 10)
        ctypes.memmove(self.src.ptr, bytes((i * 37 + 11) % 251 for i in range(256 << 10)), 256 << 10)
        self.pool = SlotPool(COPY, config)
        self.grant = GrantState(self.pool.lease("prefill:1"))
        self.receiver = StagedReceiver(self.pool, [(self.dst.ptr, self.dst.nbytes)], COPY)
        self.sender = StagedSender(COPY, LocalBuffers(COPY, config), config)
        self.writes, self.pending, self.acks = [], [], {}

    def write(self, blocks):
        self.writes.append(list(blocks))
        COPY.copy([b[0] for b in blocks], [b[1] for b in blocks], [b[2] for b in blocks])
        return 0

    def notify(self, frames):
        verdict = self.receiver.handle(frames)
        self.pending.append(verdict)
        if verdict.ack is not None:
            nonce, refusal = parse_ack(verdict.ack)
            self.acks[nonce] = refusal

    def await_ack(self, nonce, timeout):
        if nonce not in self.acks:
            raise TimeoutError
        return self.acks.pop(nonce)

    def send(self, blocks, grant="default"):
        return self.sender.send(blocks, self.grant if grant == "default" else grant, 1,
                                "tcp://127.0.0.1:1", self.write, self.notify, self.await_ack)

    def blocks(self, n, size=1024, stride=3000):
        # destinations in reverse order of the sources, with gaps: a real scatter
        return [(self.src.ptr + i * stride, self.dst.ptr + (n - 1 - i) * (size + 64), size)
                for i in range(n)]

    def landed(self, blocks):
        return all(ctypes.string_at(d, n) == ctypes.string_at(s, n) for s, d, n in blocks)


def test_a_batch_becomes_one_write_and_lands_byte_exact():
    side = Side()
    blocks = side.blocks(40)
    outcome = side.send(blocks)
    assert outcome.rc == 0 and outcome.fallback is None and outcome.writes == 1
    assert len(side.writes) == 1 and len(side.writes[0]) == 1
    assert side.writes[0][0][1] == side.grant.grant.slot_ptr
    assert side.landed(blocks) and side.receiver.scattered == 1


def test_a_batch_larger_than_a_slot_goes_in_several_staged_writes():
    side = Side()
    blocks = side.blocks(100, size=2000, stride=2100)  # 200,000 bytes > 64 KiB slots
    outcome = side.send(blocks)
    assert outcome.rc == 0 and outcome.writes == len(side.writes) == 4
    assert all(w[0][2] <= side.config.slot_bytes for w in side.writes)
    assert side.landed(blocks)


@pytest.mark.parametrize("case", ["no_grant", "few", "too_large", "busy", "retired"])
def test_fallbacks_take_the_direct_path_and_say_why(case):
    side = Side()
    blocks = side.blocks(40)
    grant = "default"
    if case == "no_grant":
        grant, want = None, FALLBACK_NO_GRANT
    elif case == "few":
        blocks, want = blocks[:1], FALLBACK_SMALL
    elif case == "too_large":
        big = (side.src.ptr + (128 << 10), side.dst.ptr + (128 << 10), (64 << 10) + 1)
        blocks, want = blocks[:3] + [big], FALLBACK_BLOCK_TOO_LARGE
    elif case == "busy":
        side.grant.lock.acquire()
        want = FALLBACK_BUSY
    else:
        side.grant.poisoned = "earlier timeout"
        want = FALLBACK_POISONED
    outcome = side.send(blocks, grant)
    assert outcome.fallback == want and outcome.rc == 0
    assert side.writes == [blocks]  # the batch as it came, to the engine
    assert side.receiver.scattered == 0 and side.landed(blocks)


def test_a_refused_scatter_fails_the_batch_and_leaves_the_slot_usable():
    side = Side()
    blocks = side.blocks(20)
    blocks[5] = (blocks[5][0], 12345, blocks[5][2])  # a destination outside decode's regions
    with pytest.raises(StagingRefused, match="not inside"):
        side.send(blocks)
    assert side.grant.poisoned is None and side.receiver.refused == 1
    good = side.blocks(20)
    assert side.send(good).rc == 0 and side.landed(good)


def test_a_missing_acknowledgement_fails_the_batch_and_retires_the_slot():
    side = Side()
    side.notify = lambda frames: None  # the message is lost: no acknowledgement ever comes
    with pytest.raises(StagingRefused, match="no acknowledgement"):
        side.send(side.blocks(20))
    assert side.grant.poisoned
    outcome = side.send(side.blocks(20))
    assert outcome.fallback == FALLBACK_POISONED and outcome.rc == 0


def test_an_engine_error_on_the_staged_write_is_returned_as_is():
    side = Side()
    side.write = lambda blocks: -7
    outcome = side.send(side.blocks(20))
    assert outcome.rc == -7 and side.receiver.scattered == 0


def test_gather_buffers_are_lent_one_per_transfer_and_come_back():
    side = Side(StagingConfig(slots=1, slot_bytes=64 << 10, min_blocks=2))
    taken = side.sender.buffers.take()
    outcome = side.send(side.blocks(20))
    assert outcome.fallback == FALLBACK_BUSY
    side.sender.buffers.give_back(taken)
    assert side.send(side.blocks(20)).fallback is None
    assert side.sender.buffers.take() is not None  # given back after the send
