"""Pins: sglang 0.5.23 behaviour the opt-in DeepSeek-V4 CP breakable graph relies on.

1. Replay metadata. The original fork zero-padded CP-global cache-location
   fields (raw_out_loc, c{1,2,4,128}_out_loc) that were shorter at replay than at
   capture. In 0.5.23 they are never shorter: the prefill graph's buffer registry
   zero-pads out_cache_loc to the bucket (slot 0 is the dummy slot), the interleave
   adapter hands that whole bucket back to the batch (test/cp_bcg
   test_cp_bcg_adapter.py checks it at capture and every replay), and under the
   prefill graph the DeepSeek-V4 backend sizes those fields from out_cache_loc's
   length. The plain in-place copy of the replay refresh then always sees equal
   shapes. A shorter source is refused by that copy; a one-row source would be
   broadcast, so these pins fail if the sizing rule changes.
2. DeepSeek-V4's sparse prefill stays off under CP, so the original fork's shared
   compressed workspaces for CP consumers are not needed.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))

from dsv41_cp_harness import PeerShardsGroup, cp_scope, extend_batch  # noqa: E402
from sglang.srt.layers.cp.utils import is_cp_active  # noqa: E402
from sglang.srt.layers.attention import deepseek_v4_backend as backend_module  # noqa: E402
from sglang.srt.layers.attention.deepseek_v4_backend import (  # noqa: E402
    DeepseekV4AttnBackend,
    DSV4AttnMetadata,
)

CP_GLOBAL_LOC_FIELDS = ("raw_out_loc", "c4_out_loc", "c128_out_loc", "c1_out_loc", "c2_out_loc")


def _function_ast(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def test_bcg_pin_prefill_graph_sizes_cp_global_writes_from_out_cache_loc():
    """init_forward_metadata_prefill: under the prefill graph the write count is
    out_cache_loc's length (the zero-padded bucket), and that is the count the
    core metadata and the CP reindex keep for the global fields."""
    fn = _function_ast(DeepseekV4AttnBackend.init_forward_metadata_prefill)
    assigns = {
        node.targets[0].id: ast.unparse(node.value)
        for node in ast.walk(fn)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    assert assigns["num_write_tokens"] == (
        "out_cache_loc.shape[0] if use_prefill_cuda_graph else num_tokens")
    calls = {ast.unparse(node.func): {kw.arg: ast.unparse(kw.value) for kw in node.keywords}
             for node in ast.walk(fn) if isinstance(node, ast.Call)}
    core = calls["self.make_core_attn_metadata"]
    assert core["out_loc"] == "out_cache_loc"
    assert core["num_tokens"] == "num_write_tokens if cp_active else None"
    assert calls["core_attn_metadata.apply_cp_reindex"]["num_tokens"] == "num_write_tokens"
    assert set(CP_GLOBAL_LOC_FIELDS) <= set(DSV4AttnMetadata._CP_GLOBAL_FIELDS)


def test_bcg_pin_low_ratio_write_locations_follow_raw_out_loc_length():
    raw = torch.tensor([5, 6, 7, 8, 0, 0, 0, 0])  # four live tokens, zero-padded bucket
    seq_lens = torch.arange(1, 9)
    for ratio in (1, 2):
        out_loc, _ = backend_module._low_ratio_compression_metadata(ratio, seq_lens, raw)
        assert out_loc.shape == raw.shape


def _metadata(length: int, value: int, **tensors):
    fields = {name: torch.full((length,), value) for name in CP_GLOBAL_LOC_FIELDS}
    fields.update(tensors)
    meta = SimpleNamespace(index_topk=512, page_size=64, cuda_int32_kwargs={},
                           present_ratios=(4, 128), low_ratios=(1, 2),
                           request_window_layout=None, **fields)
    copy_fields = _function_ast(DSV4AttnMetadata.refresh_for_breakable_cuda_graph_replay_)
    for node in ast.walk(copy_fields):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and not hasattr(meta, node.value) and node.value.isidentifier():
            setattr(meta, node.value, None)
    return meta


def test_bcg_pin_replay_refresh_copies_equal_length_cp_global_fields_in_place():
    captured = _metadata(16, -1)
    addresses = {name: getattr(captured, name).data_ptr() for name in CP_GLOBAL_LOC_FIELDS}
    live = _metadata(16, 0)
    for name in CP_GLOBAL_LOC_FIELDS:
        getattr(live, name)[:5] = torch.arange(100, 105)
    DSV4AttnMetadata.refresh_for_breakable_cuda_graph_replay_(captured, live)
    for name in CP_GLOBAL_LOC_FIELDS:
        assert getattr(captured, name).data_ptr() == addresses[name]
        assert torch.equal(getattr(captured, name), getattr(live, name))


def test_bcg_pin_replay_refresh_refuses_a_shorter_cp_global_field():
    """Why the equal lengths matter: a shorter live field is not padded by 0.5.23."""
    captured, live = _metadata(16, -1), _metadata(10, 0)
    with pytest.raises(RuntimeError):
        DSV4AttnMetadata.refresh_for_breakable_cuda_graph_replay_(captured, live)


def test_bcg_pin_sparse_prefill_is_off_under_cp():
    backend = SimpleNamespace(trtllm_attn=False,
                              forward_metadata=SimpleNamespace(late_layer_tail=None))
    big = backend_module._LARGE_INDEXER_QUERY_THRESHOLD + 1
    batch = extend_batch([big], [0])
    # the same batch takes the sparse path without CP ...
    assert DeepseekV4AttnBackend._use_sparse_prefill(backend, batch, num_qo_tokens=big)
    for size in (2, 4):
        with cp_scope(size, 0, PeerShardsGroup(size, 0)):
            assert is_cp_active(batch)
            # ... and never under CP
            assert not DeepseekV4AttnBackend._use_sparse_prefill(backend, batch, num_qo_tokens=big)
