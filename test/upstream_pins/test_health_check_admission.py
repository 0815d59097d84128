"""Pin: health-check admission is decided from state every CP/TP rank shares.

The original fork added ``Scheduler.is_sched_idle_cp_symmetric`` after a deadlock on
cp2/cp4 with hierarchical cache: one rank admitted a health-check generate while
another skipped it, because the idle check read rank-local hicache drain queues,
and the ranks then waited in different collectives. sglang 0.5.23 already decides
with ``is_fully_idle(for_health_check=True)``, which reads only collectively
maintained state; this package ships upstream's predicate. These tests fail if
that stops being true.

Behaviour we ship where the original fork differs (both are rank-symmetric, see below):
- the grammar queue does not block health-check admission (the original fork's
  predicate counted it). Grammar readiness is synchronized across ranks, but a queued
  grammar request is not running on the GPU, so it carries no health information;
- on a PD decode server, requests retracted to the prealloc queue block admission
  (the original fork's predicate ignored them). Retraction is a collective scheduling
  decision, so every rank sees the same retracted queue.

Real: Scheduler.process_input_requests and is_fully_idle on scheduler objects
made with ``Scheduler.__new__``, a published scheduler runtime context from real
argument resolution, real ScheduleBatch / DllmManager / TokenizedGenerateReqInput.
Stand-ins: the rank-local managers, only as holders of the queues the idle check
reads.
"""

from __future__ import annotations

import collections
from pathlib import Path
from types import SimpleNamespace

import pytest

import sglang_dsv41
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.dllm.mixin.scheduler import DllmManager
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.utils import HEALTH_CHECK_RID_PREFIX
from sglang.srt.runtime_context import (
    SpawnRanks,
    create_context,
    override_platform,
    use_context,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import prepare_server_args

TINY = Path(sglang_dsv41.__file__).parent / "data" / "tiny_dsv41"


@pytest.fixture(scope="module")
def scheduler_context():
    with override_platform(is_cuda=True, is_hip=False):
        args = prepare_server_args(["--model-path", str(TINY), "--device", "cuda",
                                    "--language-model-only"])
        args.resolve_once()
    context = create_context(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    with use_context(context):
        yield context


def _rank(mode=DisaggregationMode.NULL, *, local_work: bool):
    """A scheduler rank with an idle shared state; ``local_work`` fills every
    rank-local queue the non-health idle check reads."""
    sched = Scheduler.__new__(Scheduler)
    sched.running_batch = ScheduleBatch(reqs=[])
    sched.last_batch = None
    sched.chunked_req = None
    sched.dllm_manager = DllmManager()
    sched.enable_overlap = False
    sched.result_queue = collections.deque()
    sched.waiting_queue = []
    sched._engine_paused = False
    sched.disaggregation_mode = mode
    busy = [object()] if local_work else []
    sched.grammar_manager = SimpleNamespace(grammar_queue=list(busy))
    sched.disagg_prefill_inflight_queue = list(busy)
    sched.disagg_prefill_bootstrap_queue = SimpleNamespace(queue=list(busy))
    sched.disagg_decode_prealloc_queue = SimpleNamespace(queue=list(busy), retracted_queue=[])
    sched.disagg_decode_transfer_queue = SimpleNamespace(
        queue=list(busy), has_pending_deferred_releases=lambda: local_work)
    sched.decode_offload_manager = SimpleNamespace(ongoing_offload=dict.fromkeys(busy))
    sched.enable_hisparse = False
    sched.enable_lmcache = False
    sched.enable_hierarchical_cache = True
    sched.tree_cache = SimpleNamespace(
        ongoing_write_through=dict.fromkeys(busy), ongoing_load_back=dict.fromkeys(busy),
        enable_storage=True, ongoing_prefetch=dict.fromkeys(busy),
        ongoing_backup=dict.fromkeys(busy),
        buffer_pipeline=SimpleNamespace(is_idle=lambda: not local_work),
    )
    # What process_input_requests touches besides the idle check.
    sched.scheduler_stage_metrics = None  # stage metrics off
    sched.session_controller = SimpleNamespace(maybe_reap=lambda now: None)
    sched.flush_wrapper = SimpleNamespace(check_pending=lambda: None)
    sched.external_corpus_manager = None
    sched._event_loop_should_restart = False
    sched.return_health_check_ipcs = []
    sched.dispatched = []
    sched._request_dispatcher = lambda req: sched.dispatched.append(req.rid)
    return sched


def _health_check(n=0):
    return TokenizedGenerateReqInput(
        rid=f"{HEALTH_CHECK_RID_PREFIX}_{n}", input_text="", input_ids=[1],
        input_embeds=None, mm_inputs=None, token_type_ids=None,
        sampling_params=SamplingParams(max_new_tokens=1), return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
        http_worker_ipc="ipc://worker-0",
    )


MODES = [DisaggregationMode.NULL, DisaggregationMode.PREFILL, DisaggregationMode.DECODE]


@pytest.mark.parametrize("mode", MODES)
def test_rank_local_queues_do_not_change_health_check_admission(scheduler_context, mode):
    quiet, busy = _rank(mode, local_work=False), _rank(mode, local_work=True)
    # The rank-local terms are real inputs of the ordinary idle check ...
    assert quiet.is_fully_idle() is True
    assert busy.is_fully_idle() is False
    # ... and none of the health-check one: both ranks admit the same request.
    for sched in (quiet, busy):
        assert sched.is_fully_idle(for_health_check=True) is True
        sched.process_input_requests([_health_check()])
        assert sched.dispatched == [f"{HEALTH_CHECK_RID_PREFIX}_0"]
        assert sched.return_health_check_ipcs == []


@pytest.mark.parametrize("mode", MODES)
def test_shared_work_makes_every_rank_skip_the_health_check(scheduler_context, mode):
    for local_work in (False, True):
        sched = _rank(mode, local_work=local_work)
        sched.waiting_queue = [object()]  # requests arrive by broadcast: every rank has it
        sched.process_input_requests([_health_check(1)])
        assert sched.dispatched == []
        assert sched.return_health_check_ipcs == ["ipc://worker-0"]


def test_decode_retracted_requests_block_admission_on_every_rank(scheduler_context):
    for local_work in (False, True):
        sched = _rank(DisaggregationMode.DECODE, local_work=local_work)
        sched.disagg_decode_prealloc_queue.retracted_queue = [object()]
        assert sched.is_fully_idle(for_health_check=True) is False
