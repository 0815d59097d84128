"""The page path of KV peer writes against sglang 0.5.23's own send code.

``mooncake_nvlink.kv_staging.hooks.around_send_kvcache_generic`` learns a call's buffer
pairing from upstream's ``MooncakeKVManager._send_kvcache_generic`` (a dry run
for one page that the transfer hook keeps from the engine) and writes the
call's pages in one peer write. Here the real upstream method runs on a
manager built without its constructor (no engine, no threads); the transfer
funnel is the plugin's real hook in front of a recording engine, and the peer
transport records writes into an identity mapping. For each layout upstream
handles (plain MLA, layer-id pairing, K/V halves, a pipeline stage, an
elided entry) the peer write must be exactly the block list upstream hands
the engine for the same call with the page path off.
"""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import numpy as np
import pytest

from _paged import runs_of_paged
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, StateType

from sglang_dsv41.mooncake_nvlink.kv_staging.mappings import SessionMappings
from sglang_dsv41.mooncake_nvlink.kv_staging.setting import StagingConfig
from sglang_dsv41.mooncake_nvlink.routing import KindTable, MemoryKind, TransferRouter
from sglang_dsv41.mooncake_nvlink.state import RoutingState, set_routing_state
from sglang_dsv41.mooncake_nvlink.kv_staging.peer import HANDLE_BYTES, PeerMap, PeerRegion, PeerTarget, host_identity
from sglang_dsv41 import metrics
from sglang_dsv41.mooncake_nvlink.kv_staging import held
from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging
from sglang_dsv41.mooncake_nvlink import hooks as mooncake_nvlink

SESSION = "127.0.0.1:17000"
BUF = 1 << 20  # bytes per buffer, both sides
SRC0, DST0 = 0x10_0000_0000, 0x20_0000_0000


class _IdentityTransport:
    """Records peer writes; the peer's addresses are used as they are (a stand-in for the mapping)."""

    kind = "host-cma"

    def __init__(self):
        self.writes = []

    def open(self, peer):
        return PeerTarget(peer, [r.ptr for r in peer.regions], self, [])

    def write_pages(self, target, copies):  # recorded as the runs upstream's block list would hold
        if getattr(self, "fail", False):
            raise RuntimeError("injected peer write failure")
        self.writes.append(runs_of_paged(copies))

    def close(self, opened):
        pass


def _manager(entries: int, dst_entries: int, *, mla=True, start_layer=0, end_layer=None, ratios=None,
             page_path=True, min_blocks=1):
    """A real MooncakeKVManager object without its constructor: what the send path reads, no engine."""
    mgr = MooncakeKVManager.__new__(MooncakeKVManager)
    mgr.__dict__.update(
        is_mla_backend=mla, is_hybrid_mla_backend=False, state_strides_validated=set(), pp_size=1,
        enable_custom_mem_pool=False, custom_mem_pool_type=None, max_transfer_batch_indices=0,
        kv_args=SimpleNamespace(prefill_start_layer=start_layer,
                                prefill_end_layer=start_layer + entries if end_layer is None else end_layer,
                                num_draft_entries=0, mla_compression_ratios=ratios),
    )
    mgr.failures = []
    mgr.conclude_failure = lambda **kw: mgr.failures.append(kw)
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr.request_status = {room: KVPoll.Transferring for room in (1, 3, 7)}  # the rooms the tests send
    src = [SRC0 + k * BUF for k in range(entries)]
    dst = [DST0 + k * BUF for k in range(dst_entries)]
    engine = []

    def engine_write(self, session, blocks):
        engine.append(list(blocks))
        return 0

    # the funnel as the patch table installs it: the plugin's hook in front of the engine
    mgr._transfer_data = lambda session, blocks: mooncake_nvlink.around_transfer_data(
        engine_write, mgr, session, blocks)
    kinds = KindTable([(p, BUF, MemoryKind.DEVICE) for p in src], lambda ptr: MemoryKind.HOST)
    set_routing_state(mgr, RoutingState(
        "test", None, TransferRouter(kinds, None), kinds))
    transport = _IdentityTransport()
    if page_path:
        mgr.__dict__["_dsv41_kv_staging"] = kv_staging.StagingState(
            StagingConfig(min_blocks=min_blocks), transport, mappings=SessionMappings(transport))
    peer = PeerMap("host-cma", host_identity(),
                   tuple(PeerRegion(p, BUF, 0, b"h" * HANDLE_BYTES) for p in dst))
    mgr.decode_kv_args_table = {SESSION: SimpleNamespace(**{kv_staging.PEER_MAP_ATTR: peer})}
    return mgr, src, dst, engine, transport


def _send(mgr, src, dst, item_lens, pages, executor=None, **kw):
    def original(self, **call):
        return MooncakeKVManager._send_kvcache_generic(self, **call)

    src_pages, dst_pages = pages
    return kv_staging.around_send_kvcache_generic(
        original, mgr, mooncake_session_id=SESSION, src_data_ptrs=src, dst_data_ptrs=dst,
        item_lens=item_lens, prefill_data_indices=np.array(src_pages, dtype=np.int32),
        dst_data_indices=np.array(dst_pages, dtype=np.int32), executor=executor, **kw)


PAGES = ([3, 4, 5, 9, 10, 30, 31, 40], [8, 9, 10, 2, 40, 41, 42, 50])
LONG = (list(range(100, 400, 2)) + [7, 8, 9], list(range(500, 650)) + [1, 2, 3])
LAYOUTS = {
    # name: (src entries, dst entries, manager options, item lens, send options)
    "mla": (4, 4, {}, [256, 512, 128, 64], {}),
    "layer_ids": (4, 4, {}, [256] * 4, dict(src_layer_ids=[0, 1, 2, 3], dst_layer_ids=[3, 2, 1, 0])),
    "k_and_v_halves": (4, 4, dict(mla=False), [256] * 4, {}),
    "pipeline_stage": (2, 6, dict(start_layer=3), [256, 256], {}),
    "elided_entry": (3, 3, {}, [256, 0, 128], {}),
    # DeepSeek-V4 compressed KV under pipeline parallelism: layers 2-3 of ratios (4, 128, 4, 4) on
    # this stage (their KV and indexer buffers), the decode holding all seven of the model's
    "compressed_stage": (4, 7, dict(start_layer=2, end_layer=4, ratios=[4, 128, 4, 4]), [256, 256, 64, 64], {}),
    # a sliding-window state send whose decode strides are checked by upstream first
    "window_state": (5, 5, {}, [512] * 5, dict(state_type=StateType.SWA, dst_item_lens=[512] * 5,
                                               bootstrap_room=7)),
}


@pytest.mark.parametrize("pages", [PAGES, LONG], ids=["short", "long"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_peer_write_is_the_block_list_upstream_would_send(layout, pages):
    n_src, n_dst, options, item_lens, send = LAYOUTS[layout]
    mgr, src, dst, engine, transport = _manager(n_src, n_dst, **options)
    assert _paths(lambda: _send(mgr, src, dst, item_lens, pages, **send)) == {"peer_pages": 1}
    assert engine == []  # the dry run reached no engine
    assert len(transport.writes) == 1
    stock, _, _, stock_engine, _ = _manager(n_src, n_dst, page_path=False, **options)
    # (the same call with KV staging off: what upstream hands the engine)
    assert _send(stock, src, dst, item_lens, pages, **send) == 0
    assert [tuple(b) for b in stock_engine[0]] == transport.writes[0]


def test_a_send_upstream_refuses_is_refused_once_and_written_nowhere():
    # decode strides that differ from prefill's: upstream concludes the request failed
    mgr, src, dst, engine, transport = _manager(5, 5)
    bad = dict(state_type=StateType.SWA, dst_item_lens=[512] * 4 + [1024], bootstrap_room=7)
    assert _send(mgr, src, dst, [512] * 5, PAGES, **bad) == -1
    assert [f["bootstrap_room"] for f in mgr.failures] == [7]  # concluded once, by the dry run
    assert "mismatch" in mgr.failures[0]["failure_reason"]
    assert transport.writes == [] and engine == []


def test_a_call_kind_is_learnt_once_and_again_when_its_lists_change(monkeypatch):
    mgr, src, dst, engine, transport = _manager(4, 4)
    learnt = []
    capture = kv_staging.capture_layout

    def counting(original, manager, call):
        learnt.append(list(call["dst_data_ptrs"]))
        return capture(original, manager, call)

    monkeypatch.setattr(kv_staging, "capture_layout", counting)
    for _ in range(3):
        assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    assert len(learnt) == 1
    moved = dst[::-1]  # the decode registered again: its buffers elsewhere
    assert _send(mgr, src, moved, [256] * 4, PAGES) == 0
    assert learnt == [dst, moved]
    assert transport.writes[-1][0][1] == moved[0] + 8 * 256  # entry 0, first run's destination
    assert len(transport.writes) == 4 and engine == []
    # two kinds of call in turns (here: other page sizes) are each learnt once
    for _ in range(3):
        assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
        assert _send(mgr, src, dst, [512] * 4, PAGES) == 0
    assert learnt == [dst, moved, dst]
    assert transport.writes[-1][0][2] == 3 * 512 and transport.writes[-2][0][2] == 3 * 256
    # the decode registers again with the same buffers (a new map, a new mapping): nothing is
    # learnt again, but each kind of call is checked against the new mapping before its next write
    info = mgr.decode_kv_args_table[SESSION]
    old_map = getattr(info, kv_staging.PEER_MAP_ATTR)
    setattr(info, kv_staging.PEER_MAP_ATTR, PeerMap(old_map.kind, old_map.host, old_map.regions))
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    assert len(learnt) == 3
    new_target, _ = kv_staging.state_of(mgr).mappings.target(SESSION, getattr(info, kv_staging.PEER_MAP_ATTR))
    checked = [c.checked for c in kv_staging.state_of(mgr).layouts.values() if c.checked[0] is new_target]
    assert len(checked) == 1 and checked[0][1].target is new_target


def _paths(fn) -> dict:
    """How the transfer batches sent while ``fn`` ran went (kv_staging_batches by path)."""
    before = dict(metrics.totals().get("kv_staging_batches", {}))
    assert fn() == 0
    after = metrics.totals().get("kv_staging_batches", {})
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_calls_the_page_path_does_not_cover_go_the_direct_way_counted():
    # fewer blocks than the threshold
    mgr, src, dst, engine, transport = _manager(2, 2, min_blocks=64)
    assert _paths(lambda: _send(mgr, src, dst, [256, 256], PAGES)) == {"few_blocks": 1}
    assert transport.writes == [] and len(engine) == 1 and len(engine[0]) == 2 * 5
    # separate destination pages for some buffers (a hierarchical sparse pool): the block list
    # upstream builds, to the engine as it was
    mgr, src, dst, engine, transport = _manager(2, 2)
    assert _paths(lambda: _send(mgr, src, dst, [256, 256], PAGES, dst_device_data_indices=np.array(PAGES[1]),
                                dst_device_data_ptrs=set())) == {"block_path": 1}
    assert transport.writes == [] and len(engine) == 1 and len(engine[0]) == 2 * 5
    # a source in host memory (the first buffer is outside the kind table's device regions):
    # the router sends the device buffer's blocks to the engine and the host ones as frames,
    # which fail here (this stand-in has no transfer info to find the decode's endpoint)
    mgr, src, dst, engine, transport = _manager(2, 2)
    src = [SRC0 - BUF] + src[1:]
    before = dict(metrics.totals().get("kv_staging_batches", {}))
    assert _send(mgr, src, dst, [256, 256], PAGES) == -1
    assert metrics.totals()["kv_staging_batches"]["source_not_device"] == before.get("source_not_device", 0) + 1
    assert transport.writes == [] and [len(b) for b in engine] == [5]
    assert {s for s, _, _ in engine[0]} <= set(range(src[1], src[1] + BUF))


def test_layer_by_layer_sends_on_upstreams_thread_pool_are_left_alone():
    # A dry run on this thread would not see sends made on the pool's threads:
    # such a call must not be learnt, and its layers reach the engine as before.
    mgr, src, dst, engine, transport = _manager(2, 2)
    mgr.enable_custom_mem_pool, mgr.custom_mem_pool_type = True, "NVSHMEM"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert _paths(lambda: _send(mgr, src, dst, [256, 256], PAGES, executor=pool)) == {"block_path": 2}
    assert sorted(len(b) for b in engine) == [5, 5] and transport.writes == []


# --- a last chunk's sends held for one write


def _worker_queue():
    """A transfer worker's queue as the worker hook hands it to upstream's loop."""
    from sglang.srt.disaggregation.common.utils import FastQueue

    return held.ChunkAwareQueue(FastQueue())


def _take(queue, last: bool):
    queue.put(SimpleNamespace(is_last_chunk=last, room=1))
    return queue.get()


def _held_writes() -> dict:
    return dict(metrics.totals().get("kv_staging_held_writes", {}))


def _delta(before: dict) -> dict:
    after = _held_writes()
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


@pytest.fixture()
def worker_thread():
    """This test's thread plays a transfer worker; nothing held, and no room, leaks into other tests."""
    yield
    queue = _worker_queue()
    queue.put(SimpleNamespace(is_last_chunk=False))  # a chunk of no room: off a worker again
    queue.get()


def test_a_last_chunks_kv_and_state_sends_land_as_one_write_when_the_state_sends_return(worker_thread):
    mgr, src, dst, engine, transport = _manager(4, 4)
    stock, _, _, stock_engine, _ = _manager(4, 4, page_path=False)
    state_pages = ([1], [2])
    for m in (stock, None):  # upstream's block lists for the same two sends, then the held path
        if m is not None:
            assert _send(m, src, dst, [256] * 4, PAGES) == 0
            assert _send(m, src, dst, [512] * 4, state_pages, state_type=StateType.SWA,
                         dst_item_lens=[512] * 4, bootstrap_room=1) == 0
    queue, before = _worker_queue(), _held_writes()
    _take(queue, last=True)

    def state_sends(self):  # maybe_send_extra's body: one generic state send
        rc = _send(self, src, dst, [512] * 4, state_pages, state_type=StateType.SWA,
                   dst_item_lens=[512] * 4, bootstrap_room=1)
        assert transport.writes == []  # still held while the state sends run
        return rc

    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    assert transport.writes == []
    assert kv_staging.around_maybe_send_extra(state_sends, mgr) == 0
    assert transport.writes == [stock_engine[0] + stock_engine[1]] and engine == []
    assert _delta(before) == {"written": 1}
    # the next chunk is not a last one: its send is written at once
    _take(queue, last=False)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    assert len(transport.writes) == 2 and _delta(before) == {"written": 1}


def test_held_writes_land_before_a_success_status_and_fail_it_when_they_fail(worker_thread):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, src, dst, engine, transport = _manager(4, 4)
    queue, before = _worker_queue(), _held_writes()
    concluded = []

    def conclude(self, **kw):  # what upstream's conclusion sees when it sends the status
        concluded.append((kw["status"], kw["failure_reason"], len(transport.writes)))

    _take(queue, last=True)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    kv_staging.around_conclude_transfer(conclude, mgr, bootstrap_room=1, status=KVPoll.Success)
    assert concluded[-1] == (KVPoll.Success, None, 1)  # the bytes before the status
    # a write that fails turns the success into the request's failure
    _take(queue, last=True)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    transport.fail = True
    kv_staging.around_conclude_transfer(conclude, mgr, bootstrap_room=1, status=KVPoll.Success)
    status, reason, writes = concluded[-1]
    assert status == KVPoll.Failed and "peer write" in reason and writes == 1
    # a failure status: what is held is dropped, nothing written into pages about to be freed
    transport.fail = False
    _take(queue, last=True)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    kv_staging.around_conclude_transfer(conclude, mgr, bootstrap_room=1, status=KVPoll.Failed,
                                        failure_reason="decode gone")
    assert concluded[-1] == (KVPoll.Failed, "decode gone", 1)
    assert _delta(before) == {"written": 1, "failed": 1, "dropped": 1}
    assert engine == []


def test_a_page_outside_its_buffers_fails_the_request_with_nothing_written(worker_thread):
    mgr, src, dst, engine, transport = _manager(2, 2)
    far = ([1, 2], [BUF // 256 - 1, BUF // 256])  # the second destination page is past the map
    before = dict(metrics.totals().get("kv_staging_batches", {}))
    assert _send(mgr, src, dst, [256, 256], far) == -1  # off a transfer worker: sglang's own failure
    _take(_worker_queue(), last=False)  # on one: the room concluded failed, the session kept
    assert _send(mgr, src, dst, [256, 256], far) == 0
    assert [f["bootstrap_room"] for f in mgr.failures] == [1] and "destination page" in mgr.failures[0]["failure_reason"]
    assert transport.writes == [] and engine == []
    assert metrics.totals()["kv_staging_batches"]["failed"] == before.get("failed", 0) + 2


def test_a_held_page_past_the_decodes_map_fails_the_request_with_nothing_written(worker_thread):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, src, dst, engine, transport = _manager(2, 2)
    queue, before = _worker_queue(), _held_writes()
    concluded = []

    def conclude(self, **kw):
        concluded.append((kw["status"], kw["failure_reason"], len(transport.writes)))

    _take(queue, last=True)
    far = ([1, 2], [BUF // 256 - 1, BUF // 256])  # the second destination page is past the map
    assert _send(mgr, src, dst, [256, 256], PAGES) == 0  # a good send held first
    assert _send(mgr, src, dst, [256, 256], far) == 0  # held: its pages are checked when written
    kv_staging.around_conclude_transfer(conclude, mgr, bootstrap_room=1, status=KVPoll.Success)
    status, reason, writes = concluded[-1]
    assert status == KVPoll.Failed and f"destination page {BUF // 256}" in reason
    assert writes == 0 and engine == []  # neither send written, nothing sent the block way
    assert _delta(before) == {"failed": 1}


def test_held_writes_are_never_written_late_or_after_a_failed_state_send(worker_thread):
    mgr, src, dst, engine, transport = _manager(4, 4)
    queue, before = _worker_queue(), _held_writes()
    # still held when the worker takes its next chunk: dropped, not written
    _take(queue, last=True)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    _take(queue, last=False)
    assert transport.writes == [] and _delta(before) == {"dropped": 1}
    # a state send that failed, or raised: upstream fails the request; the held KV is dropped
    for body, outcome in ((lambda self: -1, -1), (lambda self: 1 / 0, ZeroDivisionError)):
        _take(queue, last=True)
        assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
        if outcome == -1:
            assert kv_staging.around_maybe_send_extra(body, mgr) == -1
        else:
            with pytest.raises(outcome):
                kv_staging.around_maybe_send_extra(body, mgr)
    assert transport.writes == [] and _delta(before) == {"dropped": 3}
    # a held write that fails fails its request (concluded here), not the decode session:
    # sglang is told the state sends returned, so it does not give up on the whole decode
    _take(queue, last=True)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    transport.fail = True
    assert kv_staging.around_maybe_send_extra(lambda self: 0, mgr) == 0
    assert [f["bootstrap_room"] for f in mgr.failures] == [1] and "peer write" in mgr.failures[0]["failure_reason"]
    assert _delta(before) == {"dropped": 3, "failed": 1} and engine == []
    # and every later send of that room on this worker is dropped, the block way included
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0 and engine == [] and transport.writes == []


def test_a_room_aborted_while_its_sends_were_held_gets_nothing_written(worker_thread):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, src, dst, engine, transport = _manager(4, 4)
    queue, before = _worker_queue(), _held_writes()
    _take(queue, last=True)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    mgr.request_status[1] = KVPoll.Failed  # the decode aborted the request meanwhile
    assert kv_staging.around_maybe_send_extra(lambda self: 0, mgr) == 0
    assert transport.writes == [] and _delta(before) == {"dropped": 1}
    _take(queue, last=True)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    del mgr.request_status[1]  # cleared: a room that no longer exists gets nothing either
    seen = []
    kv_staging.around_conclude_transfer(lambda self, **kw: seen.append(kw), mgr, bootstrap_room=1,
                                        status=KVPoll.Success)
    assert transport.writes == [] and _delta(before) == {"dropped": 2} and len(seen) == 1


def test_a_room_cleared_between_two_looks_never_raises_into_the_worker(worker_thread):
    from sglang.srt.disaggregation.base.conn import KVPoll

    class ClearedAfterAMembershipTest(dict):  # sglang's sender clears the room right after one look
        def __contains__(self, room):
            found = dict.__contains__(self, room)
            self.pop(room, None)
            return found

    mgr, src, dst, engine, transport = _manager(4, 4)
    queue, before = _worker_queue(), _held_writes()
    _take(queue, last=True)
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0
    mgr.request_status = ClearedAfterAMembershipTest({1: KVPoll.Transferring})
    assert kv_staging.around_maybe_send_extra(lambda self: 0, mgr) == 0  # one look: no KeyError
    assert len(transport.writes) == 1 and _delta(before) == {"written": 1}


def test_threads_that_hold_nothing_pass_through_unchanged(worker_thread):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, src, dst, engine, transport = _manager(4, 4)
    held.hold(None)  # not a transfer worker: sends are written at once
    assert _send(mgr, src, dst, [256] * 4, PAGES) == 0 and len(transport.writes) == 1
    seen = []
    kv_staging.around_conclude_transfer(lambda self, **kw: seen.append(kw), mgr, bootstrap_room=3,
                                        status=KVPoll.Success)
    assert seen == [dict(bootstrap_room=3, status=KVPoll.Success, targets=None, failure_reason=None)]
    assert kv_staging.around_maybe_send_extra(lambda self, *a: 5, mgr, 1) == 5
