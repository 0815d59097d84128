"""Pin: the interleave prefill-CP input contracts the V4.1 CP runner builds on.

sglang 0.5.23's ``cp_shard_model_inputs`` / ``cp_gather_after_forward`` already do
what the original fork's text-CP tests asked for: rank-local embeddings, positions and
ids with zero padding, MoE routing ids for the whole batch in rank-major order
(or this rank's shard under an all-to-all MoE backend), the speculative hidden
states sharded for the body, everything restored even when the body raises, and
short prompts left out of CP. These tests fail if one of those changes.

Real: ForwardBatch, InterleaveCPStrategy (bound with init_cp_strategy) and the cp
utils. The other CP ranks' all-gather shards come from ``PeerShardsGroup``; the
same roundtrip over real gloo collectives is in test/vision_cp/.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))

from dsv41_cp_harness import (  # noqa: E402
    PeerShardsGroup,
    cp_scope,
    extend_batch,
    interleave_rows,
    padded,
    physical_rows,
    rank_major,
)
from sglang.srt.layers.cp.utils import (  # noqa: E402
    cp_gather_after_forward,
    cp_shard_model_inputs,
    is_cp_active,
    prepare_cp_forward,
)
from sglang.srt.layers.moe.utils import MoeA2ABackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_flags  # noqa: E402


def _step(length):
    batch = extend_batch([1, length - 1], [0, 16384])
    embeds = torch.arange(length * 3, dtype=torch.float32).view(length, 3)
    return batch, embeds


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("length", [4, 5, 9, 127, 128, 129])
def test_shard_pads_with_zeros_and_gather_restores_token_order(size, length):
    for rank in range(size):
        batch, embeds = _step(length)
        ids = batch.input_ids
        group = PeerShardsGroup(size, rank, [embeds])
        with cp_scope(size, rank, group):
            assert is_cp_active(batch)
            prepare_cp_forward(batch)
            rows = physical_rows(length, size)
            with cp_shard_model_inputs(embeds, batch.positions, batch, ids) as (
                local, positions, local_ids,
            ):
                n = len(interleave_rows(embeds, rank, size))
                assert torch.equal(local, padded(interleave_rows(embeds, rank, size), rows))
                assert torch.equal(positions, padded(interleave_rows(batch.positions, rank, size), rows))
                assert torch.equal(local_ids, padded(interleave_rows(ids, rank, size), rows))
                assert not local[n:].any() and not local_ids[n:].any()
                assert torch.equal(batch.input_ids_global, rank_major(ids, size))
                restored = cp_gather_after_forward(local, batch)
                # DSv4-style (hidden, None) bodies gather to the hidden tensor alone.
                group.expected.append(embeds)
                assert torch.equal(cp_gather_after_forward((local, None), batch), embeds)
        assert torch.equal(restored, embeds)
        assert batch.input_ids is ids and not hasattr(batch, "input_ids_global")


@pytest.mark.parametrize("had_global", [False, True])
def test_speculative_states_and_global_ids_are_restored_when_the_body_raises(had_global):
    for size in (2, 4):
        for rank in range(size):
            batch, embeds = _step(9)
            batch.spec_info = SimpleNamespace(hidden_states=embeds)
            previous = torch.tensor([-1])
            if had_global:
                batch.input_ids_global = previous
            with cp_scope(size, rank, PeerShardsGroup(size, rank)):
                prepare_cp_forward(batch)
                with pytest.raises(RuntimeError, match="body failed"):
                    with cp_shard_model_inputs(embeds, batch.positions, batch, batch.input_ids):
                        rows = physical_rows(9, size)
                        assert torch.equal(batch.spec_info.hidden_states,
                                           padded(interleave_rows(embeds, rank, size), rows))
                        raise RuntimeError("body failed")
            assert batch.spec_info.hidden_states is embeds
            if had_global:
                assert batch.input_ids_global is previous
            else:
                assert not hasattr(batch, "input_ids_global")


def test_all_to_all_moe_routes_with_the_local_shard():
    batch, embeds = _step(9)
    with cp_scope(4, 1, PeerShardsGroup(4, 1)), \
            get_flags().moe.override(a2a_backend=MoeA2ABackend.DEEPEP):
        prepare_cp_forward(batch)
        with cp_shard_model_inputs(embeds, batch.positions, batch, batch.input_ids) as (
            _, _, local_ids,
        ):
            assert torch.equal(batch.input_ids_global, local_ids)


def test_short_prompts_and_non_extend_batches_stay_out_of_cp():
    with cp_scope(4, 0, PeerShardsGroup(4, 0)):
        assert not is_cp_active(extend_batch([1, 2], [0, 0]))  # 3 tokens < 4 ranks
        assert is_cp_active(extend_batch([1, 3], [0, 0]))
        decode = extend_batch([1, 3], [0, 0])
        decode.forward_mode = ForwardMode.DECODE
        assert not is_cp_active(decode)
