"""The owner protocol across real processes: torch.distributed gloo groups of 2, 3 and 4.

One spawn of four processes runs every scenario on groups of 2, 3 and 4 of
them (see _gloo_scenarios.py); a hang anywhere fails the test through the
process timeout below.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from sglang_dsv41.owner_broadcast.routing import balanced_owners

WORKER = Path(__file__).with_name("_gloo_scenarios.py")
PROCESS_TIMEOUT_S = 300
FAILURE_PHASES = ["prepare", "manifest", "plan", "encode", "receive-buffer", "features",
                  "text-embedding", "finalize"]
FAST_FAULTS = ["prepare", "manifest", "cache", "features", "text-embedding", "finalize"]


def planned_owners(world, hashes):
    """The owner the protocol plans for each of these spans when no rank
    holds them (``balanced_owners``, whose rules test_routing_unit pins),
    each span costing its token count, as these sessions leave it."""
    lengths = spans_of(world)
    return dict(zip(hashes, balanced_owners([lengths[h] for h in hashes], hashes, world)))


def counts(rounds=0, gathers=0, broadcasts=0):
    return {"rounds": rounds, "gathers": gathers, "broadcasts": broadcasts}


def run_processes(world: int, tmp_path: Path) -> dict:
    store = tmp_path / "store"
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.jsonl"
        outs.append(out)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(rank), str(world), str(store), str(out)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
        )
    logs = []
    try:
        for proc in procs:
            log, _ = proc.communicate(timeout=PROCESS_TIMEOUT_S)
            logs.append(log)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"a rank did not finish within {PROCESS_TIMEOUT_S}s (hang)")
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{logs[rank][-3000:]}"
    by_world = defaultdict(lambda: defaultdict(dict))
    for out in outs:
        for line in out.read_text().splitlines():
            result = json.loads(line)
            group_rank = result["rank"]
            by_world[result["world"]][result["scenario"]][group_rank] = result
    return by_world


@pytest.fixture(scope="module")
def all_results(tmp_path_factory):
    return run_processes(4, tmp_path_factory.mktemp("gloo"))


@pytest.fixture(params=[2, 3, 4], ids=lambda w: f"world{w}")
def group_results(request, all_results):
    world = request.param
    assert world in all_results, f"no results for the group of {world}"
    return world, all_results[world]


def spans_of(world):
    return {h: 3 + (h * 5) % 7 for h in range(2 * world)}


@pytest.mark.timeout(400)
def test_cold_chunk_identical_features_and_one_encode_per_span(group_results):
    world, results = group_results
    for name in ("cold", "after-faults"):
        ranks = results[name]
        assert len(ranks) == world
        assert {r["status"] for r in ranks.values()} == {"ok"}, ranks
        assert len({r["digest"] for r in ranks.values()}) == 1, "features differ between ranks"
        assert all(r["features_match_reference"] and r["text_matches_reference"]
                   for r in ranks.values())
        encoded = [h for r in ranks.values() for h in r["encoded"]]
        assert sorted(encoded) == sorted(spans_of(world)), "each span encoded exactly once"
        owners = planned_owners(world, sorted(spans_of(world)))
        assert set(owners.values()) == set(range(world)), "every rank owns a share"
        for rank, r in ranks.items():
            assert all(owners[h] == rank for h in r["encoded"]), "only the owner encodes"
            assert sorted(r["new_cache_entries"]) == sorted(spans_of(world))
            assert r["cache_all_valid"]
            # One coalesced payload per owner. Equal (empty) caches: the
            # manifest round alone gives the plan, then the pre-broadcast
            # round in resolve; features-ready and fence end after it.
            assert r["broadcasts"] == world
            assert r["resolve_counts"] == counts(rounds=2, broadcasts=world)
            assert r["counts"] == counts(rounds=4, broadcasts=world)


@pytest.mark.timeout(400)
def test_spans_cached_everywhere_skip_encoder_and_broadcast(group_results):
    world, results = group_results
    ranks = results["all-cached"]
    assert {r["status"] for r in ranks.values()} == {"ok"}
    assert len({r["digest"] for r in ranks.values()}) == 1
    for r in ranks.values():
        assert r["encoded"] == [] and r["broadcasts"] == 0
        assert r["features_match_reference"]


@pytest.mark.timeout(400)
def test_full_hits_take_the_fast_path(group_results):
    """Every span cached everywhere: resolve costs one status round and
    nothing else; the whole preparation adds the features-ready round (only
    when the text embedding all-reduces) and the fence end. No object
    collective at all."""
    world, results = group_results
    for name, rounds in (("all-cached", 3), ("all-cached-local-text", 2)):
        ranks = results[name]
        assert len(ranks) == world
        assert {r["status"] for r in ranks.values()} == {"ok"}, ranks
        assert len({r["digest"] for r in ranks.values()}) == 1
        for r in ranks.values():
            assert r["features_match_reference"] and r["text_matches_reference"]
            assert r["encoded"] == [], "a cached span was encoded"
            assert r["resolve_counts"] == counts(rounds=1), name
            assert r["counts"] == counts(rounds=rounds), name
            assert r["new_cache_entries"] == [] and r["cache_all_valid"]


@pytest.mark.timeout(400)
def test_one_rank_missing_a_span_sends_every_rank_down_the_slow_path(group_results):
    world, results = group_results
    for rank in range(world):
        # Whichever rank hash mod R would name, a rank that holds the span
        # sends it from its cache: nobody encodes.
        for kind, span in (("own", rank), ("other", (rank + 1) % world)):
            ranks = results[f"missing-{kind}-rank{rank}"]
            assert {r["status"] for r in ranks.values()} == {"ok"}, ranks
            assert len({r["digest"] for r in ranks.values()}) == 1
            for group_rank, r in ranks.items():
                assert r["features_match_reference"] and r["text_matches_reference"]
                # manifest, cache flags (the caches differ), pre-broadcast; one
                # payload from the owner
                assert r["resolve_counts"] == counts(rounds=3, broadcasts=1)
                assert r["counts"] == counts(rounds=5, broadcasts=1)
                assert r["encoded"] == []
                assert r["new_cache_entries"] == ([span] if group_rank == rank else [])
                assert r["cache_all_valid"]


@pytest.mark.timeout(400)
def test_owner_cache_is_broadcast_and_bad_entries_are_evicted(group_results):
    world, results = group_results
    owner_cached = results["owner-cached"]
    assert {r["status"] for r in owner_cached.values()} == {"ok"}
    assert len({r["digest"] for r in owner_cached.values()}) == 1
    # Rank 0 holds every span: it sends them all from its cache, nobody encodes.
    assert all(r["encoded"] == [] for r in owner_cached.values())
    assert all(r["features_match_reference"] for r in owner_cached.values())

    bad = results["bad-cache"]
    assert {r["status"] for r in bad.values()} == {"ok"}
    assert len({r["digest"] for r in bad.values()}) == 1
    for r in bad.values():
        assert r["features_match_reference"] and r["cache_all_valid"]
    # Rank 0 holds nothing valid (its wrong-shape and wrong-dtype entries are
    # evicted, not served), so every span comes from a peer's cache and
    # nobody encodes.
    assert all(r["encoded"] == [] for r in bad.values())


def assert_agreed(ranks: dict, world: int, *, fault_rank: int, phase: str, fragments=()):
    assert len(ranks) == world
    statuses = {r["status"] for r in ranks.values()}
    assert statuses == {"agreed-error"}, {k: (r["status"], r.get("error")) for k, r in ranks.items()}
    texts = {r["error"] for r in ranks.values()}
    assert len(texts) == 1, f"error text differs between ranks: {texts}"
    text = texts.pop()
    global_rank = ranks[fault_rank]["global_rank"]
    assert f"phase '{phase}'" in text, text
    assert f"group rank {fault_rank} (global rank {global_rank})" in text, text
    for fragment in fragments:
        assert fragment in text, text
    for r in ranks.values():
        assert r["cache_all_valid"], "a cache entry is not a complete, correct span"
    return text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", FAILURE_PHASES)
def test_failure_on_any_rank_is_the_same_error_everywhere(group_results, phase):
    world, results = group_results
    for fault_rank in range(world):
        ranks = results[f"fault-{phase}-rank{fault_rank}"]
        text = assert_agreed(ranks, world, fault_rank=fault_rank, phase=phase,
                             fragments=("['g', 'h']", "injected"))
        if phase in ("prepare", "manifest", "plan", "encode", "receive-buffer"):
            # The failure came before any span moved: nothing new is cached.
            assert all(r["new_cache_entries"] == [] for r in ranks.values()), text
        if phase == "features":
            # The failing rank stopped before its cache writes; the others
            # cached complete spans (checked by assert_agreed).
            assert ranks[fault_rank]["new_cache_entries"] == [], text
        if phase in ("prepare", "manifest", "plan", "encode", "receive-buffer"):
            assert all(r["broadcasts"] == 0 for r in ranks.values()), "broadcast after a failure"


@pytest.mark.timeout(400)
def test_manifest_disagreements_are_rejected_everywhere(group_results):
    world, results = group_results
    last = world - 1
    # A duplicate item of another geometry (on one rank here) reuses its span's encode, as
    # stock does: a client chooses mm_hashes, so it must not stop the group.
    reused = results["duplicate-geometry"]
    assert {r["status"] for r in reused.values()} == {"ok"}, reused
    assert len({r["digest"] for r in reused.values()}) == 1
    assert all(r["features_match_reference"] and r["cache_all_valid"] for r in reused.values())
    text = assert_agreed(results["rid-mismatch"], world, fault_rank=0, phase="plan",
                         fragments=(f"group ranks 0 and {last} disagree", "stray"))
    assert "request_ids" in text


@pytest.mark.timeout(400)
def test_group_ranks_differ_from_global_ranks_in_smaller_groups(group_results):
    world, results = group_results
    globals_ = {r["global_rank"] - r["rank"] for r in results["cold"].values()}
    assert globals_ == {4 - world}, "groups of 2 and 3 start above global rank 0"
    text = results["fault-encode-rank1"][0]["error"]
    assert f"group rank 1 (global rank {1 + 4 - world})" in text


@pytest.mark.timeout(400)
def test_equal_caches_plan_from_the_manifest_round(group_results):
    """Half the spans cached on every rank: no flags round; the owners encode
    the other half."""
    world, results = group_results
    ranks = results["half-cached-everywhere"]
    assert {r["status"] for r in ranks.values()} == {"ok"}, ranks
    assert len({r["digest"] for r in ranks.values()}) == 1
    missing = sorted(h for h in spans_of(world) if h % 2 == 1)
    assert sorted(h for r in ranks.values() for h in r["encoded"]) == missing
    planned = planned_owners(world, missing)
    owners = len(set(planned.values()))  # one payload per owner
    for rank, r in ranks.items():
        assert r["features_match_reference"]
        assert all(planned[h] == rank for h in r["encoded"])
        assert r["resolve_counts"] == counts(rounds=2, broadcasts=owners)
        assert r["counts"] == counts(rounds=4, broadcasts=owners)


@pytest.mark.timeout(400)
def test_more_spans_than_the_flag_mask_gather_their_flags(group_results):
    """70 spans: the flags no longer fit the manifest round, so every batch of
    that size takes the flags round, cached or not."""
    world, results = group_results
    for name, broadcasts, encoded in (("many-cached", 0, 0), ("many-cold", world, 70)):
        ranks = results[name]
        assert {r["status"] for r in ranks.values()} == {"ok"}, ranks
        assert len({r["digest"] for r in ranks.values()}) == 1
        assert sum(len(r["encoded"]) for r in ranks.values()) == encoded
        for r in ranks.values():
            assert r["features_match_reference"]
            rounds = 2 if broadcasts == 0 else 3  # manifest, flags (, pre-broadcast)
            assert r["resolve_counts"] == counts(rounds=rounds, broadcasts=broadcasts), name
            assert r["counts"] == counts(rounds=rounds + 2, broadcasts=broadcasts), name


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", FAST_FAULTS)
def test_failure_on_a_fully_cached_batch_is_the_same_error_everywhere(group_results, phase):
    """Before, at and after the fast round. Failures before it ride the fast
    round itself; later ones the features-ready or fence-end round, which the
    fast path keeps for exactly this."""
    world, results = group_results
    named = "manifest" if phase == "cache" else phase
    rounds = {"prepare": 1, "manifest": 1, "cache": 1, "features": 2, "text-embedding": 2,
              "finalize": 3}[phase]
    for fault_rank in range(world):
        ranks = results[f"cached-fault-{phase}-rank{fault_rank}"]
        assert_agreed(ranks, world, fault_rank=fault_rank, phase=named,
                      fragments=("['g', 'h']", "injected"))
        for r in ranks.values():
            assert r["encoded"] == [] and r["new_cache_entries"] == []
            # the failure shows in a status round; one gather carries its text
            assert r["counts"] == counts(rounds=rounds, gathers=1), (phase, r["counts"])
        if phase not in ("text-embedding", "finalize"):
            continue
        # Without a collective in the text embedding, both failures meet the
        # peers at the fence end, the second round.
        ranks = results[f"cached-local-fault-{phase}-rank{fault_rank}"]
        assert_agreed(ranks, world, fault_rank=fault_rank, phase=phase,
                      fragments=("['g', 'h']", "injected"))
        for r in ranks.values():
            assert r["counts"] == counts(rounds=2, gathers=1)


@pytest.mark.timeout(400)
def test_ranks_handed_different_cached_batches_get_an_agreed_error(group_results):
    """Every rank holds its own batch in cache, but the batches differ: the
    digest in the fast round catches it, the detail round names it."""
    world, results = group_results
    last = world - 1
    for name in ("cached-span-length-mismatch", "cached-extra-span"):
        ranks = results[name]
        text = assert_agreed(ranks, world, fault_rank=0, phase="plan",
                             fragments=(f"group ranks 0 and {last} disagree", "keys"))
        assert "['x']" in text
        for r in ranks.values():
            assert r["counts"] == counts(rounds=1, gathers=1) and r["encoded"] == []
    ranks = results["cached-rid-mismatch"]
    text = assert_agreed(ranks, world, fault_rank=0, phase="plan",
                         fragments=(f"group ranks 0 and {last} disagree", "stray"))
    assert "request_ids" in text
    assert all(r["counts"] == counts(rounds=1, gathers=1) for r in ranks.values())


@pytest.mark.timeout(400)
def test_digests_that_differ_for_equal_manifests_fall_back_and_serve(group_results):
    """Geometry (3, 1) on some ranks and (3.0, 1.0) on another: equal spans,
    different digests. The detail round finds no difference and the batch is
    served from the caches."""
    world, results = group_results
    ranks = results["cached-float-geometry"]
    assert {r["status"] for r in ranks.values()} == {"ok"}, ranks
    assert len({r["digest"] for r in ranks.values()}) == 1
    for r in ranks.values():
        assert r["features_match_reference"] and r["encoded"] == []
        assert r["resolve_counts"] == counts(rounds=1, gathers=1)
        assert r["counts"] == counts(rounds=3, gathers=1)


@pytest.mark.timeout(400)
def test_routing_history_is_the_same_on_every_rank_and_known_routes_never_communicate(group_results):
    """Eighty chunks through the router on every rank of the group, with a
    cache small enough to evict and one rank losing its whole cache halfway:
    every rank takes the same route for every chunk, ends with the same
    features (the reference bytes), and holds the same directory; known
    chunks make no collective of ours, not-worth chunks one status round."""
    world, results = group_results
    ranks = results["routing-history"]
    assert len(ranks) == world and {r["status"] for r in ranks.values()} == {"ok"}
    histories = [ranks[rank]["chunks"] for rank in range(world)]
    lost = world - 1
    seen_routes = set()
    for index, chunk in enumerate(zip(*histories)):
        assert len({c["route"] for c in chunk}) == 1, f"chunk {index}: routes differ"
        assert len({c["directory"] for c in chunk}) == 1, f"chunk {index}: directories differ"
        assert all(c["matches_reference"] for c in chunk), f"chunk {index}"
        route = chunk[0]["route"]
        seen_routes.add(route)
        if route == "known":
            assert all(c["counts"] == counts() for c in chunk), (index, chunk)
        elif route == "not-worth":
            # stock's encode on every rank; one status round at the fence end
            assert all(c["counts"] == counts(rounds=1) for c in chunk), (index, chunk)
        else:
            encoded = [h for c in chunk for h in c["encoded"]]
            assert len(encoded) == len(set(encoded)), f"chunk {index}: a span encoded twice"
        if route == "known" and index < len(histories[0]) // 2:
            # Before the loss every cache saw the same operations: a known
            # span the cache's own LRU dropped is re-encoded on every rank
            # alike, as stock sglang would.
            assert len({tuple(c["encoded"]) for c in chunk}) == 1, f"chunk {index}"
    # the history exercises every route, and the rank that lost its cache
    # re-encoded known spans locally without a collective
    assert seen_routes == {"owner", "known", "not-worth"}, seen_routes
    half = len(histories[0]) // 2
    relearned = [c for c in histories[lost][half:] if c["route"] == "known" and c["encoded"]]
    assert relearned, "the rank that lost its cache never re-encoded a known span"
    for rank in range(world):
        assert ranks[rank]["directory_bytes"] <= ranks[rank]["capacity"]


LOCAL_FAULT_PHASE = {"prepare": "encode", "cache": "encode", "encode": "encode",
                     "text-embedding": "text-embedding", "finalize": "finalize"}


@pytest.mark.timeout(400)
def test_status_only_session_encodes_everywhere_with_two_rounds(group_results):
    """The not-worth route: every rank runs stock's encode for itself; the
    session adds two status rounds (before the text embedding's all-reduce
    and at the fence end) and nothing else."""
    world, results = group_results
    for name, rounds in (("local-cold", 2), ("local-cold-text-local", 1)):
        ranks = results[name]
        assert {r["status"] for r in ranks.values()} == {"ok"}, ranks
        assert len({r["digest"] for r in ranks.values()}) == 1
        for r in ranks.values():
            assert r["features_match_reference"] and r["text_matches_reference"]
            assert sorted(r["encoded"]) == sorted(spans_of(world)), "every rank encodes every span"
            assert r["counts"] == counts(rounds=rounds), (name, r["counts"])
            assert r["cache_all_valid"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", sorted(LOCAL_FAULT_PHASE))
def test_status_only_session_agrees_a_failure_on_any_rank(group_results, phase):
    world, results = group_results
    for fault_rank in range(world):
        ranks = results[f"local-fault-{phase}-rank{fault_rank}"]
        assert_agreed(ranks, world, fault_rank=fault_rank, phase=LOCAL_FAULT_PHASE[phase],
                      fragments=("['m', 'n']", "injected"))
        for r in ranks.values():
            assert r["broadcasts"] == 0 and r["counts"]["gathers"] == 1, r["counts"]
