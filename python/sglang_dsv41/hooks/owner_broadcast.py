"""Adapters: owner-broadcast image embedding inside sglang 0.5.23's DeepSeek-V4.1 model.

The protocol lives in ``sglang_dsv41.core.owner_embedding``. These hooks only
connect it to sglang:

- when the model is built, pick the group that replicates image work and
  give it a router (``OWN-GROUP``);
- when the scheduler hands a request its media, build the request's image
  table for the routing (``OWN-ADMIT``);
- around the model's input preparation, route the chunk from its metadata
  (``core.owner_routing``): chunks the protocol can speed up run inside a
  session's fence, the others (every span known to the group, or too little
  encoder work to share) run stock sglang untouched (``OWN-FENCE``);
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
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang_dsv41.core import plugin_metrics
from sglang_dsv41.core.owner_embedding import (
    OwnerProtocolError,
    OwnerSession,
    SpanRequest,
    select_owner_group_kind,
)
from sglang_dsv41.core.owner_routing import (
    ENV_MODE,
    ChunkSpan,
    OwnerRouter,
    RequestImages,
    Route,
    RoutingPolicy,
    SpanDirectory,
)

logger = logging.getLogger(__name__)

_new_tuple = tuple.__new__

ENV_SWITCH = ENV_MODE


class ChunkRoute(NamedTuple):
    """What the fence decided for one input preparation: the route, the
    chunk's spans, and its session (the owner protocol for ``owner``, a
    status-only one for ``not-worth`` in mode "guarded", none otherwise)."""

    route: Route
    spans: Tuple[ChunkSpan, ...]
    session: Optional[OwnerSession]


_active_chunk: ContextVar[Optional[ChunkRoute]] = ContextVar(
    "sglang_dsv41_owner_chunk", default=None
)
_decision_logged = False
_KNOWN = Route.KNOWN  # a module global: one lookup on every chunk
_count_round = plugin_metrics.count_agreement_round
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
        _count_round()  # the protocol gathers only to agree (reports, after a failure)
        return self.coordinator.all_gather_object(obj)

    def all_reduce_max(self, values: Sequence[int]) -> List[int]:
        import torch.distributed as dist

        _count_round()
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
    policy = RoutingPolicy.from_env(os.environ)
    if policy is None:
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
    if policy.mode == "always":
        routing = "every image chunk through the protocol"
    elif policy.mode == "guarded":
        routing = (
            f"guarded: protocol when it saves >= {policy.min_saving} patch-equivalents "
            f"(image = {policy.per_image_cost} + its patches), stock for known spans, "
            "stock encodes in a status-only session"
        )
    else:
        routing = (
            f"auto: protocol when it saves >= {policy.min_saving} patch-equivalents "
            f"(image = {policy.per_image_cost} + its patches), stock for known spans"
        )
    _log_decision_once(f"on over the {kind} group ({group.world_size} ranks); routing {routing}")
    return group


def _require_request_tables() -> None:
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
    """Sets ``model.mm_owner_group`` and ``model.mm_owner_router`` (both None
    when the owner path is off for this model). A bad value in the routing
    variables stops the model build with a message naming the variable."""
    global _routes_in_process
    group = choose_owner_group(model)
    model.mm_owner_group = group
    model.mm_owner_router = None
    if group is not None:
        _require_request_tables()
        policy = RoutingPolicy.from_env(os.environ)
        row_bytes = model.config.hidden_size * model.image_start.element_size()
        model.mm_owner_router = OwnerRouter(group.world_size, policy, SpanDirectory(0), row_bytes)
        # The router counts its routes per chunk anyway; the metrics read those counts.
        plugin_metrics.export_route_counts(model.mm_owner_router.routes)
        # A PD decode server never embeds images in its batches: its
        # admissions build no tables (a chunk that ever needed one builds it).
        if not on_decode_server():
            _routes_in_process = True


def on_decode_server() -> bool:
    """Whether this process serves PD decode, from the configuration sglang
    publishes before building the model. A process that published none (a
    bare test process) is taken as not decode: its admissions build tables,
    which only costs the work the first chunk would do anyway."""
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


# Whether this process routes image chunks (a router was attached to a model
# it built, outside a PD decode server): only then are request tables built
# at admission.
_routes_in_process = False


def after_extend_image_inputs(result, req, *args, **kwargs):
    """AFTER Req.extend_image_inputs (OWN-ADMIT): build the request's image
    table as the scheduler admits it. Offsets are final here (session and
    padding adjustments run before this call), and admission already reads
    every item, so the first image chunk of the request, on the forward path,
    finds the table instead of reading every item itself. The chunk still
    checks that the table is of the request's current item list."""
    if _routes_in_process:
        mm_input = req.multimodal_inputs
        if mm_input is not None:
            _build_table(mm_input, mm_input.mm_items)
    return None


# --------------------------------------------------------------------------
# Session (OWN-FENCE)


# Per forward mode, whether the model's input preparation embeds images in
# it (not in decode or target-verify), from the mode's own predicates: one
# dict lookup per chunk instead of two method calls.
_EMBEDS_IN_MODE: dict = {}


def _learn_mode(mode) -> bool:
    embeds = _EMBEDS_IN_MODE[mode] = not mode.is_decode() and not mode.is_target_verify()
    return embeds


_IMAGE = None  # sglang's Modality.IMAGE, resolved on first use

# Where a request's image table lives: in the instance dict of its
# MultimodalInputs, so it is found with one lookup on every later chunk and
# leaves with the request (no registry of ours holds a request alive or has
# to learn that it died). attach_owner_path checks that the class keeps an
# instance dict; a test pins it.
TABLE_ATTRIBUTE = "_sglang_dsv41_image_table"


def _image_modality():
    global _IMAGE
    from sglang.srt.managers.schedule_batch import Modality

    _IMAGE = Modality.IMAGE
    return _IMAGE


def _table_of(mm_input) -> RequestImages:
    """A request's image table: built at admission (or else on its first
    chunk) and reused while its item list is the same object of the same
    length. Once a request is scheduled, sglang 0.5.23 adds media by building
    a new list (MultimodalInputs.merge) or a new MultimodalInputs (session
    turns), never by editing items in place. A table holds no state of a router's that
    could be wrong for another: its known epoch names one directory (epochs
    are unique per process)."""
    items = mm_input.mm_items
    table = mm_input.__dict__.get(TABLE_ATTRIBUTE)
    if table is None or table.source is not items or table.source_len != len(items):
        table = _build_table(mm_input, items)
    return table


def _build_table(mm_input, items) -> RequestImages:
    """Read a request's image items (offsets, precomputed, content hash, ViT
    grid as the metadata holds it) into the core's table and keep it on the
    request. One loop that reads each item once: the first chunk of every
    image request runs it, so it is written for few instructions per item."""
    image = _IMAGE if _IMAGE is not None else _image_modality()
    rows = []
    precomputed = False
    one_run = True
    for item in items:
        if item is None or item.modality is not image:
            continue
        if item.precomputed_embeddings is not None:
            precomputed = True
        try:
            (start, end), = item.offsets
        except (TypeError, ValueError):  # no offsets, or several runs
            one_run = False  # the whole request takes another path (see RequestImages)
            continue
        data = item.model_specific_data
        # span_of_run(item.hash, start, end, grid), inline
        span = _new_tuple(ChunkSpan, (item.hash, end - start + 1, (data.get("n_vit_h"), data.get("n_vit_w"))))
        rows.append((start, end, span))
    table = RequestImages.from_rows(rows if one_run else (), precomputed, items, len(items))
    mm_input.__dict__[TABLE_ATTRIBUTE] = table
    return table


def _request_tables(mm_inputs) -> Optional[List[Optional[RequestImages]]]:
    """Per request of the batch, its image table (None: a text request), or
    None when no request carries multimodal inputs."""
    tables = [None if mm_input is None else _table_of(mm_input) for mm_input in mm_inputs]
    return tables if any(table is not None for table in tables) else None


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


_MM_SCHEDULE = None


def _mm_schedule():
    global _MM_SCHEDULE
    if _MM_SCHEDULE is None:
        from sglang.srt.managers import mm_schedule

        _MM_SCHEDULE = mm_schedule
    return _MM_SCHEDULE


def _sync_directory_capacity(router: OwnerRouter) -> None:
    """The directory shadows the embedding cache: the same byte budget, read
    from the cache every rank built from the same setting. Read where spans
    are recorded: only recording can overfill the directory."""
    cache = _mm_schedule().embedding_cache
    capacity = int(getattr(cache, "max_size", 0) or 0) if cache is not None else 0
    if capacity != router.directory.capacity_bytes:
        router.directory.capacity_bytes = capacity
        router.directory.record([], 0)  # drop what no longer fits


def route_chunk(model, forward_batch) -> Optional[ChunkRoute]:
    """The route of this input preparation, the same on every rank of the
    group (it reads only batch metadata, settings and the directory). None
    when the chunk embeds no image: no owner path on this model (a router
    exists only beside a vision tower and a group), a decode or verify
    batch, or no request with multimodal inputs."""
    router = getattr(model, "mm_owner_router", None)
    if router is None:
        return None
    mm_inputs = forward_batch.mm_inputs
    if mm_inputs is None:
        return None
    mode = forward_batch.forward_mode
    embeds = _EMBEDS_IN_MODE.get(mode)
    if not (_learn_mode(mode) if embeds is None else embeds):
        return None
    if len(mm_inputs) == 1:  # a chunk of one request, the usual image chunk
        mm_input = mm_inputs[0]
        if mm_input is None:
            return None
        items = mm_input.mm_items
        table = mm_input.__dict__.get(TABLE_ATTRIBUTE)  # _table_of, inline: every chunk
        if table is None or table.source is not items or table.source_len != len(items):
            table = _build_table(mm_input, items)
        route, spans = router.route_request(
            table, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        )
    else:
        tables = _request_tables(mm_inputs)
        if tables is None:
            return None
        route, spans = router.route_requests(
            tables, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        )
    if router.routes[route] == 1 and route is not Route.NO_SPANS:
        # Once per route and router: which paths this deployment actually takes.
        logger.info(
            "[sglang-dsv41] owner-broadcast: first chunk routed '%s' (%d image spans; routes so far %s)",
            route.value,
            len(spans),
            {r.value: n for r, n in router.routes.items() if n},
        )
    if route is _KNOWN:
        return _new_tuple(ChunkRoute, (route, spans, None))  # no Python-level __new__ per chunk
    if route is Route.OWNER:
        session = open_session(model, forward_batch)
    elif route is Route.NOT_WORTH and router.guards_stock_encodes:
        # Every rank encodes its cold spans, as stock does; two status rounds
        # make an encoder failure on one rank the same error on every rank.
        session = open_session(model, forward_batch, local_encode=True)
    else:
        session = None
    return _new_tuple(ChunkRoute, (route, spans, session))


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
    )


def around_prepare_language_model_inputs(original, model, input_ids, forward_batch, *args, **kwargs):
    """AROUND DeepseekV4ForCausalLM.prepare_language_model_inputs: route the
    chunk; the owner route runs inside the session's fence."""
    chunk = route_chunk(model, forward_batch)
    if chunk is None:
        return original(model, input_ids, forward_batch, *args, **kwargs)
    route = chunk.route
    if route is _KNOWN:
        # Stock lookups and no session: the inner hooks have nothing to do
        # (the context variable is unset outside a preparation), and the
        # routing touched the spans already, so nothing follows either.
        return original(model, input_ids, forward_batch, *args, **kwargs)
    token = _active_chunk.set(chunk)
    try:
        if chunk.session is None:
            result = original(model, input_ids, forward_batch, *args, **kwargs)
        else:
            with chunk.session.fence():
                result = original(model, input_ids, forward_batch, *args, **kwargs)
    except OwnerProtocolError:  # the same error on every rank of the group
        plugin_metrics.count_agreement_failure()
        raise
    finally:
        _active_chunk.reset(token)
    if chunk.spans:
        # Reached on every rank or (after an agreed error) on none; a local
        # error on a stock route takes the scheduler down, directory and all.
        router = model.mm_owner_router
        _sync_directory_capacity(router)
        router.completed(chunk.spans)
    return result


def active_chunk() -> Optional[ChunkRoute]:
    return _active_chunk.get()


def active_session() -> Optional[OwnerSession]:
    chunk = _active_chunk.get()
    return None if chunk is None else chunk.session


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
    embedding = model.get_input_embeddings()
    session = active_session()
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
    chunk = _active_chunk.get()
    session = None if chunk is None else chunk.session
    if session is not None and session.engaged and not session.local_encode:
        features = session.resolve(
            collect_span_requests(per_image_requests),
            StaticCacheAdapter(),
            owner_encoder(data_embedding_func, device),
        )
        plugin_metrics.count_encodes_saved(session.spans_received)
        return features
    if chunk is not None and chunk.route is Route.NO_SPANS and not _fallback_warned:
        # The metadata mirror said no span; encoding locally on every rank is
        # what stock sglang does and needs no collective, so it stays safe.
        _fallback_warned = True
        logger.warning(
            "[sglang-dsv41] owner-broadcast: image spans reached the encoder in a chunk "
            "whose batch metadata showed none; encoding them on every rank"
        )
    return original(data_embedding_func, per_image_requests, device)
