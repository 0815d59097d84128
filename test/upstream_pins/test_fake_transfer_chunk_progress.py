"""Pin: chunked prefill keeps advancing when a fake PD transfer bars radix inserts.

The original fork fixed ``maybe_cache_unfinished_req``: with ``skip_radix_cache_insert``
(a fake-transfer bootstrap host, or embedding overrides) it returned without
recording the computed prefix, so the next chunk restarted from zero. sglang
0.5.23 replaced that function and ``req.prefix_indices`` with the integer
``req.prefix_len`` and ``checkpoint_kv_cache``, which advances ``prefix_len`` to
the chunk end whether or not the tree is told. This package ships upstream's code;
these tests fail if that progress stops.

Real: Req (with the fake bootstrap host), checkpoint_kv_cache, and
Scheduler.stash_chunked_request for normal and PD-prefill servers. Stand-in: the
prefix tree, which only records checkpoint calls.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST, DisaggregationMode
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.common import checkpoint_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams

PROMPT = 16385
CHUNK = 8192


class _Tree:
    def __init__(self):
        self.checkpoints = []

    def checkpoint(self, req, *, up_to):
        self.checkpoints.append(up_to)


def _req(bootstrap_host):
    return Req(rid="r0", origin_input_text="", origin_input_ids=array("i", range(PROMPT)),
               sampling_params=SamplingParams(max_new_tokens=1),
               bootstrap_host=bootstrap_host, bootstrap_port=8998, bootstrap_room=7)


def _chunks(req, tree, stash):
    """Run the prompt in CHUNK-sized extends; return prefix_len after each stash."""
    seen = []
    while req.prefix_len + CHUNK < PROMPT:
        req.extend_end = req.prefix_len + CHUNK  # what the next extend computes
        stash(req, tree)
        seen.append(req.prefix_len)
    return seen


def test_fake_transfer_request_is_barred_from_the_tree():
    assert _req(FAKE_BOOTSTRAP_HOST).skip_radix_cache_insert is True
    assert _req("10.0.0.2").skip_radix_cache_insert is False


@pytest.mark.parametrize("host, published", [(FAKE_BOOTSTRAP_HOST, False), ("10.0.0.2", True)])
def test_checkpoint_advances_prefix_with_or_without_tree_insert(host, published):
    tree = _Tree()
    req = _req(host)
    assert _chunks(req, tree, checkpoint_kv_cache) == [CHUNK, 2 * CHUNK]
    assert tree.checkpoints == ([CHUNK, 2 * CHUNK] if published else [])


@pytest.mark.parametrize("mode", [DisaggregationMode.NULL, DisaggregationMode.PREFILL])
def test_scheduler_stash_advances_fake_transfer_chunks(mode):
    sched = Scheduler.__new__(Scheduler)
    sched.disaggregation_mode = mode

    def stash(req, tree):
        sched.tree_cache = tree
        Scheduler.stash_chunked_request(sched, req)

    tree = _Tree()
    req = _req(FAKE_BOOTSTRAP_HOST)
    assert _chunks(req, tree, stash) == [CHUNK, 2 * CHUNK]
    assert tree.checkpoints == []


def test_finished_request_is_not_checkpointed():
    req = _req(FAKE_BOOTSTRAP_HOST)
    req.finished_reason = SimpleNamespace()
    req.extend_end = CHUNK
    with pytest.raises(AssertionError, match="checkpointing finished request"):
        checkpoint_kv_cache(req, _Tree())
    assert req.prefix_len == 0
