"""The engram hash of a CP prefill inside the breakable prefill graph (CPBCG-ENGRAM).

Real: sglang 0.5.23's EngramHasher (its torch path, on a small word-level
tokenizer), EngramLayout, eager_on_graph, the breakable-graph flag
(enable_breakable_cuda_graph), the forward context the graph runner sets
(set_tc_piecewise_forward_context), InterleaveCPStrategy and prepare_cp_forward.
Stand-in: the CUDA graph capture object eager_on_graph talks to (a CUDA-only
class); it records where the capture was split and the break functions it was
given, which the test then runs the way a replay does.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))

from dsv41_cp_harness import PeerShardsGroup, cp_scope, extend_batch, installed  # noqa: E402
from sglang.srt.layers.cp.utils import prepare_cp_forward  # noqa: E402
from sglang.srt.layers.engram import (  # noqa: E402
    EngramHasher,
    EngramLayout,
    build_compressed_token_map,
)
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (  # noqa: E402
    breakable_cuda_graph as bcg_module,
)
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (  # noqa: E402
    enable_breakable_cuda_graph,
)
from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (  # noqa: E402
    set_tc_piecewise_forward_context,
)

VOCAB_WORDS = 44
BUCKET = 32
# (extend lengths, prefix lengths) of live batches replayed through the captured bucket
REPLAYS = (([7], [0]), ([3, 11], [0, 5]), ([32], [0]), ([2, 9, 4], [6, 0, 20]))


def make_hasher() -> EngramHasher:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>"] + [f"w{i}" for i in range(VOCAB_WORDS - 4)] + ["W1", " w2", "é"]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                           unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    _, compressed = build_compressed_token_map(fast)
    layout = EngramLayout.from_config(SimpleNamespace(
        engram_layer_ids=[1, 3], engram_max_ngram_size=3, engram_n_heads=2,
        engram_vocab_size=VOCAB_WORDS, engram_num_embeddings=[997, 997], engram_head_dim=8))
    hasher = EngramHasher(layout, fast, 0, compressed)
    hasher.init_history(8, torch.device("cpu"))
    return hasher


def cp_batch(lengths, prefixes, seed):
    total = sum(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB_WORDS, (total,), generator=generator)
    batch = extend_batch(lengths, prefixes, input_ids=ids)
    batch.req_pool_indices = torch.arange(1, len(lengths) + 1)
    batch.out_cache_loc = torch.arange(100, 100 + total)
    batch.extend_seq_lens = torch.tensor(lengths)
    batch.extend_start_loc = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    batch.extend_num_tokens = total
    return batch


def padded_static(live, ids_buffer):
    """The live batch as the graph runner's static batch sees it: its ids in the
    fixed, bucket-long buffer, zero past the live tokens."""
    n = int(live.extend_num_tokens)
    ids_buffer.zero_()
    ids_buffer[:n].copy_(live.input_ids)
    static = copy.copy(live)
    static.input_ids = ids_buffer
    static.attn_cp_metadata = None
    return static


class RecordingCapture:
    """Stands in for the CUDA capture: records segment ends/starts and break functions."""

    def __init__(self):
        self.events = []
        self._barrier_fn = None
        self.cuda_graph = SimpleNamespace(_break_fns=[])

    def _end_current_segment(self):
        self.events.append("end segment")

    def _begin_new_segment(self):
        self.events.append("begin segment")


def capture_cp_hash(hasher, batch):
    """The DeepSeek-V4 body's CP branch, as captured: hash the whole prompt."""
    recorder = RecordingCapture()
    token = bcg_module._current_capture_var.set(recorder)
    try:
        with enable_breakable_cuda_graph(), _context(batch):
            total = int(batch.attn_cp_metadata.total_seq_lens)
            hash_ids = hasher(batch.input_ids[:total], batch)
    finally:
        bcg_module._current_capture_var.reset(token)
    return hash_ids, recorder


def _context(batch):
    return set_tc_piecewise_forward_context(batch, [], None, [], [])


def replay(recorder, batch):
    with enable_breakable_cuda_graph(), _context(batch):
        for break_fn in recorder.cuda_graph._break_fns:
            break_fn()


def eager_whole_prompt_hash(hasher, live):
    """The eager CP path: the hasher over the whole live prompt (on a copy of its history)."""
    reference = copy.deepcopy(hasher)
    return reference(live.input_ids, live), reference


@pytest.fixture
def bcg_enabled(monkeypatch):
    monkeypatch.setenv("SGLANG_DSV41_CP_BCG", "1")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_bcg_engram_hash_is_an_eager_break_that_replays_the_live_prompt(bcg_enabled, size):
    for rank in range(size):
        hasher = make_hasher()
        ids_buffer = torch.zeros(BUCKET, dtype=torch.int64)
        with installed("CPBCG-ENGRAM"), cp_scope(size, rank, PeerShardsGroup(size, rank)), \
                torch.no_grad():
            capture = padded_static(cp_batch([BUCKET], [0], seed=1), ids_buffer)
            prepare_cp_forward(capture)
            expected, _ = eager_whole_prompt_hash(hasher, capture)
            hash_ids, recorder = capture_cp_hash(hasher, capture)
            # The break was taken: the capture was split around one eager call.
            assert recorder.events == ["end segment", "begin segment"]
            assert len(recorder.cuda_graph._break_fns) == 1
            assert torch.equal(hash_ids, expected)
            out_address = hash_ids.data_ptr()

            for seed, (lengths, prefixes) in enumerate(REPLAYS, start=2):
                live = cp_batch(lengths, prefixes, seed)
                n = int(live.extend_num_tokens)
                static = padded_static(live, ids_buffer)
                prepare_cp_forward(static)
                expected, reference = eager_whole_prompt_hash(hasher, live)
                replay(recorder, static)
                # The captured output now holds the live prompt's hashes, zero after.
                assert hash_ids.data_ptr() == out_address
                assert torch.equal(hash_ids[:n], expected), (size, rank, lengths)
                assert not hash_ids[n:].any()
                # What the captured body reads for this rank (its interleaved rows)
                # equals the eager whole-prompt hash sliced for the rank.
                mine = hash_ids[rank::size]
                live_rows = expected[rank::size]
                assert torch.equal(mine[: live_rows.shape[0]], live_rows)
                assert not mine[live_rows.shape[0]:].any()
                # The hasher's per-request history was committed from the live batch.
                assert torch.equal(hasher.history, reference.history)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("patched, enabled", [(False, True), (True, False)])
def test_bcg_engram_without_the_patch_or_setting_is_captured_in_the_graph(
        monkeypatch, patched, enabled):
    """Stock (or the setting off): the hash is computed inside the captured segment,
    no break; a replay would reuse the capture batch's hash ids."""
    from contextlib import nullcontext

    monkeypatch.setenv("SGLANG_DSV41_CP_BCG", "1" if enabled else "0")
    hasher = make_hasher()
    with (installed("CPBCG-ENGRAM") if patched else nullcontext()), \
            cp_scope(2, 0, PeerShardsGroup(2, 0)), torch.no_grad():
        capture = padded_static(cp_batch([BUCKET], [0], seed=1), torch.zeros(BUCKET, dtype=torch.int64))
        prepare_cp_forward(capture)
        _, recorder = capture_cp_hash(hasher, capture)
    assert recorder.events == [] and recorder.cuda_graph._break_fns == []


@pytest.mark.timeout(60)
def test_bcg_engram_outside_cp_keeps_the_upstream_path(bcg_enabled):
    """Without CP (or outside the breakable graph) the hasher is called as upstream does."""
    hasher = make_hasher()
    batch = cp_batch([3, 5], [0, 2], seed=4)
    expected, _ = eager_whole_prompt_hash(hasher, batch)
    with installed("CPBCG-ENGRAM"), torch.no_grad():
        with enable_breakable_cuda_graph(), _context(batch):
            recorder = RecordingCapture()
            token = bcg_module._current_capture_var.set(recorder)
            try:
                got = hasher(batch.input_ids, batch)  # no CP strategy bound
            finally:
                bcg_module._current_capture_var.reset(token)
    assert recorder.cuda_graph._break_fns == []
    assert torch.equal(got, expected)


def test_bcg_engram_live_rows_must_fit_the_captured_output():
    from sglang_dsv41.cp_bcg.engram import write_live_hash_rows

    out = torch.full((6, 2, 3), 9)
    write_live_hash_rows(out, torch.ones(4, 2, 3, dtype=out.dtype))
    assert out[:4].eq(1).all() and not out[4:].any()
    with pytest.raises(RuntimeError, match="do not fit the captured output"):
        write_live_hash_rows(out, torch.ones(7, 2, 3, dtype=out.dtype))
    with pytest.raises(RuntimeError, match="do not fit the captured output"):
        write_live_hash_rows(out, torch.ones(4, 2, 4, dtype=out.dtype))
