"""The original fork's test_dsv41_dspark_pd.py cases, rewritten against sglang 0.5.23.

What changed against the original fork's case list:
* handshakes go through a real bootstrap server on 127.0.0.1 and real
  ``CommonKVManager`` objects (prefill ranks register over HTTP) instead of a
  patched ``requests.get`` and hand-assembled managers;
* the original fork's ``test_unequal_model_tp_rejected`` expected the (TP2, CP1)
  prefill against an attention-TP4 hybrid-MLA decode to be refused with "same TP
  size"; the PD pairing rule (docs/design/pd_handshake.md) accepts it (case c), and
  the other two shapes are refused with a message naming the fields and both values;
* the retraction case uses 0.5.23's API: ``mem_cache.common.backup_kv_cache`` and a
  ``DecodePreallocQueue.add`` that rebootstraps every DeepSeek-V4 pool itself (with or
  without DSpark), which is upstream behaviour pinned here, not plugin behaviour.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from unittest.mock import Mock, patch

import pytest

import _pd_harness as H
from sglang.srt.disaggregation.base.conn import StateType
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.utils import is_mla_backend
from sglang.srt.mem_cache.common import backup_kv_cache
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.runtime_context import get_context
from sglang_dsv41.pd_handshake.pairing import PairingRejected

P, D = H.PrefillShape, H.DecodeShape


@pytest.fixture(scope="module", autouse=True)
def hooked():
    with H.plugin_hook_installed() as original:
        yield original


@contextlib.contextmanager
def paired(prefill: H.PrefillShape, decode: H.DecodeShape, *, pool="mla", prefill_pool=None,
           prefill_dspark=True, decode_dspark=True, prefill_changes=None, decode_changes=None,
           prefill_draft=6, decode_draft=6):
    """A registered prefill server and the decode managers of one attention-DP group."""
    with H.BootstrapServer() as server, H.prefill_server(
            prefill, dspark=prefill_dspark, pool=prefill_pool or pool, server=server,
            kv_args_changes=prefill_changes, draft_tokens=prefill_draft):
        managers = H.decode_managers(decode, dspark=decode_dspark, pool=pool,
                                     kv_args_changes=decode_changes, draft_tokens=decode_draft)
        try:
            yield server, managers
        finally:
            H.close_managers(managers)


def assert_rejected_before_caching(manager, addr, *phrases):
    with pytest.raises(PairingRejected, match="DeepSeek-V4.1 DSpark PD") as err:
        manager.try_ensure_parallel_info(addr)
    assert addr not in manager.prefill_info_table
    assert manager.mapping_calls == []
    for phrase in phrases:
        assert phrase in str(err.value), (phrase, str(err.value))
    return err.value


# ------------------------------------------------------------ TestDSV41DSparkPD
LAYOUT_CHANGES = {  # original fork's case -> KVArgs change on the prefill side, and the message
    "num_draft_tokens": (None, "spec_layout.num_draft_tokens: prefill=5, decode=6"),
    "kv_layer_ids": ({"kv_layer_ids": [2, 1]},
                     "spec_layout.kv_layer_ids: prefill=[2, 1], decode=[1, 2]"),
    "kv_item_lens": ({"kv_item_lens": [256, 1024]},
                     "spec_layout.kv_item_lens: prefill=[256, 1024], decode=[512, 1024]"),
    "state_types": ({"state_types": [StateType.SWA, StateType.SWA, StateType.DSV4_REQUEST_STATE]},
                    "spec_layout.state_types: prefill=['swa', 'swa', 'c128_state'], "
                    "decode=['swa', 'c128_state', 'swa']"),
    "state_item_lens": ({"state_item_lens": [[512], [8192], [512]]},
                        "spec_layout.state_item_lens: prefill=[[512], [8192], [512]], "
                        "decode=[[512], [32768], [512]]"),
}


def test_matching_layout_is_cached_and_not_fetched_again():
    with paired(P(4), D(4)) as (server, managers):
        manager = managers[0]
        assert manager.try_ensure_parallel_info(server.addr) is True
        server.close()  # a second fetch would now fail: the answer must come from the cache
        assert manager.try_ensure_parallel_info(server.addr) is True
        assert len(manager.mapping_calls) == 1


def test_legacy_servers_without_dspark_are_untouched():
    # Neither side publishes a layout; unequal attention TP is upstream's business.
    with paired(P(2), D(4), prefill_dspark=False, decode_dspark=False) as (server, managers):
        for manager in managers:
            assert manager.try_ensure_parallel_info(server.addr) is True
            assert manager.prefill_info_table[server.addr].dsv41_spec_layout is None


@pytest.mark.parametrize("case", sorted(LAYOUT_CHANGES))
def test_layout_differences_are_rejected_before_caching(case):
    changes, phrase = LAYOUT_CHANGES[case]
    draft = 5 if case == "num_draft_tokens" else 6
    with paired(P(4), D(4), prefill_changes=changes, prefill_draft=draft) as (server, managers):
        for manager in managers:
            assert_rejected_before_caching(manager, server.addr, "layout mismatch", phrase)


def test_dspark_on_one_side_only_is_rejected():
    with paired(P(4), D(4), decode_dspark=False) as (server, managers):
        assert_rejected_before_caching(managers[0], server.addr,
                                       "dspark: prefill=True, decode=False")
    with paired(P(4), D(4), prefill_dspark=False) as (server, managers):
        assert_rejected_before_caching(managers[0], server.addr,
                                       "dspark: prefill=False, decode=True")


def test_tp_mismatch_without_cp_is_rule_c_for_mla_and_rejected_otherwise():
    # The original fork expected a rejection here; the pairing rule accepts it for MLA pools.
    with paired(P(2), D(4)) as (server, managers):
        for rank, manager in enumerate(managers):
            assert manager.try_ensure_parallel_info(server.addr) is True
            info = manager.prefill_info_table[server.addr]
            assert (info.target_tp_ranks, info.required_dst_info_num) == ([rank // 2], 2)
    with paired(P(2), D(4), pool="other") as (server, managers):
        assert_rejected_before_caching(managers[0], server.addr,
                                       "attn_tp_size: prefill=2, decode=4")


def test_python_bootstrap_preserves_layout_and_rejects_mixed_ranks():
    with H.BootstrapServer() as server, \
            H.prefill_server(P(1), dspark=True, pool="mla", server=server) as ranks:
        (rank,) = ranks.values()
        published = server.server_info().json()
        assert published["dsv41_spec_layout"] == rank.manager.dsv41_spec_layout
        assert published["dsv41_spec_layout"]["num_draft_tokens"] == 6
        mixed = dict(
            attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1,
            attn_dp_rank=0, pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0,
            rank_ip="127.0.0.1", rank_port=H.free_port(), page_size=H.PAGE_SIZE,
            kv_cache_dtype=H.KV_DTYPE, dsv41_spec_layout=None,
        )
        response = server.put(mixed)
        assert response.status_code == 400
        assert server.server._registered_count == 1
        assert server.server.dsv41_spec_layout == rank.manager.dsv41_spec_layout


def _queue(allocator):
    return SimpleNamespace(
        token_to_kv_pool_allocator=allocator,
        _check_if_req_exceed_kv_capacity=Mock(return_value=False),
        _create_receiver_and_enqueue=Mock(return_value=Mock(name="decode_req")),
        _resolve_prefill_dp_rank=Mock(return_value=0),
        _init_receiver=Mock(),
        retracted_queue=[],
        pending_reqs=[],
    )


def _req():
    return SimpleNamespace(
        output_ids=[7, 8], bootstrap_host="prefill", bootstrap_port=8998,
        multimodal_inputs=None, time_stats=Mock(), offload_kv_cache=Mock(),
    )


@pytest.mark.parametrize("algorithm", [None, "DSPARK"])
def test_retraction_of_a_v4_request_recomputes_from_prefill(algorithm):
    pool = object.__new__(DeepSeekV4TokenToKVPool)
    pool.compression_ratios = [0, 2, 1]
    pool.device = "cuda"
    allocator = Mock(get_kvcache=Mock(return_value=pool))
    req, request_pool = _req(), Mock()
    with get_context().override_server_args(speculative_algorithm=algorithm), \
            patch("torch.get_device_module") as device_module:
        assert backup_kv_cache(req, Mock(), request_pool, allocator, "cpu_tensor") is True
        queue = _queue(allocator)
        DecodePreallocQueue.add(queue, req, is_retracted=True)
    # 0.5.23 keeps no host copy of a DeepSeek-V4 request's KV, DSpark or not:
    # it drains the device and asks the prefill to recompute.
    req.offload_kv_cache.assert_not_called()
    device_module.return_value.synchronize.assert_called_once_with("cuda")
    assert req.output_ids == [7]
    assert req.pd_rebootstrap_forced_output_id == 8
    assert req.pd_rebootstrap_in_progress is True
    queue._create_receiver_and_enqueue.assert_called_once_with(req, is_rebootstrap=True)
    queue._init_receiver.assert_called_once_with(
        queue._create_receiver_and_enqueue.return_value, 0)
    assert queue.retracted_queue == []


def test_retraction_of_another_mla_request_offloads_to_host():
    pool = object.__new__(MLATokenToKVPool)
    allocator = Mock(get_kvcache=Mock(return_value=pool))
    req, request_pool = _req(), Mock()
    with get_context().override_server_args(speculative_algorithm=None), \
            patch("torch.get_device_module") as device_module:
        assert backup_kv_cache(req, Mock(), request_pool, allocator, "cpu_tensor") is True
        queue = _queue(allocator)
        DecodePreallocQueue.add(queue, req, is_retracted=True)
    req.offload_kv_cache.assert_called_once_with(request_pool, allocator)
    device_module.assert_not_called()
    assert req.output_ids == [7, 8]
    assert queue.retracted_queue == [req]
    queue._create_receiver_and_enqueue.assert_not_called()


# ------------------------------------------------------------ TestDSV41CPPDHandshake
def test_cp4_maps_all_shards_to_each_hybrid_decode_rank():
    with paired(P(4, 4), D(4), pool="hybrid_mla") as (server, managers):
        for manager in managers:
            assert manager.try_ensure_parallel_info(server.addr) is True
            info = manager.prefill_info_table[server.addr]
            assert info.target_tp_ranks == [0]
            assert info.target_cp_ranks == [0, 1, 2, 3]
            assert info.required_prefill_response_num == 4
            assert info.required_dst_info_num == 4


@pytest.mark.parametrize("all_cp_ranks", [False, True])
def test_dsv4_pool_is_classified_as_mla(all_cp_ranks):
    assert is_mla_backend(object.__new__(DeepSeekV4TokenToKVPool))
    env = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
    with patch.dict(os.environ, {env: "1" if all_cp_ranks else "0"}), \
            paired(P(4, 4), D(4), pool="mla") as (server, managers):
        for manager in managers:
            assert manager.is_mla_backend and not manager.is_hybrid_mla_backend
            assert manager.try_ensure_parallel_info(server.addr) is True
            info = manager.prefill_info_table[server.addr]
            # Every CP rank sends its page slice only when the variable is set on both
            # servers; otherwise CP rank 0 holds and sends everything.
            assert info.target_cp_ranks == ([0, 1, 2, 3] if all_cp_ranks else [0])
            assert info.required_prefill_response_num == (4 if all_cp_ranks else 1)


def test_cp2_tp2_maps_corresponding_tp_and_both_cp_ranks():
    with paired(P(4, 2), D(4), pool="hybrid_mla") as (server, managers):
        for rank, manager in enumerate(managers):
            assert manager.try_ensure_parallel_info(server.addr) is True
            info = manager.prefill_info_table[server.addr]
            assert info.target_tp_ranks == [rank // 2]
            assert info.target_cp_ranks == [0, 1]
            assert info.required_prefill_response_num == 2


def test_plain_tp4_unchanged():
    with paired(P(4), D(4), pool="hybrid_mla") as (server, managers):
        manager = managers[3]
        assert manager.try_ensure_parallel_info(server.addr) is True
        info = manager.prefill_info_table[server.addr]
        assert (info.target_tp_ranks, info.target_cp_ranks) == ([3], [0])


@pytest.mark.parametrize("prefill,accepted", [(P(2), True), (P(2, 2), False), (P(8, 8), False)])
def test_unequal_model_tp_follows_the_decision(prefill, accepted):
    with paired(prefill, D(4), pool="hybrid_mla") as (server, managers):
        manager = managers[0]
        if accepted:  # (c): both CP 1, hybrid-MLA pool
            assert manager.try_ensure_parallel_info(server.addr) is True
        else:
            assert_rejected_before_caching(
                manager, server.addr,
                f"attn_tp_size: prefill={prefill.attn_tp}, decode=4",
                f"attn_cp_size: prefill={prefill.cp}, decode=1")


def test_nonhybrid_cp_mismatch_rejected():
    with paired(P(4, 4), D(4), pool="other") as (server, managers):
        assert_rejected_before_caching(managers[0], server.addr,
                                       "kv_pool: prefill=None, decode='other'")


def test_layout_mismatch_still_rejected():
    with paired(P(4, 4), D(4), pool="hybrid_mla",
                prefill_changes={"kv_item_lens": [1024, 1024]}) as (server, managers):
        assert_rejected_before_caching(
            managers[0], server.addr, "layout mismatch",
            "spec_layout.kv_item_lens: prefill=[1024, 1024], decode=[512, 1024]")


def test_each_refused_pairing_is_counted_for_the_metrics():
    """sglang_dsv41_pd_pairings_refused_total: one per refused handshake, none
    for an accepted one."""
    from sglang_dsv41 import metrics

    def refused() -> float:
        return metrics.totals()["pd_pairings_refused"].get("", 0)

    before = refused()
    with paired(P(4), D(4), decode_dspark=False) as (server, managers):
        assert_rejected_before_caching(managers[0], server.addr, "dspark: prefill=True, decode=False")
        assert_rejected_before_caching(managers[1], server.addr, "dspark: prefill=True, decode=False")
    with paired(P(4), D(4)) as (server, managers):
        assert managers[0].try_ensure_parallel_info(server.addr) is True
    assert refused() - before == 2
