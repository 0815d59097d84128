"""A DeepSeek-V4 PD decode's retraction aborts requests with images: counted, logged, explained.

sglang's real ``ScheduleBatch.retract_decode`` on CPU pools (``embed_harness``'s
scheduler rig: request-to-token pool, KV allocator, radix cache, prefill
admission building the batch), in decode mode. The KV pool the allocator
reports is a ``DeepSeekV4TokenToKVPool`` without buffers (only its type and
device are read), which is what makes sglang recompute retracted requests instead
of backing them up.
"""

from __future__ import annotations

import logging

import pytest

import embed_harness as E
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.runtime_context import get_disagg, reset_context

from sglang_dsv41 import metrics
from sglang_dsv41.pd_retraction.aborts import REASONS, VISION_MESSAGE, abort_reason
from sglang_dsv41.plugin.testing import patches_installed

PATCH_ID = "PDR-ABORT-REASON"


@pytest.fixture(autouse=True)
def _clean_context():
    """The scheduler rig publishes a server context; later tests in this process need none."""
    yield
    reset_context()


def decode_batch():
    """Three decoding requests; the one with images is the first a retraction gives up."""
    rig = E.SchedulerRig(kv_tokens=256, chunk=512)
    for req in (E.image_req("vision", 60, span=(2, 20)), E.text_req("text-a", 40),
                E.text_req("text-b", 20)):
        rig.submit(req)
    batch, _ = rig.scheduler._get_new_batch_prefill_raw(None, ScheduleBatch(reqs=[]))
    assert [r.rid for r in batch.reqs] == ["vision", "text-a", "text-b"]
    pool = DeepSeekV4TokenToKVPool.__new__(DeepSeekV4TokenToKVPool)
    pool.device = "cpu"
    rig.allocator._kvcache = pool
    for req in batch.reqs:
        req.output_ids.extend([3, 4])
    return batch


def retract_twice(backup: str = "cpu_tensor"):
    """Two retractions on a decode: each gives up the request it prefers least."""
    batch = decode_batch()
    with get_disagg().override(disaggregation_mode="decode",
                               disaggregation_decode_retraction_backup=backup):
        first = batch.retract_decode()
        second = batch.retract_decode()
    return first, second


def counted() -> dict:
    return dict(metrics.totals()["retraction_aborts"])


def test_stock_aborts_the_vision_request_with_the_words_of_a_missing_backup(caplog):
    before = counted()
    (retracted, _, aborted), (retracted2, _, aborted2) = retract_twice()
    assert retracted == [] and [r.rid for r in aborted] == ["vision"]
    assert [r.rid for r in retracted2] == ["text-a"] and aborted2 == []  # text survives
    assert "without a KV backup" in aborted[0].to_finish.message
    assert counted() == before  # nothing counts it


def test_the_plugin_counts_names_and_explains_the_vision_abort(caplog):
    before = counted()
    with patches_installed(PATCH_ID), caplog.at_level(logging.WARNING, "sglang_dsv41"):
        (retracted, _, aborted), (retracted2, _, aborted2) = retract_twice()
    assert retracted == [] and [r.rid for r in aborted] == ["vision"]
    assert [r.rid for r in retracted2] == ["text-a"] and aborted2 == []
    assert aborted[0].to_finish.message == VISION_MESSAGE
    assert aborted[0].to_finish.to_json()["message"] == VISION_MESSAGE  # what the client gets
    after = counted()
    assert after.get("vision_inputs", 0) == before.get("vision_inputs", 0) + 1
    assert {k: v for k, v in after.items() if k != "vision_inputs"} == \
        {k: v for k, v in before.items() if k != "vision_inputs"}
    lines = [r.getMessage() for r in caplog.records if "retraction aborted" in r.getMessage()]
    assert len(lines) == 1 and "rid=vision reason=vision_inputs" in lines[0], lines
    assert "1 image items" in lines[0]


def test_without_a_backup_every_abort_is_counted_as_no_backup():
    before = counted()
    with patches_installed(PATCH_ID):
        (_, _, aborted), (_, _, aborted2) = retract_twice(backup="none")
    assert [r.rid for r in aborted + aborted2] == ["vision", "text-a"]
    # Without any backup a text request is lost too: the images are not the cause.
    assert all(r.to_finish.message != VISION_MESSAGE for r in aborted + aborted2)
    assert counted().get("no_backup", 0) == before.get("no_backup", 0) + 2


@pytest.mark.parametrize("kwargs,reason", [
    (dict(beam_group=True, out_of_memory=False, recompute_pool=True, has_images=True, backup="cpu_tensor"), "beam_group"),
    (dict(beam_group=False, out_of_memory=True, recompute_pool=True, has_images=True, backup="cpu_tensor"), "out_of_memory"),
    (dict(beam_group=False, out_of_memory=False, recompute_pool=True, has_images=True, backup="host_pool"), "vision_inputs"),
    (dict(beam_group=False, out_of_memory=False, recompute_pool=False, has_images=True, backup="host_pool"), "host_pool_exhausted"),
    (dict(beam_group=False, out_of_memory=False, recompute_pool=True, has_images=False, backup="none"), "no_backup"),
    (dict(beam_group=False, out_of_memory=False, recompute_pool=False, has_images=False, backup="cpu_tensor"), "no_backup"),
])
def test_abort_reasons(kwargs, reason):
    assert abort_reason(**kwargs) == reason
    assert reason in REASONS
