"""The DeepSeek-V4.1 request pattern of benchmarks/mooncake_nvlink/mooncake_routing.py.

- Its geometry is sglang's: a fresh interpreter builds sglang 0.5.23's own
  ``DeepSeekV4TokenToKVPool`` on the CPU for the documented layer plan and reads
  the buffers PD registers; every constant of the benchmark must match.
- Its blocks merge as upstream's ``group_concurrent_contiguous`` merges them.
- The benchmark runs in CPU mode (real Mooncake engines over tcp on 127.0.0.1),
  byte-exact on every moving path, the held peer writes included (the receiver's host
  buffers written with process_vm_writev), and refuses bad input with one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT

import dsv41_kv_pattern as pattern

BENCH = REPO_ROOT / "benchmarks" / "mooncake_nvlink" / "mooncake_routing.py"

# The layer plan of the docstring: 43 layers, ratio-1/2 compressed attention,
# KV storage on layers 2 (ratio 1), 3, 15 and 29 (ratio 2), the rest reading
# a source layer's KV; layers 0 and 1 are sliding-window only.
POOL_SCRIPT = r"""
import json, os, sys, types
import torch
import sglang_dsv41
from sglang.srt.server_args import prepare_server_args
from sglang.srt.runtime_context import publish, SpawnRanks
tiny = os.path.join(os.path.dirname(sglang_dsv41.__file__), "data", "tiny_dsv41")
args = prepare_server_args(["--model-path", tiny, "--device", "cpu", "--host", "127.0.0.1",
                            "--skip-tokenizer-init"])
publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
import sglang.srt.mem_cache.deepseek_v4_memory_pool as pools
# DSpark as the shipped PD topologies run it: --speculative-dspark-block-size 5, six draft tokens.
spec = pools.get_spec()
dspark = types.SimpleNamespace(**{k: getattr(spec, k) for k in dir(spec) if not k.startswith("__")})
dspark.speculative_algorithm, dspark.speculative_num_draft_tokens = "DSPARK", 6
pools.get_spec = lambda: dspark
ratios = [0, 0] + [1 if i % 2 == 0 else 2 for i in range(41)]
sources = [2, 3, 15, 29]
for layer, ratio in zip(sources, (1, 2, 2, 2)):
    ratios[layer] = ratio
common = dict(
    max_num_reqs=4, swa_size=4096, c4_size=1024, c128_size=64, c4_state_pool_size=64,
    c128_state_pool_size=64, page_size=256, swa_page_size=256, dtype=torch.float8_e4m3fn,
    c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
    qk_rope_head_dim=64, indexer_head_dim=128, device="cpu", enable_memory_saver=False,
    sliding_window=128, full_size=8192, kv_layout="v41", online_mtp_max_draft_tokens=6)
names = ("get_contiguous_buf_infos", "get_state_buf_infos", "get_request_state_buf_infos",
         "get_swa_valid_from_buf_infos", "get_unified_swa_ring_buf_infos")
target = pools.DeepSeekV4TokenToKVPool(layer_num=43, compression_ratios=ratios, kv_source_layers=sources, **common)
draft = pools.DeepSeekV4TokenToKVPool(layer_num=2, compression_ratios=[0, 0], kv_source_layers=[],
                                      is_draft_worker=True, **common)
out = {"page_size": target.page_size, "sliding_window": target.sliding_window,
       "pd_kv_layout": target.pd_kv_layout()}
for role, pool in (("target", target), ("draft", draft)):
    out[role] = {name: getattr(pool, name)()[2] for name in names}
print("POOL " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def sglang_pool():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", POOL_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=240)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("POOL ")]
    assert lines, f"pool build failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("POOL "):])


@pytest.mark.timeout(300)
def test_benchmark_geometry_is_sglang_pools_with_dspark(sglang_pool):
    assert sglang_pool["page_size"] == pattern.DSV41_PAGE_TOKENS
    assert sglang_pool["sliding_window"] == pattern.DSV41_SLIDING_WINDOW
    assert sglang_pool["pd_kv_layout"] == "v41,c1:v41_fp4,c2:v41_fp4"
    target, draft = sglang_pool["target"], sglang_pool["draft"]
    assert tuple(target["get_contiguous_buf_infos"]) == pattern.DSV41_KV_ITEM_BYTES
    assert target["get_state_buf_infos"] == [pattern.DSV41_SWA_ITEM_BYTES] * pattern.DSV41_SWA_LAYERS
    assert tuple(target["get_request_state_buf_infos"]) == pattern.DSV41_REQUEST_STATE_ITEM_BYTES
    assert target["get_swa_valid_from_buf_infos"] == [] and target["get_unified_swa_ring_buf_infos"] == []
    # The draft adds no KV buffer: its sliding window and its request row only.
    assert draft["get_contiguous_buf_infos"] == [] and draft["get_request_state_buf_infos"] == []
    assert draft["get_state_buf_infos"] == [pattern.DSV41_SWA_ITEM_BYTES] * pattern.DSV41_DRAFT_SWA_LAYERS
    assert draft["get_swa_valid_from_buf_infos"] == [pattern.DSV41_REQUEST_ROW_ITEM_BYTES]


STATE_BYTES = 45 * 135_168 + 8  # target and draft windows (43 + 2 layers, one page), the request row
EXPECTED = {  # (engine calls, blocks, bytes) per request
    "8k contiguous": (4, 8 + 43 + 2 + 1, 32 * 227_840 + STATE_BYTES),
    "8k runs of 8": (4, 8 * 4 + 46, 32 * 227_840 + STATE_BYTES),
    "8k fragmented": (4, 8 * 32 + 46, 32 * 227_840 + STATE_BYTES),
    "32k contiguous": (5, 8 * 2 + 46, 128 * 227_840 + STATE_BYTES),
    "32k runs of 8": (5, 8 * 16 + 46, 128 * 227_840 + STATE_BYTES),
    "32k fragmented": (5, 8 * 128 + 46, 128 * 227_840 + STATE_BYTES),
    "state alone": (3, 46, STATE_BYTES),
}


def test_an_odd_prompt_also_sends_the_request_state():
    calls = pattern.dsv41_paged_calls(8193, "contiguous")
    assert [items for _, items, _, _ in calls][2] == pattern.DSV41_REQUEST_STATE_ITEM_BYTES
    assert len(calls) == len(pattern.dsv41_paged_calls(8192, "contiguous")) + 1


@pytest.mark.parametrize("name, tokens, layout", pattern.DSV41_CASES)
def test_request_calls_blocks_and_bytes(name, tokens, layout):
    batches = pattern.dsv41_batches(tokens, layout)
    got = (len(batches), sum(len(b) for b in batches), sum(sp[3] for b in batches for sp in b))
    assert got == EXPECTED[name]
    sizes = pattern.dsv41_buffer_sizes()
    for batch in batches:
        for buf, src_off, dst_off, length in batch:
            assert 0 <= src_off and src_off + length <= sizes[buf]
            assert 0 <= dst_off and dst_off + length <= sizes[buf]
    # no destination byte is written twice (the byte check counts nonzero bytes)
    spans = sorted((b, d, d + n) for batch in batches for b, _, d, n in batch)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("layout", ["contiguous", "runs8", "fragmented"])
def test_merging_matches_upstream_group_concurrent_contiguous(layout):
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous

    rng = np.random.default_rng(7)
    src = pattern.dsv41_page_ids(layout, 64, 1)
    cases = [(src, pattern.dsv41_page_ids(layout, 64, 2)),
             (src, list(rng.permutation(np.arange(100, 164)))),  # decode pages shuffled
             (src, [5 + i + (i >= 20) for i in range(64)])]  # one break on the decode side only
    for s, d in cases:
        src_groups, dst_groups = group_concurrent_contiguous(np.array(s, np.int32), np.array(d, np.int32))
        want = [(g[0], h[0], len(g)) for g, h in zip(src_groups, dst_groups)]
        assert pattern.merge_consecutive(list(s), [int(x) for x in d]) == want


def _run_bench(*argv, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(BENCH), *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_cpu_mode_moves_requests_byte_exact(tmp_path):
    out = tmp_path / "dsv41.json"
    proc = _run_bench("--pattern", "dsv41", "--mode", "cpu", "--case", "state alone",
                      "--case", "8k runs of 8", "--rounds", "1", "--iters", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["case"]: r for r in result["runs"][0]["rows"]}
    assert set(rows) == {"state alone", "8k runs of 8"}
    for name, row in rows.items():
        assert row["byte_exact"] is True
        assert (row["calls"], row["blocks"], row["bytes"]) == EXPECTED[name]
        assert row["stock_us"] > 0 and row["routed_us"] > 0 and row["contiguous_us"] > 0
        assert row["held_us"] > 0 and row["held_x_contiguous"] > 0 and row["held_over_stock"] > 0
        assert not any(k.startswith(("peer_", "pages_")) for k in row)  # those paths were removed
    # Held: the request's calls (its one KV chunk is the last) written as one batch, the small
    # draft calls included (host memory takes any width; on a GPU the 8-byte row goes direct).
    assert rows["8k runs of 8"]["held_batches"] == {"peer_pages": 4, "held_writes": 1}
    assert rows["state alone"]["held_batches"] == {"peer_pages": 3, "held_writes": 1}
    # where a held request's time went: no earlier chunk in these one-chunk requests, then the
    # holding and the one write
    for row in rows.values():
        phases = row["held_phases_us"]
        assert set(phases) == {"earlier", "hold", "write"}
        assert phases["hold"] > 0 and phases["write"] > 0
        assert phases["earlier"] < phases["hold"] + phases["write"]
    assert "earlier us" in proc.stdout and "hold us" in proc.stdout
    assert result["peer"] is True
    assert result["runs"][0]["memory_backend"] == "InjectedKinds"
    assert "routed/stock" in proc.stdout and "every request byte-exact: True" in proc.stdout
    assert "stock/held" in proc.stdout and "stock/peer" not in proc.stdout and "stock/pages" not in proc.stdout


@pytest.mark.timeout(300)
def test_cpu_mode_peer_opt_out(tmp_path):
    out = tmp_path / "dsv41.json"
    proc = _run_bench("--pattern", "dsv41", "--mode", "cpu", "--case", "state alone",
                      "--no-peer", "--rounds", "1", "--iters", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["peer"] is False
    assert not any(k.startswith("held") for k in result["runs"][0]["rows"][0])
    assert "stock/held" not in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--pattern", "dsv41", "--case", "9k contiguous"], "unknown --case '9k contiguous'"),
    (["--pattern", "dsv41", "--repeat", "0"], "must be at least 1"),
    (["--case", "state alone"], "apply to --pattern dsv41 only"),
])
def test_bad_input_is_one_line_and_nonzero(argv, message):
    proc = _run_bench(*argv, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def _run_script(name, *argv, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(BENCH.parent / "kv_staging" / name), *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_send_call_python_runs_every_way_against_sglangs_send_code():
    proc = _run_script("send_call_python.py", "--runs", "1", "--iters", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["request"])
    assert header.split()[1:] == ["sglang", "blocks", "pages", "held"]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("32k fragmented")]
    assert rows and all(float(v) > 0 for v in rows[0][2:6])


def test_send_call_python_answers_bad_input_with_one_line():
    proc = _run_script("send_call_python.py", "--runs", "0", timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "at least 1" in proc.stderr


def test_peer_goals_are_judged_only_on_the_gpu(capsys):
    pattern.print_peer_goals({"8k contiguous": 1.5, "32k fragmented": 3.5}, path="held")
    gpu = capsys.readouterr().out.splitlines()
    assert gpu == ["goal: 32k fragmented held within 3x of one contiguous write: 3.50x, NOT met",
                   "goal: 8k contiguous held within 2x of one contiguous write: 1.50x, met"]
    pattern.print_peer_goals({"8k contiguous": 0.3}, path="held", gpu=False)
    cpu = capsys.readouterr().out
    assert cpu.endswith("0.30x, not judged in CPU mode\n") and "met" not in cpu


def test_gpu_mode_without_the_gpus_asked_for_is_one_line_and_exit_2():
    proc = _run_bench("--pattern", "dsv41", "--mode", "gpu", "--gpu", "99", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line, no traceback
    assert "needs GPU 99" in proc.stderr and "Traceback" not in proc.stderr
