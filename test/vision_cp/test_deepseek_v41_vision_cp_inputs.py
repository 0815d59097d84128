"""V4.1 image inputs under prefill CP: merged on the full extend layout, then sharded.

Runs sglang 0.5.23's real eager CP path (interleave strategy, ``prepare_cp_forward``,
``cp_shard_model_inputs``, ``cp_gather_after_forward``), the real
``DeepseekV4ForCausalLM.prepare_language_model_inputs`` / ``_prepare_mm_embeddings``
and the real ``embed_mm_inputs`` merge, with our VCP-RUNNER and VCP-PREPARE patches.
Stand-ins: the vision encoder (``get_image_feature`` returns fixed spans) and the
transformer body (records what it receives); one process plays each CP rank with
the other ranks' all-gather shards supplied by ``PeerShardsGroup``. The same merge
under real gloo collectives is in test_deepseek_v41_multimodal_cp.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dsv41_cp_harness import (
    RUNTIME_PATCHES,
    PeerShardsGroup,
    cp_scope,
    extend_batch,
    installed,
    interleave_rows,
    padded,
    physical_rows,
    rank_major,
)
from sglang.srt.layers.cp.utils import is_cp_active, prepare_cp_forward
from sglang.srt.managers import mm_schedule
from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs
from sglang.srt.model_executor.runner.eager_runner import EagerRunner
from sglang.srt.models.deepseek_v4 import MM_PAD_SHIFT_VALUE, DeepseekV4ForCausalLM

HIDDEN = 8
VOCAB = 64
IMAGE_TOKEN_ID = 5

# Three requests in one extend step, as (prefix_len, extend_len):
#  0: text only;
#  1: image A at request positions [2, 7] starts inside the cached prefix (only
#     positions 4..7 are in this chunk), then text, image B at [10, 12], text;
#  2: no multimodal inputs at all (None).
REQUESTS = [(0, 6), (4, 10), (0, 5)]
IMAGE_A, IMAGE_B = (2, 7), (10, 12)


def _span(item: MultimodalDataItem) -> torch.Tensor:
    """The complete embedding span the vision stand-in returns for one image."""
    start, end = item.offsets[0]
    rows = end - start + 1
    base = 1000.0 * (1 + int(item.hash % 7))
    return base + torch.arange(rows * HIDDEN, dtype=torch.float32).view(rows, HIDDEN)


class _Body:
    """Transformer-body stand-in: records its inputs, returns (hidden, pre-norm)."""

    def __init__(self, embed: nn.Embedding):
        self.embed = embed
        self.calls = []

    def get_input_embeddings(self):
        return self.embed

    def __call__(self, input_ids, positions, forward_batch, input_embeds=None):
        self.calls.append(SimpleNamespace(
            input_ids=input_ids.clone(), positions=positions.clone(),
            input_embeds=input_embeds.clone(),
            input_ids_global=forward_batch.input_ids_global.clone(),
        ))
        return input_embeds, input_embeds


class _VisionModel(DeepseekV4ForCausalLM):
    """sglang's DeepseekV4ForCausalLM methods on stand-in vision and body modules
    (the real constructor needs CUDA; see test_deepseek_v41_vision_cp_build.py)."""

    def __init__(self, embed: nn.Embedding):
        nn.Module.__init__(self)
        self.config = SimpleNamespace(image_token_id=IMAGE_TOKEN_ID, hidden_size=HIDDEN)
        self.vision = object()  # a vision model; the encoder itself is get_image_feature
        self.mm_owner_group = None
        self.model = _Body(embed)
        self.pp_group = SimpleNamespace(is_last_rank=True)
        self.lm_head = object()
        self.capture_aux_hidden_states = False
        self.encoded = []
        self.logits_calls = []

    def get_image_feature(self, items):
        self.encoded.extend(item.hash for item in items)
        return [_span(item) for item in items]

    def logits_processor(self, input_ids, hidden_states, lm_head, logits_metadata,
                         aux_hidden_states=None, hidden_states_before_norm=None):
        self.logits_calls.append(SimpleNamespace(
            input_ids=input_ids, hidden_states=hidden_states,
            logits_metadata=logits_metadata,
            hidden_states_before_norm=hidden_states_before_norm,
        ))
        return "logits"


def _image(hash_value: int, offsets) -> MultimodalDataItem:
    item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(1),
                              offsets=[offsets])
    item.set_hash(hash_value)
    return item


def _build_step():
    """(forward batch, expected merged embeddings fn, expected model ids)."""
    image_a, image_b = _image(0xA11CE, IMAGE_A), _image(0xB0B, IMAGE_B)
    request_ids = []
    image_rows = {}
    for index, (prefix, length) in enumerate(REQUESTS):
        ids = [10 + index * 10 + p for p in range(prefix, prefix + length)]
        for item in ((image_a, image_b) if index == 1 else ()):
            start, end = item.offsets[0]
            span_ids = item.padding_sequence(end - start + 1)
            for pos in range(max(start, prefix), end + 1):
                ids[pos - prefix] = span_ids[pos - start]
                image_rows[len(request_ids) + pos - prefix] = (item, pos - start)
        request_ids.extend(ids)
    scheduler_ids = torch.tensor(request_ids, dtype=torch.long)
    mm_inputs = [
        MultimodalInputs(mm_items=[]),
        MultimodalInputs(mm_items=[image_a, image_b], im_token_id=IMAGE_TOKEN_ID),
        None,
    ]
    batch = extend_batch([n for _, n in REQUESTS], [p for p, _ in REQUESTS],
                         input_ids=scheduler_ids, mm_inputs=mm_inputs)

    model_ids = scheduler_ids.clone()
    for row in image_rows:
        model_ids[row] = IMAGE_TOKEN_ID

    def merged(embed: nn.Embedding) -> torch.Tensor:
        with torch.no_grad():
            full = embed(model_ids.clamp(max=VOCAB - 1)).clone()
        for row, (item, span_row) in image_rows.items():
            full[row] = _span(item)[span_row]
        return full

    return batch, merged, model_ids


def _fresh_rank_state():
    """Each CP rank is its own process with its own multimodal embedding cache."""
    mm_schedule.init_mm_embedding_cache(1 << 20)
    torch.manual_seed(0)


def _run_rank(size: int, rank: int):
    _fresh_rank_state()
    model = _VisionModel(nn.Embedding(VOCAB, HIDDEN))
    batch, merged, model_ids = _build_step()
    full = merged(model.model.embed)
    scheduler_ids = batch.input_ids
    scheduler_copy = scheduler_ids.clone()
    runner = EagerRunner.__new__(EagerRunner)
    runner.model_runner = SimpleNamespace(model=model)
    group = PeerShardsGroup(size, rank, full)
    with cp_scope(size, rank, group), torch.no_grad():
        assert is_cp_active(batch)
        prepare_cp_forward(batch)
        result = runner._execute_extend_cp(batch, {})
    return SimpleNamespace(model=model, batch=batch, full=full, model_ids=model_ids,
                           scheduler_ids=scheduler_ids, scheduler_copy=scheduler_copy,
                           result=result, group=group)


@pytest.mark.parametrize("size", [2, 4])
def test_runner_merges_images_on_full_layout_before_the_shard(size):
    with installed(*RUNTIME_PATCHES):
        for rank in range(size):
            run = _run_rank(size, rank)
            total = run.full.shape[0]
            rows = physical_rows(total, size)
            assert run.batch.attn_cp_metadata.per_rank_actual_token == [rows] * size

            (body,) = run.model.model.calls
            assert torch.equal(body.input_ids, padded(interleave_rows(run.model_ids, rank, size), rows))
            assert torch.equal(body.positions,
                               padded(interleave_rows(run.batch.positions, rank, size), rows))
            assert torch.equal(body.input_embeds, padded(interleave_rows(run.full, rank, size), rows))
            # MoE routing ids: normalized, in rank-major order, never raw hashes.
            assert torch.equal(body.input_ids_global, rank_major(run.model_ids, size))
            assert not (body.input_ids_global >= MM_PAD_SHIFT_VALUE).any()

            (logits,) = run.model.logits_calls
            assert run.result == "logits"
            assert run.group.gathers == 2  # hidden states and pre-norm states
            assert torch.equal(logits.input_ids, run.model_ids)
            assert torch.equal(logits.hidden_states, run.full)
            assert torch.equal(logits.hidden_states_before_norm, run.full)
            assert logits.logits_metadata is run.batch

            # The scheduler's ids: same tensor, same values; shard-scoped state restored.
            assert run.batch.input_ids is run.scheduler_ids
            assert torch.equal(run.scheduler_ids, run.scheduler_copy)
            assert not hasattr(run.batch, "input_ids_global")
            assert torch.equal(run.batch.mm_input_embeds, run.full)
            # Each image is encoded once per rank, on the full layout.
            assert sorted(run.model.encoded) == sorted({0xA11CE & ((1 << 64) - 1), 0xB0B})


def test_stock_runner_embeds_raw_placeholder_hashes():
    """Without VCP-RUNNER, sglang 0.5.23 embeds the scheduler's ids, placeholder
    hashes included, before any image merge: the lookup fails on the hash ids."""
    with installed("VCP-PREPARE"), pytest.raises(IndexError):
        _run_rank(2, 0)


def test_external_embeddings_with_images_are_refused_before_any_collective():
    _fresh_rank_state()
    model = _VisionModel(nn.Embedding(VOCAB, HIDDEN))
    batch, _, _ = _build_step()
    before = batch.input_ids.clone()
    runner = EagerRunner.__new__(EagerRunner)
    runner.model_runner = SimpleNamespace(model=model)
    group = PeerShardsGroup(2, 0)
    with installed(*RUNTIME_PATCHES), cp_scope(2, 0, group), torch.no_grad():
        prepare_cp_forward(batch)
        with pytest.raises(ValueError, match="Cannot combine input_embeds and image inputs"):
            runner._execute_extend_cp(
                batch, {"input_embeds": torch.zeros(batch.input_ids.shape[0], HIDDEN)})
    assert group.gathers == 0 and model.model.calls == []
    assert torch.equal(batch.input_ids, before)


def test_prepare_model_inputs_delegates_to_upstream_preparation():
    _fresh_rank_state()
    model = _VisionModel(nn.Embedding(VOCAB, HIDDEN))
    batch, merged, model_ids = _build_step()
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
