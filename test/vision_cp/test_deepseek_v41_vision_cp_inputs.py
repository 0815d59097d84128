"""V4.1 image inputs under prefill CP: merged on the full extend layout, then sharded.

Runs sglang 0.5.23's real eager CP path (interleave strategy, ``prepare_cp_forward``,
``cp_shard_model_inputs``, ``cp_gather_after_forward``), the real
``DeepseekV4ForCausalLM.prepare_language_model_inputs`` / ``_prepare_mm_embeddings``
and the real ``embed_mm_inputs`` merge, with our VCP-RUNNER and VCP-PREPARE patches.
Stand-ins: the vision encoder (fixed spans) and the transformer body (records its
inputs). One process plays each CP rank; ``PeerShardsGroup`` supplies the other
ranks' all-gather shards. The same path under real gloo collectives is in
test_deepseek_v41_multimodal_cp.py.

Where the original fork's tests differ: its runner called ``prepare_model_inputs``
while its multimodal test drove ``prepare_language_model_inputs`` directly. We ship
both names: the runner calls ``prepare_model_inputs`` (VCP-PREPARE), which delegates
to 0.5.23's ``prepare_language_model_inputs``, so wrappers of the latter (the
owner-broadcast fence) also run under CP. sglang 0.5.23 also reads
``enable_cp_tp_group_sharing`` in ``prepare_cp_forward``; the CP scope sets it off,
which is the layout this runner serves.
"""

from __future__ import annotations

import pytest
import torch

from _image_cp_rank import HASH_A, HASH_B, HIDDEN, extend_step, fresh_rank_state, run_rank, vision_model
from dsv41_cp_harness import (
    RUNTIME_PATCHES,
    PeerShardsGroup,
    installed,
    interleave_rows,
    padded,
    physical_rows,
    rank_major,
    run_extend_cp,
)
from sglang.srt.models.deepseek_v4 import MM_PAD_SHIFT_VALUE


@pytest.mark.parametrize("size", [2, 4])
def test_runner_merges_images_on_full_layout_before_the_shard(size):
    with installed(*RUNTIME_PATCHES):
        for rank in range(size):
            run = run_rank(size, rank)
            rows = physical_rows(run.full.shape[0], size)
            assert run.batch.attn_cp_metadata.per_rank_actual_token == [rows] * size

            (body,) = run.model.model.calls
            assert torch.equal(body.input_ids,
                               padded(interleave_rows(run.model_ids, rank, size), rows))
            assert torch.equal(body.positions,
                               padded(interleave_rows(run.batch.positions, rank, size), rows))
            assert torch.equal(body.input_embeds,
                               padded(interleave_rows(run.full, rank, size), rows))
            # MoE routing ids: normalized, in rank-major order, never raw hashes.
            assert torch.equal(body.input_ids_global, rank_major(run.model_ids, size))
            assert not (body.input_ids_global >= MM_PAD_SHIFT_VALUE).any()

            (logits,) = run.model.logits_calls
            assert run.result == "logits"
            assert run.group.gathers == 2  # hidden states, then pre-norm states
            assert torch.equal(logits.input_ids, run.model_ids)
            assert torch.equal(logits.hidden_states, run.hidden)
            assert torch.equal(logits.hidden_states_before_norm, run.pre_norm)
            assert logits.logits_metadata is run.batch

            # The scheduler's ids: same tensor, same values; shard-scoped state restored.
            assert run.batch.input_ids is run.scheduler_ids
            assert torch.equal(run.scheduler_ids, run.scheduler_copy)
            assert (run.scheduler_ids >= MM_PAD_SHIFT_VALUE).sum() == 7
            assert not hasattr(run.batch, "input_ids_global")
            assert torch.equal(run.batch.mm_input_embeds, run.full)
            # Both images are encoded on every rank, on the full layout.
            assert sorted(run.model.encoded) == sorted([HASH_A, HASH_B])


def test_stock_runner_embeds_raw_placeholder_hashes():
    """Without VCP-RUNNER, sglang 0.5.23 embeds the scheduler's ids, placeholder
    hashes included, before any image merge: the lookup fails on the hash ids."""
    with installed("VCP-PREPARE"), pytest.raises(IndexError):
        run_rank(2, 0)


def test_external_embeddings_with_images_are_refused_before_any_collective():
    fresh_rank_state()
    model = vision_model()
    batch, _, _ = extend_step()
    before = batch.input_ids.clone()
    group = PeerShardsGroup(2, 0)
    with installed(*RUNTIME_PATCHES), \
            pytest.raises(ValueError, match="Cannot combine input_embeds and image inputs"):
        run_extend_cp(model, batch, 2, 0, group,
                      {"input_embeds": torch.zeros(batch.input_ids.shape[0], HIDDEN)})
    assert group.gathers == 0 and model.model.calls == [] and model.encoded == []
    assert torch.equal(batch.input_ids, before)


def test_prepare_model_inputs_is_upstream_preparation():
    fresh_rank_state()
    model = vision_model()
    batch, model_ids, merged = extend_step()
    before = batch.input_ids.clone()
    with installed("VCP-PREPARE"), torch.no_grad():
        ids, embeds = model.prepare_model_inputs(
            input_ids=batch.input_ids, forward_batch=batch, input_embeds=None)
        upstream_ids, upstream_embeds = model.prepare_language_model_inputs(
            batch.input_ids, batch, None)
    assert torch.equal(ids, model_ids) and torch.equal(upstream_ids, model_ids)
    assert torch.equal(embeds, merged(model.model.embed))
    assert torch.equal(embeds, upstream_embeds)
    assert torch.equal(batch.input_ids, before)
