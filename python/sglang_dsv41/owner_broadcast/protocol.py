"""Owner-broadcast image embedding for a group of ranks that run the same requests.

Design: docs/design/owner_broadcast.md.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from contextlib import contextmanager, nullcontext
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Union,
)

import msgspec
import torch

from sglang_dsv41.owner_broadcast.routing import balanced_owners
from sglang_dsv41.metrics import count_agreement_round as _count_round

logger = logging.getLogger(__name__)

# (content hash, span length in tokens): the key sglang's per-image path uses
# for its hash -> embedding map.
SpanKey = Tuple[int, int]


# --------------------------------------------------------------------------
# The two interfaces


class OwnerGroup(Protocol):
    """A process group whose members all prepare the same prefill chunk."""

    rank_in_group: int
    world_size: int
    ranks: Sequence[int]  # global rank of each group rank

    def all_gather_object(self, obj: Any) -> List[Any]: ...

    def all_reduce_max(self, values: Sequence[int]) -> List[int]:
        """Elementwise maximum over the group of a short list of int64 values,
        on the group's tensor path (it need not be a CPU collective)."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...


class EmbeddingCache(Protocol):
    """Embeddings keyed by content hash."""

    def get(self, content_hash: int) -> Optional[torch.Tensor]: ...

    def set(self, content_hash: int, span: torch.Tensor) -> bool: ...

    def free(self, content_hash: int) -> None: ...


# --------------------------------------------------------------------------
# Data


class Action(enum.IntEnum):
    LOCAL_HIT = 0  # every rank holds the span: no transfer
    OWNER_CACHE_BROADCAST = 1  # the owner holds it: broadcast from its cache
    OWNER_ENCODE_BROADCAST = 2  # the owner encodes it, then broadcasts


class Phase(str, enum.Enum):
    PREPARE = "prepare"  # input preparation before the owner path
    MANIFEST = "manifest"
    PLAN = "plan"
    ENCODE = "encode"
    RECEIVE_BUFFER = "receive-buffer"
    BROADCAST = "broadcast"
    FEATURES = "features"  # after the spans, before features are ready
    TEXT_EMBEDDING = "text-embedding"
    FINALIZE = "finalize"  # after features are ready, until the fence ends


class SpanRequest(msgspec.Struct):
    """One distinct image span of the chunk, as the scheduling code found it."""

    content_hash: Optional[int]
    span_len: int
    item: Any
    inside_chunk: bool = False  # the whole span lies inside this chunk
    duplicates: List[Any] = msgspec.field(default_factory=list)

    @property
    def key(self) -> SpanKey:
        return (self.content_hash, self.span_len)


class SpanManifestKey(msgspec.Struct, frozen=True, array_like=True):
    content_hash: int
    span_len: int
    geometry: Any
    # Encoder cost estimate (the routing's units) from the span's metadata:
    # the owners are balanced by it. Part of the digest, so ranks that would
    # balance differently disagree on the manifest instead.
    cost: int = 0


class Manifest(msgspec.Struct, frozen=True):
    keys: List[SpanManifestKey]
    cached: List[bool]
    dtype: str
    width: int
    request_ids: List[str]


class Report(msgspec.Struct, frozen=True):
    """What one rank publishes at an agreement: its error, or (at the manifest
    exchange) its manifest."""

    group_rank: int
    error: Optional[str] = None
    manifest: Optional[Manifest] = None


class Plan(msgspec.Struct, frozen=True):
    actions: List[int] = msgspec.field(default_factory=list)
    owners: List[int] = msgspec.field(default_factory=list)

    def transfer_indices(self, owner: int) -> List[int]:
        return [
            index
            for index, (action, span_owner) in enumerate(zip(self.actions, self.owners))
            if action != Action.LOCAL_HIT and span_owner == owner
        ]

    def has_transfers(self) -> bool:
        return any(action != Action.LOCAL_HIT for action in self.actions)


def _token_count(request: SpanRequest) -> int:
    return request.span_len


class OwnerProtocolError(RuntimeError):
    """Raised with the same text on every rank of the group."""


_report_codec = msgspec.msgpack.Decoder(Report)
_encoder = msgspec.msgpack.Encoder()

# The status vector every agreement reduces with MAX.
STATUS_WORDS = 5
_FAILED, _DIGEST, _NEG_DIGEST, _FLAGS, _NEG_FLAGS = range(STATUS_WORDS)
_DIGEST_MODULUS = (1 << 62) - 1  # digests in [1, 2**62): -digest stays in int64
FLAG_BITS = 62  # cache flags carried exactly in the manifest round, as a bit mask


# --------------------------------------------------------------------------
# Pure helpers (unit-tested on their own)


def select_owner_group_kind(
    *, tp_size: int, attn_dp_size: int, attn_cp_size: int, pp_size: int = 1
) -> Optional[str]:
    """Which group replicates the image work: ``"attn_tp"``, ``"attn_cp"``, or None.

    With attention DP each DP group runs its own requests, so replication is
    the attention-TP width. Under CP only the layout where the CP group is the
    whole TP group runs the same requests on every member.
    """
    if pp_size != 1 or attn_dp_size < 1:
        return None
    replication = tp_size // attn_dp_size
    if replication <= 1:
        return None
    if attn_cp_size == 1:
        return "attn_tp"
    if attn_dp_size == 1 and attn_cp_size == tp_size:
        return "attn_cp"
    return None


def canonical_geometry(value: Any) -> Any:
    """A geometry signature as nested tuples of plain values, so that equal
    inputs compare equal on every rank and the manifest can be serialized."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, dict):
        return tuple((str(k), canonical_geometry(v)) for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(canonical_geometry(v) for v in value)
    return repr(value)


def manifest_digest(manifest: Manifest) -> int:
    """62 bits that differ, almost surely, when two ranks' manifests differ in
    anything but their cache flags."""
    payload = _encoder.encode(
        (manifest.request_ids, manifest.keys, manifest.dtype, manifest.width)
    )
    value = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
    return value % _DIGEST_MODULUS + 1


def plan_spans(
    content_hashes: Sequence[int],
    cached_by_rank: Sequence[Sequence[bool]],
    costs: Optional[Sequence[int]] = None,
) -> Plan:
    """The plan for spans every rank agrees on, from each rank's cache flags
    (``cached_by_rank[rank][span]``) and the spans' encoder costs (None: all
    equal). Owners: ``balanced_owners`` (a holder sends a span some rank
    holds; the rest are spread by cost)."""
    world = len(cached_by_rank)
    count = len(content_hashes)
    holders = [[rank for rank in range(world) if cached_by_rank[rank][index]] for index in range(count)]
    owners = balanced_owners([1] * count if costs is None else costs, content_hashes, world, holders)
    actions: List[int] = []
    for index in range(count):
        if len(holders[index]) == world:
            action = Action.LOCAL_HIT
        elif holders[index]:
            action = Action.OWNER_CACHE_BROADCAST
        else:
            action = Action.OWNER_ENCODE_BROADCAST
        actions.append(int(action))
    return Plan(actions=actions, owners=owners)


def make_plan(manifests: Sequence[Manifest]) -> Plan:
    """The plan from every rank's manifest, as group rank 0 would make it.
    Raises ValueError when the ranks disagree on what the chunk contains."""
    if not manifests:
        raise ValueError("no manifests")
    lead = manifests[0]
    for rank, manifest in enumerate(manifests[1:], start=1):
        differences = [
            f"{name}: {getattr(lead, name)!r} vs {getattr(manifest, name)!r}"
            for name in ("request_ids", "keys", "dtype", "width")
            if getattr(lead, name) != getattr(manifest, name)
        ]
        if differences:
            raise ValueError(
                f"group ranks 0 and {rank} disagree on the image spans of this "
                "chunk (" + "; ".join(differences) + ")"
            )
    for rank, manifest in enumerate(manifests):
        if len(manifest.cached) != len(manifest.keys):
            raise ValueError(f"group rank {rank} sent a malformed manifest")
    return plan_spans(
        [key.content_hash for key in lead.keys],
        [manifest.cached for manifest in manifests],
        [key.cost for key in lead.keys],
    )


def split_encoder_output(
    encoded: Union[torch.Tensor, Sequence[torch.Tensor]], span_lens: Sequence[int]
) -> List[torch.Tensor]:
    """One ``[span_len, width]`` tensor per span from a batched encoder call.

    Encoders return either one tensor per item or one tensor holding all spans
    in order (possibly with extra leading dimensions).
    """
    if isinstance(encoded, torch.Tensor):
        flat = encoded.reshape(-1, encoded.shape[-1]) if encoded.dim() != 2 else encoded
        if flat.shape[0] != sum(span_lens):
            raise ValueError(
                f"encoder returned {flat.shape[0]} rows for spans of {list(span_lens)} "
                f"tokens ({sum(span_lens)} rows expected)"
            )
        return list(torch.split(flat, list(span_lens), dim=0))
    if isinstance(encoded, (list, tuple)):
        if len(encoded) != len(span_lens):
            raise ValueError(
                f"encoder returned {len(encoded)} spans for {len(span_lens)} images"
            )
        spans = []
        for span in encoded:
            if not isinstance(span, torch.Tensor):
                raise TypeError(f"encoder returned a {type(span).__name__}, not a tensor")
            spans.append(span.reshape(-1, span.shape[-1]) if span.dim() != 2 else span)
        return spans
    raise TypeError(f"encoder returned a {type(encoded).__name__}, not tensors")


def _same_device(a: torch.device, b: torch.device) -> bool:
    def index(device: torch.device) -> Optional[int]:
        if device.index is None and device.type == "cuda":
            return torch.cuda.current_device()
        return device.index

    return a.type == b.type and index(a) == index(b)


def _default_synchronize(device: torch.device) -> None:
    # Asynchronous device errors must surface before a rank reports success.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _default_allocate(shape: Tuple[int, int], dtype: torch.dtype, device: torch.device):
    return torch.empty(shape, dtype=dtype, device=device)


SpanEncoder = Callable[[List[SpanRequest]], Union[torch.Tensor, Sequence[torch.Tensor]]]
GeometrySignature = Callable[[Any, int], Any]


class _State(enum.Enum):
    AWAIT_MANIFEST = "await-manifest"
    AWAIT_FEATURES_READY = "await-features-ready"
    AWAIT_FENCE_END = "await-fence-end"
    DONE = "done"


# Spans whose items share a key but not a geometry (each reused; logged on the first).
duplicate_geometry_spans = 0


def _warn_if_duplicates_differ(request: SpanRequest, geometry: Any, signature) -> None:
    """Items sharing a span's key (content hash, token count) reuse its one encode, as stock
    sglang's per-image path does, even when their geometry differs: a client may choose
    ``mm_hashes``, and an error here would take the whole group down on one request's word."""
    global duplicate_geometry_spans
    for duplicate in request.duplicates:
        try:
            other = canonical_geometry(signature(duplicate, request.span_len))
        except Exception:  # unreadable is different: it is reused all the same
            other = None
        if other != geometry:
            duplicate_geometry_spans += 1
            if duplicate_geometry_spans == 1:
                logger.warning(
                    "[sglang-dsv41] owner-broadcast: image hash %s (%d tokens) occurs with different "
                    "geometry (%r vs %r): every item of it gets the first one's embedding, as in stock "
                    "sglang (a client or router reusing mm_hashes for different images; said once)",
                    request.content_hash, request.span_len, geometry, other)
            return


# --------------------------------------------------------------------------
# The session


class OwnerSession:
    """The owner protocol for one input preparation of one group.

    ``engaged`` must be decided identically on every rank without communication
    (from host-side batch metadata); a session that is not engaged does nothing.

    Beyond the group: ``device``, ``dtype``, ``width`` (every span is
    ``[span_len, width]``); ``request_ids`` (manifest check, error texts);
    ``signature`` (``(item, span_len) -> geometry``; raising rejects the span);
    ``allocate`` (receive buffers, ``(shape, dtype, device) -> tensor``), entered
    inside ``allocation_context``; ``synchronize`` (waits for the device before a
    rank reports success); ``on_phase`` (a test seam, None in production);
    ``span_cost`` (balances the owners; default: token count); ``local_encode``
    (every rank encodes its own misses, the session only agrees status).
    Design: docs/design/owner_broadcast.md (the session's parameters).
    """

    def __init__(
        self,
        group: OwnerGroup,
        *,
        device: torch.device,
        dtype: torch.dtype,
        width: int,
        request_ids: Sequence[str],
        signature: GeometrySignature,
        engaged: bool = True,
        allocate: Callable[..., torch.Tensor] = _default_allocate,
        allocation_context: Callable[[], ContextManager] = nullcontext,
        synchronize: Callable[[torch.device], None] = _default_synchronize,
        on_phase: Optional[Callable[[Phase], None]] = None,
        local_encode: bool = False,
        span_cost: Optional[Callable[["SpanRequest"], int]] = None,
    ):
        self.group = group
        self.span_cost = _token_count if span_cost is None else span_cost
        self.device = torch.device(device)
        self.dtype = dtype
        self.width = int(width)
        self.request_ids = [str(rid) for rid in request_ids]
        self.signature = signature
        self.engaged = bool(engaged)
        self._allocate = allocate
        self._allocation_context = allocation_context
        self._synchronize = synchronize
        self._on_phase = on_phase
        self.local_encode = bool(local_encode)
        self.phase = Phase.ENCODE if self.local_encode else Phase.PREPARE
        # A local-encode session has no manifest round: its first agreement
        # is features_ready.
        self._state = _State.AWAIT_FEATURES_READY if self.local_encode else _State.AWAIT_MANIFEST
        self._collective_failed = False
        # The text embedding ran without a collective: the fence end also
        # agrees that the features were ready.
        self._text_embedded_locally = False
        # Spans this rank lacked and took from a peer's broadcast instead of
        # encoding them: encodes the owner path saved on this rank.
        self.spans_received = 0

    # -- public protocol steps -------------------------------------------

    def resolve(
        self,
        requests: Sequence[SpanRequest],
        cache: EmbeddingCache,
        encode: SpanEncoder,
    ) -> Dict[SpanKey, torch.Tensor]:
        """Full ``[span_len, width]`` embeddings for every requested span, the
        same bytes on every rank. Each span is encoded at most once in the group."""
        if not self.engaged:
            raise RuntimeError(
                "owner protocol reached for a chunk whose batch metadata shows no image span"
            )
        if self.local_encode:
            raise RuntimeError("owner protocol resolve called on a local-encode session")
        if self._state is not _State.AWAIT_MANIFEST:
            raise RuntimeError(
                f"owner protocol resolved twice in one input preparation (state {self._state.value})"
            )
        with self._allocation_context():
            return self._resolve(list(requests), cache, encode)

    def features_ready(self, error: Optional[BaseException] = None) -> None:
        """Agree that every rank has its image features (and, when ``error`` is
        given, report that this rank has not). Must precede any collective of
        the text embedding."""
        if not self.engaged:
            if error is not None:
                raise error
            return
        text = None if error is None else self._describe(error)
        if text is None:
            text = self._device_error()
        if self._state is _State.AWAIT_FEATURES_READY:
            self._agree(text, cause=error)
            self._state = _State.AWAIT_FENCE_END
            # No fault hook here: peers may already be in the text embedding's
            # collective, where a failure could no longer be agreed.
            self.phase = Phase.FINALIZE
            return
        self._agree_out_of_order(text, cause=error, step="features_ready")

    def embed_text(
        self,
        lookup: Callable[[], torch.Tensor],
        reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """The text embedding with ``features_ready`` agreed in the middle.

        ``lookup`` must not communicate: its failure on any rank is agreed
        together with the features. ``reduce`` (a collective, e.g. the TP
        all-reduce of a vocab-parallel embedding) runs only after that
        agreement, and a failure inside it is not agreed.

        Without ``reduce`` the caller promises that no collective follows
        until the fence ends; the features agreement then rides on the
        fence-end round instead of costing one of its own.
        """
        if not self.engaged:
            partial = lookup()
            return partial if reduce is None else reduce(partial)
        self._enter(Phase.TEXT_EMBEDDING)
        if reduce is None and self._state is _State.AWAIT_FEATURES_READY:
            # A failure here reaches the fence, which agrees it at the round
            # the peers wait in: the fence end.
            embedded = lookup()
            self._text_embedded_locally = True
            self.phase = Phase.FINALIZE
            return embedded
        partial, error = None, None
        try:
            partial = lookup()
        except Exception as exc:  # agreed below, raised on every rank
            error = exc
        self.features_ready(error)
        if reduce is None:
            return partial
        with self.collective():
            return reduce(partial)

    @contextmanager
    def collective(self) -> Iterator[None]:
        """Marks a region in which peers may be inside a collective with us. A
        failure here is never followed by another agreement attempt."""
        try:
            yield
        except BaseException:
            self._collective_failed = True
            raise

    @contextmanager
    def fence(self) -> Iterator["OwnerSession"]:
        """Wraps the whole input preparation. Leaves only after every rank has
        finished it, or with the same error on every rank."""
        if not self.engaged:
            yield self
            return
        try:
            yield self
        except Exception as exc:
            self._fail(exc)
            raise
        self._finish()

    # -- the owner path ----------------------------------------------------

    def _resolve(
        self, requests: List[SpanRequest], cache: EmbeddingCache, encode: SpanEncoder
    ) -> Dict[SpanKey, torch.Tensor]:
        features: Dict[SpanKey, torch.Tensor] = {}
        manifest, digest, error, cause = None, 0, None, None
        try:
            self._enter(Phase.MANIFEST)
            manifest = self._build_manifest(requests, cache, features)
            digest = manifest_digest(manifest)
        except Exception as exc:
            manifest, error, cause = None, self._describe(exc), exc
            features.clear()
        plan = self._manifest_round(manifest, digest, error, cause)
        if plan is None:
            # Fast path: every rank holds every span valid in its own cache.
            self._enter(Phase.FEATURES)
            return features

        self._enter(Phase.PLAN)
        if len(plan.actions) != len(requests) or len(plan.owners) != len(requests):
            raise RuntimeError(
                f"plan covers {len(plan.actions)} spans, this rank has {len(requests)}"
            )
        if not plan.has_transfers():
            self._enter(Phase.FEATURES)
            return features

        payloads: Dict[int, torch.Tensor] = {}
        error, cause = None, None
        try:
            payloads = self._prepare_payloads(requests, plan, features, encode)
            self._synchronize(self.device)
        except Exception as exc:
            error, cause = self._describe(exc), exc
        self._agree(error, cause)

        with self.collective():
            # Nothing may fail between the agreement above and the broadcasts:
            # peers are already inside them.
            self.phase = Phase.BROADCAST
            for owner in sorted(payloads):
                self.group.broadcast(payloads[owner], src=owner)

        self._enter(Phase.FEATURES)
        received: List[Tuple[int, torch.Tensor]] = []
        for owner in sorted(payloads):
            indices = plan.transfer_indices(owner)
            spans = torch.split(payloads[owner], [requests[i].span_len for i in indices])
            received.extend(zip(indices, spans))
        # Only complete spans reach the cache, and only after every broadcast.
        me = self.group.rank_in_group
        for index, span in received:
            request = requests[index]
            if plan.owners[index] != me and request.key not in features:
                self.spans_received += 1  # neither cached here nor encoded here
            features[request.key] = span
            cache.set(request.content_hash, span)
        return features

    # -- local work --------------------------------------------------------

    def _build_manifest(
        self,
        requests: List[SpanRequest],
        cache: EmbeddingCache,
        features: Dict[SpanKey, torch.Tensor],
    ) -> Manifest:
        keys: List[SpanManifestKey] = []
        cached: List[bool] = []
        seen = set()
        for request in requests:
            if request.content_hash is None:
                raise ValueError(f"image span of {request.span_len} tokens has no content hash")
            if request.key in seen:
                raise ValueError(f"image span {request.key} listed twice")
            seen.add(request.key)
            geometry = canonical_geometry(self.signature(request.item, request.span_len))
            _warn_if_duplicates_differ(request, geometry, self.signature)
            keys.append(
                SpanManifestKey(
                    content_hash=request.content_hash,
                    span_len=request.span_len,
                    geometry=geometry,
                    cost=int(self.span_cost(request)),
                )
            )
            span = self._valid_cached_span(cache, request)
            if span is not None:
                features[request.key] = span
            cached.append(span is not None)
        return Manifest(
            keys=keys,
            cached=cached,
            dtype=str(self.dtype),
            width=self.width,
            request_ids=list(self.request_ids),
        )

    def _valid_cached_span(
        self, cache: EmbeddingCache, request: SpanRequest
    ) -> Optional[torch.Tensor]:
        span = cache.get(request.content_hash)
        if span is None:
            return None
        if (
            isinstance(span, torch.Tensor)
            and span.dim() == 2
            and tuple(span.shape) == (request.span_len, self.width)
            and span.dtype == self.dtype
            and _same_device(span.device, self.device)
        ):
            return span
        described = (
            f"{tuple(span.shape)} {span.dtype} on {span.device}"
            if isinstance(span, torch.Tensor)
            else type(span).__name__
        )
        logger.warning(
            "evicting cached image embedding %s that cannot serve a span of "
            "(%d, %d) %s on %s: cached %s",
            request.content_hash,
            request.span_len,
            self.width,
            self.dtype,
            self.device,
            described,
        )
        cache.free(request.content_hash)
        return None

    def _prepare_payloads(
        self,
        requests: List[SpanRequest],
        plan: Plan,
        features: Dict[SpanKey, torch.Tensor],
        encode: SpanEncoder,
    ) -> Dict[int, torch.Tensor]:
        """One contiguous payload per owner that has transfers: the owner's
        spans in plan order on the owner, an empty buffer elsewhere."""
        me = self.group.rank_in_group
        payloads: Dict[int, torch.Tensor] = {}
        for owner in range(self.group.world_size):
            indices = plan.transfer_indices(owner)
            if not indices:
                continue
            if owner == me:
                payloads[owner] = self._owner_payload(requests, plan, indices, features, encode)
                continue
            self._enter(Phase.RECEIVE_BUFFER)
            rows = sum(requests[i].span_len for i in indices)
            shape = (rows, self.width)
            try:
                payloads[owner] = self._allocate(shape, self.dtype, self.device)
            except Exception as exc:
                raise RuntimeError(
                    f"receive buffer {shape} {self.dtype} for the spans of group rank "
                    f"{owner} failed: {type(exc).__name__}: {exc}"
                ) from exc
        return payloads

    def _owner_payload(
        self,
        requests: List[SpanRequest],
        plan: Plan,
        indices: List[int],
        features: Dict[SpanKey, torch.Tensor],
        encode: SpanEncoder,
    ) -> torch.Tensor:
        to_encode = [i for i in indices if plan.actions[i] == Action.OWNER_ENCODE_BROADCAST]
        spans: Dict[int, torch.Tensor] = {}
        for index in indices:
            if plan.actions[index] == Action.OWNER_CACHE_BROADCAST:
                spans[index] = features[requests[index].key]
        encoded_whole = None
        if to_encode:
            self._enter(Phase.ENCODE)
            hashes = [requests[i].content_hash for i in to_encode]
            try:
                encoded = encode([requests[i] for i in to_encode])
                pieces = split_encoder_output(encoded, [requests[i].span_len for i in to_encode])
                for index, piece in zip(to_encode, pieces):
                    spans[index] = self._checked_span(requests[index], piece)
            except Exception as exc:
                raise RuntimeError(
                    f"owner encode of image hashes {hashes} failed: {type(exc).__name__}: {exc}"
                ) from exc
            if len(to_encode) == len(indices) and isinstance(encoded, torch.Tensor):
                encoded_whole = encoded
        if (
            encoded_whole is not None
            and encoded_whole.dtype == self.dtype
            and _same_device(encoded_whole.device, self.device)
            and encoded_whole.is_contiguous()
        ):
            # The encoder already produced the payload in plan order: no copy.
            return encoded_whole.reshape(-1, self.width)
        ordered = [spans[i] for i in indices]
        return ordered[0].contiguous() if len(ordered) == 1 else torch.cat(ordered, dim=0)

    def _checked_span(self, request: SpanRequest, span: torch.Tensor) -> torch.Tensor:
        expected = (request.span_len, self.width)
        if tuple(span.shape) != expected or span.dtype != self.dtype:
            raise ValueError(
                f"encoded span for hash {request.content_hash} is {tuple(span.shape)} "
                f"{span.dtype}; expected {expected} {self.dtype}"
            )
        if not _same_device(span.device, self.device):
            span = span.to(self.device)
        return span

    # -- agreement ---------------------------------------------------------

    def _status_round(self, status: List[int]) -> List[int]:
        with self.collective():
            reduced = [int(v) for v in self.group.all_reduce_max(status)]
        if len(reduced) != STATUS_WORDS:
            # Same on every rank: every rank got the same reduced vector.
            self._state = _State.DONE
            raise OwnerProtocolError(
                f"owner-broadcast status round returned {len(reduced)} values, "
                f"{STATUS_WORDS} expected"
            )
        return reduced

    def _manifest_round(
        self,
        manifest: Optional[Manifest],
        digest: int,
        error: Optional[str],
        cause: Optional[BaseException] = None,
    ) -> Optional[Plan]:
        """The first agreement. Returns None for the fast path (every span
        cached and valid on every rank), else the plan; raises the agreed
        error. Every branch depends only on the reduced vector (and, once the
        digests agree, on the span count, which is then the same everywhere),
        so all ranks take the same one."""
        status = [0] * STATUS_WORDS
        if error is not None or manifest is None:
            status[_FAILED] = 1
        else:
            status[_DIGEST], status[_NEG_DIGEST] = digest, -digest
            if len(manifest.cached) <= FLAG_BITS:
                mask = sum(1 << index for index, cached in enumerate(manifest.cached) if cached)
                status[_FLAGS], status[_NEG_FLAGS] = mask, -mask
        reduced = self._status_round(status)
        self._state = _State.AWAIT_FEATURES_READY
        same_batch = reduced[_DIGEST] == -reduced[_NEG_DIGEST]
        if reduced[_FAILED] != 0 or not same_batch:
            return self._plan_from_reports(manifest, error, cause)
        same_flags = (
            len(manifest.cached) <= FLAG_BITS and reduced[_FLAGS] == -reduced[_NEG_FLAGS]
        )
        if not same_flags:
            return self._flags_round(manifest)
        if all(manifest.cached):
            return None
        cached = [bool(c) for c in manifest.cached]
        return plan_spans(
            [key.content_hash for key in manifest.keys],
            [cached] * self.group.world_size,
            [key.cost for key in manifest.keys],
        )

    def _flags_round(self, manifest: Manifest) -> Plan:
        """Every rank's cache flags: each rank fills its own row of a zero
        ``[world, spans]`` matrix, so the MAX all-reduce is an all-gather."""
        world, me = self.group.world_size, self.group.rank_in_group
        spans = len(manifest.keys)
        flags = [0] * (world * spans)
        flags[me * spans : (me + 1) * spans] = [int(bool(c)) for c in manifest.cached]
        with self.collective():
            gathered = [int(v) for v in self.group.all_reduce_max(flags)]
        cached_by_rank = [
            [bool(v) for v in gathered[rank * spans : (rank + 1) * spans]]
            for rank in range(world)
        ]
        return plan_spans(
            [key.content_hash for key in manifest.keys],
            cached_by_rank,
            [key.cost for key in manifest.keys],
        )

    def _plan_from_reports(
        self,
        manifest: Optional[Manifest],
        error: Optional[str],
        cause: Optional[BaseException],
    ) -> Plan:
        """The detail round of the manifest: the agreed error, or the plan
        every rank computes from the gathered manifests."""
        report = Report(group_rank=self.group.rank_in_group, error=error, manifest=manifest)
        with self.collective():
            gathered = self.group.all_gather_object(_encoder.encode(report))
        plan, agreed = self._plan_or_error(gathered)
        if agreed is not None:
            self._state = _State.DONE
            raise OwnerProtocolError(agreed) from cause
        return plan

    def _plan_or_error(self, gathered: List[bytes]) -> Tuple[Optional[Plan], Optional[str]]:
        """The same on every rank (a function of the gathered bytes only).
        Never raises: a failure becomes the error, worded as group rank 0's."""
        lead_request_ids: List[str] = []
        try:
            reports = [_report_codec.decode(raw) for raw in gathered]
            if reports and reports[0].manifest is not None:
                lead_request_ids = list(reports[0].manifest.request_ids)
            agreed = _first_error(reports, self.group.world_size)
            if agreed is not None:
                return None, agreed
            manifests = []
            for report in reports:
                if report.manifest is None:
                    raise ValueError(f"group rank {report.group_rank} sent no manifest")
                manifests.append(report.manifest)
            return make_plan(manifests), None
        except Exception as exc:
            return None, self._describe(
                exc, phase=Phase.PLAN, group_rank=0, request_ids=lead_request_ids
            )

    def _agree(self, error: Optional[str], cause: Optional[BaseException] = None) -> None:
        """One status round: returns if no rank failed, else gathers the
        reports and raises the first reported error on every rank."""
        status = [0] * STATUS_WORDS
        status[_FAILED] = int(error is not None)
        reduced = self._status_round(status)
        if reduced[_FAILED] == 0:
            return
        report = Report(group_rank=self.group.rank_in_group, error=error)
        with self.collective():
            gathered = self.group.all_gather_object(_encoder.encode(report))
        self._state = _State.DONE
        try:
            agreed = _first_error(
                [_report_codec.decode(raw) for raw in gathered], self.group.world_size
            )
        except Exception as exc:
            agreed = f"owner-broadcast embedding failed: unreadable status reports ({exc})"
        if agreed is None:
            agreed = "owner-broadcast embedding failed: a status round showed a failure no rank reported"
        raise OwnerProtocolError(agreed) from cause

    def _agree_out_of_order(
        self, text: Optional[str], *, cause: Optional[BaseException], step: str
    ) -> None:
        """A step reached in the wrong state. Peers that followed the protocol
        wait in a status round; take part in it with an error so that every
        rank stops with the same text."""
        if text is None:
            text = self._describe(
                RuntimeError(f"{step} reached in protocol state {self._state.value}")
            )
        if self._state is _State.AWAIT_MANIFEST:
            self._manifest_round(None, 0, text, cause)  # raises: a failure is reported
        if self._state is _State.DONE:
            raise RuntimeError(f"owner protocol {step} after the session ended")
        self._agree(text, cause=cause)
        raise AssertionError("unreachable: an agreement on an error always raises")

    def _finish(self) -> None:
        if self._state is _State.AWAIT_FENCE_END or (
            self._state is _State.AWAIT_FEATURES_READY and self._text_embedded_locally
        ):
            self._agree(self._device_error())
            self._state = _State.DONE
            return
        if self._state is _State.DONE:
            return
        missing = (
            "no image span reached the owner path although the batch metadata shows one"
            if self._state is _State.AWAIT_MANIFEST
            else "the input preparation ended before its image features were marked ready"
        )
        self._agree_out_of_order(self._describe(RuntimeError(missing)), cause=None, step="fence end")

    def _fail(self, exc: BaseException) -> None:
        """A local failure inside the fence: agree on it unless that is unsafe."""
        if (
            isinstance(exc, OwnerProtocolError)
            or self._collective_failed
            or self._state is _State.DONE
        ):
            self._state = _State.DONE
            return
        text = self._describe(exc)
        if self._state is _State.AWAIT_MANIFEST:
            self._manifest_round(None, 0, text, exc)  # raises: a failure is reported
        self._agree(text, cause=exc)

    # -- text --------------------------------------------------------------

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        if self._on_phase is not None:
            self._on_phase(phase)

    def _device_error(self) -> Optional[str]:
        try:
            self._synchronize(self.device)
        except Exception as exc:
            return self._describe(exc)
        return None

    def _describe(
        self,
        exc: BaseException,
        *,
        phase: Optional[Phase] = None,
        group_rank: Optional[int] = None,
        request_ids: Optional[Sequence[str]] = None,
    ) -> str:
        """The error text; by default for this rank in its current phase."""
        group = self.group
        rank = group.rank_in_group if group_rank is None else group_rank
        try:
            global_rank = group.ranks[rank]
        except Exception:
            global_rank = "?"
        phase = self.phase if phase is None else phase
        request_ids = self.request_ids if request_ids is None else list(request_ids)
        return (
            f"owner-broadcast embedding failed in phase '{phase.value}' on group "
            f"rank {rank} (global rank {global_rank}) for requests {request_ids}: "
            f"{type(exc).__name__}: {exc}"
        )


def _first_error(reports: Sequence[Report], world_size: int) -> Optional[str]:
    failed = sorted((r for r in reports if r.error is not None), key=lambda r: r.group_rank)
    if not failed:
        return None
    text = failed[0].error
    if len(failed) > 1:
        others = [r.group_rank for r in failed[1:]]
        text += f" [group ranks {others} of {world_size} also failed]"
    return text


# --------------------------------------------------------------------------
# A plain torch.distributed implementation of OwnerGroup


class TorchDistributedGroup:
    """``OwnerGroup`` over torch.distributed: objects travel on ``object_group``
    (gloo), tensors and status rounds on ``tensor_group`` (gloo on CPU, NCCL on
    GPU)."""

    def __init__(self, tensor_group=None, object_group=None):
        import torch.distributed as dist

        self._dist = dist
        self.tensor_group = tensor_group
        self.object_group = object_group if object_group is not None else tensor_group
        self.ranks = list(dist.get_process_group_ranks(self.tensor_group or dist.group.WORLD))
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(dist.get_rank())
        backend = str(dist.get_backend(self.tensor_group or dist.group.WORLD)).lower()
        self._status_device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    def all_gather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.object_group)
        return out

    def all_reduce_max(self, values: Sequence[int]) -> List[int]:
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._status_device)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self.tensor_group)
        return tensor.tolist()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._dist.broadcast(tensor, src=self.ranks[src], group=self.tensor_group)
        return tensor


class CoordinatorGroup:
    """``OwnerGroup`` over a group coordinator shaped like sglang's
    ``GroupCoordinator`` (``rank_in_group``, ``world_size``, ``ranks``,
    ``device``, ``device_group``, ``all_gather_object``, ``broadcast``):
    objects (only after a failure) go over its gloo CPU group; span
    broadcasts over its device group (pynccl when enabled); status rounds are
    a MAX all-reduce of a few int64 words on the device group (NCCL on GPUs),
    next to the broadcasts' own communicator. The coordinator's own
    ``all_reduce`` is not used for them: sglang's only sums, and routes
    through custom all-reduce kernels sized for activations."""

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
