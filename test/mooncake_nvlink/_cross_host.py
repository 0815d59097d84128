"""The prefill side of a PD pair, as the NVLink routing adapter sees it (no sglang, no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_dsv41 import metrics
from sglang_dsv41.mooncake_nvlink import hooks as hook
from sglang_dsv41.mooncake_nvlink.memory import InjectedKinds

DEVICE = 1 << 30
HOST = 8192
REMOTE_HOST_ID = "198.51.100.77"  # TEST-NET-2 (documentation): assigned to no real machine
# One device block and one host block: routed, the host block needs a side channel.
BLOCKS = [(DEVICE, 99, 64), (HOST, 100, 8)]


class Manager:
    """Stand-in owner of the hooked methods: only the attributes the adapter reads."""

    def __init__(self):
        self.kv_args = SimpleNamespace(gpu_id=0, kv_data_ptrs=[], kv_data_lens=[], aux_data_ptrs=[],
                                       aux_data_lens=[], state_data_ptrs=[], state_data_lens=[])
        self.transfer_infos = {}


def active_manager(monkeypatch) -> Manager:
    for name in ("MC_INTRANODE_NVLINK", "MC_INTRA_NVLINK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "nvlink_intra")
    hook.set_memory_access(InjectedKinds([(DEVICE, 4096)]))
    manager = Manager()
    assert hook.after_registerable_regions([(DEVICE, 4096), (HOST, 64)], manager) == [(DEVICE, 4096)]
    return manager


def send(manager, session_id):
    sent = []
    rc = hook.around_transfer_data(lambda s, sid, blocks: sent.append(list(blocks)) or 0,
                                   manager, session_id, list(BLOCKS))
    return rc, sent


def cross_host_count() -> float:
    return sum(metrics.totals().get("nvlink_cross_host_peers", {}).values())
