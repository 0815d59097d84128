"""V4.1 image + text batches under interleave prefill CP, over real gloo collectives,
and the upstream input-preparation contracts the CP runner relies on.

The gloo test forks a 4-process world (two CP-2 groups and one CP-4 group built as
real sglang ``GroupCoordinator``s). Every rank runs sglang 0.5.23's eager CP extend
with our VCP-RUNNER / VCP-PREPARE patches on the real ``ForwardBatch``, the real
interleave strategy, the real image merge (``embed_mm_inputs``) and the real
all-gather. Stand-ins: the vision encoder (fixed spans) and the transformer body
(hidden = embeds + position mark, so any row mix-up in the gather shows).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dsv41_cp_harness import (
    CP_LAYOUTS,
    RUNTIME_PATCHES,
    expected_hidden,
    extend_batch,
    gloo_group_for,
    image_item,
    image_step,
    installed,
    interleave_rows,
    make_v4_model,
    padded,
    physical_rows,
    rank_major,
    run_extend_cp,
    run_gloo_ranks,
)
from sglang.srt.managers import mm_schedule
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models import deepseek_v4
from sglang.srt.models.deepseek_v4 import MM_PAD_SHIFT_VALUE

HIDDEN = 6
VOCAB = 97
IMAGE_TOKEN_ID = 11


def _scenarios():
    """(name, requests [(prefix, extend)], images per request). Mixed lengths,
    cached prefixes, spans that start in the prefix or run past the chunk, totals
    that need CP padding, and a text-only batch on the vision model."""
    return [
        ("image_crosses_ranks", [(0, 3), (0, 6)], [None, [image_item(0x11, (2, 3))]]),
        ("span_starts_in_prefix", [(0, 7), (3, 9), (1, 5)],
         [[], [image_item(0x22, (2, 8))], None]),
        ("long_prefix_two_images", [(16384, 4), (127, 9)],
         [None, [image_item(0x33, (120, 130)), image_item(0x44, (133, 135))]]),
        ("span_continues_next_chunk", [(0, 5), (0, 13)],
         [[image_item(0x55, (1, 3))], [image_item(0x66, (9, 20))]]),
        ("text_batch_on_vision_model", [(0, 9), (40, 4)], [None, None]),
    ]


def _rank_body(world_rank: int, groups: dict):
    """Runs in each forked rank: every scenario at CP 2 and CP 4."""
    report = {}
    for size in (2, 4):
        group = gloo_group_for(size, world_rank, groups)
        rank = group.rank_in_group
        for name, requests, images in _scenarios():
            mm_schedule.init_mm_embedding_cache(1 << 20)  # one cache per rank process
            torch.manual_seed(0)
            model = make_v4_model(nn.Embedding(VOCAB, HIDDEN), vision=True,
                                  image_token_id=IMAGE_TOKEN_ID)
            batch, model_ids, merged = image_step(
                requests, images, image_token_id=IMAGE_TOKEN_ID, vocab=VOCAB)
            full = merged(model.model.embed)
            hidden, pre_norm = expected_hidden(full, batch.positions)
            scheduler_ids = batch.input_ids
            scheduler_copy = scheduler_ids.clone()

            assert run_extend_cp(model, batch, size, rank, group) == "logits"

            rows = physical_rows(full.shape[0], size)
            (body,) = model.model.calls
            assert torch.equal(body.input_ids, padded(interleave_rows(model_ids, rank, size), rows))
            assert torch.equal(body.input_embeds, padded(interleave_rows(full, rank, size), rows))
            assert torch.equal(body.input_ids_global, rank_major(model_ids, size))
            (logits,) = model.logits_calls
            assert torch.equal(logits.input_ids, model_ids)
            assert torch.equal(logits.hidden_states, hidden), name
            assert torch.equal(logits.hidden_states_before_norm, pre_norm), name
            assert batch.input_ids is scheduler_ids
            assert torch.equal(scheduler_ids, scheduler_copy)
            assert not hasattr(batch, "input_ids_global")
            n_images = sum(len(items or ()) for items in images)
            assert len(model.encoded) == n_images
            report[(size, name)] = {
                "rank": rank,
                "placeholders": int((scheduler_ids >= MM_PAD_SHIFT_VALUE).sum()),
                "local_rows": body.input_embeds[: len(interleave_rows(full, rank, size))].tolist(),
                "gathered_sum": float(logits.hidden_states.sum()),
            }
    return report


def _expected_full(requests, images) -> torch.Tensor:
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, HIDDEN)
    _, _, merged = image_step(requests, images, image_token_id=IMAGE_TOKEN_ID, vocab=VOCAB)
    return merged(embed)


@pytest.mark.timeout(240)
def test_image_and_text_batches_roundtrip_over_gloo_in_2_and_4_processes():
    with installed(*RUNTIME_PATCHES):
        reports = run_gloo_ranks(4, CP_LAYOUTS, _rank_body)
    assert sorted(reports) == [0, 1, 2, 3]
    for size in (2, 4):
        for name, requests, images in _scenarios():
            entries = [reports[r][(size, name)] for r in range(4)]
            # Every rank gathered the same full hidden states.
            assert len({e["gathered_sum"] for e in entries}) == 1, (size, name)
            # The local rows of one CP group, interleaved back, are the merged
            # embeddings of the whole extend step, each row exactly once.
            members = {e["rank"]: e for e in entries[:size]}
            assert sorted(members) == list(range(size))
            full = _expected_full(requests, images)
            rebuilt = torch.full_like(full, float("nan"))
            for rank, entry in members.items():
                rebuilt[rank::size] = torch.tensor(entry["local_rows"])
            assert torch.equal(rebuilt, full), (size, name)
    placeholders = {name: reports[0][(2, name)]["placeholders"] for name, _, _ in _scenarios()}
    assert placeholders == {"image_crosses_ranks": 2, "span_starts_in_prefix": 6,
                            "long_prefix_two_images": 7, "span_continues_next_chunk": 7,
                            "text_batch_on_vision_model": 0}


# --- upstream input-preparation contracts the CP runner relies on (sglang 0.5.23) -------


def _vision_model():
    mm_schedule.init_mm_embedding_cache(1 << 20)
    torch.manual_seed(0)
    return make_v4_model(nn.Embedding(VOCAB, HIDDEN), vision=True,
                         image_token_id=IMAGE_TOKEN_ID)


@pytest.mark.parametrize("prefixes", [(0, 0), (16384, 127)])
def test_embedder_gets_chunk_metadata_and_a_copy_of_the_scheduler_ids(prefixes, monkeypatch):
    """_prepare_mm_embeddings hands embed_mm_inputs the chunk's prefix/extend lengths
    and a copy of the ids: the shared embedder clamps its input in place, and the
    scheduler's placeholder hashes are its multimodal cache keys."""
    model = _vision_model()
    start = prefixes[1] + 1
    images = [None, [image_item(0x77, (start, start + 4))]]
    batch, _, merged = image_step([(prefixes[0], 3), (prefixes[1], 6)], images,
                                  image_token_id=IMAGE_TOKEN_ID, vocab=VOCAB)
    scheduler_copy = batch.input_ids.clone()
    seen = {}
    real_embed = deepseek_v4.embed_mm_inputs

    def spy(**kwargs):
        seen.update(kwargs)
        return real_embed(**kwargs)

    monkeypatch.setattr(deepseek_v4, "embed_mm_inputs", spy)
    with torch.no_grad():
        embeds = model._prepare_mm_embeddings(batch.input_ids, batch)
    assert seen["extend_prefix_lens"] == list(prefixes)
    assert seen["extend_seq_lens"] == [3, 6]
    assert seen["mm_inputs_list"][0].mm_items == []  # None became an empty input
    assert seen["input_ids"].data_ptr() != batch.input_ids.data_ptr()
    assert torch.equal(batch.input_ids, scheduler_copy)
    assert embeds is batch.mm_input_embeds
    assert torch.equal(embeds, merged(model.model.embed))


@pytest.mark.parametrize("mm_inputs", [None, [None, None], []])
def test_text_batch_on_vision_model_skips_the_encoder(mm_inputs):
    model = _vision_model()
    batch = extend_batch([2, 1], [0, 5], mm_inputs=mm_inputs)
    ids, embeds = model.prepare_language_model_inputs(batch.input_ids, batch)
    assert torch.equal(ids, batch.input_ids) and embeds is None
    assert model.encoded == []


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.IDLE,
                                  ForwardMode.TARGET_VERIFY])
def test_decode_idle_and_verify_keep_vocabulary_ids(mode):
    model = _vision_model()
    batch = extend_batch([3], [0], input_ids=torch.tensor([4, IMAGE_TOKEN_ID, 6]),
                         mm_inputs=[None])
    batch.forward_mode = mode
    ids, embeds = model.prepare_language_model_inputs(batch.input_ids, batch)
    assert ids is batch.input_ids and embeds is None
    assert model.encoded == []


def test_encoder_failure_leaves_scheduler_ids_and_batch_untouched():
    model = _vision_model()

    def broken_encoder(items):
        raise RuntimeError("vision failure")

    model.get_image_feature = broken_encoder
    batch, _, _ = image_step([(0, 4)], [[image_item(0x88, (1, 2))]],
                             image_token_id=IMAGE_TOKEN_ID, vocab=VOCAB)
    before = batch.input_ids.clone()
    with pytest.raises(RuntimeError, match="vision failure"):
        model.prepare_language_model_inputs(batch.input_ids, batch)
    assert torch.equal(batch.input_ids, before)
    assert batch.mm_input_embeds is None


def test_text_only_models_keep_given_embeddings():
    """Vision off (text checkpoint or --language-model-only) and the NextN subclass,
    which has no ``vision`` attribute at all: ids and embeddings pass through."""
    batch, _, _ = image_step([(0, 4)], [[image_item(0x99, (1, 2))]],
                             image_token_id=IMAGE_TOKEN_ID, vocab=VOCAB)
    given = torch.ones(4, HIDDEN)
    text_model = make_v4_model(nn.Embedding(VOCAB, HIDDEN), vision=False,
                               image_token_id=IMAGE_TOKEN_ID)
    ids, embeds = text_model.prepare_language_model_inputs(batch.input_ids, batch, given)
    assert ids is batch.input_ids and embeds is given
    del text_model.vision
    ids, embeds = text_model.prepare_language_model_inputs(batch.input_ids, batch, given)
    assert ids is batch.input_ids and embeds is given


# --- with the owner-broadcast embedding over the CP group ----------------------------------

OWNER_PATCHES = (*RUNTIME_PATCHES, "OWN-FENCE", "OWN-TEXT-EMBED", "OWN-ENCODE")


def _owner_scenarios():
    """Spans long enough for a real ViT grid (downsample 2): (rows, cols) -> tokens
    4x2 -> 6, 2x8 -> 7, 2x2 -> 4, 2x4 -> 5. One image is repeated in two requests."""
    return [
        ("one_image", [(0, 3), (0, 9)], [None, [image_item(0x101, (2, 7), (4, 2))]]),
        ("span_starts_in_prefix", [(0, 7), (3, 9), (1, 5)],
         [[], [image_item(0x202, (2, 8), (2, 8))], None]),
        ("repeated_and_second_image", [(0, 8), (0, 12)],
         [[image_item(0x303, (1, 4), (2, 2))],
          [image_item(0x303, (2, 5), (2, 2)), image_item(0x404, (7, 11), (2, 4))]]),
    ]


def _owner_rank_body(world_rank: int, groups: dict):
    from sglang.srt.runtime_context import get_parallel
    from sglang_dsv41.owner_broadcast.routing import ENV_MODE
    from sglang_dsv41.owner_broadcast import hooks
    from sglang_dsv41.owner_broadcast.hooks import attach_owner_path

    # The protocol on every image chunk: these chunks are too small for the
    # default routing to think the owner path worth its rounds.
    os.environ[ENV_MODE] = "always"
    report = {}
    for size in (2, 4):
        group = gloo_group_for(size, world_rank, groups)
        rank = group.rank_in_group
        for name, requests, images in _owner_scenarios():
            mm_schedule.init_mm_embedding_cache(1 << 20)
            torch.manual_seed(0)
            model = make_v4_model(nn.Embedding(VOCAB, HIDDEN), vision=True,
                                  image_token_id=IMAGE_TOKEN_ID)
            batch, model_ids, merged = image_step(
                requests, images, image_token_id=IMAGE_TOKEN_ID, vocab=VOCAB)
            batch.rids = [f"req{i}" for i in range(len(requests))]
            full = merged(model.model.embed)
            hidden, _ = expected_hidden(full, batch.positions)
            with get_parallel().override(
                    tp_size=size, attn_tp_size=1, attn_dp_size=1, attn_cp_size=size,
                    attn_cp_group=group, pp_group=groups["single"]):
                attach_owner_path(model)
            assert model.mm_owner_group is not None and model.mm_owner_group.world_size == size
            # a router in this process: OWN-ADMIT builds request tables at admission
            assert hooks.routes_in_process

            assert run_extend_cp(model, batch, size, rank, group) == "logits"
            (logits,) = model.logits_calls
            assert torch.equal(logits.input_ids, model_ids)
            assert torch.equal(logits.hidden_states, hidden), name
            assert torch.equal(batch.mm_input_embeds, full), name
            report[(size, name)] = (rank, sorted(model.encoded))
    return report


@pytest.mark.timeout(240)
def test_owner_broadcast_under_cp_encodes_each_image_once_per_group():
    """The CP group replicates image work (every rank prepares the full layout), so
    the owner-broadcast embedding engages over it: each distinct image is encoded by
    one rank and every rank still merges identical embeddings before the shard."""
    layouts = {**CP_LAYOUTS, "single": [[0], [1], [2], [3]]}
    with installed(*OWNER_PATCHES):
        reports = run_gloo_ranks(4, layouts, _owner_rank_body)
    for size in (2, 4):
        for name, _, images in _owner_scenarios():
            distinct = sorted({item.hash for items in images for item in items or ()})
            for first in range(0, 4, size):  # each CP group of this size
                encoded = [h for r in range(first, first + size)
                           for h in reports[r][(size, name)][1]]
                assert sorted(encoded) == distinct, (size, name, first)
