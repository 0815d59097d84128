"""How long the prefill keeps a decode's memory mapped (CPU, stand-in CUDA).

An opened CUDA IPC mapping keeps the decode's allocation alive: a decode that
restarts while the prefill still maps its old KV pool finds that memory gone
from its GPU. These tests drive the prefill's real send path (the kv_staging
hooks, ``SessionMappings``, ``CudaIpcTransport``) with the CUDA calls answered
by a stand-in that records every handle opened and closed.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_dsv41 import metrics
from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging
from sglang_dsv41.mooncake_nvlink.kv_staging.mappings import PROBE_MISSES
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

    def __init__(self, monkeypatch, allocations, limit=None, probing=False):
        monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
        monkeypatch.setenv("SGLANG_DSV41_KV_STAGING_MIN_BLOCKS", "1")
        self.cuda = StandInCuda(allocations)
        self.copier = RecordingCopy()
        kv_staging.set_peer_transport(CudaIpcTransport(self.copier, 0, runtime=self.cuda, driver=self.cuda))
        self.alive: set[str] = set()  # sessions whose decode answers sglang's probe
        self.probed: list[str] = []
        self.mgr = SimpleNamespace(disaggregation_mode=SimpleNamespace(value="prefill"),
                                   kv_args=SimpleNamespace(gpu_id=0), decode_kv_args_table={},
                                   failed_sessions=set(), session_failures=defaultdict(int),
                                   session_lock=threading.Lock(), _send_probe=self._probe)
        try:
            kv_staging.set_up(self.mgr)
        finally:
            kv_staging.set_peer_transport(None)
        kinds = KindTable([(PREFILL_KV, 16 * MiB, MemoryKind.DEVICE)], lambda ptr: MemoryKind.HOST)
        set_routing_state(self.mgr, RoutingState("test", None, TransferRouter(kinds, None), kinds))
        self.state = kv_staging.state_of(self.mgr)
        if limit is not None:
            self.state.mappings.limit = limit
        if not probing:
            self.state.stopped.set()  # the test runs each probe pass itself

    def _probe(self, session: str) -> int:  # sglang's probe: 0 when the decode's engine answers
        self.probed.append(session)
        return 0 if session in self.alive else -102

    def register(self, session: str, n: int, peer_map: bool = True) -> None:
        """A decode registers (as sglang's bootstrap thread does), its KV pool in allocation ``n``."""
        info = SimpleNamespace()
        if peer_map:
            info.__dict__[kv_staging.PEER_MAP_ATTR] = PeerMap(
                "cuda-ipc", host_identity(), (PeerRegion(DECODE_KV, 16 * MiB, 0, handle(n)),))
        self.mgr.decode_kv_args_table[session] = info
        self.alive.add(session)

    def probe(self, passes: int = 1) -> list[str]:
        return [s for _ in range(passes) for s in kv_staging.probe_mapped_decodes(self.mgr, self.state)]

    def send(self, session: str, direct: bool = False) -> int:
        """One KV send of one page: through the page path (upstream's send only learns its
        layout), or, ``direct``, upstream's send as it was."""
        def upstream(mgr, **call):  # one buffer, page p to page q, as sglang's send builds it
            blocks = [(PREFILL_KV + int(p) * PAGE, DECODE_KV + int(q) * PAGE, PAGE)
                      for p, q in zip(call["prefill_data_indices"], call["dst_data_indices"])]
            assert kv_staging.captured(blocks) != direct, "went the wrong way"
            return 0

        rc = kv_staging.around_send_kvcache_generic(
            upstream, self.mgr, session, [PREFILL_KV], [DECODE_KV], [PAGE], np.array([3], np.int32),
            np.array([5], np.int32), None)
        assert rc == 0
        return rc

    def open_allocations(self) -> int:
        return len(self.cuda.open)


def test_a_decode_restarted_five_times_leaves_one_mapping(monkeypatch):
    # Each start: a new mooncake session id, new ports (sglang binds them at random) and a new
    # KV allocation; the old incarnation's process is gone, so its engine stops answering.
    prefill = Prefill(monkeypatch, {handle(n): (64 * MiB, 0) for n in range(1, 7)})
    before = metrics.totals().get("kv_staging_peer_maps", {}).get("decode_gone", 0)
    for incarnation in range(1, 7):
        session = f"10.0.0.5:{17000 + 97 * incarnation}"
        if incarnation > 1:
            prefill.alive.discard(f"10.0.0.5:{17000 + 97 * (incarnation - 1)}")  # the old process died
            assert prefill.probe(PROBE_MISSES - 1) == [] and prefill.open_allocations() == 1
            assert prefill.probe() == [f"10.0.0.5:{17000 + 97 * (incarnation - 1)}"]
            assert prefill.open_allocations() == 0
        prefill.register(session, incarnation)
        prefill.send(session)
        assert prefill.open_allocations() == 1
        assert len(prefill.cuda.closed) == incarnation - 1
    assert prefill.state.mappings.sessions() == ["10.0.0.5:17582"]
    assert prefill.copier.batches == 6
    # each dead incarnation is counted failed with sglang, as a failed transfer would count it
    assert prefill.mgr.failed_sessions == {f"10.0.0.5:{17000 + 97 * n}" for n in range(1, 6)}
    assert set(prefill.mgr.session_failures.values()) == {1}
    assert metrics.totals()["kv_staging_peer_maps"]["decode_gone"] - before == 5


def test_a_decode_that_answers_keeps_its_mapping_and_a_missed_probe_is_forgiven(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0)})
    prefill.register("s1", 1)
    prefill.send("s1")
    for _ in range(3):
        prefill.alive.discard("s1")  # a probe lost once in a while
        assert prefill.probe(PROBE_MISSES - 1) == []
        prefill.alive.add("s1")
        assert prefill.probe() == []
    assert prefill.open_allocations() == 1 and prefill.mgr.failed_sessions == set()
    assert prefill.probed.count("s1") == 3 * PROBE_MISSES


def test_only_mapped_sessions_are_probed(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0)})
    prefill.register("mapped", 1)
    prefill.register("unsent", 2)  # registered, never sent to: nothing mapped, nothing to free
    prefill.send("mapped")
    prefill.probe()
    assert prefill.probed == ["mapped"]


def test_the_prefill_probes_on_a_thread_of_its_own_until_teardown(monkeypatch):
    import time

    monkeypatch.setattr(kv_staging, "PROBE_INTERVAL_S", 0.01)
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0)}, probing=True)
    prober = prefill.state.prober
    assert prober.name == "dsv41-kv-peer-probe" and prober.daemon and prober.is_alive()
    prefill.register("s1", 1)
    prefill.send("s1")
    prefill.alive.discard("s1")
    deadline = time.monotonic() + 10
    while "s1" not in prefill.mgr.failed_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefill.mgr.failed_sessions == {"s1"} and prefill.open_allocations() == 0
    kv_staging.after_teardown(None, prefill.mgr)
    prober.join(5)
    assert not prober.is_alive()


def test_a_write_in_flight_keeps_the_old_mapping_until_it_is_done(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0), handle(2): (64 * MiB, 0)})
    prefill.register("s1", 1)
    prefill.send("s1")
    peer = getattr(prefill.mgr.decode_kv_args_table["s1"], kv_staging.PEER_MAP_ATTR)
    old, _ = prefill.state.mappings.target("s1", peer)
    assert old.acquire()  # a held write of the old incarnation is still being written
    prefill.alive.discard("s1")
    prefill.register("s2", 2)
    prefill.send("s2")
    assert prefill.probe(PROBE_MISSES) == ["s1"]
    assert prefill.open_allocations() == 2 and prefill.cuda.closed == []
    old.release()
    assert prefill.open_allocations() == 1 and len(prefill.cuda.closed) == 1


def test_a_session_sglang_counts_failed_is_unmapped_and_mapped_again_when_it_recovers(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0), handle(2): (64 * MiB, 0)})
    prefill.register("dead", 1)
    prefill.register("alive", 2)
    prefill.send("dead")
    prefill.send("alive")
    prefill.mgr.failed_sessions.add("dead")  # sglang's transfer failures blacklisted it
    assert prefill.probe() == []  # let go for sglang's verdict, not probed
    assert prefill.open_allocations() == 1 and prefill.state.mappings.sessions() == ["alive"]
    prefill.mgr.failed_sessions.clear()  # sglang's probe found it alive again
    prefill.send("dead")
    assert prefill.open_allocations() == 2


def test_the_number_of_mapped_sessions_is_bounded(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(n): (64 * MiB, 0) for n in range(1, 5)}, limit=2)
    for n in range(1, 5):
        prefill.register(f"s{n}", n)
        prefill.send(f"s{n}")
    assert prefill.state.mappings.sessions() == ["s3", "s4"]
    assert prefill.open_allocations() == 2 and len(prefill.cuda.closed) == 2


def test_teardown_closes_every_mapping(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0), handle(2): (64 * MiB, 0)})
    for n in (1, 2):
        prefill.register(f"s{n}", n)
        prefill.send(f"s{n}")
    assert kv_staging.after_teardown(None, prefill.mgr) is None
    assert prefill.open_allocations() == 0 and len(prefill.state.mappings) == 0
    # a worker still draining its queue after teardown maps nothing again: its sends go direct
    prefill.send("s1", direct=True)
    assert prefill.open_allocations() == 0 and len(prefill.state.mappings) == 0


def test_a_registration_without_a_map_lets_the_older_mapping_go(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0)})
    prefill.register("s1", 1)
    prefill.send("s1")
    prefill.register("s1", 2, peer_map=False)  # registered again without peer writes (or a bad map)
    prefill.send("s1", direct=True)
    assert prefill.open_allocations() == 0 and len(prefill.state.mappings) == 0


def test_closing_gives_back_every_reference_even_when_the_driver_fails(monkeypatch):
    prefill = Prefill(monkeypatch, {handle(1): (64 * MiB, 0), handle(2): (64 * MiB, 0)})
    two = PeerMap("cuda-ipc", host_identity(), (PeerRegion(DECODE_KV, MiB, 0, handle(1)),
                                                PeerRegion(DECODE_KV + 2 * MiB, MiB, 0, handle(2))))
    info = SimpleNamespace(**{kv_staging.PEER_MAP_ATTR: two})
    prefill.mgr.decode_kv_args_table["s1"] = info
    prefill.send("s1")
    assert prefill.open_allocations() == 2
    prefill.cuda.lib.cudaSetDevice = lambda device: 999  # a sticky error on the prefill's GPU
    prefill.cuda.lib.cudaIpcCloseMemHandle = lambda ptr: prefill.cuda.closed.append(ptr.value) or 999
    prefill.register("s1", 1, peer_map=False)
    prefill.send("s1", direct=True)  # lets the mapping go: neither close raises into the worker
    transport = prefill.state.transport
    assert transport.open_mappings == 0 and len(prefill.cuda.closed) == 2


@pytest.fixture(autouse=True)
def _no_injection():
    yield
    kv_staging.set_peer_transport(None)
