"""Pin: the DSv4 paged indexer's row chunking (the original fork's additions to
test_dsv4_nonpaged_indexer.py, rewritten against sglang 0.5.23).

The original fork added a capture-mode skip of the free-memory budget, ``row_chunks()``
pairing each row chunk with its own DeepGEMM schedule, and a chunked decode
candidate publisher. sglang 0.5.23 has all three (the publisher moved from
``candidate_indexer_deep_gemm`` to ``v41_indexer.SparseTableBackend``); these tests
fail if that changes. Stand-ins are limited to device queries and GPU kernels
(DeepGEMM, top-k and candidate-block kernels, streams and events); the chunk
planning, the metadata object and the publisher's orchestration are sglang's.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

import deep_gemm
import pytest
import torch

import sglang.kernels.ops.attention.dsv4 as dsv4_kernels

from sglang.srt.layers.attention.dsv4 import metadata as metadata_module
from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata, iter_row_chunks
from sglang.srt.layers.attention.dsv4.v41_indexer import sparse_table
from sglang.srt.layers.attention.dsv4.v41_indexer.scoring import DeepGEMMDecodeData
from sglang.srt.layers.attention.dsv4.v41_indexer.types import DecodeInputs
from sglang.srt.model_executor.runner_utils import capture_mode

PAGES = 12500  # 10 rows x 800000 compressed columns: large enough to need a budget
ROWS = 10


# --- the free-memory budget is not read during capture ----------------------------------


@pytest.mark.parametrize("capturing", [True, False])
def test_capture_warmup_skips_dynamic_budget_but_eager_forward_uses_it(capturing, monkeypatch):
    meta = object.__new__(PagedIndexerMetadata)
    meta.use_prefill_cuda_graph = False
    meta.compressed_page_size = 64
    meta.page_table = torch.zeros((1, 1024), dtype=torch.int32)  # 65536 columns
    # A device tensor's two properties the budget check reads (no device here).
    meta.compressed_seq_lens = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    budget = MagicMock(return_value=4096)
    monkeypatch.setattr(metadata_module, "mqa_logits_budget_bytes", budget)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(capture_mode, "is_capture_mode", capturing)

    result = meta._mqa_logits_budget(num_rows=256)
    if capturing:
        assert result is None
        budget.assert_not_called()
    else:
        assert result == 4096
        budget.assert_called_once_with(device_index=0, allow_sync=True)


# --- each row chunk carries the schedule built for its rows ------------------------------


def _schedule_kernels(monkeypatch, plan):
    """DeepGEMM's and sglang's JIT schedule kernels (either may be chosen)."""
    monkeypatch.setattr(deep_gemm, "get_num_sms", lambda: 132)
    monkeypatch.setattr(deep_gemm, "get_paged_mqa_logits_metadata", plan)
    monkeypatch.setattr(dsv4_kernels, "get_paged_mqa_logits_metadata", plan)


@pytest.fixture
def chunked_metadata(monkeypatch):
    """A real PagedIndexerMetadata whose logits do not fit a 4-row budget."""
    planned = []

    def plan(seq_lens, page_size, num_sms):
        plan_tensor = torch.tensor([len(planned)], dtype=torch.int32)
        planned.append((seq_lens.clone(), plan_tensor))
        return plan_tensor

    _schedule_kernels(monkeypatch, plan)
    row_bytes = PAGES * 64 * 4
    monkeypatch.setattr(PagedIndexerMetadata, "_mqa_logits_budget",
                        lambda self, *, num_rows: 4 * row_bytes)
    meta = PagedIndexerMetadata(
        page_size=256, compressed_page_size=64,
        page_table=torch.zeros((ROWS, PAGES), dtype=torch.int32),
        compressed_seq_lens=torch.arange(1, ROWS + 1, dtype=torch.int32),
        use_topk_v2=False,
    )
    return meta, planned


def test_row_chunks_pair_each_chunk_with_its_own_schedule(chunked_metadata):
    meta, planned = chunked_metadata
    assert meta.rows_per_chunk == 4
    chunks = meta.row_chunks()
    assert [rows for rows, _ in chunks] == list(iter_row_chunks(num_rows=ROWS, rows_per_chunk=4))
    assert [rows for rows, _ in chunks] == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert len(planned) == len(chunks)
    for (rows, plan), (seq_lens, made) in zip(chunks, planned):
        assert plan is made
        assert torch.equal(seq_lens.view(-1), meta.compressed_seq_lens[rows])


def test_row_chunks_refuse_schedules_that_do_not_cover_every_row(chunked_metadata):
    meta, _ = chunked_metadata
    meta.deep_gemm_metadata = meta.deep_gemm_metadata[:-1]
    with pytest.raises(AssertionError, match="chunk schedules do not cover all rows"):
        meta.row_chunks()


def test_unchunked_metadata_is_one_chunk(monkeypatch):
    _schedule_kernels(monkeypatch, lambda seq_lens, page_size, num_sms: torch.tensor([9]))
    meta = PagedIndexerMetadata(page_size=256, compressed_page_size=64,
                                page_table=torch.zeros((3, 4), dtype=torch.int32),
                                compressed_seq_lens=torch.tensor([5, 6, 7]),
                                use_topk_v2=False)
    ((rows, plan),) = meta.row_chunks()
    assert rows == slice(0, 3) and plan is meta.deep_gemm_metadata


# --- the chunked decode candidate publisher ----------------------------------------------


def test_chunked_publisher_gives_each_kernel_call_its_chunk_schedule(monkeypatch):
    width, topk_blocks = 16, 2
    chunks = [slice(0, 2), slice(2, 4), slice(4, 5)]
    plans = [torch.tensor([i], dtype=torch.uint8) for i in range(len(chunks))]
    topk_plans = [torch.tensor([i], dtype=torch.int32) for i in range(len(chunks))]
    meta = object.__new__(PagedIndexerMetadata)
    meta.page_size, meta.compressed_page_size, meta.rows_per_request = 256, 64, 1
    meta.compressed_seq_lens = torch.full((5, 1), width, dtype=torch.int32)
    meta.page_table = torch.zeros((5, 1), dtype=torch.int32)
    meta.deep_gemm_metadata, meta.rows_per_chunk = plans, 2
    meta.use_topk_v2, meta.topk_metadata_chunks = True, topk_plans

    data = DeepGEMMDecodeData(
        q_fp4=torch.zeros((5, 1, 2, 64), dtype=torch.int8),
        q_sf=torch.zeros((5, 1, 2), dtype=torch.int32),
        weights=torch.zeros((5, 2), dtype=torch.float32),
        k_cache=torch.zeros((1, 64, 1, 68), dtype=torch.uint8),
    )
    inputs = DecodeInputs(
        indexer=None, layer_id=3, compress_ratio=4, freqs_cis=torch.zeros(1),
        x=torch.zeros(5, 8), q_lora=torch.zeros(5, 4), positions=torch.arange(5),
        req_rows=torch.arange(5), paged_metadata=meta, is_verify=False,
        out_page_indices=torch.full((5, 4), -1, dtype=torch.int32),
    )
    logits_calls = MagicMock(side_effect=lambda q, k, w, lens, table, plan, cols:
                             torch.zeros((q[0].shape[0], width)))
    topk = MagicMock()
    event = MagicMock()
    stream = object()
    patches = {
        "get_deep_gemm_decode_data": lambda inputs, pool: data,
        "deep_gemm_fp4_paged_mqa_logits": logits_calls,
        "topk_transform_paged_from_metadata": topk,
        "candidate_row_lens": lambda lens, k: (torch.ones_like(lens), lens.clone()),
        "amax_topk_blocks": lambda logits, lens, nblocks, k:
            torch.zeros((lens.shape[0], k), dtype=torch.int32),
        "sort_candidate_blocks": lambda blocks, *args: blocks + 1,
        "build_sparse_indexer_schedule": lambda *args: torch.tensor([7], dtype=torch.uint8),
    }
    for name, value in patches.items():
        monkeypatch.setattr(sparse_table, name, value)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: object())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    backend = sparse_table.SparseTableBackend(
        token_to_kv_pool=None, page_size=256, candidate_topk_blocks=topk_blocks,
        candidate_block_size=sparse_table.CANDIDATE_BLOCK_SIZE)
    table = backend.publish_decode(inputs)

    assert logits_calls.call_count == len(chunks)
    for call, rows, plan in zip(logits_calls.call_args_list, chunks, plans):
        assert call.args[5] is plan
        assert call.args[0][0].shape[0] == rows.stop - rows.start
    assert [c.kwargs["rows"] for c in topk.call_args_list] == chunks
    assert [c.kwargs["topk_metadata"] for c in topk.call_args_list] == topk_plans
    assert table.blocks.shape == (5, topk_blocks)
    assert torch.equal(table.phys_blocks, table.blocks + 1)
    assert table.valid_lens.shape == (5,)
    event.record.assert_called_once_with(stream)
