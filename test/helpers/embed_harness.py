"""Real sglang 0.5.23 objects for the embed-override tests, and a way to install
just this group's hooks in the test process and take them out again.

The scheduler rig uses the real request-to-token pool, KV allocator, radix
cache (disabled, as with --disable-radix-cache), Req, PrefillAdder,
SchedulePolicy, ScheduleBatch and Scheduler admission code on the CPU. Only
the parts that stand for hardware or for other subsystems (attention backend,
grammar, metrics) are plain stand-ins.
"""

from __future__ import annotations

import contextlib
from array import array
from types import SimpleNamespace

from sglang.test.test_utils import maybe_stub_sgl_kernel

maybe_stub_sgl_kernel()

import torch  # noqa: E402
from sglang.srt.beam_search.coordinator import BeamCoordinator  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers.embed_types import PositionalEmbeds  # noqa: E402
from sglang.srt.managers.schedule_batch import (  # noqa: E402
    Modality,
    MultimodalDataItem,
    MultimodalInputs,
    Req,
    ScheduleBatch,
)
from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel, publish, reset_context  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_dsv41.plugin.table import PATCHES  # noqa: E402
from sglang_dsv41.plugin.testing import patches_installed  # noqa: E402

GROUP = "embed_overrides"
HIDDEN = 4
VOCAB = 1000


def group_patches():
    return [p for p in PATCHES if p.group == GROUP]


@contextlib.contextmanager
def hooks_installed(ids=None):
    """Install this group's patches (all, or ``ids``) the way HookRegistry does.

    Uses sglang's own wrapper builder, so the calling convention is exactly the
    one a server gets; restores the class attributes on exit (HookRegistry
    itself cannot un-patch).
    """
    chosen = [p.id for p in group_patches() if ids is None or p.id in ids]
    if not chosen:  # a renamed group or id must fail here, not install nothing
        raise LookupError(f"no patch of group {GROUP!r} matches {sorted(ids) if ids else 'all'}")
    with patches_installed(*chosen):
        yield


def vec(value: float = 1.0) -> torch.Tensor:
    return torch.full((HIDDEN,), float(value))


def image_item(span: tuple[int, int], *, seed: int = 1234, with_offsets: bool = True):
    """A real image item with a content hash and an inclusive placeholder span."""
    item = MultimodalDataItem(
        modality=Modality.IMAGE,
        feature=torch.zeros(1),
        offsets=[span] if with_offsets else None,
    )
    item.set_hash(seed)
    return item


def prompt_with_image(length: int, span: tuple[int, int], item) -> array:
    """Token ids as the tokenizer hands them over: text ids, placeholder ids in the span."""
    ids = [(7 * i) % (VOCAB - 1) + 1 for i in range(length)]
    start, end = span
    ids[start : end + 1] = item.padding_sequence(end - start + 1)
    return array("q", ids)


def sampling(max_new_tokens: int = 4) -> SamplingParams:
    params = SamplingParams(max_new_tokens=max_new_tokens)
    params.normalize(None)
    return params


def text_req(rid: str, length: int, **kwargs) -> Req:
    ids = array("q", [(5 * i) % (VOCAB - 1) + 1 for i in range(length)])
    return Req(rid, "", ids, sampling(), vocab_size=VOCAB, **kwargs)


def override_req(rid: str, length: int, positions=(1,)) -> Req:
    overrides = PositionalEmbeds(
        embeds=[vec(10 + i) for i in range(len(positions))], positions=list(positions)
    )
    return text_req(rid, length, positional_embed_overrides=overrides)


def image_req(rid: str, length: int, span=(2, 9), *, seed: int = 1234,
              with_offsets: bool = True) -> Req:
    item = image_item(span, seed=seed, with_offsets=with_offsets)
    req = Req(rid, "", prompt_with_image(length, span, item), sampling(), vocab_size=VOCAB)
    req.multimodal_inputs = MultimodalInputs(mm_items=[item])
    return req


def publish_scheduler_context() -> None:
    reset_context()
    publish(ServerArgs(model_path="dummy"), role="scheduler")
    # Scheduler.__init__ derives this default; admission reads it.
    get_context().override("test.pp_max_micro_batch_size", pp_max_micro_batch_size=64)
    # a single-rank scheduler (set_finish_with_abort logs on TP rank 0)
    get_parallel().override_permanently(tp_rank=0)


class SchedulerRig:
    """A Scheduler whose admission runs for real on CPU pools."""

    def __init__(self, *, chunk: int = 16, kv_tokens: int = 4096, rows: int = 32,
                 policy: str = "fcfs", priority_preemption: bool = False):
        publish_scheduler_context()
        self.req_to_token_pool = ReqToTokenPool(
            size=rows, max_context_len=512, device="cpu", enable_memory_saver=False
        )
        kv = MHATokenToKVPool(
            size=kv_tokens, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8,
            layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
        )
        self.allocator = TokenToKVPoolAllocator(
            kv_tokens, torch.bfloat16, "cpu", kv, need_sort=False
        )
        self.tree_cache = RadixCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=1,
            )
        )
        s = Scheduler.__new__(Scheduler)
        fields = dict(
            # what admission reads from the scheduler
            waiting_queue=[],
            chunked_req=None,
            page_size=1,
            chunked_prefill_size=chunk,
            max_prefill_tokens=16384,
            max_prefill_bs=64,
            max_running_requests=64,
            is_mixed_chunk=False,
            priority_scheduling_preemption_threshold=0,
            enable_priority_preemption=priority_preemption,
            enable_priority_scheduling=priority_preemption,
            schedule_low_priority_values_first=False,
            abort_on_priority_when_disabled=False,
            max_queued_requests=None,
            is_hybrid_swa=False,
            min_free_slots_delayer=None,
            dynamic_chunk_sizer=None,
            processed_tokens_counter=0,
            dllm_config=None,
            enable_lora=False,
            lora_drainer=None,
            enable_hicache_storage=False,
            enable_lmcache=False,
            enable_hierarchical_cache=False,
            enable_unified_cache_external_linker=False,
            truncation_align_size=None,
            enable_overlap=False,
            hisparse_coordinator=None,
            disaggregation_mode=DisaggregationMode.NULL,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            tree_cache=self.tree_cache,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            policy=SchedulePolicy(
                policy=policy,
                tree_cache=self.tree_cache,
                enable_hierarchical_cache=False,
                enable_priority_scheduling=priority_preemption,
                schedule_low_priority_values_first=False,
            ),
            new_token_ratio_tracker=SimpleNamespace(current=1.0),
            model_config=SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False),
            beam_coordinator=BeamCoordinator(
                model_config=None, spec_algorithm=SpeculativeAlgorithm.NONE,
                dllm_enabled=False, max_req_len=512,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                tree_cache=self.tree_cache, future_map=None,
            ),
            # stand-ins for subsystems admission only consults
            grammar_manager=SimpleNamespace(has_waiting_grammars=lambda: False),
            tp_worker=SimpleNamespace(
                model_runner=SimpleNamespace(attn_backend=object(), prefill_aware_swa=False)
            ),
            load_inquirer=SimpleNamespace(_get_num_pending_tokens=lambda **kw: 0),
        )
        for name, value in fields.items():
            setattr(s, name, value)
        self.scheduler = s

    def receive_generate_requests(self, pad_input_ids_func) -> None:
        """Also let the real ``Scheduler.handle_generate_request`` run whole:
        what it reads besides admission, as a plain single-rank prefill server
        sets it (no metrics, sessions, grammar, KV events or mrope), and the
        model's real ``pad_input_ids``."""
        get_parallel().override_permanently(tp_rank=0, pp_rank=0)
        fields = dict(
            model_config=SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False,
                                         hf_eos_token_id=None, requires_mm_token_modalities=False),
            metrics_reporter=SimpleNamespace(enable_metrics=False),
            metrics_collector=None,
            tokenizer=None,
            enable_session_radix_cache=False,
            kv_events_publisher=SimpleNamespace(enable_kv_cache_events=False),
            grammar_manager=SimpleNamespace(has_waiting_grammars=lambda: False,
                                            process_req_with_grammar=lambda req: False),
            _mm_processor=None,
            max_req_input_len=1 << 20,
            max_req_len=(1 << 20) + 1,
            max_new_tokens_limit=None,
            max_total_num_tokens=self.allocator.size,
            kv_shard_widening=1,
            sliding_window_size=None,
            pad_input_ids_func=pad_input_ids_func,
        )
        for name, value in fields.items():
            setattr(self.scheduler, name, value)

    def submit(self, req: Req) -> None:
        """Queue a request the way the scheduler does after receiving it."""
        self.scheduler._add_request_to_queue(req)

    def run_round(self, running: ScheduleBatch | None = None):
        """One scheduling step's prefill part, as get_next_batch_to_run does it.

        The continuing chunk's progress is recorded first (stash_chunked_request);
        requests whose prompt the batch completes leave for decode, which here
        means their KV row is given back at once.
        """
        s = self.scheduler
        if s.chunked_req is not None and s.chunked_req.extend_end > s.chunked_req.prefix_len:
            s.stash_chunked_request(s.chunked_req)
        batch, _ = s._get_new_batch_prefill_raw(None, running or ScheduleBatch(reqs=[]))
        if batch is None:
            return None
        for req in batch.reqs:
            if req is not s.chunked_req:
                release_kv_cache(req, self.tree_cache, checkpoint=False)
        if s.chunked_req is not None:
            s.chunked_req.inflight_middle_chunks -= 1  # its result was processed
        return batch
