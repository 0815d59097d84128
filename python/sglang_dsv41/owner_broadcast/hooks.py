"""Adapters: owner-broadcast image embedding inside sglang 0.5.23's DeepSeek-V4.1 model.

The protocol is ``owner_broadcast.protocol``, the routing ``owner_broadcast.routing``,
the reading of sglang's batch objects ``owner_broadcast.chunks``. These hooks
connect them to sglang: the group and router at model build (``OWN-GROUP``),
a request's image table at admission (``OWN-ADMIT``), the chunk's route and
session around the input preparation (``OWN-FENCE``), the per-image encode
through the session (``OWN-ENCODE``), and a text embedding that agrees
``features_ready`` before its collective (``OWN-TEXT-EMBED``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

import torch

from sglang_dsv41.owner_broadcast import chunks as owner_chunks

from sglang_dsv41 import metrics
from sglang_dsv41.owner_broadcast.chunks import (
    TABLE_ATTRIBUTE,
    active_chunk,
    build_table,
    collect_span_requests,
    route_chunk,
)
from sglang_dsv41.owner_broadcast.protocol import CoordinatorGroup, OwnerSession
from sglang_dsv41.owner_broadcast.routing import ENV_MODE, OwnerRouter, Route, RoutingPolicy, SpanDirectory

ENV_SWITCH = ENV_MODE
_KNOWN = Route.KNOWN  # a module global: one lookup on every chunk

# Whether this process routes image chunks (a router was attached to a model
# it built, outside a PD decode server): only then are request tables built
# at admission.
routes_in_process = False


class StaticCacheAdapter:
    """``EmbeddingCache`` over ``mm_schedule.embedding_cache`` (read at each
    call: sglang may re-initialize it)."""

    @staticmethod
    def _cache():
        from sglang.srt.managers import mm_schedule

        return mm_schedule.embedding_cache

    def get(self, content_hash: int) -> Optional[torch.Tensor]:
        entry = self._cache().get_single(content_hash)
        return None if entry is None else entry.embedding

    def set(self, content_hash: int, span: torch.Tensor) -> bool:
        from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

        return bool(self._cache().set(content_hash, EmbeddingResult(embedding=span)))

    def free(self, content_hash: int) -> None:
        self._cache().free(content_hash, None)


def cache_capacity() -> int:
    """The embedding cache's byte budget (the span directory shadows it)."""
    from sglang.srt.managers import mm_schedule

    cache = mm_schedule.embedding_cache
    return int(getattr(cache, "max_size", 0) or 0) if cache is not None else 0


@contextmanager
def symmetric_memory_disabled():
    """Receive buffers differ in size between owners and receivers, which a
    symmetric-memory pool cannot take: allocate them outside any active one."""
    from sglang.srt.distributed.device_communicators import pynccl_allocator

    saved = pynccl_allocator.disable_symmetric_memory_context()
    try:
        yield
    finally:
        pynccl_allocator.restore_symmetric_memory_context(saved)


# --------------------------------------------------------------------------
# Group choice (OWN-GROUP) and admission (OWN-ADMIT)


def choose_owner_group(model) -> Optional[CoordinatorGroup]:
    """The group whose members all prepare the same chunk, or None to keep
    sglang's replicated encode."""
    if getattr(model, "vision", None) is None:
        return None
    from sglang.srt.managers import mm_schedule
    from sglang.srt.runtime_context import get_parallel

    # HIP, NPU and XPU encode per request, never through the per-image path.
    batched = not (mm_schedule._is_hip or mm_schedule._is_npu or mm_schedule._is_xpu)
    coordinator, _decision = owner_chunks.owner_group_decision(
        RoutingPolicy.from_env(os.environ), batched, get_parallel
    )
    return None if coordinator is None else CoordinatorGroup(coordinator)


def require_request_tables() -> None:
    """Fail closed at model build when sglang's MultimodalInputs cannot carry
    the routing's per-request table (a release that gives it __slots__)."""
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    if not MultimodalInputs.__dictoffset__:  # instances carry no __dict__
        raise RuntimeError(
            "[sglang-dsv41] OWN-FENCE: sglang's MultimodalInputs has no instance dict, "
            f"so the owner routing cannot keep its per-request table ({TABLE_ATTRIBUTE}); "
            f"set {ENV_SWITCH}=0 to run without the owner path"
        )


def attach_owner_path(model) -> None:
    """Sets ``model.mm_owner_group`` and ``model.mm_owner_router`` (None when
    the owner path is off); a bad routing setting stops the build, naming it."""
    global routes_in_process
    group = choose_owner_group(model)
    model.mm_owner_group = group
    model.mm_owner_router = None
    if group is not None:
        require_request_tables()
        policy = RoutingPolicy.from_env(os.environ)
        row_bytes = model.config.hidden_size * model.image_start.element_size()
        model.mm_owner_router = OwnerRouter(group.world_size, policy, SpanDirectory(0), row_bytes)
        # The router counts its routes per chunk anyway; the metrics read those counts.
        metrics.export_route_counts(model.mm_owner_router.routes)
        # A PD decode server never embeds images in its batches: its
        # admissions build no tables (a chunk that ever needed one builds it).
        if not on_decode_server():
            routes_in_process = True


def on_decode_server() -> bool:
    """Whether this process serves PD decode, from the configuration sglang
    publishes before building the model (none published, as in a bare test
    process: not decode; its admissions build tables the first chunk would)."""
    from sglang.srt.runtime_context import get_disagg

    try:
        mode = get_disagg().disaggregation_mode
    except ValueError:  # "config namespace 'disagg' not published"
        return False
    return mode == "decode"


def after_model_init(result, model, *args, **kwargs):
    """AFTER DeepseekV4ForCausalLM.__init__."""
    attach_owner_path(model)
    return None


def after_extend_image_inputs(result, req, *args, **kwargs):
    """AFTER Req.extend_image_inputs (OWN-ADMIT): build the request's image
    table as the scheduler admits it, where offsets are final and every item
    is read anyway, so its first chunk finds the table (and still checks it
    is of the request's current item list)."""
    if routes_in_process:
        mm_input = req.multimodal_inputs
        if mm_input is not None:
            build_table(mm_input, mm_input.mm_items)
    return None


# --------------------------------------------------------------------------
# Session (OWN-FENCE)


def _image_modality():
    from sglang.srt.managers.schedule_batch import Modality

    return Modality.IMAGE


def image_span_geometry(config, item, span_len: int):
    """A span's geometry signature (grid and GPU plan), checked against its length."""
    from sglang.srt.multimodal import deepseek_v41_image_processing as processing

    plan = item.model_specific_data.get(processing.GPU_PLAN_KEY)
    return owner_chunks.span_geometry(item, span_len, config.vision_downsample_ratio,
                                      processing.image_token_types, plan)


def open_session(model, forward_batch, local_encode: bool = False) -> OwnerSession:
    group = model.mm_owner_group
    config = model.config
    return OwnerSession(
        group,
        device=model.image_start.device,
        dtype=model.image_start.dtype,
        width=config.hidden_size,
        request_ids=list(forward_batch.rids or ()),
        signature=lambda item, span_len: image_span_geometry(config, item, span_len),
        allocation_context=symmetric_memory_disabled,
        local_encode=local_encode,
        span_cost=owner_chunks.span_cost(model.mm_owner_router.policy.per_image_cost),
    )


owner_chunks.connect(open_session=open_session, image_modality=_image_modality)


def around_prepare_language_model_inputs(original, model, input_ids, forward_batch, *args, **kwargs):
    """AROUND DeepseekV4ForCausalLM.prepare_language_model_inputs: route the
    chunk; the owner route runs inside the session's fence."""
    chunk = route_chunk(model, forward_batch)
    if chunk is None or chunk.route is _KNOWN:
        # Stock lookups and no session: the inner hooks have nothing to do
        # (no chunk is active outside a preparation), and the routing touched
        # the spans already, so nothing follows either.
        return original(model, input_ids, forward_batch, *args, **kwargs)
    return owner_chunks.prepare_routed_chunk(
        chunk, model.mm_owner_router,
        lambda: original(model, input_ids, forward_batch, *args, **kwargs), cache_capacity,
    )


# --------------------------------------------------------------------------
# Text embedding (OWN-TEXT-EMBED)


_DEEPSEEK_V4 = None


def _deepseek_v4():
    global _DEEPSEEK_V4
    if _DEEPSEEK_V4 is None:
        from sglang.srt.models import deepseek_v4

        _DEEPSEEK_V4 = deepseek_v4
    return _DEEPSEEK_V4


def replace_prepare_mm_embeddings(model, input_ids, forward_batch):
    """REPLACE DeepseekV4ForCausalLM._prepare_mm_embeddings: the same call of
    ``embed_mm_inputs``, with the agreed text embedding when a session is engaged."""
    deepseek_v4 = _deepseek_v4()
    embedding = owner_chunks.chunk_text_embedding(model.get_input_embeddings())
    # embed_mm_inputs clamps its input ids in place; the scheduler's hash ids
    # must stay intact, hence the clone.
    input_embeds, _ = deepseek_v4.embed_mm_inputs(
        mm_inputs_list=[
            mm_input if mm_input is not None else deepseek_v4.MultimodalInputs(mm_items=[])
            for mm_input in forward_batch.mm_inputs
        ],
        extend_prefix_lens=forward_batch.extend_prefix_lens_cpu,
        extend_seq_lens=forward_batch.extend_seq_lens_cpu,
        input_ids=input_ids.clone(),
        input_embedding=embedding,
        multimodal_model=model,
    )
    forward_batch.mm_input_embeds = input_embeds
    return input_embeds


# --------------------------------------------------------------------------
# Per-image encode (OWN-ENCODE)


def around_batch_encode_per_image_misses(original, data_embedding_func, per_image_requests, device):
    """AROUND mm_schedule._batch_encode_per_image_misses."""
    chunk = active_chunk()
    session = None if chunk is None else chunk.session
    if session is not None and session.engaged and not session.local_encode:
        from sglang.srt.managers import mm_schedule

        features = session.resolve(
            collect_span_requests(per_image_requests, mm_schedule._item_overlap),
            StaticCacheAdapter(),
            owner_chunks.owner_encoder(data_embedding_func, device, mm_schedule._move_items_to_device,
                                       mm_schedule.BORROW_CUDA_IPC_FEATURE_KEY),
        )
        metrics.count_encodes_saved(session.spans_received)
        return features
    owner_chunks.warn_once_if_unrouted(chunk)
    return original(data_embedding_func, per_image_requests, device)
