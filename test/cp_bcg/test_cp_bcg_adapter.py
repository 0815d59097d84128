"""The DeepSeek-V4 interleave adapter's bookkeeping across capture and replays.

Real: sglang 0.5.23's PrefillCPBCGInput.create dispatch through
get_cp_bcg_input_type (with CPBCG-INPUT installed), upstream's interleave
adapter under our subclass, InterleaveCPStrategy bound with init_cp_strategy,
the prefill graph buffer registry that load_batch fills (zero-padded static
input ids, positions and cache locations), and, in the gloo test, the attention
CP all-gather over real processes. Stand-in: the prefill graph runner object
(it needs a GPU to build); the adapter reads only its device, capacity, model
config, dtype and embedding from it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))

from dsv41_cp_harness import (  # noqa: E402
    CP_LAYOUTS,
    PeerShardsGroup,
    cp_scope,
    extend_batch,
    gloo_group_for,
    installed,
    run_gloo_ranks,
)
# Imported at collection, so the per-test timeouts measure the tests, not sglang's import.
from sglang.srt.layers.cp.bcg.bcg import PrefillCPBCGInput  # noqa: E402
from sglang.srt.layers.cp.bcg.interleave_bcg import InterleaveCPBCGInput  # noqa: E402
from sglang.srt.layers.cp.interleave import InterleaveCPStrategy  # noqa: E402
from sglang.srt.layers.cp.utils import cp_gather_after_forward  # noqa: E402
from sglang.srt.model_executor.cuda_graph_buffer_registry import (  # noqa: E402
    build_prefill_registry,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.model_runner import (  # noqa: E402
    _prefill_cuda_graph_allows_context_parallel,
)
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (  # noqa: E402
    _MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR,
)

HIDDEN = 4
VOCAB = 97
MAX_TOKENS = 64
BUCKETS = (8, 16, 32)
# (extend lengths, prefix lengths) of the live batches replayed after capture
REPLAYS = (
    ([5], [0]),
    ([3, 9], [0, 40]),
    ([16], [0]),
    ([1, 6, 4], [12, 0, 3]),
    ([29], [0]),
    ([7], [100]),
)


@pytest.fixture
def bcg_enabled(monkeypatch):
    monkeypatch.setenv("SGLANG_DSV41_CP_BCG", "1")


def stand_in_runner(embed: nn.Embedding, architecture: str = "DeepseekV4ForCausalLM"):
    hf_config = SimpleNamespace(architectures=[architecture])
    return SimpleNamespace(
        device=torch.device("cpu"),
        max_num_tokens=MAX_TOKENS,
        model_runner=SimpleNamespace(
            model=SimpleNamespace(get_input_embeddings=lambda: embed),
            model_config=SimpleNamespace(hidden_size=HIDDEN, hf_config=hf_config),
            dtype=torch.float32,
        ),
    )


def prefill_registry():
    return build_prefill_registry(device=torch.device("cpu"), max_bs=8,
                                  max_num_token=MAX_TOKENS, cache_loc_dtype=torch.int64,
                                  share_pool=False)


def live_batch(lengths, prefixes):
    total = sum(lengths)
    batch = extend_batch(lengths, prefixes, input_ids=(torch.arange(total) * 7 + 3) % VOCAB)
    batch.out_cache_loc = torch.arange(1000, 1000 + total)
    batch.extend_num_tokens = total
    return batch


def static_batch(registry, live, bucket):
    """What the prefill graph runner's load_batch hands the adapter: the live batch's
    ids, positions and cache locations in the fixed buffers, zero past the live rows."""
    n, bs = int(live.extend_num_tokens), live.batch_size
    registry.fill_from(live, raw_bs=bs, padded_bs=bs, raw_num_tokens=n, padded_num_tokens=bucket)

    def slot(name):
        return registry.get_slot(name).slice_for(bs, bucket)

    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=bs,
                         input_ids=slot("input_ids"), req_pool_indices=live.req_pool_indices,
                         seq_lens=live.seq_lens, out_cache_loc=slot("out_cache_loc"),
                         seq_lens_sum=live.seq_lens_sum)
    batch.positions = slot("positions")
    batch.extend_seq_lens_cpu = list(live.extend_seq_lens_cpu)
    batch.extend_prefix_lens_cpu = list(live.extend_prefix_lens_cpu)
    batch.seq_lens_cpu = live.seq_lens_cpu
    batch.extend_num_tokens = n
    return batch


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def addresses(inp, batch) -> dict:
    meta = batch.attn_cp_metadata
    return {
        "input_ids_global": batch.input_ids_global.data_ptr(),
        "input_ids_global_buffer": inp.input_ids_global.data_ptr(),
        "moe_count": meta.moe_local_token_count.data_ptr(),
        "input_embeds": batch.input_embeds.data_ptr(),
        "model_positions": inp.model_positions(batch).data_ptr(),
    }


def check_replay(inp, batch, live, bucket, size, rank, embed):
    """Everything the captured body and the eager breaks read after prepare()."""
    n = int(live.extend_num_tokens)
    local_rows = inp.bucket_local_tokens[bucket]
    meta = batch.attn_cp_metadata
    ids, positions = live.input_ids, live.positions
    mine = list(range(rank, n, size))

    # MoE routing ids: every rank's rows, rank-major, each rank zero past its live
    # rows; under an all-to-all MoE backend (DeepEP, MegaMoE) this rank's rows only.
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    if get_moe_a2a_backend().is_none():
        expected_ids = torch.cat([padded_rows(ids[r::size], local_rows) for r in range(size)])
    else:
        expected_ids = padded_rows(ids[rank::size], local_rows)
    assert torch.equal(batch.input_ids_global, expected_ids)
    # MoE local token count: this rank's live rows, in the fixed tensor the strategy returns.
    assert int(inp.moe_local_token_count) == len(mine)
    assert meta.moe_local_token_count is inp.moe_local_token_count
    assert InterleaveCPStrategy.moe_num_token_non_padded(
        SimpleNamespace(cp_rank=rank), batch) is inp.moe_local_token_count
    # Captured body: local embeddings and local positions, zero past the live rows.
    with torch.no_grad():
        assert torch.equal(batch.input_embeds, padded_rows(embed(ids[mine]), local_rows))
    assert torch.equal(inp.model_positions(batch), padded_rows(positions[mine], local_rows))
    # Compressor write path: global positions and the whole bucket of cache
    # locations, zero (the dummy slot) past the live tokens.
    assert torch.equal(batch.positions, padded_rows(positions, bucket))
    assert torch.equal(batch.out_cache_loc, padded_rows(live.out_cache_loc, bucket))
    # No GLM-only field: no KDA reorder capacity.
    assert meta.graph_num_tokens is None
    assert meta.total_seq_lens == n


def adapter_steps(size, rank, embed, on_replay=None):
    """Capture every bucket, then replay each live batch; returns per-step facts."""
    runner = stand_in_runner(embed)
    registry = prefill_registry()
    inp = PrefillCPBCGInput.create(runner)
    assert type(inp).__name__ == "DeepseekV4InterleaveCPBCGInput"
    with torch.no_grad():  # as the graph runner captures and replays
        return _capture_and_replay(inp, runner, registry, size, rank, embed, on_replay)


def _capture_and_replay(inp, runner, registry, size, rank, embed, on_replay):
    captured = {}
    for bucket in BUCKETS:
        batch = static_batch(registry, live_batch([bucket], [0]), bucket)
        inp.prepare(runner, batch, static_num_tokens=bucket, capture=True)
        captured[bucket] = addresses(inp, batch)
    facts = []
    for lengths, prefixes in REPLAYS:
        live = live_batch(lengths, prefixes)
        n = int(live.extend_num_tokens)
        bucket = inp.select_replay_bucket_for_batch(
            num_tokens=n, extend_seq_lens=live.extend_seq_lens_cpu,
            capture_num_tokens=list(BUCKETS),
            max_padding_factor=_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR)
        assert bucket == min(b for b in BUCKETS if b >= n), (lengths, bucket)
        batch = static_batch(registry, live, bucket)
        inp.prepare(runner, batch, static_num_tokens=bucket, capture=False)
        # The graph reads these by address: the same as at capture.
        assert addresses(inp, batch) == captured[bucket], (lengths, bucket)
        check_replay(inp, batch, live, bucket, size, rank, embed)
        facts.append({"n": n, "bucket": bucket,
                      "count": int(inp.moe_local_token_count),
                      "extra": on_replay(batch, live) if on_replay else None})
    return facts


# --- in one process per rank ------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_bcg_adapter_keeps_addresses_and_fills_live_rows(bcg_enabled, size):
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, HIDDEN)
    with installed("CPBCG-INPUT"):
        for rank in range(size):
            with cp_scope(size, rank, PeerShardsGroup(size, rank)):
                facts = adapter_steps(size, rank, embed)
            assert [f["count"] for f in facts] == [
                len(range(rank, f["n"], size)) for f in facts]


@pytest.mark.timeout(120)
def test_bcg_adapter_with_an_all_to_all_moe_backend_routes_local_ids(bcg_enabled):
    """EP == TP with DeepEP or MegaMoE: the fixed id buffer carries this rank's shard."""
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    from sglang.srt.runtime_context import get_flags

    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, HIDDEN)
    with installed("CPBCG-INPUT"), get_flags().moe.override(a2a_backend=MoeA2ABackend.DEEPEP):
        for rank in range(4):
            with cp_scope(4, rank, PeerShardsGroup(4, rank)):
                adapter_steps(4, rank, embed)


@pytest.mark.timeout(60)
def test_bcg_adapter_is_not_chosen_without_the_setting(monkeypatch):
    monkeypatch.delenv("SGLANG_DSV41_CP_BCG", raising=False)
    embed = nn.Embedding(VOCAB, HIDDEN)
    with installed("CPBCG-INPUT"), cp_scope(2, 0, PeerShardsGroup(2, 0)):
        assert type(PrefillCPBCGInput.create(stand_in_runner(embed))) is InterleaveCPBCGInput


@pytest.mark.timeout(60)
def test_bcg_adapter_hands_other_models_to_upstream_and_drops_the_glm_field(bcg_enabled):
    """A GLM model still gets upstream's adapter, which sets the KDA reorder
    capacity our DeepSeek-V4 subclass leaves unset."""
    embed = nn.Embedding(VOCAB, HIDDEN)
    with installed("CPBCG-INPUT"), cp_scope(2, 1, PeerShardsGroup(2, 1)):
        glm_runner = stand_in_runner(embed, "Glm5NextForConditionalGeneration")
        glm = PrefillCPBCGInput.create(glm_runner)
        assert type(glm) is InterleaveCPBCGInput
        batch = static_batch(prefill_registry(), live_batch([16], [0]), 16)
        glm.prepare(glm_runner, batch, static_num_tokens=16, capture=True)
        assert batch.attn_cp_metadata.graph_num_tokens == 16
        ours = PrefillCPBCGInput.create(stand_in_runner(embed))
        assert isinstance(ours, InterleaveCPBCGInput) and type(ours) is not InterleaveCPBCGInput
        batch = static_batch(prefill_registry(), live_batch([16], [0]), 16)
        ours.prepare(stand_in_runner(embed), batch, static_num_tokens=16, capture=True)
        assert batch.attn_cp_metadata.graph_num_tokens is None


@pytest.mark.timeout(60)
def test_bcg_prefill_graph_takes_cp_batches_only_through_a_cp_capture():
    """model_runner's guard: a CP batch replays only through a runner that captured
    the CP body (enable_cp_bcg_capture, set from the gated supports_prefill_cp_bcg);
    a batch too short for CP never replays a CP-local body."""
    cp_runner = SimpleNamespace(enable_cp_bcg_capture=True)
    stock_runner = SimpleNamespace(enable_cp_bcg_capture=False)
    with cp_scope(4, 0, PeerShardsGroup(4, 0)):
        cp_batch, short_batch = live_batch([9], [0]), live_batch([3], [0])
        assert _prefill_cuda_graph_allows_context_parallel(cp_runner, cp_batch)
        assert not _prefill_cuda_graph_allows_context_parallel(stock_runner, cp_batch)
        assert not _prefill_cuda_graph_allows_context_parallel(cp_runner, short_batch)
    assert _prefill_cuda_graph_allows_context_parallel(stock_runner, live_batch([9], [0]))


@pytest.mark.timeout(60)
def test_bcg_replay_bucket_needs_the_captured_local_rows(bcg_enabled):
    """A bucket is chosen only when every rank's live rows fit what it captured."""
    embed = nn.Embedding(VOCAB, HIDDEN)
    with installed("CPBCG-INPUT"), cp_scope(4, 0, PeerShardsGroup(4, 0)):
        runner = stand_in_runner(embed)
        inp = PrefillCPBCGInput.create(runner)
        registry = prefill_registry()
        for bucket in (4, 8):
            inp.prepare(runner, static_batch(registry, live_batch([bucket], [0]), bucket),
                        static_num_tokens=bucket, capture=True)
        assert inp.bucket_local_tokens == {4: 4, 8: 4}
        pick = lambda lens: inp.select_replay_bucket_for_batch(
            num_tokens=sum(lens), extend_seq_lens=lens, capture_num_tokens=[4, 8],
            max_padding_factor=4)
        assert pick([4]) == 4
        assert pick([5]) == 8
        assert pick([8]) == 8
        assert pick([9]) is None


# --- real gloo ranks --------------------------------------------------------------------

def _gloo_body(world_rank: int, groups: dict):
    report = {}
    for size in (2, 4):
        group = gloo_group_for(size, world_rank, groups)
        rank = group.rank_in_group
        torch.manual_seed(0)
        embed = nn.Embedding(VOCAB, HIDDEN)

        def collective_checks(batch, live):
            n = int(live.extend_num_tokens)
            # The local shards gather back to the whole prompt in token order.
            gathered = cp_gather_after_forward(batch.input_embeds, batch)
            with torch.no_grad():
                assert torch.equal(gathered[:n], embed(live.input_ids))
            # Every rank routes the same rank-major ids, and the fixed MoE
            # counts add up to the live tokens.
            all_ids = group.all_gather(batch.input_ids_global.clone().unsqueeze(0), dim=0)
            assert all(torch.equal(row, all_ids[0]) for row in all_ids)
            total = group.all_reduce(batch.attn_cp_metadata.moe_local_token_count.clone())
            assert int(total) == n
            return int(total)

        with cp_scope(size, rank, group):  # CP-2: both pairs of the world; CP-4: all four
            facts = adapter_steps(size, rank, embed, collective_checks)
        report[size] = facts
    return report


@pytest.mark.timeout(240)
def test_bcg_adapter_over_gloo_2_and_4_ranks(bcg_enabled):
    with installed("CPBCG-INPUT"):
        reports = run_gloo_ranks(4, CP_LAYOUTS, _gloo_body)
    for size in (2, 4):
        for world_rank in range(4):
            facts = reports[world_rank][size]
            assert [f["extra"] for f in facts] == [f["n"] for f in facts]
            assert [f["bucket"] for f in facts] == [8, 16, 16, 16, 32, 8]
