"""The last check before the base embedding lookup of an override batch, run
through the real (hooked) ModelRunner._extend_forward_kwargs on real
ForwardBatch and MultimodalInputs objects."""

from __future__ import annotations

import pytest
import torch

from embed_harness import (
    HIDDEN,
    VOCAB,
    SchedulerRig,
    hooks_installed,
    image_item,
    image_req,
    override_req,
    vec,
)
from sglang.srt.managers.schedule_batch import MultimodalInputs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.runtime_context import reset_context

REFUSED = "cannot share an extend batch with multimodal placeholder rows"


class RecordingEmbedding(torch.nn.Embedding):
    """A real embedding table that remembers whether it was looked up."""

    def __init__(self):
        super().__init__(VOCAB, HIDDEN)
        self.calls = 0

    def forward(self, ids):
        self.calls += 1
        return super().forward(ids)


class _Model:
    def __init__(self):
        self.embedding = RecordingEmbedding()

    def get_input_embeddings(self):
        return self.embedding


def _runner():
    runner = ModelRunner.__new__(ModelRunner)
    runner.support_pp = False
    runner.is_generation = True
    runner.model = _Model()
    return runner


def _forward_batch(input_ids, mm_inputs, prefix_lens, extend_lens, replace_positions,
                   *, cpu_lens=True):
    n = len(mm_inputs)
    seq_lens = torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)])
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=n,
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        req_pool_indices=torch.arange(1, n + 1),
        seq_lens=seq_lens,
        out_cache_loc=torch.arange(1, len(input_ids) + 1),
        seq_lens_sum=int(seq_lens.sum()),
        mm_inputs=mm_inputs,
        extend_prefix_lens_cpu=list(prefix_lens) if cpu_lens else None,
        extend_seq_lens_cpu=list(extend_lens) if cpu_lens else None,
        replace_embeds=torch.stack([vec(5.0) for _ in replace_positions]),
        replace_positions=torch.tensor(replace_positions, dtype=torch.int64),
    )


@pytest.fixture(autouse=True)
def _clean_context():
    yield
    reset_context()


@pytest.mark.parametrize("with_offsets", [True, False], ids=["spans", "no-spans"])
def test_mixed_extend_batch_is_refused_before_the_lookup(with_offsets):
    """Row 1 is an image request whose chunk covers its placeholders; row 0
    carries an override. The lookup must not run."""
    image = image_item((0, 1), with_offsets=with_offsets)
    pad = image.padding_sequence(2)
    runner = _runner()
    fb = _forward_batch(
        [1, 2, *pad], [None, MultimodalInputs(mm_items=[image])], [0, 0], [2, 2], [0]
    )
    with hooks_installed({"EMB-LOOKUP"}):
        with pytest.raises(ValueError, match=rf"{REFUSED} \(batch row 1\)"):
            ModelRunner._extend_forward_kwargs(runner, fb, None)
    assert runner.model.embedding.calls == 0


@pytest.mark.parametrize("with_offsets", [True, False], ids=["spans", "no-spans"])
def test_decoding_image_row_in_a_mixed_step_is_fine(with_offsets):
    """A decode row of an image request carries a generated token, not a
    placeholder, so the override row next to it is embedded normally."""
    image = image_item((0, 1), with_offsets=with_offsets)
    runner = _runner()
    fb = _forward_batch(
        [1, 2, 3], [None, MultimodalInputs(mm_items=[image])], [0, 5], [2, 1], [0]
    )
    with hooks_installed({"EMB-LOOKUP"}):
        kwargs = ModelRunner._extend_forward_kwargs(runner, fb, None)
    assert runner.model.embedding.calls == 1
    assert torch.equal(kwargs["input_embeds"][0], vec(5.0))
    assert torch.equal(kwargs["input_embeds"][1], runner.model.embedding.weight[2].detach())


def test_without_host_chunk_lengths_the_token_ids_are_scanned():
    image = image_item((0, 1))
    runner = _runner()
    placeholders = [None, MultimodalInputs(mm_items=[image])]
    fb = _forward_batch([1, 2, *image.padding_sequence(2)], placeholders, [0, 0], [2, 2],
                        [0], cpu_lens=False)
    with hooks_installed({"EMB-LOOKUP"}):
        with pytest.raises(ValueError, match=REFUSED):
            ModelRunner._extend_forward_kwargs(runner, fb, None)
        fb = _forward_batch([1, 2, 3], placeholders, [0, 5], [2, 1], [0], cpu_lens=False)
        ModelRunner._extend_forward_kwargs(runner, fb, None)


def test_batches_without_overrides_are_untouched():
    """Plain multimodal batches never reach the override lookup; the check
    must not stand in their way (the model merges their features itself)."""
    image = image_item((0, 1))
    runner = _runner()
    fb = _forward_batch([1, 2, *image.padding_sequence(2)],
                        [None, MultimodalInputs(mm_items=[image])], [0, 0], [2, 2], [0])
    fb.replace_embeds = None
    fb.replace_positions = None
    with hooks_installed({"EMB-LOOKUP"}):
        kwargs = ModelRunner._extend_forward_kwargs(runner, fb, None)
    assert "input_embeds" not in kwargs and runner.model.embedding.calls == 0


def _stock_mixed_batch():
    """What 0.5.23's scheduler builds from an override request arriving behind an
    image continuation: one extend batch with both."""
    rig = SchedulerRig(chunk=16)
    rig.submit(image_req("image", 40, span=(2, 36)))  # media reaches the last chunk
    rig.run_round()
    rig.submit(override_req("override", 6))
    rig.run_round()  # tokens 16..32 of the image fill the chunk
    batch = rig.run_round()  # tokens 32..40 and the override request
    assert [r.rid for r in batch.reqs] == ["image", "override"]
    assert batch.replace_embeds is not None
    return ForwardBatch(
        forward_mode=batch.forward_mode,
        batch_size=batch.batch_size(),
        # resolve_forward_inputs moves these host ids to the device unchanged
        input_ids=batch.prefill_input_ids_cpu,
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        out_cache_loc=batch.out_cache_loc,
        seq_lens_sum=batch.seq_lens_sum,
        mm_inputs=batch.multimodal_inputs,
        extend_prefix_lens_cpu=list(batch.prefix_lens),
        extend_seq_lens_cpu=list(batch.extend_lens),
        replace_embeds=batch.replace_embeds,
        replace_positions=batch.replace_positions,
    )


def test_the_batch_stock_sglang_builds_is_caught_instead_of_indexing_garbage():
    fb = _stock_mixed_batch()
    runner = _runner()
    # stock: the lookup runs on placeholder hash ids far outside the table
    with pytest.raises(IndexError):
        ModelRunner._extend_forward_kwargs(runner, fb, None)
    assert runner.model.embedding.calls == 1
    runner = _runner()
    with hooks_installed({"EMB-LOOKUP"}):
        with pytest.raises(ValueError, match=rf"{REFUSED} \(batch row 0\)"):
            ModelRunner._extend_forward_kwargs(runner, fb, None)
    assert runner.model.embedding.calls == 0
