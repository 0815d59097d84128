"""KV peer writes' set-up in a transfer manager fails closed, naming the setting.

``kv_staging.hooks.set_up`` runs inside the manager's registration
(MC-NVL-REGIONS). Asked for but impossible (a bad or removed value, no Triton on
the prefill, memory the decode cannot export), it stops the manager with one
message instead of silently sending directly; the loader refuses a bad value
before the model loads.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import numpy as np

from host_peer import HostCmaTransport
from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging


def _manager(mode: str):
    return SimpleNamespace(disaggregation_mode=SimpleNamespace(value=mode),
                           kv_args=SimpleNamespace(gpu_id=0), _send_probe=lambda session: 0)


@pytest.fixture(autouse=True)
def _no_injection():
    kv_staging.set_peer_transport(None)
    yield
    kv_staging.set_peer_transport(None)


def test_off_means_nothing_is_set_up(monkeypatch):
    monkeypatch.delenv("SGLANG_DSV41_KV_STAGING", raising=False)
    manager = _manager("decode")
    assert kv_staging.set_up(manager) is None
    assert kv_staging.state_of(manager) is None


@pytest.mark.parametrize("env, refusal", [
    ({"SGLANG_DSV41_KV_STAGING": "1"}, "SGLANG_DSV41_KV_STAGING=1 \\(slot staging\\) was removed.*set SGLANG_DSV41_KV_STAGING=peer"),
    ({"SGLANG_DSV41_KV_STAGING": "yes"}, "'yes': use peer"),
    ({"SGLANG_DSV41_KV_STAGING": "peer", "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS": "many"}, "'many' is not an integer"),
    ({"SGLANG_DSV41_KV_STAGING": "peer", "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS": "0"}, "outside 1..1048576"),
    ({"SGLANG_DSV41_KV_STAGING": "peer", "SGLANG_DSV41_KV_STAGING_SLOTS": "8"}, "SLOTS belonged to slot staging"),
    ({"SGLANG_DSV41_KV_STAGING_SLOT_MB": "32"}, "SLOT_MB belonged to slot staging.*unset it"),
])
def test_a_bad_or_removed_value_stops_the_manager_naming_it(monkeypatch, env, refusal):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=refusal):
        kv_staging.set_up(_manager("prefill"))


def test_the_loader_refuses_slot_staging_before_anything_else_starts():
    import subprocess
    import sys

    env = {**os.environ, "SGLANG_DSV41_KV_STAGING": "1"}
    run = subprocess.run([sys.executable, "-c", "from sglang_dsv41.loader import activate; activate()"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "refusing to start: kv_staging patches (MC-KVS-*): SGLANG_DSV41_KV_STAGING=1 (slot staging) was removed" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_copy_without_triton_is_refused_on_the_prefill(monkeypatch):
    import sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy as batch_copy

    def without_triton(device):
        raise batch_copy.BatchCopyError("the batched copy needs Triton, which does not import: no module")

    monkeypatch.setattr(batch_copy, "CudaBatchCopy", without_triton)
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
    with pytest.raises(RuntimeError, match="=peer but the prefill side cannot set up peer writes.*Triton"):
        kv_staging.set_up(_manager("prefill"))


def test_a_prefill_manager_without_sglangs_probe_is_refused_before_building_anything(monkeypatch):
    import sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy as batch_copy

    built = []
    monkeypatch.setattr(batch_copy, "CudaBatchCopy", lambda device: built.append(device))
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
    manager = _manager("prefill")
    del manager._send_probe  # a release whose manager cannot probe a decode
    with pytest.raises(RuntimeError, match="=peer but the prefill side cannot set up peer writes.*_send_probe"):
        kv_staging.set_up(manager)
    assert built == [] and kv_staging.state_of(manager) is None


def test_sglangs_manager_has_the_probe_the_prefill_uses():
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    assert callable(MooncakeKVManager._send_probe)


# --- peer mode


class _FailingExport:
    kind = "cuda-ipc"

    def export(self, regions):
        from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PeerMapError

        raise PeerMapError("cudaIpcGetMemHandle failed: invalid argument")


def test_peer_mode_stops_a_decode_whose_memory_cannot_be_exported(monkeypatch):
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
    kv_staging.set_peer_transport(_FailingExport())
    with pytest.raises(RuntimeError) as exc:
        kv_staging.set_up(_manager("decode"), [(0x1000, 0x1000)])
    assert "SGLANG_DSV41_KV_STAGING=peer but the decode side cannot set up peer writes" in str(exc.value)
    assert "invalid argument" in str(exc.value)


def test_peer_mode_exports_the_registered_regions_and_only_the_prefill_builds_a_copier(monkeypatch):
    import sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy as batch_copy
    import sglang_dsv41.mooncake_nvlink.kv_staging.peer as peer

    class Transport(HostCmaTransport):  # CudaIpcTransport's place: its copier recorded
        def __init__(self, copier, device):
            super().__init__()
            self.copier = copier

    built = []
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
    monkeypatch.setattr(batch_copy, "CudaBatchCopy", lambda device: built.append(device) or "copier")
    monkeypatch.setattr(peer, "CudaIpcTransport", Transport)
    decode = _manager("decode")
    kv_staging.set_up(decode, [(0x10000, 0x2000), (0x40000, 0x100)])
    state = kv_staging.state_of(decode)
    assert [(r.ptr, r.length) for r in state.exported.regions] == [(0x10000, 0x2000), (0x40000, 0x100)]
    assert state.mappings is None and state.transport.copier is None and built == []  # a decode only exports
    prefill = _manager("prefill")
    kv_staging.set_up(prefill, [(0x90000, 0x100)])
    assert kv_staging.state_of(prefill).exported is None and kv_staging.state_of(prefill).transport.copier == "copier"
    assert built == [0] and kv_staging.state_of(prefill).config.min_blocks == 8


def test_a_new_registration_retires_the_old_mapping_and_an_unusable_map_is_not_retried(monkeypatch):
    """A restarted decode registers again under the same session with new handles."""
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PeerMap, PeerMapError, PeerRegion, PeerTarget, host_identity
    from sglang_dsv41.mooncake_nvlink.routing import KindTable, MemoryKind, TransferRouter
    from sglang_dsv41.mooncake_nvlink.state import RoutingState, set_routing_state

    class Recording:
        kind = "host-cma"

        def __init__(self):
            self.opened, self.closed, self.writes = [], [], 0

        def open(self, peer):
            if peer.regions[0].handle == b"bad".ljust(64, b"\0"):
                self.opened.append("refused")
                raise PeerMapError("cannot open")
            self.opened.append(peer.regions[0].handle[:3])
            return PeerTarget(peer, [0xA0000], self, [peer.regions[0].handle])

        def write_pages(self, target, copies):
            self.writes += 1

        def close(self, opened):
            self.closed.append(opened[0][:3])

    def peer_map(tag: bytes):
        return PeerMap("host-cma", host_identity(), (PeerRegion(0x10000, 0x1000, 0, tag.ljust(64, b"\0")),))

    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING_MIN_BLOCKS", "1")
    transport = Recording()
    kv_staging.set_peer_transport(transport)
    manager = _manager("prefill")
    kv_staging.set_up(manager)
    kinds = KindTable([(0x500, 0x1000, MemoryKind.DEVICE)], lambda ptr: MemoryKind.HOST)
    set_routing_state(manager, RoutingState("test", None, TransferRouter(kinds, None), kinds))
    info = SimpleNamespace()
    manager.decode_kv_args_table = {"decode:1": info}
    direct = []

    def upstream(mgr, **call):  # one 16-byte page of one buffer, as sglang's send builds it
        blocks = [(0x500, 0x10000, 16)]
        if not kv_staging.captured(blocks):
            direct.append(blocks)
        return 0

    def send():
        return kv_staging.around_send_kvcache_generic(upstream, manager, "decode:1", [0x500], [0x10000], [16],
                                                      np.array([0]), np.array([0]), None)

    info.__dict__[kv_staging.PEER_MAP_ATTR] = peer_map(b"one")
    assert send() == 0 and send() == 0
    assert transport.opened == [b"one"] and transport.writes == 2  # opened once, used twice
    info.__dict__[kv_staging.PEER_MAP_ATTR] = peer_map(b"two")  # the decode restarted
    assert send() == 0
    assert transport.opened == [b"one", b"two"] and transport.closed == [b"one"]
    info.__dict__[kv_staging.PEER_MAP_ATTR] = peer_map(b"bad")
    assert send() == 0 and send() == 0
    assert transport.opened == [b"one", b"two", "refused"]  # not retried for every send
    assert transport.closed == [b"one", b"two"] and len(direct) == 2 and transport.writes == 3
    del info.__dict__[kv_staging.PEER_MAP_ATTR]  # a decode without peer writes
    assert send() == 0 and len(direct) == 3
