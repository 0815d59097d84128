"""The adapter functions on their own (no sglang import): fail-closed and pass-through paths.

The real sglang code path is covered by test_nvlink_pd_integration.py; these
pin what the adapter does around it without building a MooncakeKVManager.
"""

from __future__ import annotations

import ctypes
import logging
from types import SimpleNamespace

import pytest

from sglang_dsv41.mooncake_nvlink.memory import InjectedKinds
from sglang_dsv41.mooncake_nvlink.routing import encode_host_blocks
from sglang_dsv41.mooncake_nvlink import hooks as hook


class Manager:
    """Stand-in owner of the hooked methods: only the attributes the adapter reads."""

    def __init__(self, regions=(), aux=()):
        self.kv_args = SimpleNamespace(
            gpu_id=0, kv_data_ptrs=[p for p, _ in regions], kv_data_lens=[n for _, n in regions],
            aux_data_ptrs=[p for p, _ in aux], aux_data_lens=[n for _, n in aux],
            state_data_ptrs=[], state_data_lens=[],
        )
        self.transfer_infos = {}
        self.request_status = {}  # room -> sglang's KVPoll value (3: Transferring)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("MC_INTRANODE_NVLINK", "MC_INTRA_NVLINK", "MOONCAKE_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    hook.set_memory_access(None)
    yield
    hook.set_memory_access(None)


def test_inactive_transport_keeps_upstream_regions_and_transfer():
    mgr = Manager()
    assert hook.after_registerable_regions([(1, 2)], mgr) is None  # AFTER: keep the result
    calls = []
    rc = hook.around_transfer_data(lambda s, sid, blocks: calls.append((sid, blocks)) or 7,
                                   mgr, "peer:1", [(1, 2, 3)])
    assert rc == 7 and calls == [("peer:1", [(1, 2, 3)])]


def test_active_transport_without_cuda_refuses_to_register(monkeypatch):
    """No injected classification and no GPU here: a clear error, not a blind registration."""
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    with pytest.raises(RuntimeError, match="cannot be told apart"):
        hook.after_registerable_regions([(4096, 4096)], Manager())


def test_active_transport_filters_and_routes(monkeypatch):
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "nvlink_intra")
    hook.set_memory_access(InjectedKinds([(1 << 30, 4096)]))
    mgr = Manager()
    assert hook.after_registerable_regions([(1 << 30, 4096), (8192, 64)], mgr) == [(1 << 30, 4096)]
    # No transfer info for the session: host blocks cannot be delivered, the transfer fails.
    sent = []
    rc = hook.around_transfer_data(lambda s, sid, blocks: sent.append(blocks) or 0, mgr, "peer:1",
                                   [(1 << 30, 99, 64), (8192, 100, 8)])
    assert rc == -1 and sent == [[(1 << 30, 99, 64)]]


def test_aux_handler_passes_upstream_frames_and_never_raises_on_ours(caplog):
    buf = ctypes.create_string_buffer(16)
    mgr = Manager(aux=[(ctypes.addressof(buf), 16)])
    hook.set_memory_access(InjectedKinds([]))
    seen = []
    upstream = [b"AUX_DATA", b"1", b"0", b"0", b"\0\0\0\1", b"x"]
    hook.around_handle_aux_data(lambda s, msg: seen.append(msg), mgr, upstream)
    assert seen == [upstream]
    ours = encode_host_blocks(3, [(ctypes.addressof(buf) + 2, b"hi")])
    assert hook.around_handle_aux_data(lambda s, msg: seen.append(msg), mgr, ours) is None
    assert seen == [upstream] and buf.raw[2:4] == bytes(2)  # room 3 is no request's here
    mgr.request_status[3] = 3
    assert hook.around_handle_aux_data(lambda s, msg: seen.append(msg), mgr, ours) is None
    assert seen == [upstream] and buf.raw[2:4] == b"hi"
    broken = Manager()
    del broken.kv_args  # the receiver cannot even be built
    with caplog.at_level(logging.ERROR, logger="sglang_dsv41.mooncake"):
        hook.around_handle_aux_data(lambda s, msg: seen.append(msg), broken, ours)
    assert "dropped" in caplog.text and seen == [upstream]
