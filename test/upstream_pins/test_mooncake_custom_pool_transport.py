"""sglang 0.5.23: ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK`` selects no Mooncake transport.

The engine's protocol is ``MOONCAKE_PROTOCOL`` whatever the custom pool setting,
and the INTRA_NODE_NVLINK pool type allocates no pool. This is why `plan` and the
runtime do not count the setting as the intra-node NVLink transport
(``mooncake_nvlink.routing.nvlink_intra_reason``).
"""

from __future__ import annotations

from sglang.srt.disaggregation.mooncake.utils import init_mooncake_custom_mem_pool
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine


class RecordingEngine:
    """Stands in for Mooncake's C++ engine: records what sglang initializes it with."""

    def __init__(self):
        self.calls = []

    def initialize(self, hostname, metadata_server, protocol, device_name):
        self.calls.append((hostname, metadata_server, protocol, device_name))
        return 0


def test_the_custom_pool_setting_leaves_the_protocol_to_mooncake_protocol(monkeypatch):
    monkeypatch.setenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "INTRA_NODE_NVLINK")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.delenv("ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE", raising=False)
    engine = MooncakeTransferEngine.__new__(MooncakeTransferEngine)
    engine.engine = RecordingEngine()
    engine.gpu_id = 0
    engine.initialize("127.0.0.1", None)
    assert engine.engine.calls == [("127.0.0.1", "P2PHANDSHAKE", "tcp", "")]
    assert init_mooncake_custom_mem_pool("cpu") == (False, None, None)
