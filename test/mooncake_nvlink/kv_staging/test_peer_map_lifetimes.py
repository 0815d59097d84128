"""How long the prefill keeps a decode's memory mapped (CPU, stand-in CUDA).

An opened CUDA IPC mapping keeps the decode's allocation alive: a decode that
restarts while the prefill still maps its old KV pool finds that memory gone
from its GPU. These tests drive the prefill's real send path (the kv_staging
hooks, ``SessionMappings``, ``CudaIpcTransport``) with the CUDA calls answered
by a stand-in that records every handle opened and closed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging
from sglang_dsv41.mooncake_nvlink.kv_staging.peer import CudaIpcTransport, PeerMap, PeerRegion, host_identity
from sglang_dsv41.mooncake_nvlink.routing import KindTable, MemoryKind, TransferRouter
from sglang_dsv41.mooncake_nvlink.state import RoutingState, set_routing_state

from _cuda_stand_in import StandInCuda, handle

MiB = 1 << 20
DECODE_KV = 0x7000_0000  # where every decode incarnation's KV pool starts, in its own process
PREFILL_KV = 0x1000_0000
PAGE = 4096


class RecordingCopy:
    """The GPU copy, recorded: the addresses are the stand-in's, nothing is written."""

    def __init__(self):
        self.batches = 0

    def copy_pages(self, copies):
        self.batches += 1


class Prefill:
    """A prefill transfer manager as the hooks see it, with peer writes on."""

    def __init__(self, monkeypatch, allocations, limit=None):
        monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
        monkeypatch.setenv("SGLANG_DSV41_KV_STAGING_MIN_BLOCKS", "1")
        self.cuda = StandInCuda(allocations)
        self.copier = RecordingCopy()
        kv_staging.set_peer_transport(CudaIpcTransport(self.copier, 0, runtime=self.cuda, driver=self.cuda))
        self.mgr = SimpleNamespace(disaggregation_mode=SimpleNamespace(value="prefill"),
                                   kv_args=SimpleNamespace(gpu_id=0), decode_kv_args_table={},
                                   failed_sessions=set())
        try:
            kv_staging.set_up(self.mgr)
        finally:
            kv_staging.set_peer_transport(None)
        kinds = KindTable([(PREFILL_KV, 16 * MiB, MemoryKind.DEVICE)], lambda ptr: MemoryKind.HOST)
        set_routing_state(self.mgr, RoutingState("test", None, TransferRouter(kinds, None), kinds))
        self.state = kv_staging.state_of(self.mgr)
        if limit is not None:
            self.state.mappings.limit = limit

    def register(self, session: str, endpoint: tuple, n: int) -> None:
        """A decode registers (as sglang's bootstrap thread does), its KV pool in allocation ``n``."""
        peer = PeerMap("cuda-ipc", host_identity(), (PeerRegion(DECODE_KV, 16 * MiB, 0, handle(n)),))
        info = SimpleNamespace(endpoint=endpoint[0], dst_port=endpoint[1])
        info.__dict__[kv_staging.PEER_MAP_ATTR] = peer
        self.mgr.decode_kv_args_table[session] = info

    def send(self, session: str) -> int:
        """One KV send of one page through the page path; upstream's send only ever learns its layout."""
        def upstream(mgr, **call):  # one buffer, page p to page q, as sglang's send builds it
            blocks = [(PREFILL_KV + int(p) * PAGE, DECODE_KV + int(q) * PAGE, PAGE)
                      for p, q in zip(call["prefill_data_indices"], call["dst_data_indices"])]
            assert kv_staging.captured(blocks), "went the direct way"
            return 0

        rc = kv_staging.around_send_kvcache_generic(
            upstream, self.mgr, session, [PREFILL_KV], [DECODE_KV], [PAGE], np.array([3], np.int32),
            np.array([5], np.int32), None)
        assert rc == 0
        return rc

    def open_allocations(self) -> int:
        return len(self.cuda.open)


def test_a_decode_restarted_five_times_on_its_endpoint_leaves_one_mapping(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(n): (64 * MiB, 0) for n in range(1, 7)})
    for incarnation in range(1, 7):  # each start: a new mooncake session id, a new KV allocation
        prefill.register(f"10.0.0.5:{17000 + incarnation}", ("10.0.0.5", 8998), incarnation)
        prefill.send(f"10.0.0.5:{17000 + incarnation}")
        assert prefill.open_allocations() == 1
        assert len(prefill.cuda.closed) == incarnation - 1
    assert prefill.state.mappings.sessions() == ["10.0.0.5:17006"]
    assert prefill.copier.batches == 6


def test_another_decode_rank_keeps_its_mapping(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0), handle(2): (64 * MiB, 0)})
    prefill.register("10.0.0.5:17001", ("10.0.0.5", 8998), 1)
    prefill.register("10.0.0.5:17002", ("10.0.0.5", 8999), 2)  # the next rank: another port
    prefill.send("10.0.0.5:17001")
    prefill.send("10.0.0.5:17002")
    assert prefill.open_allocations() == 2 and prefill.cuda.closed == []


def test_a_write_in_flight_keeps_the_old_mapping_until_it_is_done(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0), handle(2): (64 * MiB, 0)})
    prefill.register("s1", ("10.0.0.5", 8998), 1)
    prefill.send("s1")
    peer = getattr(prefill.mgr.decode_kv_args_table["s1"], kv_staging.PEER_MAP_ATTR)
    old, _ = prefill.state.mappings.target("s1", peer, None)
    assert old.acquire()  # a held write of the old incarnation is still being written
    prefill.register("s2", ("10.0.0.5", 8998), 2)
    prefill.send("s2")
    assert prefill.open_allocations() == 2 and prefill.cuda.closed == []
    old.release()
    assert prefill.open_allocations() == 1 and len(prefill.cuda.closed) == 1


def test_a_session_sglang_counts_failed_is_unmapped_and_mapped_again_when_it_recovers(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0), handle(2): (64 * MiB, 0)})
    prefill.register("dead", ("10.0.0.5", 8998), 1)
    prefill.register("alive", ("10.0.0.6", 8998), 2)
    prefill.send("dead")
    prefill.send("alive")
    prefill.mgr.failed_sessions.add("dead")  # sglang's transfer failures blacklisted it
    prefill.state.next_sweep = 0.0
    prefill.send("alive")
    assert prefill.open_allocations() == 1 and prefill.state.mappings.sessions() == ["alive"]
    prefill.mgr.failed_sessions.clear()  # sglang's probe found it alive again
    prefill.send("dead")
    assert prefill.open_allocations() == 2


def test_the_number_of_mapped_sessions_is_bounded(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(n): (64 * MiB, 0) for n in range(1, 5)}, limit=2)
    for n in range(1, 5):
        prefill.register(f"s{n}", (f"10.0.0.{n}", 8998), n)
        prefill.send(f"s{n}")
    assert prefill.state.mappings.sessions() == ["s3", "s4"]
    assert prefill.open_allocations() == 2 and len(prefill.cuda.closed) == 2


def test_teardown_closes_every_mapping(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0), handle(2): (64 * MiB, 0)})
    for n in (1, 2):
        prefill.register(f"s{n}", (f"10.0.0.{n}", 8998), n)
        prefill.send(f"s{n}")
    assert kv_staging.after_teardown(None, prefill.mgr) is None
    assert prefill.open_allocations() == 0 and len(prefill.state.mappings) == 0


@pytest.fixture(autouse=True)
def _no_injection():
    yield
    kv_staging.set_peer_transport(None)
