"""The hook's scoped substitutions leave nothing behind and keep threads apart."""

from __future__ import annotations

import threading

import pytest

import _pd_harness as H
from sglang.srt.disaggregation.common import conn
from sglang_dsv41.pd_handshake.pairing import PairingRejected

REAL_INFO_CLASS = conn.PrefillServerInfo


@pytest.fixture(scope="module", autouse=True)
def hooked():
    with H.plugin_hook_installed() as original:
        yield original


def test_module_global_is_restored_after_accept_reject_and_not_ready():
    with H.BootstrapServer() as server:
        decode = H.decode_managers(H.DecodeShape(2), dspark=True, pool="mla")
        try:
            # Nothing registered yet: 503, not ready.
            assert decode[0].try_ensure_parallel_info(server.addr) is False
            assert conn.PrefillServerInfo is REAL_INFO_CLASS
            with H.prefill_server(H.PrefillShape(4, 4), dspark=True, pool="mla", server=server):
                pass
            with pytest.raises(PairingRejected):
                decode[0].try_ensure_parallel_info(server.addr)
            assert conn.PrefillServerInfo is REAL_INFO_CLASS
        finally:
            H.close_managers(decode)
        decode = H.decode_managers(H.DecodeShape(4), dspark=True, pool="mla")
        try:
            assert decode[0].try_ensure_parallel_info(server.addr) is True
            assert conn.PrefillServerInfo is REAL_INFO_CLASS
            assert type(decode[0].prefill_info_table[server.addr]) is REAL_INFO_CLASS
        finally:
            H.close_managers(decode)


def test_concurrent_handshakes_in_one_process_each_check_their_own_peer():
    """Two prefills, eight decode ranks in threads: each verdict and mapping is its own.
    (The bootstrap servers also build PrefillServerInfo, in their own threads.)"""
    with H.BootstrapServer() as cp_server, H.BootstrapServer() as tp_server, \
            H.prefill_server(H.PrefillShape(4, 4), dspark=True, pool="mla", server=cp_server), \
            H.prefill_server(H.PrefillShape(4), dspark=True, pool="mla", server=tp_server,
                             draft_tokens=5):
        decode = H.decode_managers(H.DecodeShape(4), dspark=True, pool="mla")
        results, barrier = {}, threading.Barrier(8)

        def handshake(manager, addr):
            barrier.wait()
            try:
                results[(manager.kv_args.engine_rank, addr)] = manager.try_ensure_parallel_info(addr)
            except PairingRejected as exc:
                results[(manager.kv_args.engine_rank, addr)] = str(exc)

        threads = [threading.Thread(target=handshake, args=(m, s.addr))
                   for m in decode for s in (cp_server, tp_server)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert conn.PrefillServerInfo is REAL_INFO_CLASS
            for manager in decode:
                rank = manager.kv_args.engine_rank
                assert results[(rank, cp_server.addr)] is True
                info = manager.prefill_info_table[cp_server.addr]
                assert (info.target_tp_ranks, info.required_dst_info_num) == ([0], 4)
                assert "spec_layout.num_draft_tokens: prefill=5, decode=6" in \
                    results[(rank, tp_server.addr)]
                assert tp_server.addr not in manager.prefill_info_table
        finally:
            H.close_managers(decode)
