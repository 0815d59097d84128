"""Image chunks of a group's input preparation: from the batch objects to a route and a session.

Design: docs/design/owner_broadcast.md.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang_dsv41 import metrics
from sglang_dsv41.owner_broadcast.protocol import (
    OwnerProtocolError,
    OwnerSession,
    SpanRequest,
    select_owner_group_kind,
)
from sglang_dsv41.owner_broadcast.routing import (
    ENV_MODE,
    ChunkSpan,
    OwnerRouter,
    RequestImages,
    Route,
    RoutingPolicy,
)

logger = logging.getLogger(__name__)

_new_tuple = tuple.__new__
_KNOWN = Route.KNOWN  # a module global: one lookup on every chunk

# Where a request's image table lives: in the instance dict of its
# MultimodalInputs, so it is found with one lookup on every later chunk and
# leaves with the request (no registry of ours holds a request alive or has
# to learn that it died). The adapter checks at model build that the class
# keeps an instance dict; a test pins it.
TABLE_ATTRIBUTE = "_sglang_dsv41_image_table"


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


def active_chunk() -> Optional[ChunkRoute]:
    return _active_chunk.get()


def active_session() -> Optional[OwnerSession]:
    chunk = _active_chunk.get()
    return None if chunk is None else chunk.session


# --------------------------------------------------------------------------
# What the engine adapter provides


# (model, forward_batch, local_encode) -> OwnerSession
SessionOpener = Callable[[Any, Any, bool], OwnerSession]

_open_session: Optional[SessionOpener] = None
_image_modality_of_engine: Optional[Callable[[], Any]] = None
_IMAGE = None  # the engine's image modality value, resolved on first use


def connect(open_session: SessionOpener, image_modality: Callable[[], Any]) -> None:
    """Hand in the engine's session opener and a resolver of its image
    modality value (called once, when the first table is built)."""
    global _open_session, _image_modality_of_engine, _IMAGE
    _open_session = open_session
    _image_modality_of_engine = image_modality
    _IMAGE = None


def _image_modality():
    global _IMAGE
    if _image_modality_of_engine is None:
        raise RuntimeError("owner chunks: no engine adapter connected (owner_broadcast.chunks.connect)")
    _IMAGE = _image_modality_of_engine()
    return _IMAGE


def open_session(model, forward_batch, local_encode: bool = False) -> OwnerSession:
    if _open_session is None:
        raise RuntimeError("owner chunks: no engine adapter connected (owner_broadcast.chunks.connect)")
    return _open_session(model, forward_batch, local_encode)


# --------------------------------------------------------------------------
# Per-request tables


def table_of(mm_input) -> RequestImages:
    """A request's image table: built at admission (or else on its first
    chunk) and reused while its item list is the same object of the same
    length. Once a request is scheduled, sglang 0.5.23 adds media by building
    a new list (MultimodalInputs.merge) or a new MultimodalInputs (session
    turns), never by editing items in place. A table holds no state of a
    router's that could be wrong for another: its known epoch names one
    directory (epochs are unique per process)."""
    items = mm_input.mm_items
    table = mm_input.__dict__.get(TABLE_ATTRIBUTE)
    if table is None or table.source is not items or table.source_len != len(items):
        table = build_table(mm_input, items)
    return table


def build_table(mm_input, items) -> RequestImages:
    """Read a request's image items (offsets, precomputed, content hash, ViT
    grid as the metadata holds it) into the routing's table and keep it on the
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


def request_tables(mm_inputs) -> Optional[List[Optional[RequestImages]]]:
    """Per request of the batch, its image table (None: a text request), or
    None when no request carries multimodal inputs."""
    tables = [None if mm_input is None else table_of(mm_input) for mm_input in mm_inputs]
    return tables if any(table is not None for table in tables) else None


# --------------------------------------------------------------------------
# Routing a chunk


# Per forward mode, whether the model's input preparation embeds images in
# it (not in decode or target-verify), from the mode's own predicates: one
# dict lookup per chunk instead of two method calls.
_EMBEDS_IN_MODE: dict = {}


def _learn_mode(mode) -> bool:
    embeds = _EMBEDS_IN_MODE[mode] = not mode.is_decode() and not mode.is_target_verify()
    return embeds


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
        table = mm_input.__dict__.get(TABLE_ATTRIBUTE)  # table_of, inline: every chunk
        if table is None or table.source is not items or table.source_len != len(items):
            table = build_table(mm_input, items)
        route, spans = router.route_request(
            table, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        )
    else:
        tables = request_tables(mm_inputs)
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


def span_cost(per_image_cost: int) -> Callable[[SpanRequest], int]:
    """A session's span cost, in the routing's units: the per-image cost plus
    the ViT patches of the span's item (its grid as the metadata holds it),
    so the protocol balances its owners by what the routing estimated."""

    def cost(request: SpanRequest) -> int:
        data = request.item.model_specific_data
        grid = (data.get("n_vit_h"), data.get("n_vit_w"))
        return per_image_cost + _new_tuple(ChunkSpan, (request.content_hash, request.span_len, grid)).patches

    return cost


def sync_directory_capacity(router: OwnerRouter, capacity_bytes: int) -> None:
    """The directory shadows the embedding cache: the same byte budget, read
    from the cache every rank built from the same setting. Read where spans
    are recorded: only recording can overfill the directory."""
    if capacity_bytes != router.directory.capacity_bytes:
        router.directory.capacity_bytes = capacity_bytes
        router.directory.record([], 0)  # drop what no longer fits


def prepare_routed_chunk(chunk: ChunkRoute, router: OwnerRouter, prepare: Callable[[], Any],
                         cache_capacity: Callable[[], int]) -> Any:
    """Run the engine's input preparation (``prepare``) for a chunk routed
    anything but ``known``: with the chunk active for the inner call sites,
    inside its session's fence when it has one, then record its spans (the
    directory's budget read from ``cache_capacity``)."""
    token = _active_chunk.set(chunk)
    try:
        if chunk.session is None:
            result = prepare()
        else:
            with chunk.session.fence():
                result = prepare()
    except OwnerProtocolError:  # the same error on every rank of the group
        metrics.count_agreement_failure()
        raise
    finally:
        _active_chunk.reset(token)
    if chunk.spans:
        # Reached on every rank or (after an agreed error) on none; a local
        # error on a stock route takes the scheduler down, directory and all.
        sync_directory_capacity(router, cache_capacity())
        router.completed(chunk.spans)
    return result


def owner_group_decision(policy: Optional[RoutingPolicy], batched_per_image: bool,
                         parallel: Callable[[], Any]) -> Tuple[Any, str]:
    """Whether a vision model gets the owner path: the coordinator of the
    group that replicates its image work (or None) and the decision in
    words, logged once per process. ``policy``: from the environment (None:
    switched off); ``batched_per_image``: whether the platform encodes
    through the batched per-image path the protocol hooks; ``parallel``: the
    engine's parallel layout, read only when the rest allows the owner path."""
    if policy is None:
        coordinator, decision = None, f"off ({ENV_MODE}=0)"
    elif not batched_per_image:
        coordinator, decision = None, "off (this platform does not use the batched per-image encode)"
    else:
        coordinator, decision = replicating_coordinator(parallel())
        if coordinator is not None:
            decision = f"{decision}; routing {describe_routing(policy)}"
    global _decision_logged
    if not _decision_logged:
        _decision_logged = True
        logger.info("[sglang-dsv41] owner-broadcast embedding: %s (pid %d)", decision, os.getpid())
    return coordinator, decision


_decision_logged = False


def replicating_coordinator(parallel) -> Tuple[Any, str]:
    """The coordinator of the group whose members all prepare the same
    chunk, from the engine's parallel layout (``tp_size``, ``attn_dp_size``,
    ``attn_cp_size``, ``pp_group``, ``attn_tp_group``, ``attn_cp_group``),
    and the decision in words; (None, why not) when no group does."""
    kind = select_owner_group_kind(
        tp_size=parallel.tp_size,
        attn_dp_size=parallel.attn_dp_size,
        attn_cp_size=parallel.attn_cp_size,
        pp_size=parallel.pp_group.world_size,
    )
    if kind is None:
        return None, (
            f"off (no group replicates image work: tp={parallel.tp_size} "
            f"attn_dp={parallel.attn_dp_size} attn_cp={parallel.attn_cp_size})"
        )
    coordinator = parallel.attn_tp_group if kind == "attn_tp" else parallel.attn_cp_group
    replication = parallel.tp_size // parallel.attn_dp_size
    if coordinator is None or coordinator.world_size != replication:
        return None, (
            f"off ({kind} group has {getattr(coordinator, 'world_size', None)} ranks, "
            f"{replication} replicate the work)"
        )
    return coordinator, f"on over the {kind} group ({coordinator.world_size} ranks)"


def describe_routing(policy: RoutingPolicy) -> str:
    """The routing rule of a policy, as the model build logs it."""
    costs = (
        f"protocol when it saves >= {policy.min_saving} patch-equivalents "
        f"(image = {policy.per_image_cost} + its patches), stock for known spans"
    )
    if policy.mode == "always":
        return "every image chunk through the protocol"
    if policy.mode == "guarded":
        return f"guarded: {costs}, stock encodes in a status-only session"
    return f"auto: {costs}"


# --------------------------------------------------------------------------
# Per-image encode


def collect_span_requests(per_image_requests, item_overlap: Callable[[Any, int, int], Optional[int]]
                          ) -> List[SpanRequest]:
    """The distinct image spans that overlap this chunk, in first-seen order.

    ``per_image_requests``: the engine's per-request records of the per-image
    path (``extend_prefix_len``, ``extend_seq_len``, ``items``);
    ``item_overlap(item, chunk_start, chunk_end)``: the engine's count of an
    item's tokens inside the chunk (None: none). Also fills each record's
    ``overlapping`` list in sglang 0.5.23's format ``(index, item,
    token_count)``, which the chunk assembly reads afterwards.
    """
    spans: dict = {}
    for req_info in per_image_requests:
        chunk_start = req_info.extend_prefix_len
        chunk_end = chunk_start + req_info.extend_seq_len
        overlapping = []
        if req_info.extend_seq_len > 0:
            for index, item in enumerate(req_info.items):
                token_count = item_overlap(item, chunk_start, chunk_end)
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


def owner_encoder(data_embedding_func, device, move_items_to_device, borrow_key: str):
    """Encodes an owner's spans the way the engine encodes cache misses:
    items whose whole span lies in the chunk may borrow their CUDA IPC
    feature (``borrow_key`` in their model data), then they move to the
    device (``move_items_to_device(items, device, data_embedding_func)``)
    and go through ``data_embedding_func`` in one call."""

    def encode(requests: List[SpanRequest]):
        items = [request.item for request in requests]
        for request in requests:
            if request.inside_chunk and request.item.can_defer_cuda_ipc_feature_reconstruction():
                request.item.model_specific_data[borrow_key] = True
        move_items_to_device(items, device, data_embedding_func)
        return data_embedding_func(items)

    return encode


def warn_once_if_unrouted(chunk: Optional[ChunkRoute]) -> None:
    """Spans reached the encoder in a chunk whose batch metadata showed none:
    encoding them on every rank is what stock sglang does and needs no
    collective, so it stays safe; say so once per process."""
    global _unrouted_warned
    if chunk is not None and chunk.route is Route.NO_SPANS and not _unrouted_warned:
        _unrouted_warned = True
        logger.warning(
            "[sglang-dsv41] owner-broadcast: image spans reached the encoder in a chunk "
            "whose batch metadata showed none; encoding them on every rank"
        )


_unrouted_warned = False


# --------------------------------------------------------------------------
# Text embedding


def chunk_text_embedding(embedding):
    """The text embedding for the engine's multimodal embedding step: the
    agreed one while a chunk's session is engaged, else ``embedding``."""
    session = active_session()
    if session is not None and session.engaged:
        return AgreedTextEmbedding(session, embedding)
    return embedding


def span_geometry(item, span_len: int, ratio: int, token_types: Callable[[int, int], Sequence[Any]],
                  plan: Any) -> Tuple[int, int, Any]:
    """What makes two items with one content hash the same span: the ViT grid
    (``item.n_vit_h`` x ``item.n_vit_w``) and the preprocessing ``plan``. A
    grid whose token layout (``token_types`` of the grid downsampled by
    ``ratio``) cannot yield ``span_len`` tokens is rejected here, before any
    rank encodes it."""
    height, width = int(item.n_vit_h), int(item.n_vit_w)
    expected = len(token_types(-(-height // ratio), -(-width // ratio)))
    if expected != span_len:
        raise ValueError(
            f"image grid {(height, width)} yields {expected} span tokens, "
            f"the placeholder has {span_len}"
        )
    return (height, width, plan)


class AgreedTextEmbedding:
    """Stands in for the model's text embedding inside the engine's
    multimodal embedding step.

    A vocab-parallel embedding is a local lookup followed by a TP all-reduce.
    The lookup runs first and its failure is agreed together with
    ``features_ready``; then the real module runs with its local lookup
    answered from that result, so the engine's own reduce logic decides
    whether and over which group to all-reduce. A vocab-parallel embedding of
    one shard (``tp_size == 1``, as DeepSeek-V4 builds it under attention DP)
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
