"""Unit tests of chunk routing (sglang_dsv41.owner_broadcast.routing), no sglang import.

Multi-rank behaviour of the routes (no collective on stock routes, directories
equal on every rank) is in test_gloo_group.py and test_adapters.py.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dsv41.owner_broadcast.protocol import plan_spans
from sglang_dsv41.owner_broadcast.routing import (
    DEFAULT_MIN_SAVING,
    DEFAULT_PER_IMAGE_COST,
    ENV_MIN_SAVING,
    ENV_MODE,
    ENV_PER_IMAGE_COST,
    ChunkSpan,
    ItemMeta,
    OwnerRouter,
    RequestImages,
    Route,
    RoutingPolicy,
    SpanDirectory,
    balanced_owners,
    encoder_saving,
    gather_spans,
    owner_loads,
)


def chunk_spans(requests, prefix_lens, extend_lens):
    tables = [RequestImages(items) if items else None for items in requests]
    return gather_spans(tables, prefix_lens, extend_lens)[0]


def knows_all(directory, spans):
    return all(s.key in directory for s in spans)


def meta(start, end, content_hash=7, grid=(4, 4), **kwargs):
    return ItemMeta(offsets=[(start, end)], content_hash=content_hash, grid=grid, **kwargs)


# ------------------------------------------------ spans from host metadata


def test_spans_only_where_a_span_overlaps_the_chunk():
    image = [meta(5, 14)]
    # prefix 0, extend 8: tokens 0..7 overlap the span 5..14
    assert chunk_spans([image], [0], [8]) == [ChunkSpan(7, 10, (4, 4))]
    # prefix 15: the span lies wholly in the prefix
    assert chunk_spans([image], [15], [10]) == []
    # the chunk ends right before the span
    assert chunk_spans([image], [0], [5]) == []
    # the last span token is the first chunk token
    assert chunk_spans([image], [14], [3]) == [ChunkSpan(7, 10, (4, 4))]
    # nothing extended for this request
    assert chunk_spans([image], [0], [0]) == []
    # extend lengths shorter than the request list count as zero
    assert chunk_spans([[], image], [0, 0], [4]) == []
    assert len(chunk_spans([[], image], [0, 0], [4, 6])) == 1


def test_no_spans_for_precomputed_or_multi_run_items():
    assert chunk_spans([[meta(0, 3, precomputed=True)]], [0], [9]) == []
    # one precomputed item anywhere sends the batch down another path
    assert chunk_spans([[meta(0, 3)], [meta(0, 3, precomputed=True)]], [0, 0], [9, 9]) == []
    multi_run = ItemMeta(offsets=[(0, 3), (6, 8)], content_hash=1)
    assert chunk_spans([[multi_run]], [0], [9]) == []
    # a request with a multi-run item takes the whole-request path; others still count
    assert chunk_spans([[multi_run], [meta(0, 3, content_hash=2)]], [0, 0], [9, 9]) == [
        ChunkSpan(2, 4, (4, 4))
    ]
    assert chunk_spans([[]], [0], [9]) == []


def test_spans_deduplicated_by_hash_and_length_in_first_seen_order():
    a = [meta(0, 9, content_hash=3), meta(10, 13, content_hash=5)]
    b = [meta(2, 11, content_hash=3), meta(12, 21, content_hash=5)]
    spans = chunk_spans([a, b], [0, 0], [14, 22])
    # hash 3 twice with 10 tokens is one span; hash 5 with 4 and 10 tokens is two
    assert [(s.content_hash, s.span_len) for s in spans] == [(3, 10), (5, 4), (5, 10)]


def test_patches_from_the_grid_or_the_span_length():
    assert ChunkSpan(1, 20, (6, 8)).patches == 48
    assert ChunkSpan(1, 20).patches == 20
    # the grid as the metadata holds it: whole numbers in any form count,
    # anything else (a missing side) falls back to the tokens
    assert ChunkSpan(1, 20, ("6", 8)).patches == 48
    assert ChunkSpan(1, 20, (None, None)).patches == 20
    assert ChunkSpan(1, 20, ("x", 8)).patches == 20


# ------------------------------------------------ the directory


def span(content_hash, span_len=10, grid=(3, 3)):
    return ChunkSpan(content_hash, span_len, grid)


def test_directory_records_touches_and_evicts_least_recently_used_by_bytes():
    directory = SpanDirectory(capacity_bytes=300)
    directory.record([span(1), span(2), span(3)], 10)  # 10 tokens x 10 bytes each
    assert knows_all(directory, [span(1), span(2), span(3)]) and directory.bytes == 300
    directory.record([span(1)], 10)  # touch: 2 is now the oldest
    directory.record([span(4)], 10)
    assert span(2).key not in directory
    assert knows_all(directory, [span(1), span(3), span(4)])
    assert directory.bytes == 300 and len(directory) == 3


def test_directory_skips_what_the_cache_would_not_hold():
    directory = SpanDirectory(capacity_bytes=100)
    directory.record([span(1, 101), span(None, 10), span(2, 50)], 1)
    assert span(1, 101).key not in directory  # bigger than the whole cache
    assert span(None, 10).key not in directory  # never cached under a hash
    assert span(2, 50).key in directory


def test_directory_key_includes_length_and_grid():
    directory = SpanDirectory(capacity_bytes=1000)
    directory.record([span(1, 10, (3, 3))], 1)
    assert not knows_all(directory, [span(1, 12, (3, 3))])
    assert not knows_all(directory, [span(1, 10, (3, 4))])
    assert knows_all(directory, [span(1, 10, (3, 3))])


def test_directory_shrinks_when_capacity_drops():
    directory = SpanDirectory(capacity_bytes=1000)
    directory.record([span(1), span(2)], 40)
    directory.capacity_bytes = 500
    directory.record([], 40)
    assert list(k[0] for k in directory._entries) == [2] and directory.bytes == 400


def test_directories_fed_the_same_history_are_equal():
    rng = random.Random(3)
    history = [
        [span(h, 10 * (h % 4 + 1)) for h in (rng.randrange(20) for _ in range(rng.randrange(1, 5)))]
        for _ in range(200)
    ]
    first, second = SpanDirectory(2000), SpanDirectory(2000)
    for spans in history:
        first.record(spans, 10)
        second.record(spans, 10)
    assert first.digest() == second.digest()
    assert first.bytes <= 2000
    # and a different history gives a different digest
    second.record([span(999)], 10)
    assert first.digest() != second.digest()


# ------------------------------------------------ the policy


def test_policy_from_env_defaults_and_switches():
    # unset, or switched on without a mode: guarded
    assert RoutingPolicy.from_env({}) == RoutingPolicy(
        "guarded", DEFAULT_PER_IMAGE_COST, DEFAULT_MIN_SAVING
    ) == RoutingPolicy()
    for off in ("0", "off", "false", " NO "):
        assert RoutingPolicy.from_env({ENV_MODE: off}) is None
    for on in ("", " ", "1", "on", "true", "Guarded"):
        assert RoutingPolicy.from_env({ENV_MODE: on}).mode == "guarded"
    assert RoutingPolicy.from_env({ENV_MODE: "always"}).mode == "always"
    assert RoutingPolicy.from_env({ENV_MODE: "AUTO"}).mode == "auto"
    # guarded routes exactly as auto; only the stock encodes get a session
    guarded = OwnerRouter(2, RoutingPolicy(), SpanDirectory(0), 1)
    assert guarded.guards_stock_encodes and not router(mode="auto").guards_stock_encodes
    assert guarded.route([span(1, grid=(64, 64))]) is Route.NOT_WORTH
    policy = RoutingPolicy.from_env({ENV_PER_IMAGE_COST: "10", ENV_MIN_SAVING: "0"})
    assert (policy.per_image_cost, policy.min_saving) == (10, 0)


@pytest.mark.parametrize(
    "env, named",
    [
        ({ENV_MODE: "sometimes"}, ENV_MODE),
        ({ENV_PER_IMAGE_COST: "ten"}, ENV_PER_IMAGE_COST),
        ({ENV_MIN_SAVING: "-1"}, ENV_MIN_SAVING),
        ({ENV_MIN_SAVING: "1.5"}, ENV_MIN_SAVING),
    ],
)
def test_policy_rejects_bad_values_naming_the_variable(env, named):
    with pytest.raises(ValueError, match=named):
        RoutingPolicy.from_env(env)


# ------------------------------------------------ saving and routes


def test_encoder_saving_counts_what_leaves_the_busiest_owner():
    # two images on two owners: one image's cost is saved
    assert encoder_saving([span(0, grid=(4, 4)), span(1, grid=(4, 4))], 2, 100) == 116
    # hashes 0 and 2 (one owner under hash mod 2) are balanced over both ranks
    assert encoder_saving([span(0, grid=(4, 4)), span(2, grid=(4, 4))], 2, 100) == 116
    # a big and two small images: the big one alone, the small ones together
    assert encoder_saving([span(1, grid=(2, 2)), span(2, grid=(10, 10)), span(3, grid=(2, 2))],
                          2, 0) == 8
    # one image never saves anything
    assert encoder_saving([span(5, grid=(64, 64))], 8, 100) == 0
    assert encoder_saving([span(1), span(2)], 1, 100) == 0
    # eight images over eight owners, one each: seven of eight are saved
    assert encoder_saving([span(h, grid=(2, 2)) for h in range(8)], 8, 0) == 7 * 4


def router(world=2, **policy):
    return OwnerRouter(world, RoutingPolicy(**policy), SpanDirectory(10**9), row_bytes=2)


def test_routes():
    r = router(per_image_cost=100, min_saving=100)
    assert r.route([]) is Route.NO_SPANS
    # one image: the owner path cannot beat every rank encoding it at once
    assert r.route([span(1, grid=(64, 64))]) is Route.NOT_WORTH
    # two images on two owners, each worth more than the threshold
    pair = [span(0, grid=(4, 4)), span(1, grid=(4, 4))]
    assert r.route(pair) is Route.OWNER
    r.completed(pair)
    assert r.route(pair) is Route.KNOWN
    # one known, one cold: the cold one alone saves nothing
    assert r.route([span(0, grid=(4, 4)), span(3, grid=(4, 4))]) is Route.NOT_WORTH
    # a hashless span goes to the protocol, which rejects it on every rank
    assert r.route([span(None)]) is Route.OWNER
    assert r.routes[Route.OWNER] == 2 and r.routes[Route.KNOWN] == 1


def test_threshold_is_inclusive_and_tiny_images_stay_stock():
    tiny = [span(h, grid=(1, 1)) for h in range(8)]
    # defaults: eight one-patch images over eight owners save 7 x (4096 + 1)
    assert router(world=8).route(tiny) is Route.OWNER
    assert router(world=8, per_image_cost=0, min_saving=7).route(tiny) is Route.OWNER
    assert router(world=8, per_image_cost=0, min_saving=8).route(tiny) is Route.NOT_WORTH
    # two tiny images with the defaults: ~4 ms saved is the line
    two = [span(0, grid=(1, 1)), span(1, grid=(1, 1))]
    assert router().route(two) is Route.OWNER
    assert router(min_saving=DEFAULT_PER_IMAGE_COST + 2).route(two) is Route.NOT_WORTH


def test_always_mode_sends_every_chunk_with_spans_to_the_protocol():
    r = router(mode="always")
    one = [span(1)]
    assert r.route(one) is Route.OWNER
    r.completed(one)
    assert r.route(one) is Route.OWNER
    assert r.route([]) is Route.NO_SPANS


# ------------------------------------------------ per-request tables, fast path


def reference_spans(requests, prefix_lens, seq_lens):
    """The rules of sglang's per-image path, written out item by item with no
    precomputation: what the tables must reproduce on every chunk."""
    if any(item.precomputed for items in requests for item in items):
        return []
    found = {}
    for index, items in enumerate(requests):
        if index >= len(prefix_lens) or not items:
            continue
        extend = seq_lens[index] if index < len(seq_lens) else 0
        if extend <= 0 or any(len(item.offsets) != 1 for item in items):
            continue
        lo, hi = prefix_lens[index], prefix_lens[index] + extend
        for item in items:
            (start, end), = item.offsets
            if end >= lo and start < hi:
                found.setdefault((item.content_hash, end - start + 1),
                                 ChunkSpan(item.content_hash, end - start + 1, item.grid))
    return list(found.values())


item_strategy = st.builds(
    lambda start, length, runs, content_hash, grid, precomputed: ItemMeta(
        offsets=[(start + 20 * r, start + 20 * r + length - 1) for r in range(runs)],
        precomputed=precomputed,
        content_hash=content_hash,
        grid=grid,
    ),
    st.integers(0, 60),
    st.integers(1, 12),
    st.sampled_from([1, 1, 1, 1, 1, 1, 2, 0]),
    st.sampled_from([None, 0, 1, 2, 3, 5, 8]),
    st.sampled_from([(), (2, 2), (3, 4)]),
    st.sampled_from([False] * 12 + [True]),
)
batch_strategy = st.lists(st.lists(item_strategy, max_size=5), max_size=4).flatmap(
    lambda requests: st.tuples(
        st.just(requests),
        st.lists(st.integers(0, 70), min_size=max(len(requests) - 1, 0), max_size=len(requests)),
        st.lists(st.integers(-1, 40), min_size=max(len(requests) - 1, 0), max_size=len(requests)),
    )
)


@settings(max_examples=400, deadline=None)
@given(batch_strategy)
def test_tables_find_the_spans_the_item_by_item_rules_find(batch):
    requests, prefix_lens, seq_lens = batch
    expected = reference_spans(requests, prefix_lens, seq_lens)
    assert chunk_spans(requests, prefix_lens, seq_lens) == expected
    # the same tables asked again (a later chunk reuses them) answer the same
    tables = [RequestImages(items) if items else None for items in requests]
    for _ in range(2):
        spans, contributors = gather_spans(tables, prefix_lens, seq_lens)
        assert spans == expected
        assert all(table in tables for table in contributors)


def step_against_scratch(cached, fresh, routed, expected_spans):
    """One chunk routed by the router under test (``routed``: its route and
    spans) against a router that routes the plain rules' spans from scratch;
    both then record the chunk and must hold equal directories."""
    route, spans = routed
    assert spans == tuple(expected_spans)
    assert route is fresh.route(expected_spans)
    cached.completed(spans)
    fresh.completed(expected_spans)
    assert cached.directory.digest() == fresh.directory.digest()


pool_strategy = st.lists(st.lists(item_strategy, min_size=1, max_size=4), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(pool_strategy, st.data(), st.integers(5, 60))
def test_cached_known_routes_match_routing_from_scratch(pool, data, capacity):
    """A router that keeps per-request tables (and their known epochs) across
    chunks routes every chunk as a router that recomputes everything, while
    a small directory evicts; the directories stay equal. Requests come from
    a small pool, so they recur, chunked at different points."""
    cached = OwnerRouter(2, RoutingPolicy(per_image_cost=1, min_saving=1), SpanDirectory(capacity), 1)
    fresh = OwnerRouter(2, RoutingPolicy(per_image_cost=1, min_saving=1), SpanDirectory(capacity), 1)
    tables = [RequestImages(items) for items in pool]  # one table per request, kept
    for _ in range(data.draw(st.integers(1, 30), label="chunks")):
        picked = data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=3))
        prefix_lens = data.draw(st.lists(st.integers(0, 70), min_size=len(picked), max_size=len(picked)))
        seq_lens = data.draw(st.lists(st.integers(0, 40), min_size=len(picked), max_size=len(picked)))
        requests = [pool[i] for i in picked]
        routed = cached.route_requests([tables[i] for i in picked], prefix_lens, seq_lens)
        step_against_scratch(cached, fresh, routed, reference_spans(requests, prefix_lens, seq_lens))
    assert cached.routes == fresh.routes


@settings(max_examples=150, deadline=None)
@given(pool_strategy, st.data(), st.integers(5, 60), st.sampled_from(["auto", "always"]))
def test_one_request_chunks_route_as_the_general_rules(pool, data, capacity, mode):
    """route_request (one request's chunk, the hook's usual call) against
    routing from scratch, with length lists of any length (the batch
    metadata of one request normally has one pair; zero or two take the
    general rules) and the routing mode under test."""
    policy = RoutingPolicy(mode=mode, per_image_cost=1, min_saving=1)
    cached = OwnerRouter(2, policy, SpanDirectory(capacity), 1)
    fresh = OwnerRouter(2, policy, SpanDirectory(capacity), 1)
    tables = [RequestImages(items) for items in pool]
    for _ in range(data.draw(st.integers(1, 30), label="chunks")):
        picked = data.draw(st.integers(0, len(pool) - 1), label="request")
        pairs = data.draw(st.sampled_from([1, 1, 1, 1, 0, 2]), label="length pairs")
        prefix_lens = data.draw(st.lists(st.integers(0, 70), min_size=pairs, max_size=pairs))
        seq_lens = data.draw(st.lists(st.integers(-1, 40), min_size=pairs, max_size=pairs))
        routed = cached.route_request(tables[picked], prefix_lens, seq_lens)
        step_against_scratch(cached, fresh, routed, reference_spans([pool[picked]], prefix_lens, seq_lens))
    assert cached.routes == fresh.routes


def test_known_requests_skip_lookups_until_the_directory_evicts():
    r = OwnerRouter(2, RoutingPolicy(per_image_cost=1, min_saving=1), SpanDirectory(100), 1)
    a = RequestImages([meta(0, 9, content_hash=1), meta(10, 19, content_hash=2)])
    b = RequestImages([meta(0, 9, content_hash=3)])
    assert r.route_requests([a], [0], [20])[0] is Route.OWNER
    r.completed(list(a.spans))
    assert a.known_epoch == -1  # learned on the next chunk, not assumed
    assert r.route_requests([a], [0], [20])[0] is Route.KNOWN
    assert a.known_epoch == r.directory.epoch
    first_epoch = r.directory.epoch
    # a chunk of the first image only: known without a lookup per span
    lookups = []

    class CountedEntries(OrderedDict):
        def __contains__(self, key):
            lookups.append(key)
            return super().__contains__(key)

    r.directory._entries = CountedEntries(r.directory._entries)
    assert r.route_requests([a], [0], [5]) == (Route.KNOWN, (ChunkSpan(1, 10, (4, 4)),))
    assert lookups == []
    # ...and the span it used is now the most recently used
    assert list(r.directory._entries)[-1] == ChunkSpan(1, 10, (4, 4))
    # an eviction moves the epoch: the next chunk of `a` looks again
    r.completed(list(b.spans) * 9 + [ChunkSpan(4, 90, ())])
    assert r.directory.epoch != first_epoch and ChunkSpan(1, 10, (4, 4)) not in r.directory
    assert r.route_requests([a], [0], [20])[0] is not Route.KNOWN


def test_a_request_known_only_in_part_is_not_remembered_as_known():
    r = OwnerRouter(2, RoutingPolicy(per_image_cost=1, min_saving=1), SpanDirectory(1000), 1)
    request = RequestImages([meta(0, 9, content_hash=1), meta(30, 39, content_hash=2)])
    r.completed([ChunkSpan(1, 10, (4, 4))])
    # first chunk covers the known image only
    assert r.route_requests([request], [0], [20])[0] is Route.KNOWN
    assert request.known_epoch == -1
    # the next chunk reaches the cold image: not served from the cache
    assert r.route_requests([request], [20], [20])[0] is Route.NOT_WORTH


def test_directory_epochs_are_unique_in_the_process():
    # A table's known epoch is only ever equal to the epoch of the directory
    # that set it, so tables can be shared between routers.
    first, second = SpanDirectory(10), SpanDirectory(10)
    assert first.epoch != second.epoch
    seen = {first.epoch, second.epoch}
    for _ in range(3):
        first.record([ChunkSpan(1, 8, ()), ChunkSpan(2, 8, ())], 1)  # 16 bytes > 10: evicts
        assert first.epoch not in seen
        seen.add(first.epoch)


def test_single_and_multi_item_tables_agree():
    # one row takes a shortcut in the table's fill; it must equal the general derivation
    one = RequestImages([meta(3, 12, content_hash=9)])
    two = RequestImages([meta(3, 12, content_hash=9), meta(3, 12, content_hash=9)])
    assert one.spans == two.spans == one.all_keys == (ChunkSpan(9, 10, (4, 4)),)
    assert (one.max_start, one.min_end) == (two.max_start, two.min_end) == (3, 12)
    assert one.items == two.items[:1]
    precomputed = RequestImages([meta(3, 12, precomputed=True)])
    assert precomputed.precomputed and gather_spans([precomputed], [0], [20]) == ([], [])
    for items in ([ItemMeta(offsets=[], content_hash=1)], [ItemMeta(offsets=[(0, 1), (4, 5)], content_hash=1)]):
        table = RequestImages(items)  # not a one-run item: the whole-request path, no span
        assert table.items == table.spans == table.all_keys == () and not table.precomputed
        assert gather_spans([table], [0], [20]) == ([], [])


def test_a_known_request_covers_every_item_s_key_not_only_the_first_per_hash():
    # Two items with one hash and length but different grids: a chunk that
    # holds only the second names the second's key, which the directory
    # never saw; the request must not count as known.
    r = OwnerRouter(2, RoutingPolicy(per_image_cost=1, min_saving=1), SpanDirectory(1000), 1)
    request = RequestImages([meta(0, 9, content_hash=1, grid=(2, 2)), meta(20, 29, content_hash=1, grid=())])
    assert request.spans == (ChunkSpan(1, 10, (2, 2)),)
    r.completed(list(request.spans))
    assert r.route_requests([request], [0], [15])[0] is Route.KNOWN
    route, spans = r.route_requests([request], [15], [15])
    assert spans == (ChunkSpan(1, 10, ()),) and route is not Route.KNOWN


def test_the_owner_core_modules_import_no_sglang():
    # The routing, the protocol and the reading of the engine's batch objects
    # are plain modules: importing them must not pull sglang in.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import sglang_dsv41.owner_broadcast.chunks, sglang_dsv41.owner_broadcast.routing\n"
        "import sglang_dsv41.owner_broadcast.protocol\n"
        "print(sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# ------------------------------------------------ balanced owners


def plain_owners(costs, hashes, world, holders=None):
    """The ownership rules written out with no sorting: repeatedly the
    costliest cold span left (then lowest hash, then first) goes to the rank
    with least work (then fewest spans sent, then lowest id); then each held
    span, in order, to its holder by the same measure (sent by nobody when
    every rank holds it)."""
    owners = [0] * len(costs)
    if world <= 1:
        return owners
    work, sent = [0] * world, [0] * world
    left = [i for i in range(len(costs)) if not (holders and holders[i])]
    while left:
        pick = left[0]
        for i in left[1:]:
            a = (costs[i], -(hashes[i] if hashes[i] is not None else -1), -i)
            b = (costs[pick], -(hashes[pick] if hashes[pick] is not None else -1), -pick)
            if (hashes[i] is None) != (hashes[pick] is None):
                better = hashes[pick] is None if costs[i] == costs[pick] else a > b
            else:
                better = a > b
            if better:
                pick = i
        left.remove(pick)
        rank = 0
        for r in range(1, world):
            if (work[r], sent[r]) < (work[rank], sent[rank]):
                rank = r
        owners[pick] = rank
        work[rank] += costs[pick]
        sent[rank] += 1
    for i in range(len(costs)):
        if holders and holders[i]:
            rank = holders[i][0]
            for r in holders[i][1:]:
                if (work[r], sent[r], r) < (work[rank], sent[rank], rank):
                    rank = r
            owners[i] = rank
            if len(holders[i]) < world:
                sent[rank] += 1
    return owners


owner_case = st.integers(1, 9).flatmap(lambda world: st.tuples(
    st.just(world),
    st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([None] + list(range(40))),
                       st.sets(st.integers(0, world - 1))), max_size=40),
))


@settings(max_examples=400, deadline=None)
@given(owner_case, st.booleans())
def test_balanced_owners_follow_the_plain_rules(case, with_holders):
    world, spans = case
    costs = [cost for cost, _h, _held in spans]
    hashes = [h for _c, h, _held in spans]
    holders = [sorted(held) for _c, _h, held in spans] if with_holders else None
    owners = balanced_owners(costs, hashes, world, holders)
    assert owners == plain_owners(costs, hashes, world, holders)
    assert all(0 <= owner < world for owner in owners)
    if holders:
        # a span some rank holds is sent by a holder, never encoded
        assert all(owner in held for owner, held in zip(owners, holders) if held)
    else:
        # longest first: the busiest owner carries at most the ideal share
        # plus one span
        loads = owner_loads(costs, owners, world)
        assert max(loads, default=0) <= sum(costs) / world + max(costs, default=0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.integers(0, 500), st.integers(0, 10**6)),
                                   unique_by=lambda t: t[1], max_size=30), st.randoms())
def test_balanced_owners_do_not_depend_on_the_order_of_distinct_spans(world, spans, rng):
    costs, hashes = [c for c, _h in spans], [h for _c, h in spans]
    owners = dict(zip(hashes, balanced_owners(costs, hashes, world)))
    rng.shuffle(spans)
    costs, hashes = [c for c, _h in spans], [h for _c, h in spans]
    assert dict(zip(hashes, balanced_owners(costs, hashes, world))) == owners


def test_balanced_owners_meet_the_share_goal_where_hash_mod_misses_it():
    # 32 images of one size over 8 ranks: 4 each; hash mod 8 of these hashes
    # piles 16 onto each of two ranks
    hashes = [8 * i for i in range(16)] + [8 * i + 1 for i in range(16)]
    owners = balanced_owners([100] * 32, hashes, 8)
    assert sorted(owners.count(r) for r in range(8)) == [4] * 8
    assert max([h % 8 for h in hashes].count(r) for r in range(8)) == 16


class PlainDirectory:
    """The span directory's rules written out: an LRU list by bytes."""

    def __init__(self, capacity):
        self.capacity, self.entries = capacity, OrderedDict()

    def record(self, spans, row_bytes):
        for s in spans:
            if s in self.entries:
                self.entries.move_to_end(s)
            elif s.content_hash is not None and s.span_len * row_bytes <= self.capacity:
                self.entries[s] = s.span_len * row_bytes
        while sum(self.entries.values()) > self.capacity:
            self.entries.popitem(last=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(20, 400), st.integers(0, 300), st.integers(0, 2000), st.randoms())
def test_routes_and_owners_follow_the_plain_rules_over_evicting_histories(
        world, capacity, per_image_cost, min_saving, rng):
    """200 chunks from a pool of images that recur, through a small
    directory that evicts: each route is the one the plain rules give (cold
    spans from a plain LRU, saving from the plain ownership), and the owners
    the protocol plans for a cold chunk (no rank holding its spans) are the
    plain ones, so the routing's estimate is of the plan that runs."""
    policy = RoutingPolicy(mode="guarded", per_image_cost=per_image_cost, min_saving=min_saving)
    router = OwnerRouter(world, policy, SpanDirectory(capacity), row_bytes=1)
    plain = PlainDirectory(capacity)
    pool = [span(h, rng.randrange(1, 30), (rng.randrange(1, 40), rng.randrange(1, 40)))
            for h in rng.sample(range(10**6), 40)]
    for _ in range(200):
        spans = list(dict.fromkeys(rng.choice(pool) for _ in range(rng.randrange(0, 9))))
        cold = [s for s in spans if s not in plain.entries]
        costs = [per_image_cost + s.patches for s in cold]
        hashes = [s.content_hash for s in cold]
        owners = plain_owners(costs, hashes, world)
        work = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        if not spans:
            expected = Route.NO_SPANS
        elif not cold:
            expected = Route.KNOWN
        else:
            expected = Route.OWNER if sum(costs) - max(work) >= min_saving else Route.NOT_WORTH
        assert router.route(spans) is expected
        if cold:
            planned = plan_spans(hashes, [[False] * len(cold)] * world, costs)
            assert planned.owners == owners
        if expected is Route.KNOWN:
            plain.record(spans, 1)  # a known chunk's lookups touch its spans
        else:
            router.completed(spans)
            plain.record(spans, 1)
        assert list(router.directory._entries) == list(plain.entries)
