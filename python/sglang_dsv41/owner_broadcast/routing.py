"""Which image chunks take the owner protocol, decided without communication.

Design: docs/design/owner_broadcast.md.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import operator
from collections import OrderedDict
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import msgspec

ENV_MODE = "SGLANG_DSV41_OWNER_BROADCAST"
ENV_PER_IMAGE_COST = "SGLANG_DSV41_OWNER_PER_IMAGE_COST"
ENV_MIN_SAVING = "SGLANG_DSV41_OWNER_MIN_SAVING"

# Defaults, in patch-equivalents (the encoder cost of one ViT patch). On the
# H200 with a V4.1-shaped tower (benchmarks/owner_broadcast/owner_embedding.py) an image costs
# about 4.7 ms before its first patch and 0.9 us per patch, so one image is
# worth about 5,000 patches; 4,096 keeps the estimate on the low side. The
# protocol on two NCCL ranks costs about 1 ms per chunk (~1,100 patches);
# the owner path is taken only when it saves at least 4,096 (~3.6 ms), so
# that misestimates of either term do not make it the slower choice.
DEFAULT_PER_IMAGE_COST = 4096
DEFAULT_MIN_SAVING = 4096

MODES = ("auto", "guarded", "always")

_EPOCHS = itertools.count()  # SpanDirectory epochs, unique in the process

_content_hash_of = operator.itemgetter(0)  # of a ChunkSpan
_start_of = operator.itemgetter(0)  # of a table row (start, end, span)
_end_of = operator.itemgetter(1)
_span_of = operator.itemgetter(2)

# (content hash, span length in tokens, ViT grid): what identifies a span.
DirectoryKey = Tuple[Optional[int], int, Tuple[object, ...]]

# NamedTuple construction runs a Python-level __new__; on the per-chunk path
# the tuple constructor is called directly (same object, a third of the cost).
_new_tuple = tuple.__new__
_new_object = object.__new__


class Route(str, enum.Enum):
    NO_SPANS = "no-spans"  # the per-image path sees no span in this chunk
    KNOWN = "known"  # every span is in the directory: local lookups only
    NOT_WORTH = "not-worth"  # the owner path would not save encoder time: every rank encodes
    OWNER = "owner"  # the owner protocol


_KNOWN = Route.KNOWN  # a module global: one lookup on every known chunk


class ChunkSpan(NamedTuple):
    """One distinct image span of a chunk, from host-side metadata. The tuple
    is its own directory key (routing runs on every chunk, including full hits
    that stock serves in microseconds, so nothing is built twice)."""

    content_hash: Optional[int]
    span_len: int
    # The item's ViT patch grid as its metadata holds it (part of the key:
    # every rank reads the same metadata, so whatever it holds, a missing
    # side included, keys the span the same way on every rank).
    grid: Tuple[object, ...] = ()

    @property
    def key(self) -> "ChunkSpan":
        return self

    @property
    def patches(self) -> int:
        """The encoder work estimate: the grid's patches when every side is
        a whole number, else the span's tokens (the next best proxy)."""
        if not self.grid:
            return self.span_len
        count = 1
        try:
            for side in self.grid:
                count *= max(int(side), 0)
        except (TypeError, ValueError):
            return self.span_len
        return count


def span_of_run(content_hash: Optional[int], start: int, end: int, grid: Tuple[object, ...]) -> ChunkSpan:
    """The span of an item whose only run covers tokens start..end (sglang's
    offsets are inclusive). Callers that read items in a loop of their own
    inline this expression (a call per item is a measurable share of a new
    request's first chunk); the table tests hold them to it."""
    return _new_tuple(ChunkSpan, (content_hash, end - start + 1, grid))


class ItemMeta(NamedTuple):
    """The host-side facts about one image item that the routing needs
    (``grid``: as the item's metadata holds it, see ChunkSpan)."""

    offsets: Sequence[Tuple[int, int]]
    precomputed: bool = False
    content_hash: Optional[int] = None
    grid: Tuple[object, ...] = ()


class RequestImages:
    """One request's image items in the form the routing reads on every chunk,
    built once per request: the scheduler's metadata for a request (offsets,
    content hashes, grids) is fixed once the request is scheduled, so chunks
    after the first cost a lookup instead of a pass over every item.

    ``known_epoch`` caches "every span of this request was in the directory"
    together with the directory's eviction epoch at which that held: until the
    directory evicts anything, it still holds, and a chunk of this request
    routes ``known`` without a lookup per span.
    """

    __slots__ = (
        "precomputed", "items", "spans", "all_keys", "max_start", "min_end", "known_epoch",
        "source", "source_len", "__weakref__",
    )

    def __init__(self, items: Sequence[ItemMeta], source: object = None, source_len: int = 0):
        # ``source``, ``source_len``: what the table was built from, for the
        # caller to check that it is still the same (the scheduler's item
        # list and its length).
        rows = []
        precomputed = False
        one_run = True
        for offsets, item_precomputed, content_hash, grid in items:
            if item_precomputed:
                precomputed = True
            if len(offsets) != 1:
                one_run = False  # a multi-run item: the whole request takes another path
                continue
            (start, end), = offsets
            rows.append((start, end, span_of_run(content_hash, start, end, grid)))
        self._fill(rows if one_run else (), precomputed, source, source_len)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Tuple[int, int, ChunkSpan]],
        precomputed: bool,
        source: object = None,
        source_len: int = 0,
    ) -> "RequestImages":
        """The table of a request whose items the caller has read itself:
        ``rows`` holds (start, end, ``span_of_run(...)``) per image item in
        item order, or nothing when an item has several runs (or none);
        ``precomputed``: whether any item carries precomputed embeddings.
        The same table as ``RequestImages`` of the items' ``ItemMeta``, with
        no Python step per item beyond the caller's own read."""
        table = _new_object(cls)
        table._fill(rows, precomputed, source, source_len)
        return table

    def _fill(self, rows, precomputed, source, source_len) -> None:
        self.source = source
        self.source_len = source_len
        self.known_epoch = -1
        self.precomputed = bool(precomputed)
        self.items = tuple(rows)
        if len(rows) == 1:  # most image requests
            (start, end, span), = rows
            self.spans = self.all_keys = (span,)
            self.max_start = start
            self.min_end = end
            return
        spans = tuple(map(_span_of, rows))
        if len(set(map(_content_hash_of, spans))) == len(spans):
            # Distinct content hashes (the usual request): every span is its
            # own key and stands for itself. One pass over plain ints.
            self.spans = self.all_keys = spans
        else:
            # Every directory key a chunk of this request can name: a chunk
            # that covers only some items may pick another item's grid for a
            # (hash, length) than the whole request does.
            self.all_keys = tuple(dict.fromkeys(spans))
            self.spans = tuple(_first_per_hash_and_length(spans))
        self.max_start = max(map(_start_of, rows), default=0)
        self.min_end = min(map(_end_of, rows), default=0)

    def spans_in(self, chunk_start: int, chunk_end: int) -> Sequence[ChunkSpan]:
        """The distinct spans overlapping tokens [chunk_start, chunk_end) in
        first-seen order (item offsets are inclusive)."""
        if self.min_end >= chunk_start and self.max_start < chunk_end:
            return self.spans  # the chunk overlaps every item
        return _first_per_hash_and_length(
            span for start, end, span in self.items if end >= chunk_start and start < chunk_end
        )


def _first_per_hash_and_length(spans: Iterable[ChunkSpan]) -> List[ChunkSpan]:
    """sglang's per-image path treats items with one content hash and span
    length as one span; the first one seen stands for them."""
    first: Dict[Tuple[Optional[int], int], ChunkSpan] = {}
    for span in spans:
        dedup = (span[0], span[1])
        if dedup not in first:
            first[dedup] = span
    return list(first.values())


def gather_spans(
    requests: Sequence[Optional[RequestImages]],
    extend_prefix_lens: Sequence[int],
    extend_seq_lens: Sequence[int],
) -> Tuple[List[ChunkSpan], List[RequestImages]]:
    """The distinct spans sglang's per-image path will find in this chunk, in
    first-seen order, deduplicated by (content hash, span length) as that path
    does, and the requests that contributed them.

    Mirrors the scheduling code: items with precomputed embeddings send the
    whole batch another way, a request whose items have several runs takes the
    whole-request path, and an item counts only when its span overlaps the
    tokens this chunk extends.
    """
    parts = []
    contributors = []
    # One pass (this runs on every image chunk); a request without both
    # lengths extends nothing, but its precomputed items still count.
    for table, chunk_start, extend_len in zip(requests, extend_prefix_lens, extend_seq_lens):
        if table is None:
            continue
        if table.precomputed:
            return [], []  # one precomputed item sends the whole batch another way
        if extend_len <= 0 or not table.items:
            continue
        chunk_end = chunk_start + extend_len
        if table.min_end >= chunk_start and table.max_start < chunk_end:
            found = table.spans  # the chunk overlaps every item
        else:
            found = table.spans_in(chunk_start, chunk_end)
            if not found:
                continue
        parts.append(found)
        contributors.append(table)
    paired = min(len(extend_prefix_lens), len(extend_seq_lens))
    if len(requests) > paired:
        for table in requests[paired:]:
            if table is not None and table.precomputed:
                return [], []
    if len(parts) == 1:
        return list(parts[0]), contributors
    return _first_per_hash_and_length(span for found in parts for span in found), contributors


class SpanDirectory:
    """The spans this group completed recently, least recently used first,
    bounded in bytes like the embedding cache it shadows.

    Every rank applies the same ``record`` calls in the same order, so every
    rank holds the same directory; nothing local (cache hits, allocation
    results, timing) ever enters it.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = max(int(capacity_bytes), 0)
        self._entries: "OrderedDict[DirectoryKey, int]" = OrderedDict()
        self.bytes = 0
        # Changes whenever an entry leaves. Entries only leave by eviction, so
        # a set of spans found known at epoch E is still known while the epoch
        # is E (what RequestImages.known_epoch relies on). Epochs come from one
        # process-wide count, so no two directories ever share one: a table
        # remembered as known by one directory never reads as known to another.
        self.epoch = next(_EPOCHS)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: DirectoryKey) -> bool:
        return key in self._entries

    def touch(self, spans: Sequence[ChunkSpan]) -> None:
        """Mark spans the directory holds as just used, in order (what the
        embedding cache's lookups do to its own LRU order)."""
        # any() runs the loop in C; move_to_end returns None, so it visits all.
        any(map(self._entries.move_to_end, spans))

    def record(self, spans: Sequence[ChunkSpan], row_bytes: int) -> None:
        """The group completed these spans (in this order; a span of n tokens
        takes n * ``row_bytes``): touch or add each, then drop the least
        recently used until the bytes fit."""
        entries = self._entries
        touch = entries.move_to_end
        for span in spans:  # a span is its own key
            if span in entries:
                touch(span)
                continue
            size = span.span_len * row_bytes
            if span.content_hash is None or size > self.capacity_bytes:
                continue  # never cached under a hash, or too big for the cache
            entries[span] = size
            self.bytes += size
        if self.bytes > self.capacity_bytes and entries:
            self.epoch = next(_EPOCHS)
            while self.bytes > self.capacity_bytes and entries:
                _key, size = entries.popitem(last=False)
                self.bytes -= size

    def digest(self) -> str:
        """A short fingerprint of the contents and their order (diagnostics
        and tests: equal on every rank of a group)."""
        text = repr(list(self._entries.items())).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()


class RoutingPolicy(msgspec.Struct, frozen=True):
    """``mode``: "guarded" (the default) routes each chunk by the rules
    above and runs ``not-worth`` chunks in a status-only session; "auto"
    routes the same way without that session; "always" sends every chunk with
    an image span through the protocol (the agreement guards every chunk, at
    its cost). Costs are in patch-equivalents."""

    mode: str = "guarded"
    per_image_cost: int = DEFAULT_PER_IMAGE_COST
    min_saving: int = DEFAULT_MIN_SAVING

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"routing mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.per_image_cost < 0 or self.min_saving < 0:
            raise ValueError("routing costs must be >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Optional["RoutingPolicy"]:
        """The policy the environment asks for, or None when the owner path is
        switched off. Raises ValueError naming the variable on a bad value."""
        raw = environ.get(ENV_MODE, "").strip().lower()
        if raw in ("0", "false", "off", "no"):
            return None
        if raw in ("", "1", "true", "on", "yes", "guarded"):
            mode = "guarded"
        elif raw in ("auto", "always"):
            mode = raw
        else:
            raise ValueError(f"{ENV_MODE}={environ[ENV_MODE]!r}: expected 0, 1, auto, guarded or always")
        costs = {}
        for name, field, default in (
            (ENV_PER_IMAGE_COST, "per_image_cost", DEFAULT_PER_IMAGE_COST),
            (ENV_MIN_SAVING, "min_saving", DEFAULT_MIN_SAVING),
        ):
            text = environ.get(name, "").strip()
            try:
                costs[field] = int(text) if text else default
            except ValueError:
                raise ValueError(f"{name}={text!r}: expected a whole number of patches") from None
            if costs[field] < 0:
                raise ValueError(f"{name}={text!r}: expected a number >= 0")
        return cls(mode=mode, **costs)


def owner_of(content_hash: int, world_size: int) -> int:
    """Ownership by content hash mod group size: the first rule, kept as the
    baseline the balanced rule is measured against."""
    return content_hash % world_size


def balanced_owners(
    costs: Sequence[int],
    content_hashes: Sequence[Optional[int]],
    world_size: int,
    holders: Optional[Sequence[Sequence[int]]] = None,
) -> List[int]:
    """The group rank that provides each span, from what every rank holds
    identically (the spans' costs and hashes, and, in the protocol's plan,
    the agreed cache flags), so every rank computes the same owners.

    Spans no rank holds (``holders[i]`` empty, or no ``holders``) are
    encoded: longest first (cost descending, then content hash, then
    position), each to the rank with the least encoder work so far, ties to
    the rank with fewer spans sent, then the lower rank id. Spans some rank
    holds cost no encode: each goes to the holder with the least work, then
    fewest spans sent, then lowest id (spreading the broadcasts; a span every
    rank holds is sent by nobody and counts for no one).
    """
    count = len(costs)
    owners = [0] * count
    if world_size <= 1:
        return owners
    loads = [0] * world_size
    spans = [0] * world_size
    ranks = range(world_size)
    held = []
    cold = []
    for index in range(count):
        if holders is not None and holders[index]:
            held.append(index)
        else:
            content_hash = content_hashes[index]
            cold.append((-costs[index], content_hash is None, content_hash or 0, index))
    cold.sort()
    for negative_cost, _hashless, _hash, index in cold:
        rank = min(ranks, key=lambda r: (loads[r], spans[r], r))
        owners[index] = rank
        loads[rank] -= negative_cost
        spans[rank] += 1
    for index in held:
        rank = min(holders[index], key=lambda r: (loads[r], spans[r], r))
        owners[index] = rank
        if len(holders[index]) < world_size:  # held everywhere: nothing is sent
            spans[rank] += 1
    return owners


def owner_loads(costs: Sequence[int], owners: Sequence[int], world_size: int) -> List[int]:
    """Each rank's encoder work under an assignment."""
    loads = [0] * world_size
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return loads


def encoder_saving(spans: Sequence[ChunkSpan], world_size: int, per_image_cost: int) -> int:
    """Encoder work (patch-equivalents) the owner path takes off the slowest
    rank: every rank encoding all ``spans`` (cold: no rank holds them),
    against the busiest owner of ``balanced_owners`` (the protocol's own
    rule, with the same costs) encoding its share."""
    if world_size <= 1 or not spans:
        return 0
    costs = [per_image_cost + span.patches for span in spans]
    owners = balanced_owners(costs, [span[0] for span in spans], world_size)
    return sum(costs) - max(owner_loads(costs, owners, world_size))


class OwnerRouter:
    """Routes each chunk and keeps the directory; one per model (group)."""

    def __init__(
        self, world_size: int, policy: RoutingPolicy, directory: SpanDirectory, row_bytes: int
    ):
        """``row_bytes``: bytes of one embedding row (width x element size)."""
        self.world_size = int(world_size)
        self.row_bytes = int(row_bytes)
        self.policy = policy
        self.directory = directory
        self.routes: Dict[Route, int] = {route: 0 for route in Route}
        self._always = policy.mode == "always"
        # not-worth chunks run in a status-only session (their routes are the
        # same as in "auto")
        self.guards_stock_encodes = policy.mode == "guarded"

    def route(self, spans: Sequence[ChunkSpan]) -> Route:
        """The route of a chunk with these spans. A ``known`` chunk touches
        its spans here, as the cache's lookups will (the chunk needs no
        ``completed``; calling it anyway changes nothing)."""
        route = self._route(spans)
        self.routes[route] += 1
        if route is Route.KNOWN:
            self.directory.touch(spans)
        return route

    def route_requests(
        self,
        requests: Sequence[Optional[RequestImages]],
        extend_prefix_lens: Sequence[int],
        extend_seq_lens: Sequence[int],
    ) -> Tuple[Route, Tuple[ChunkSpan, ...]]:
        """Route a chunk given per request tables (None: no image items):
        the same route as ``route(gather_spans(...))``, and the same spans as
        a tuple, without a lookup per span while the contributing requests are
        known and nothing left the directory since."""
        if len(requests) == 1 and requests[0] is not None:
            return self.route_request(requests[0], extend_prefix_lens, extend_seq_lens)
        return self._route_tables(requests, extend_prefix_lens, extend_seq_lens)

    def _route_tables(self, requests, extend_prefix_lens, extend_seq_lens):
        """route_requests by the general rules (several requests, or one
        without a single length pair)."""
        found, contributors = gather_spans(requests, extend_prefix_lens, extend_seq_lens)
        spans = tuple(found)
        if not spans or self._always:
            return self.route(spans), spans
        directory = self.directory
        epoch = directory.epoch
        entries = directory._entries
        for table in contributors:
            if table.known_epoch == epoch:
                continue
            # Look up every span of the request (not only this chunk's), so a
            # request found known is remembered and its next chunks skip this.
            if not all(map(entries.__contains__, table.all_keys)):
                # Not all known: route this chunk's spans one by one.
                return self.route(spans), spans
            table.known_epoch = epoch
        self.routes[_KNOWN] += 1
        any(map(entries.move_to_end, spans))  # directory.touch(spans), inline: every known chunk
        return _KNOWN, spans

    def route_request(
        self,
        table: RequestImages,
        extend_prefix_lens: Sequence[int],
        extend_seq_lens: Sequence[int],
    ) -> Tuple[Route, Tuple[ChunkSpan, ...]]:
        """``route_requests`` for a chunk of one request (the usual image
        chunk), in one pass: the chunk's spans, the known check and the
        touch, with nothing built when the chunk covers the whole request."""
        try:
            (chunk_start,), (extend_len,) = extend_prefix_lens, extend_seq_lens
        except ValueError:  # not one length pair: the general rules
            return self._route_tables((table,), extend_prefix_lens, extend_seq_lens)
        if table.precomputed or not table.items or extend_len <= 0:
            return self.route(()), ()
        chunk_end = chunk_start + extend_len
        if table.min_end >= chunk_start and table.max_start < chunk_end:
            spans = table.spans  # the chunk overlaps every item: the table's own tuple
        else:
            spans = tuple(table.spans_in(chunk_start, chunk_end))
            if not spans:
                return self.route(spans), spans
        directory = self.directory
        if table.known_epoch != directory.epoch:  # never set in mode "always"
            entries = directory._entries
            if self._always or not all(map(entries.__contains__, table.all_keys)):
                return self.route(spans), spans
            # Every span of the request (not only this chunk's) is known: its
            # next chunks skip the lookups until the directory evicts.
            table.known_epoch = directory.epoch
        self.routes[_KNOWN] += 1
        any(map(directory._entries.move_to_end, spans))  # directory.touch(spans), inline
        return _KNOWN, spans

    def _route(self, spans: Sequence[ChunkSpan]) -> Route:
        if not spans:
            return Route.NO_SPANS
        if self._always:
            return Route.OWNER
        known = self.directory._entries
        cold = []
        for span in spans:
            if span[0] is None:
                # Hashless spans go to the protocol, which rejects them on every rank.
                return Route.OWNER
            if span not in known:
                cold.append(span)
        if not cold:
            return Route.KNOWN
        saving = encoder_saving(cold, self.world_size, self.policy.per_image_cost)
        return Route.OWNER if saving >= self.policy.min_saving else Route.NOT_WORTH

    def completed(self, spans: Sequence[ChunkSpan]) -> None:
        """Every rank finished preparing a chunk with these spans."""
        self.directory.record(spans, self.row_bytes)
