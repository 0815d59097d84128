"""KV staging (opt-in) over a real sglang 0.5.23 Mooncake PD pair on 127.0.0.1.

The harness of test_nvlink_pd_integration (_pd_pair.py): real managers,
bootstrap server, senders and receivers, real Mooncake engines over tcp,
buffers in host memory whose "device" classification is injected; the
staging copies are plain host copies (no GPU here). Three runs in parallel:
- staged: every KV batch goes through the decode's slot, byte-exact, and the
  decode buffers already hold every byte when the Success status is applied;
  malformed or lying staged messages are refused and write nothing;
- exhausted: the decode pool's only slot is leased to another peer, so this
  prefill gets no grant and every batch takes the direct path, counted;
- failing: the decode's third scatter fails (room B's KV batch, after room A
  completed): room B fails on both sides, room A stays byte-exact.
"""

from __future__ import annotations


import pytest


from _staging_pairs import assert_exact_and_in_place_at_status, batches, run_pairs

pytestmark = pytest.mark.timeout(600)

SMALL = {"SGLANG_DSV41_KV_STAGING": "1", "SGLANG_DSV41_KV_STAGING_SLOTS": "2",
         "SGLANG_DSV41_KV_STAGING_SLOT_MB": "1", "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS": "2",
         "SGLANG_DSV41_KV_STAGING_ACK_TIMEOUT_S": "20"}
RUNS = {
    "staged": {"env": SMALL, "bad_frames": True},
    "exhausted": {"env": {**SMALL, "SGLANG_DSV41_KV_STAGING_SLOTS": "1"}, "prelease": 1},
    # MIN_BLOCKS 1 stages the one-device-block state batch too: scatters are
    # room A KV, room A state, room B KV (fails).
    "failing": {"env": {**SMALL, "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS": "1"}, "fail_scatter_at": 3},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_pairs(RUNS, tmp_path_factory.mktemp("model"), 11000)


def test_staged_transfer_is_byte_exact_and_scattered_before_status(runs):
    assert_exact_and_in_place_at_status(runs["staged"])
    r = runs["staged"]
    # Both rooms' KV batches went through the slot; the state batches have one
    # device block each (below MIN_BLOCKS 2) and went direct.
    assert batches(r, "prefill") == {"staged": 2, "few_blocks": 2}
    assert r["decode"]["scattered"] == 2
    assert r["decode"]["plugin_metrics"]["kv_staging_grants"] == {"granted": 1}


def test_staging_memory_is_registered_with_the_engine(runs):
    r = runs["staged"]
    for role in ("prefill", "decode"):
        registered = {tuple(x) for x in r[role]["registered"]}
        # 2 slots x 1 MiB, in one region, besides the device KV/state regions
        assert any(n == 2 << 20 for _, n in registered), registered
        assert not {tuple(x) for x in r[role]["host_regions"]} & registered


def test_bad_staged_messages_are_refused_and_write_nothing(runs):
    d = runs["staged"]["decode"]
    answers = d["bad_staged_answers"]
    assert set(answers) == {"11", "12", "13", "14"}, answers
    assert "not leased" in answers["11"]
    assert "not inside" in answers["12"] and "not inside" in answers["13"]
    assert "exceed" in answers["14"]
    assert d["untouched_after_bad_staged"] is True
    # 4 refused with an answer + 2 too malformed to answer
    assert d["scatter_refused"] == 6
    assert d["decode_thread_alive"] is True


def test_exhausted_pool_falls_back_to_the_direct_path_and_counts_it(runs):
    r = runs["exhausted"]
    assert r["decode"]["preleased"] == [True]
    for room in ("A", "B"):
        assert r["prefill"][f"status_{room}"] == "success"
        assert r["decode"][f"mismatch_{room}"] == []
    # KV batches: no grant; the one-block state batches: below MIN_BLOCKS, counted first
    assert batches(r, "prefill") == {"no_grant": 2, "few_blocks": 2}
    assert r["decode"]["plugin_metrics"]["kv_staging_grants"] == {"pool_full": 1}
    assert r["decode"]["scattered"] == 0


def test_a_failed_scatter_fails_that_request_only_after_the_earlier_one_completed(runs):
    r = runs["failing"]
    assert r["prefill"]["status_A"] == "success" and r["decode"]["status_A"] == "success"
    assert r["decode"]["mismatch_A"] == [] and r["decode"]["mismatch_at_status_A"] == []
    assert r["prefill"]["status_B"] == "failed"
    assert r["decode"]["status_B"] == "failed"
    assert r["decode"]["scattered"] == 2 and r["decode"]["scatter_refused"] == 1
    assert batches(r, "prefill") == {"staged": 2, "failed": 1}
