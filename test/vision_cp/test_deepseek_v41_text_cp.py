"""Language-only V4.1 under interleave prefill CP through our eager CP runner (VCP-RUNNER):
the shard/gather roundtrip over real gloo collectives, and the runner's contracts
for embeddings, DSpark aux states, pre-norm states, pipeline stages and models that
own their CP inputs (GLM's ``prepare_cp_inputs``).

Real: sglang 0.5.23's ForwardBatch, interleave strategy, ``prepare_cp_forward``,
``cp_shard_model_inputs``, ``cp_gather_after_forward`` and DeepseekV4ForCausalLM's
input preparation. Stand-in: the transformer body.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import Mock

import pytest
import torch
from torch import nn

from dsv41_cp_harness import (
    CP_LAYOUTS,
    RUNTIME_PATCHES,
    PeerShardsGroup,
    expected_hidden,
    extend_batch,
    gloo_group_for,
    installed,
    interleave_rows,
    make_v4_model,
    padded,
    physical_rows,
    rank_major,
    run_extend_cp,
    run_gloo_ranks,
)

HIDDEN = 3
VOCAB = 200
LENGTHS = (4, 5, 9, 127, 128, 129)


def _text_step(length: int):
    """Two requests: one token without prefix, the rest after a 16384-token prefix."""
    lengths, prefixes = (1, length - 1), (0, 16384)
    return extend_batch(lengths, prefixes, input_ids=torch.arange(length) % VOCAB)


def _rank_body(world_rank: int, groups: dict):
    report = {}
    for size in (2, 4):
        group = gloo_group_for(size, world_rank, groups)
        rank = group.rank_in_group
        for length in LENGTHS:
            for preembedded in (False, True):
                torch.manual_seed(0)
                model = make_v4_model(nn.Embedding(VOCAB, HIDDEN), vision=False,
                                      image_token_id=VOCAB - 1)
                batch = _text_step(length)
                scheduler_ids = batch.input_ids
                with torch.no_grad():
                    full = model.model.embed(scheduler_ids)
                if preembedded:
                    full = full + 7.0  # distinguishable from the model's own lookup
                hidden, pre_norm = expected_hidden(full, batch.positions)
                kwargs = {"input_embeds": full} if preembedded else {}
                assert run_extend_cp(model, batch, size, rank, group, kwargs) == "logits"

                rows = physical_rows(length, size)
                (body,) = model.model.calls
                n_local = len(interleave_rows(full, rank, size))
                assert torch.equal(body.input_embeds, padded(interleave_rows(full, rank, size), rows))
                assert torch.equal(body.positions,
                                   padded(interleave_rows(batch.positions, rank, size), rows))
                assert torch.equal(body.input_ids,
                                   padded(interleave_rows(scheduler_ids, rank, size), rows))
                # Physical CP padding rows are zeros, for embeddings and ids alike.
                assert not body.input_embeds[n_local:].any()
                assert not body.input_ids[n_local:].any()
                assert torch.equal(body.input_ids_global, rank_major(scheduler_ids, size))
                (logits,) = model.logits_calls
                assert logits.input_ids is scheduler_ids
                assert torch.equal(logits.hidden_states, hidden)
                assert torch.equal(logits.hidden_states_before_norm, pre_norm)
                assert not hasattr(batch, "input_ids_global")
                report[(size, length, preembedded)] = (rank, body.input_embeds[:n_local].tolist())
    return report


@pytest.mark.timeout(240)
def test_text_roundtrip_over_gloo_mixed_lengths_prefixes_padding_2_and_4_processes():
    with installed(*RUNTIME_PATCHES):
        reports = run_gloo_ranks(4, CP_LAYOUTS, _rank_body)
    for size in (2, 4):
        for length in LENGTHS:
            for preembedded in (False, True):
                torch.manual_seed(0)
                embed = nn.Embedding(VOCAB, HIDDEN)
                with torch.no_grad():
                    full = embed(torch.arange(length) % VOCAB) + (7.0 if preembedded else 0.0)
                rebuilt = torch.full_like(full, float("nan"))
                for world_rank in range(size):  # ranks 0..size-1 form one CP group
                    rank, rows = reports[world_rank][(size, length, preembedded)]
                    rebuilt[rank::size] = torch.tensor(rows)
                assert torch.equal(rebuilt, full), (size, length, preembedded)
    # The second CP-2 group (world ranks 2, 3) ran the same steps independently.
    assert reports[2][(2, 129, False)] == reports[0][(2, 129, False)]


# --- runner contracts, one process per rank with the peers' shards supplied ---------------


class _TupleBody:
    """Returns whatever ``make_output(local_embeds)`` builds, records its kwargs."""

    def __init__(self, embed, make_output):
        self.embed = embed
        self.make_output = make_output
        self.calls = []

    def get_input_embeddings(self):
        return self.embed

    def __call__(self, input_ids, positions, forward_batch, input_embeds=None, **kwargs):
        self.calls.append(SimpleNamespace(input_ids=input_ids, kwargs=kwargs))
        return self.make_output(input_embeds)


def _model_and_step(size=4, rank=1):
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, HIDDEN)
    model = make_v4_model(embed, vision=False, image_token_id=VOCAB - 1)
    batch = extend_batch([3, 6], [7, 13])
    with torch.no_grad():
        full = embed(batch.input_ids)
    return model, batch, full


@pytest.mark.parametrize("rank", range(4))
def test_text_embedding_runs_once_on_the_scheduler_ids(rank):
    model, batch, full = _model_and_step()
    lookups = []
    model.model.embed = Mock(side_effect=lambda ids: (lookups.append(ids), full)[1])
    hidden, pre_norm = expected_hidden(full, batch.positions)
    with installed(*RUNTIME_PATCHES):
        run_extend_cp(model, batch, 4, rank, PeerShardsGroup(4, rank, [hidden, pre_norm]))
    assert len(lookups) == 1 and lookups[0] is batch.input_ids
    assert model.logits_calls[0].input_ids is batch.input_ids


def test_dspark_aux_states_are_gathered_and_pre_norm_is_not_passed():
    for as_list in (False, True):
        model, batch, full = _model_and_step()
        model.capture_aux_hidden_states = True

        def output(local):
            aux = [local * 2, local * 3] if as_list else local * 2
            return (local, local + 1), aux

        model.model = _TupleBody(model.model.embed, output)
        gathers = [full, full + 1] + ([full * 2, full * 3] if as_list else [full * 2])
        group = PeerShardsGroup(4, 1, gathers)
        with installed(*RUNTIME_PATCHES):
            run_extend_cp(model, batch, 4, 1, group)
        (logits,) = model.logits_calls
        assert group.gathers == len(gathers)
        assert torch.equal(logits.hidden_states, full)
        aux = logits.aux_hidden_states
        if as_list:
            assert torch.equal(aux[0], full * 2) and torch.equal(aux[1], full * 3)
        else:
            assert torch.equal(aux, full * 2)
        assert logits.hidden_states_before_norm is None


def test_non_last_pipeline_stage_returns_local_states_without_gathering():
    model, batch, full = _model_and_step()
    model.pp_group = SimpleNamespace(is_last_rank=False)
    model.model = _TupleBody(model.model.embed, lambda local: local * 5)
    proxy = object()
    group = PeerShardsGroup(4, 2)
    with installed(*RUNTIME_PATCHES):
        out = run_extend_cp(model, batch, 4, 2, group, {"pp_proxy_tensors": proxy})
    rows = physical_rows(9, 4)
    assert torch.equal(out, padded(interleave_rows(full, 2, 4), rows) * 5)
    assert group.gathers == 0 and model.logits_calls == []
    assert model.model.calls[0].kwargs["pp_proxy_tensors"] is proxy


def test_model_owning_its_cp_inputs_keeps_that_path():
    """GLM's prepare_cp_inputs stays in charge; our preparation is not called."""
    model, batch, full = _model_and_step()
    positions = batch.positions + 100
    model.prepare_cp_inputs = lambda fb, **kwargs: (full * 4, positions, {"marker": 1})
    model.prepare_model_inputs = Mock(side_effect=AssertionError("not for this model"))
    model.model.embed = Mock(side_effect=AssertionError("no lookup for this model"))
    hidden, pre_norm = expected_hidden(full * 4, positions)
    with installed(*RUNTIME_PATCHES):
        run_extend_cp(model, batch, 4, 3, PeerShardsGroup(4, 3, [hidden, pre_norm]))
    (body,) = model.model.calls
    assert body.kwargs == {"marker": 1}
    assert torch.equal(model.logits_calls[0].hidden_states, hidden)
    assert model.logits_calls[0].input_ids is batch.input_ids
