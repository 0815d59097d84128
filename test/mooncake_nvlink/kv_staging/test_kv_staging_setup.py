"""KV staging's set-up in a transfer manager fails closed, naming the setting.

``hooks.kv_staging.staging_region`` runs inside the manager's registration
(MC-NVL-REGIONS). Asked for but impossible (a bad value, no CUDA, no Triton),
it stops the manager with one message instead of silently sending directly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import HostBatchCopy
from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging


def _manager(mode: str):
    return SimpleNamespace(disaggregation_mode=SimpleNamespace(value=mode),
                           kv_args=SimpleNamespace(gpu_id=0))


@pytest.fixture(autouse=True)
def _no_injection():
    kv_staging.set_batch_copy(None)
    yield
    kv_staging.set_batch_copy(None)


def test_off_means_nothing_is_allocated(monkeypatch):
    monkeypatch.delenv("SGLANG_DSV41_KV_STAGING", raising=False)
    manager = _manager("decode")
    assert kv_staging.staging_region(manager) is None
    assert kv_staging.state_of(manager) is None


def test_a_bad_value_stops_the_manager_naming_it(monkeypatch):
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "1")
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING_SLOTS", "many")
    with pytest.raises(RuntimeError, match="SGLANG_DSV41_KV_STAGING_SLOTS='many' is not an integer"):
        kv_staging.staging_region(_manager("prefill"))


def test_no_usable_gpu_copy_stops_the_manager_naming_the_setting(monkeypatch):
    # This machine has no CUDA: the batched copy cannot be built.
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "1")
    with pytest.raises(RuntimeError) as exc:
        kv_staging.staging_region(_manager("decode"))
    assert "SGLANG_DSV41_KV_STAGING=1 but the decode side cannot set up its staging memory" in str(exc.value)


@pytest.mark.parametrize("switch, refusal", [
    ("1", "needs Triton.*triton does not import"),
    ("peer", "=peer but the prefill side cannot set up peer writes.*Triton"),
])
def test_a_copy_without_triton_is_refused(monkeypatch, switch, refusal):
    import sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy as batch_copy

    class PerEntry(HostBatchCopy):
        backend = "memcpy-async"
        fallback_reason = "triton does not import"

    monkeypatch.setattr(batch_copy, "batch_copy_for", lambda device, prefer=None: PerEntry())
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", switch)
    with pytest.raises(RuntimeError, match=refusal):
        kv_staging.staging_region(_manager("prefill"))


def test_sizes_follow_the_settings_and_the_region_is_allocated_once(monkeypatch):
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "1")
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING_SLOTS", "3")
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING_SLOT_MB", "2")
    kv_staging.set_batch_copy(HostBatchCopy())
    for mode in ("prefill", "decode"):
        manager = _manager(mode)
        region = kv_staging.staging_region(manager)
        assert region[1] == 3 * (2 << 20)
        assert kv_staging.staging_region(manager) == region  # re-registration: the same memory
        state = kv_staging.state_of(manager)
        assert (state.pool is not None) == (mode == "decode")
        assert (state.sender is not None) == (mode == "prefill")
    assert kv_staging.staging_region(_manager("null")) is None  # not a PD manager


# --- peer mode


class _FailingExport:
    kind = "cuda-ipc"

    def export(self, regions):
        from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PeerMapError

        raise PeerMapError("cudaIpcGetMemHandle failed: invalid argument")


def test_peer_mode_stops_a_decode_whose_memory_cannot_be_exported(monkeypatch):
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
    kv_staging.set_batch_copy(HostBatchCopy())
    kv_staging.set_peer_transport(_FailingExport())
    try:
        with pytest.raises(RuntimeError) as exc:
            kv_staging.staging_region(_manager("decode"), [(0x1000, 0x1000)])
    finally:
        kv_staging.set_peer_transport(None)
    assert "SGLANG_DSV41_KV_STAGING=peer but the decode side cannot set up peer writes" in str(exc.value)
    assert "invalid argument" in str(exc.value)


def test_peer_mode_exports_the_registered_regions_and_allocates_nothing(monkeypatch):
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import HostCmaTransport

    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
    kv_staging.set_batch_copy(HostBatchCopy())
    kv_staging.set_peer_transport(HostCmaTransport())
    try:
        decode, prefill = _manager("decode"), _manager("prefill")
        assert kv_staging.staging_region(decode, [(0x10000, 0x2000), (0x40000, 0x100)]) is None
        assert kv_staging.staging_region(prefill, [(0x90000, 0x100)]) is None
    finally:
        kv_staging.set_peer_transport(None)
    exported = kv_staging.state_of(decode).exported
    assert [(r.ptr, r.length) for r in exported.regions] == [(0x10000, 0x2000), (0x40000, 0x100)]
    assert kv_staging.state_of(decode).pool is None
    assert kv_staging.state_of(prefill).exported is None and kv_staging.state_of(prefill).buffers is None
    assert kv_staging.state_of(prefill).config.min_blocks == 8


def test_a_new_registration_retires_the_old_mapping_and_an_unusable_map_is_not_retried(monkeypatch):
    """A restarted decode registers again under the same session with new handles."""
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import HostBatchCopy
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PeerMap, PeerMapError, PeerRegion, PeerTarget, host_identity

    class Recording:
        kind = "host-cma"
        min_word = 1

        def __init__(self):
            self.opened, self.closed, self.writes = [], [], 0

        def open(self, peer):
            if peer.regions[0].handle == b"bad".ljust(64, b"\0"):
                self.opened.append("refused")
                raise PeerMapError("cannot open")
            self.opened.append(peer.regions[0].handle[:3])
            return PeerTarget(peer, [0xA0000], self, [peer.regions[0].handle])

        def write(self, target, srcs, dsts, lengths):
            self.writes += 1

        def close(self, opened):
            self.closed.append(opened[0][:3])

    def peer_map(tag: bytes):
        return PeerMap("host-cma", host_identity(), (PeerRegion(0x10000, 0x1000, 0, tag.ljust(64, b"\0")),))

    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING", "peer")
    monkeypatch.setenv("SGLANG_DSV41_KV_STAGING_MIN_BLOCKS", "1")
    transport = Recording()
    kv_staging.set_batch_copy(HostBatchCopy())
    kv_staging.set_peer_transport(transport)
    try:
        manager = _manager("prefill")
        kv_staging.staging_region(manager)
    finally:
        kv_staging.set_peer_transport(None)
    info = SimpleNamespace()
    manager.decode_kv_args_table = {"decode:1": info}
    blocks = [(0x500, 0x10000, 16)]
    direct = []

    def write(b):
        direct.append(b)
        return 0

    def send():
        return kv_staging.send_device_batch(manager, "decode:1", blocks, write, None)

    info.__dict__[kv_staging.PEER_MAP_ATTR] = peer_map(b"one")
    assert send() == 0 and send() == 0
    assert transport.opened == [b"one"] and transport.writes == 2  # opened once, used twice
    info.__dict__[kv_staging.PEER_MAP_ATTR] = peer_map(b"two")  # the decode restarted
    assert send() == 0
    assert transport.opened == [b"one", b"two"] and transport.closed == [b"one"]
    info.__dict__[kv_staging.PEER_MAP_ATTR] = peer_map(b"bad")
    assert send() == 0 and send() == 0
    assert transport.opened == [b"one", b"two", "refused"]  # not retried for every batch
    assert transport.closed == [b"one", b"two"] and direct == [blocks, blocks]
    del info.__dict__[kv_staging.PEER_MAP_ATTR]  # a decode without peer writes
    assert send() == 0 and direct == [blocks] * 3
