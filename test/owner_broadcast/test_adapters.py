"""Our hooks inside the real sglang 0.5.23 input preparation, two ranks on gloo.

_adapter_worker.py registers only the owner-broadcast patches through sglang's
HookRegistry and drives DeepseekV4ForCausalLM.prepare_language_model_inputs
through embed_mm_inputs and the chunked per-image scheduling code. Here we
check which path each chunk took and what it produced.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_adapter_worker.py")
PROCESS_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(tmp / "store"), str(tmp / f"out{rank}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=PROCESS_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"adapter ranks did not finish within {PROCESS_TIMEOUT_S}s (hang)")
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{logs[rank][-4000:]}"
    by_name = {}
    for rank in (0, 1):
        for result in json.loads((tmp / f"out{rank}.json").read_text()):
            by_name.setdefault(result["name"], {})[rank] = result
    by_name["_logs"] = logs
    return by_name


def both(results, name):
    ranks = results[name]
    assert sorted(ranks) == [0, 1]
    return ranks[0], ranks[1]


pytestmark = pytest.mark.timeout(500)


def test_hooks_are_installed_by_sglangs_registry(results):
    for r in both(results, "installed"):
        assert r["init_wrapped"] and r["fence_wrapped"] and r["mm_replaced"] and r["encode_wrapped"]


def test_vocab_parallel_forward_reduces_its_local_shard(results):
    # Pins the 0.5.23 behaviour the agreed text embedding splits on.
    for r in both(results, "installed"):
        assert r["forward_uses_local_shard"]
        assert r["sharded_reduces"] == ["tensor_model_parallel_all_reduce"]
        # enable_tp=False (DeepSeek-V4 under attention DP): one shard, no
        # collective, so the features agreement may wait for the fence end.
        assert r["single_shard_tp_size"] == 1 and r["single_shard_reduces"] == []


def test_image_chunk_takes_the_owner_path(results):
    r0, r1 = both(results, "owner")
    for r in (r0, r1):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["group"].startswith("CoordinatorGroup(") and "ranks=[0, 1]" in r["group"]
        # status rounds: manifest (equal, empty caches give the plan),
        # pre-broadcast, features_ready, fence end; no object collective
        # without a failure
        assert r["all_reduce_max"] == 4 and r["all_gather_object"] == 0
        assert r["broadcast"] == 2  # one payload per owner
        assert r["cached"] == [101, 202, 303]
        assert r["ids_in_vocab"] and r["image_ids"] == 8 + 4 + 8 + 6
    assert r0["digest"] == r1["digest"]
    # Each distinct image once in the group, by its owner, owners balanced by
    # cost (4096 + patches): 101 (6x6), the costliest, alone on rank 0, then
    # 303 (6x3) and 202 (3x3) on rank 1. Image 101 sits in both prompts and is
    # still encoded once.
    assert r0["encoded"] == [101] and r1["encoded"] == [202, 303]


def test_stock_path_is_byte_identical_and_encodes_everywhere(results):
    owner0, _ = both(results, "owner")
    for r in both(results, "disabled"):
        assert r["group"] == "None"
        assert r["status"] == "ok" and r["embeds_match"]
        assert r["encoded"] == [101, 202, 303], "stock sglang encodes every image on every rank"
        assert r["all_gather_object"] == 0 and r["broadcast"] == 0
        assert r["all_reduce_max"] == 0
        assert r["digest"] == owner0["digest"]


def test_cached_chunk_skips_encoder_and_broadcast(results):
    owner0, _ = both(results, "owner")
    for r in both(results, "warm"):
        assert r["status"] == "ok" and r["embeds_match"]
        assert r["encoded"] == [] and r["broadcast"] == 0
        # the fast path: manifest round, features_ready, fence end
        assert r["all_reduce_max"] == 3 and r["all_gather_object"] == 0
        assert r["digest"] == owner0["digest"]
    for r in both(results, "warm-single-shard"):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["encoded"] == [] and r["broadcast"] == 0
        # no collective in the text embedding: features_ready rides the fence end
        assert r["all_reduce_max"] == 2 and r["all_gather_object"] == 0
        assert r["digest"] == owner0["digest"]


def test_partial_image_spans_in_a_chunk(results):
    r0, r1 = both(results, "partial")
    assert r0["status"] == r1["status"] == "ok"
    assert r0["embeds_match"] and r1["embeds_match"] and r0["digest"] == r1["digest"]
    # tokens 5..15: the tail of image 101 (5..9) and the start of image 202 (14..15)
    assert r0["image_ids"] == 5 + 2
    # whole spans are encoded and cached even when the chunk holds only part,
    # each once, one per owner
    assert r0["encoded"] == [101] and r1["encoded"] == [202]
    assert r0["cached"] == r1["cached"] == [101, 202]


def test_no_image_span_in_the_chunk_keeps_the_stock_path(results):
    for name in ("text-chunk", "decode"):
        for r in both(results, name):
            assert r["status"] == "ok", r
            assert r["all_gather_object"] == 0 and r["broadcast"] == 0, name
            assert r["all_reduce_max"] == 0, name
            assert r["encoded"] == []
    for r in both(results, "text-chunk"):
        assert r["embeds_match"] and r["image_ids"] == 0


def test_text_prompt_beside_an_image_prompt(results):
    r0, r1 = both(results, "mixed")
    assert r0["status"] == r1["status"] == "ok"
    assert r0["embeds_match"] and r0["digest"] == r1["digest"]
    # the image request's two images, one per owner
    assert r0["encoded"] == [101] and r1["encoded"] == [303]


@pytest.mark.parametrize(
    "name, phase, rank, fragment, rounds",
    [
        # manifest, pre-broadcast (shows the failure)
        ("encode-fails", "encode", 1, "vision tower failed on 303", 2),
        # ... then features_ready shows it
        ("lookup-fails", "text-embedding", 0, "text lookup failed", 3),
        # ... no features_ready round: the fence end shows it
        ("single-shard-lookup-fails", "text-embedding", 1, "text lookup failed", 3),
    ],
)
def test_failure_on_one_rank_is_the_same_error_on_both(results, name, phase, rank, fragment, rounds):
    r0, r1 = both(results, name)
    assert r0["status"] == r1["status"] == "agreed-error", (r0, r1)
    assert r0["error"] == r1["error"]
    text = r0["error"]
    assert f"phase '{phase}' on group rank {rank} (global rank {rank})" in text
    assert f"requests ['{name}-0'" in text and fragment in text
    for r in (r0, r1):
        # one object gather, after the status round that showed the failure
        assert r["all_reduce_max"] == rounds and r["all_gather_object"] == 1, r
    if phase == "encode":
        assert r0["cached"] == r1["cached"] == [], "nothing cached from a failed chunk"
        assert r0["broadcast"] == r1["broadcast"] == 0


def test_group_keeps_working_after_agreed_failures(results):
    r0, r1 = both(results, "after-failure")
    assert r0["status"] == r1["status"] == "ok"
    assert r0["embeds_match"] and r0["digest"] == r1["digest"]


def test_decision_is_logged_once_per_process(results):
    for log in results["_logs"]:
        lines = [l for l in log.splitlines() if "owner-broadcast embedding:" in l]
        assert len(lines) == 1, lines
        assert "on over the attn_tp group (2 ranks)" in lines[0]


def test_first_chunk_of_each_route_is_logged_per_router(results):
    for log in results["_logs"]:
        firsts = [l.split("first chunk routed ")[1].split(" ")[0]
                  for l in log.splitlines() if "first chunk routed" in l]
        # the "auto" model's router saw owner then known; the seven one-image
        # runs' routers (each its own model) saw not-worth (also the ones whose
        # chunk then failed: routing comes first); every "always" model one
        # owner chunk
        assert firsts.count("'known'") == 1 and firsts.count("'not-worth'") == 7, firsts
        assert "'owner'" in firsts


# ------------------------------------------------ routing (SGLANG_DSV41_OWNER_BROADCAST=auto)


def test_auto_routing_takes_the_protocol_when_it_saves_encoder_work(results):
    owner0, _ = both(results, "owner")
    r0, r1 = both(results, "auto-cold")
    for r in (r0, r1):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["routes"] == {"owner": 1}
        assert r["all_reduce_max"] == 4 and r["broadcast"] == 2
        assert r["digest"] == owner0["digest"]
    assert r0["encoded"] == [101] and r1["encoded"] == [202, 303]
    # the group recorded the three spans, identically on both ranks
    assert r0["directory_spans"] == r1["directory_spans"] == 3
    assert r0["directory"] == r1["directory"]


def test_known_spans_need_no_collective_at_all(results):
    owner0, _ = both(results, "owner")
    cold0, _ = both(results, "auto-cold")
    r0, r1 = both(results, "auto-known")
    for r in (r0, r1):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["routes"] == {"owner": 1, "known": 1}
        assert r["all_reduce_max"] == 0 and r["all_gather_object"] == 0 and r["broadcast"] == 0
        assert r["encoded"] == []
        assert r["digest"] == owner0["digest"]
    assert r0["directory"] == r1["directory"] == cold0["directory"]  # touched, same order


def test_a_rank_that_lost_a_known_span_encodes_it_locally(results):
    owner0, _ = both(results, "owner")
    r0, r1 = both(results, "auto-known-cache-lost-on-1")
    for r in (r0, r1):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["routes"]["known"] == 2
        # still no collective: the directory, not the local cache, decides
        assert r["all_reduce_max"] == 0 and r["all_gather_object"] == 0 and r["broadcast"] == 0
        assert r["digest"] == owner0["digest"]
    assert r0["encoded"] == [] and r1["encoded"] == [101, 202, 303]
    assert r0["cached"] == r1["cached"] == [101, 202, 303]
    assert r0["directory"] == r1["directory"]


def test_one_image_runs_stock_on_every_rank(results):
    for r in both(results, "auto-one-image"):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["routes"] == {"not-worth": 1}
        assert r["encoded"] == [404], "every rank encodes it, as stock sglang does"
        assert r["all_reduce_max"] == 0 and r["all_gather_object"] == 0 and r["broadcast"] == 0
    r0, r1 = both(results, "auto-one-image")
    assert r0["digest"] == r1["digest"] and r0["directory"] == r1["directory"]
    assert r0["directory_spans"] == 1


def test_guarded_mode_runs_the_stock_encode_with_two_status_rounds(results):
    for r in both(results, "guarded-one-image"):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["routes"] == {"not-worth": 1}
        assert r["encoded"] == [404], "every rank encodes it, as stock sglang does"
        # features ready (before the text all-reduce) and the fence end; no
        # manifest, no broadcast
        assert r["all_reduce_max"] == 2 and r["all_gather_object"] == 0 and r["broadcast"] == 0
        assert r["directory_spans"] == 1
    for r in both(results, "guarded-one-image-single-shard"):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["all_reduce_max"] == 1 and r["all_gather_object"] == 0 and r["broadcast"] == 0


def test_guarded_mode_agrees_an_encoder_failure_on_one_rank(results):
    r0, r1 = both(results, "guarded-one-image-fails-on-1")
    assert r0["status"] == r1["status"] == "agreed-error", (r0, r1)
    assert r0["error"] == r1["error"]
    text = r0["error"]
    assert "phase 'encode'" in text and "group rank 1 (global rank 1)" in text, text
    assert "vision tower failed on 404" in text and "guarded-one-image-fails-on-1-0" in text, text
    assert r0["encoded"] == [404] and r1["encoded"] == []
    # nothing recorded for a chunk that failed, on either rank
    assert r0["directory_spans"] == r1["directory_spans"] == 0
    # and the group goes on: the next chunk runs normally on both ranks
    for r in both(results, "guarded-after-failure"):
        assert r["status"] == "ok" and r["embeds_match"], r


def test_a_bad_routing_setting_stops_the_model_build(results):
    for r in both(results, "bad-env"):
        assert "SGLANG_DSV41_OWNER_BROADCAST='sometimes'" in r["mode"], r
        assert "SGLANG_DSV41_OWNER_MIN_SAVING='lots'" in r["saving"], r


def test_the_default_mode_is_guarded(results):
    # SGLANG_DSV41_OWNER_BROADCAST unset at model build: the one-image chunk
    # that auto would run with no collective gets guarded's two status rounds
    for r in both(results, "default-one-image"):
        assert r["status"] == "ok" and r["embeds_match"], r
        assert r["routes"] == {"not-worth": 1}
        assert r["encoded"] == [404]
        assert r["all_reduce_max"] == 2 and r["all_gather_object"] == 0 and r["broadcast"] == 0
    # so an encoder failure on one rank is the same error on both
    r0, r1 = both(results, "default-one-image-fails-on-1")
    assert r0["status"] == r1["status"] == "agreed-error", (r0, r1)
    assert r0["error"] == r1["error"]
    assert "vision tower failed on 404" in r0["error"], r0


def test_plugin_metrics_count_what_each_chunk_did(results):
    """The counters behind sglang_dsv41_owner_* follow each chunk of the real
    input preparation: one route per routed chunk, one agreement round per
    status round or report gather, one failure per agreed error."""
    checked = 0
    for name, ranks in results.items():
        if name.startswith("_"):
            continue
        for r in ranks.values():
            if "metrics" not in r:
                continue
            metrics = r["metrics"]
            rounds = metrics.get("owner_agreement_rounds", {}).get("", 0)
            assert rounds == r["all_reduce_max"] + r["all_gather_object"], (name, r)
            failures = metrics.get("owner_agreement_failures", {}).get("", 0)
            assert failures == (1 if r["status"] == "agreed-error" else 0), (name, r)
            assert metrics.get("owner_routes", {}) == r.get("routes_this_run", {}), (name, r)
            checked += 1
    assert checked >= 20
    r0, r1 = both(results, "owner")
    # Rank 0 encoded 202 and took 101 and 303 from rank 1's broadcast; rank 1 took 202.
    assert r0["metrics"]["owner_encodes_saved"] == {"": 2}
    assert r1["metrics"]["owner_encodes_saved"] == {"": 1}
    for r in both(results, "warm") + both(results, "disabled"):
        assert "owner_encodes_saved" not in r["metrics"], r
    assert any(r["status"] == "agreed-error" for r in results["encode-fails"].values())
