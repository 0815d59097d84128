"""Scheduler admission with the real 0.5.23 PrefillAdder, Req, ScheduleBatch and
Scheduler admission loop on CPU pools: an override request and a multimodal
request never share an extend batch, and neither starves the other."""

from __future__ import annotations

import pytest

from embed_harness import (
    ScheduleBatch,
    SchedulerRig,
    hooks_installed,
    image_req,
    override_req,
    text_req,
)
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.runtime_context import reset_context

SCHEDULER_SIDE = {"EMB-CAN-SHARE", "EMB-ADD-ONE", "EMB-PREEMPT", "EMB-INTAKE"}


@pytest.fixture(autouse=True)
def _clean_context():
    yield
    reset_context()


def _mixed(reqs) -> bool:
    return any(r.positional_embed_overrides is not None for r in reqs) and any(
        r.multimodal_inputs is not None for r in reqs
    )


def _adder(rig: SchedulerRig) -> PrefillAdder:
    return PrefillAdder(
        rig.scheduler.page_size,
        rig.tree_cache,
        rig.allocator,
        ScheduleBatch(reqs=[]),
        1.0,
        16384,
        64,
    )


def _add(adder, req):
    req.init_next_round_input(adder.tree_cache)
    return adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)


def test_override_and_multimodal_requests_never_share_a_batch():
    rig = SchedulerRig()
    with hooks_installed(SCHEDULER_SIDE):
        for make_first, make_second in (
            (lambda: image_req("image", 12), lambda: override_req("override", 6)),
            (lambda: override_req("override", 6), lambda: image_req("image", 12)),
        ):
            adder = _adder(rig)
            first, second = make_first(), make_second()
            assert adder.can_share_extend_batch(first)
            assert _add(adder, first) == AddReqResult.CONTINUE
            assert adder.can_run_list == [first]
            assert not adder.can_share_extend_batch(second)
            assert adder.can_share_extend_batch(text_req("text", 5))
            # the admission call itself refuses it, as 'this pass is full'
            assert _add(adder, second) == AddReqResult.OTHER
            assert adder.can_run_list == [first]
            assert _add(adder, text_req("text", 5)) == AddReqResult.CONTINUE
            assert not _mixed(adder.can_run_list)


def test_a_continuing_image_chunk_keeps_override_requests_out():
    rig = SchedulerRig()
    with hooks_installed(SCHEDULER_SIDE):
        adder = _adder(rig)
        chunked = image_req("chunked-image", 40, span=(2, 30))
        chunked.init_next_round_input(rig.tree_cache)
        adder.add_chunked_req(chunked)
        assert adder.can_run_list == [chunked]
        override = override_req("override", 6)
        assert not adder.can_share_extend_batch(override)
        assert _add(adder, override) == AddReqResult.OTHER
        assert adder.can_run_list == [chunked]


def _drive(rig, first_arrivals, arrivals_per_round, rounds):
    for req in first_arrivals:
        rig.submit(req)
    batches = []
    for index in range(rounds):
        for make in arrivals_per_round:
            rig.submit(make(index))
        batch = rig.run_round()
        batches.append([] if batch is None else list(batch.reqs))
    return batches


def _override_behind_image_continuation(rig):
    rig.submit(image_req("image-0", 40, span=(2, 30)))
    first = rig.run_round()
    assert rig.scheduler.chunked_req is first.reqs[0]  # a 40-token prompt in 16-token chunks
    override = override_req("override", 6)
    # new image requests keep arriving behind the override request
    batches = _drive(
        rig,
        [override],
        [lambda i: image_req(f"image-{i + 1}", 20, span=(2, 9), seed=100 + i)],
        rounds=6,
    )
    return override, batches


def test_override_request_is_admitted_once_the_image_continuation_drains():
    """FCFS: the override request at the head waits only for the image chunks
    ahead of it, although image requests keep arriving behind it."""
    rig = SchedulerRig(chunk=16)
    with hooks_installed(SCHEDULER_SIDE):
        override, batches = _override_behind_image_continuation(rig)
    for reqs in batches:
        assert not _mixed(reqs), [r.rid for r in reqs]
    admitted_at = [i for i, reqs in enumerate(batches) if override in reqs]
    # rounds 0 and 1 finish image-0 (tokens 16..32, 32..40); round 2 is the override's
    assert admitted_at == [2]
    assert [r.rid for r in batches[2]] == ["override"]
    assert override not in rig.scheduler.waiting_queue
    # and the image requests behind it are served afterwards, in order
    assert [r.rid for r in batches[3]][:1] == ["image-1"]


def test_stock_sglang_mixes_them_in_the_same_traffic():
    """Control for the test above: 0.5.23 alone puts the override request into
    the image continuation's batch."""
    rig = SchedulerRig(chunk=16)
    override, batches = _override_behind_image_continuation(rig)
    assert any(_mixed(reqs) for reqs in batches)


def test_image_request_waits_for_an_override_continuation_and_is_then_admitted():
    rig = SchedulerRig(chunk=16)
    with hooks_installed(SCHEDULER_SIDE):
        long_override = override_req("override", 40, positions=(1, 20, 35))
        image = image_req("image", 12)
        batches = _drive(rig, [long_override, image], [], rounds=5)
    for reqs in batches:
        assert not _mixed(reqs), [r.rid for r in reqs]
    override_rounds = [i for i, reqs in enumerate(batches) if long_override in reqs]
    image_rounds = [i for i, reqs in enumerate(batches) if image in reqs]
    assert override_rounds == [0, 1, 2]  # 16 + 16 + 8 tokens
    assert image_rounds == [3]


def _preemption_case(ids):
    """A full batch, a low-priority running request, and a high-priority override
    request arriving behind a continuing image chunk."""
    rig = SchedulerRig(chunk=16, rows=2, priority_preemption=True)
    s = rig.scheduler
    with hooks_installed(ids):
        low = text_req("low", 6)
        low.priority = 0
        rig.submit(low)
        running, _ = s._get_new_batch_prefill_raw(None, ScheduleBatch(reqs=[]))
        assert running.reqs == [low] and low.kv.holds_kv
        image = image_req("image", 20, span=(2, 12))
        image.priority = 0
        rig.submit(image)
        rig.run_round(running=running)  # image tokens 0..16; now both rows are held
        override = override_req("override", 6)
        override.priority = 10
        rig.submit(override)
        batch = rig.run_round(running=running)  # image 16..20 leaves chunk budget
    return low, running, override, batch, s


def test_no_running_request_is_preempted_for_a_request_that_cannot_share():
    low, running, override, batch, s = _preemption_case(SCHEDULER_SIDE)
    assert running.reqs == [low] and low.kv.holds_kv
    assert [r.rid for r in batch.reqs] == ["image"]
    assert s.waiting_queue == [override]


def test_without_the_preemption_guard_the_running_request_is_evicted_for_nothing():
    """Why EMB-PREEMPT exists: the loop preempts before add_one_req refuses."""
    low, running, override, batch, s = _preemption_case(SCHEDULER_SIDE - {"EMB-PREEMPT"})
    assert running.reqs == [] and not low.kv.holds_kv
    assert override in s.waiting_queue and low in s.waiting_queue
    assert [r.rid for r in batch.reqs] == ["image"]


def test_a_request_carrying_both_kinds_is_aborted_at_intake_and_blocks_nothing():
    rig = SchedulerRig(chunk=16)
    with hooks_installed(SCHEDULER_SIDE):
        both = image_req("both", 12)
        both.positional_embed_overrides = override_req("x", 12).positional_embed_overrides
        rig.submit(both)
        assert both.to_finish is not None
        assert "carries both embedding overrides and multimodal inputs" in both.to_finish.message
        assert both.positional_embed_overrides is None and both.multimodal_inputs is None
        override = override_req("override", 6)
        image = image_req("image", 12)
        batches = _drive(rig, [override, image], [], rounds=3)
    # the aborted request runs its one-token early-abort prefill like any other
    assert [r.rid for r in batches[0]] == ["both", "override"]
    assert [r.rid for r in batches[1]] == ["image"]
    assert all(not _mixed(reqs) for reqs in batches)
