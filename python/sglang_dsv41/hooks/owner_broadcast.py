"""Adapters: owner-broadcast image embedding inside sglang 0.5.23's DeepSeek-V4.1 model.

The protocol lives in ``sglang_dsv41.core.owner_embedding``. These hooks only
connect it to sglang:

- when the model is built, pick the group that replicates image work
  (``OWN-GROUP``);
- around the model's input preparation, open a session when the batch has
  images and run the preparation inside the session's fence (``OWN-FENCE``);
- where sglang encodes the per-image cache misses of a chunk, resolve the
  spans through the session instead (``OWN-ENCODE``);
- in the model's multimodal embedding step, hand ``embed_mm_inputs`` a text
  embedding that agrees ``features_ready`` before its collective
  (``OWN-TEXT-EMBED``).

The session travels from the fence to the two inner call sites in a context
variable, so no upstream signature changes.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, List, Optional, Sequence

import torch

from sglang_dsv41.core.owner_embedding import (
    ItemView,
    OwnerSession,
    SpanRequest,
    chunk_has_owner_spans,
    select_owner_group_kind,
)

logger = logging.getLogger(__name__)

ENV_SWITCH = "SGLANG_DSV41_OWNER_BROADCAST"

_active_session: ContextVar[Optional[OwnerSession]] = ContextVar(
    "sglang_dsv41_owner_session", default=None
)
_decision_logged = False
_fallback_warned = False


# --------------------------------------------------------------------------
# Adapters for sglang objects


class CoordinatorGroup:
    """``OwnerGroup`` over sglang's ``GroupCoordinator``: objects (only after a
    failure) go over its gloo CPU group; span broadcasts over its device group
    (pynccl when enabled); status rounds are a MAX all-reduce of a few int64
    words on the device group (NCCL on GPUs), next to the broadcasts' own
    communicator. ``GroupCoordinator.all_reduce`` is not used for them: it
    only sums, and routes through custom all-reduce kernels sized for
    activations."""

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self._status_device = None

    @property
    def rank_in_group(self) -> int:
        return self.coordinator.rank_in_group

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    @property
    def ranks(self) -> List[int]:
        return list(self.coordinator.ranks)

    def all_gather_object(self, obj: Any) -> List[Any]:
        return self.coordinator.all_gather_object(obj)

    def all_reduce_max(self, values: Sequence[int]) -> List[int]:
        import torch.distributed as dist

        coordinator = self.coordinator
        if coordinator.world_size == 1:
            return [int(v) for v in values]
        if self._status_device is None:
            backend = str(dist.get_backend(coordinator.device_group)).lower()
            self._status_device = (
                torch.device("cpu") if backend == "gloo" else torch.device(coordinator.device)
            )
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._status_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=coordinator.device_group)
        return tensor.tolist()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.coordinator.broadcast(tensor, src=src)

    def __repr__(self) -> str:
        return f"CoordinatorGroup({self.coordinator.unique_name}, ranks={self.ranks})"


class StaticCacheAdapter:
    """``EmbeddingCache`` over the scheduler's ``MultiModalStaticCache``
    (``mm_schedule.embedding_cache``, read at each call because sglang may
    re-initialize it)."""

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
# Group choice (OWN-GROUP)


def _switch_enabled() -> bool:
    raw = os.environ.get(ENV_SWITCH, "").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r}: expected 0 or 1")


def _log_decision_once(message: str) -> None:
    global _decision_logged
    if not _decision_logged:
        _decision_logged = True
        logger.info("[sglang-dsv41] owner-broadcast embedding: %s (pid %d)", message, os.getpid())


def choose_owner_group(model) -> Optional[CoordinatorGroup]:
    """The group whose members all prepare the same chunk, or None to keep
    sglang's replicated encode."""
    if getattr(model, "vision", None) is None:
        return None
    if not _switch_enabled():
        _log_decision_once(f"off ({ENV_SWITCH}=0)")
        return None
    from sglang.srt.managers import mm_schedule

    if mm_schedule._is_hip or mm_schedule._is_npu or mm_schedule._is_xpu:
        # These platforms encode per request and never reach the batched
        # per-image path the owner protocol hooks.
        _log_decision_once("off (this platform does not use the batched per-image encode)")
        return None
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    kind = select_owner_group_kind(
        tp_size=parallel.tp_size,
        attn_dp_size=parallel.attn_dp_size,
        attn_cp_size=parallel.attn_cp_size,
        pp_size=parallel.pp_group.world_size,
    )
    if kind is None:
        _log_decision_once(
            f"off (no group replicates image work: tp={parallel.tp_size} "
            f"attn_dp={parallel.attn_dp_size} attn_cp={parallel.attn_cp_size})"
        )
        return None
    coordinator = parallel.attn_tp_group if kind == "attn_tp" else parallel.attn_cp_group
    replication = parallel.tp_size // parallel.attn_dp_size
    if coordinator is None or coordinator.world_size != replication:
        _log_decision_once(
            f"off ({kind} group has {getattr(coordinator, 'world_size', None)} ranks, "
            f"{replication} replicate the work)"
        )
        return None
    group = CoordinatorGroup(coordinator)
    _log_decision_once(f"on over the {kind} group ({group.world_size} ranks)")
    return group


def after_model_init(result, model, *args, **kwargs):
    """AFTER DeepseekV4ForCausalLM.__init__."""
    model.mm_owner_group = choose_owner_group(model)
    return None


# --------------------------------------------------------------------------
# Session (OWN-FENCE)


def _batch_has_images(model, forward_batch) -> bool:
    """The condition under which the model's input preparation embeds images."""
    mode = forward_batch.forward_mode
    return (
        getattr(model, "vision", None) is not None
        and not mode.is_decode()
        and not mode.is_target_verify()
        and forward_batch.mm_inputs is not None
        and any(mm_input is not None for mm_input in forward_batch.mm_inputs)
    )


def _image_item_views(forward_batch) -> List[List[ItemView]]:
    from sglang.srt.managers.schedule_batch import Modality

    views = []
    for mm_input in forward_batch.mm_inputs:
        items = [] if mm_input is None else [i for i in mm_input.mm_items if i is not None]
        views.append(
            [
                ItemView(
                    offsets=[tuple(o) for o in (item.offsets or [])],
                    precomputed=item.precomputed_embeddings is not None,
                )
                for item in items
                if item.is_modality(Modality.IMAGE)
            ]
        )
    return views


def image_span_geometry(config, item, span_len: int):
    """What makes two items with one content hash the same span: the ViT grid
    and the GPU preprocessing plan. A grid that cannot yield ``span_len``
    tokens is rejected here, before any rank encodes it."""
    from sglang.srt.multimodal.deepseek_v41_image_processing import (
        GPU_PLAN_KEY,
        image_token_types,
    )

    height, width = int(item.n_vit_h), int(item.n_vit_w)
    ratio = config.vision_downsample_ratio
    expected = len(image_token_types(-(-height // ratio), -(-width // ratio)))
    if expected != span_len:
        raise ValueError(
            f"image grid {(height, width)} yields {expected} span tokens, "
            f"the placeholder has {span_len}"
        )
    return (height, width, item.model_specific_data.get(GPU_PLAN_KEY))


def open_session(model, forward_batch) -> Optional[OwnerSession]:
    group = getattr(model, "mm_owner_group", None)
    if group is None or not _batch_has_images(model, forward_batch):
        return None
    config = model.config
    return OwnerSession(
        group,
        device=model.image_start.device,
        dtype=model.image_start.dtype,
        width=config.hidden_size,
        request_ids=list(forward_batch.rids or ()),
        signature=lambda item, span_len: image_span_geometry(config, item, span_len),
        engaged=chunk_has_owner_spans(
            _image_item_views(forward_batch),
            forward_batch.extend_prefix_lens_cpu,
            forward_batch.extend_seq_lens_cpu,
        ),
        allocation_context=symmetric_memory_disabled,
    )


def around_prepare_language_model_inputs(original, model, input_ids, forward_batch, *args, **kwargs):
    """AROUND DeepseekV4ForCausalLM.prepare_language_model_inputs: the fence."""
    session = open_session(model, forward_batch)
    token = _active_session.set(session)
    try:
        if session is None:
            return original(model, input_ids, forward_batch, *args, **kwargs)
        with session.fence():
            return original(model, input_ids, forward_batch, *args, **kwargs)
    finally:
        _active_session.reset(token)


def active_session() -> Optional[OwnerSession]:
    return _active_session.get()


# --------------------------------------------------------------------------
# Text embedding (OWN-TEXT-EMBED)


class AgreedTextEmbedding:
    """Stands in for the model's text embedding inside ``embed_mm_inputs``.

    A vocab-parallel embedding is a local lookup followed by a TP all-reduce.
    The lookup runs first and its failure is agreed together with
    ``features_ready``; then the real module runs with its local lookup
    answered from that result, so sglang's own reduce logic decides whether
    and over which group to all-reduce. A vocab-parallel embedding of one
    shard (``enable_tp=False``, as DeepSeek-V4 builds it under attention DP)
    never communicates, so it runs whole and the features agreement is left
    to the fence end.
    """

    def __init__(self, session: OwnerSession, embedding):
        self._session = session
        self._embedding = embedding

    @property
    def num_embeddings(self):
        return self._embedding.num_embeddings

    def __getattr__(self, name):
        return getattr(self._embedding, name)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedding = self._embedding
        if callable(getattr(type(embedding), "_embed_local_shard", None)):
            if getattr(embedding, "tp_size", None) == 1:  # no collective inside
                return self._session.embed_text(lambda: embedding(input_ids))

            def reduce(partial: torch.Tensor) -> torch.Tensor:
                embedding.__dict__["_embed_local_shard"] = lambda _ids: partial
                try:
                    return embedding(input_ids)
                finally:
                    del embedding.__dict__["_embed_local_shard"]

            return self._session.embed_text(
                lambda: embedding._embed_local_shard(input_ids), reduce
            )
        if isinstance(embedding, torch.nn.Embedding):  # no collective inside
            return self._session.embed_text(lambda: embedding(input_ids))
        # Unknown module: it may communicate, so all of it counts as a collective.
        return self._session.embed_text(lambda: None, lambda _unused: embedding(input_ids))


def replace_prepare_mm_embeddings(model, input_ids, forward_batch):
    """REPLACE DeepseekV4ForCausalLM._prepare_mm_embeddings: the same call of
    ``embed_mm_inputs``, with the agreed text embedding when a session is engaged."""
    from sglang.srt.models import deepseek_v4

    embedding = model.get_input_embeddings()
    session = _active_session.get()
    if session is not None and session.engaged:
        embedding = AgreedTextEmbedding(session, embedding)
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


def collect_span_requests(per_image_requests) -> List[SpanRequest]:
    """The distinct image spans that overlap this chunk, in first-seen order.

    Also fills each request's ``overlapping`` list in the 0.5.23 format
    ``(index, item, token_count)``, which the chunk assembly reads afterwards.
    """
    from sglang.srt.managers import mm_schedule

    spans: dict = {}
    for req_info in per_image_requests:
        chunk_start = req_info.extend_prefix_len
        chunk_end = chunk_start + req_info.extend_seq_len
        overlapping = []
        if req_info.extend_seq_len > 0:
            for index, item in enumerate(req_info.items):
                token_count = mm_schedule._item_overlap(item, chunk_start, chunk_end)
                if token_count is not None:
                    overlapping.append((index, item, token_count))
        req_info.overlapping = overlapping
        for _index, item, token_count in overlapping:
            key = (item.hash, token_count)
            if key in spans:
                spans[key].duplicates.append(item)
                continue
            spans[key] = SpanRequest(
                content_hash=item.hash,
                span_len=token_count,
                item=item,
                inside_chunk=item.offsets[0][0] >= chunk_start
                and item.offsets[-1][1] < chunk_end,
            )
    return list(spans.values())


def owner_encoder(data_embedding_func, device):
    """Encodes the owner's spans the way sglang encodes cache misses."""
    from sglang.srt.managers import mm_schedule

    def encode(requests: List[SpanRequest]):
        items = [request.item for request in requests]
        for request in requests:
            if request.inside_chunk and request.item.can_defer_cuda_ipc_feature_reconstruction():
                request.item.model_specific_data[mm_schedule.BORROW_CUDA_IPC_FEATURE_KEY] = True
        mm_schedule._move_items_to_device(items, device, data_embedding_func)
        return data_embedding_func(items)

    return encode


def around_batch_encode_per_image_misses(original, data_embedding_func, per_image_requests, device):
    """AROUND mm_schedule._batch_encode_per_image_misses."""
    global _fallback_warned
    session = _active_session.get()
    if session is not None and session.engaged:
        return session.resolve(
            collect_span_requests(per_image_requests),
            StaticCacheAdapter(),
            owner_encoder(data_embedding_func, device),
        )
    if session is not None and not _fallback_warned:
        # The metadata mirror said no span; encoding locally on every rank is
        # what stock sglang does and needs no collective, so it stays safe.
        _fallback_warned = True
        logger.warning(
            "[sglang-dsv41] owner-broadcast: image spans reached the encoder in a chunk "
            "whose batch metadata showed none; encoding them on every rank"
        )
    return original(data_embedding_func, per_image_requests, device)
