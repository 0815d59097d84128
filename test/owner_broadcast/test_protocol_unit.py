"""Unit tests of the owner protocol's pieces, in one process (no sglang import).

The session tests use a one-rank group: every collective of a group of one is
exact (the gathered list is the rank's own object), so the protocol runs its
real code path; multi-rank behaviour is in test_gloo_group.py.
"""

from __future__ import annotations

import pytest
import torch

from sglang_dsv41.owner_broadcast import protocol
from sglang_dsv41.owner_broadcast.protocol import (
    Action,
    Manifest,
    OwnerProtocolError,
    OwnerSession,
    Phase,
    SpanManifestKey,
    SpanRequest,
    canonical_geometry,
    make_plan,
    manifest_digest,
    plan_spans,
    select_owner_group_kind,
    split_encoder_output,
)
from sglang_dsv41.owner_broadcast.routing import owner_of

WIDTH = 4


def manifest(keys, cached, *, rids=("r1",), dtype="torch.float32", width=WIDTH):
    return Manifest(
        keys=[SpanManifestKey(content_hash=h, span_len=n, geometry=(n,)) for h, n in keys],
        cached=list(cached),
        dtype=dtype,
        width=width,
        request_ids=list(rids),
    )


# ---------------------------------------------------------------- planning


def test_plan_actions_and_owners():
    keys = [(10, 3), (11, 2), (12, 5), (13, 1)]
    manifests = [
        manifest(keys, [True, True, False, False]),  # rank 0
        manifest(keys, [True, False, False, True]),  # rank 1
        manifest(keys, [True, True, True, False]),  # rank 2
    ]
    plan = make_plan(manifests)
    # every span some rank holds is sent from a holder's cache, never encoded
    assert plan.owners == [0, 0, 2, 1]
    assert plan.actions == [
        Action.LOCAL_HIT,  # cached everywhere
        Action.OWNER_CACHE_BROADCAST,  # ranks 0 and 2 hold it: the lower sends
        Action.OWNER_CACHE_BROADCAST,  # only rank 2 holds it (hash mod 3 would make 0 encode it)
        Action.OWNER_CACHE_BROADCAST,  # only rank 1 holds it
    ]
    assert plan.transfer_indices(1) == [3]
    assert plan.transfer_indices(2) == [2]
    assert plan.transfer_indices(0) == [1]
    assert plan.has_transfers()


def test_plan_spreads_cold_spans_by_cost_longest_first():
    # costs 9, 5, 4, 3, 3 over two ranks, nothing cached anywhere: 9 -> 0,
    # 5 -> 1, 4 -> 1 (5 < 9), 3 -> 0 (work 9 each: rank 0 sends fewer
    # spans), the last 3 -> 1 (9 < 12)
    keys = [(40, 3), (41, 3), (42, 3), (43, 3), (44, 3)]
    costs = [3, 9, 4, 5, 3]
    manifests = [
        Manifest(keys=[SpanManifestKey(h, n, (), cost) for (h, n), cost in zip(keys, costs)],
                 cached=[False] * 5, dtype="torch.float32", width=WIDTH, request_ids=["r1"])
    ] * 2
    plan = make_plan(manifests)
    assert plan.actions == [Action.OWNER_ENCODE_BROADCAST] * 5
    assert plan.owners == [0, 0, 1, 1, 1]
    # each owner encodes 12 patch-equivalents: hash mod 2 would give rank 0
    # hashes 40, 42, 44 (10) and rank 1 41, 43 (14)
    loads = [sum(c for c, o in zip(costs, plan.owners) if o == r) for r in (0, 1)]
    assert loads == [12, 12]


def test_ranks_that_estimate_costs_differently_disagree_on_the_manifest():
    one = Manifest(keys=[SpanManifestKey(10, 3, (), 7)], cached=[False], dtype="torch.float32",
                   width=WIDTH, request_ids=["r1"])
    other = Manifest(keys=[SpanManifestKey(10, 3, (), 8)], cached=[False], dtype="torch.float32",
                     width=WIDTH, request_ids=["r1"])
    assert manifest_digest(one) != manifest_digest(other)
    with pytest.raises(ValueError, match="keys"):
        make_plan([one, other])


def test_plan_without_transfers_when_everything_is_cached():
    keys = [(4, 2), (5, 2)]
    plan = make_plan([manifest(keys, [True, True]), manifest(keys, [True, True])])
    assert plan.actions == [Action.LOCAL_HIT, Action.LOCAL_HIT]
    assert not plan.has_transfers()


@pytest.mark.parametrize(
    "other, named",
    [
        (dict(rids=("r1", "r2")), "request_ids"),
        (dict(keys=[(10, 4)]), "keys"),
        (dict(dtype="torch.bfloat16"), "dtype"),
        (dict(width=WIDTH + 1), "width"),
    ],
)
def test_plan_rejects_ranks_that_disagree(other, named):
    base = dict(keys=[(10, 3)], cached=[False])
    lead = manifest(**base)
    args = dict(base)
    args.update({k: v for k, v in other.items()})
    peer = manifest(**args)
    with pytest.raises(ValueError, match=rf"group ranks 0 and 2 disagree.*{named}"):
        make_plan([lead, lead, peer])


def test_plan_rejects_a_different_geometry():
    lead = manifest([(10, 3)], [False])
    peer = Manifest(
        keys=[SpanManifestKey(content_hash=10, span_len=3, geometry=(9,))],
        cached=[False], dtype="torch.float32", width=WIDTH, request_ids=["r1"],
    )
    with pytest.raises(ValueError, match="keys"):
        make_plan([lead, peer])


def test_plan_from_cache_flags_matches_the_plan_from_manifests():
    keys = [(10, 3), (11, 2), (12, 5), (13, 1)]
    flags = [[True, True, False, False], [True, False, False, True], [True, True, True, False]]
    assert plan_spans([h for h, _ in keys], flags) == make_plan(
        [manifest(keys, cached) for cached in flags]
    )


def test_manifest_digest_covers_everything_but_the_cache_flags():
    base = dict(keys=[(10, 3), (11, 2)], cached=[True, False])
    digest = manifest_digest(manifest(**base))
    assert 1 <= digest < 2**62
    assert manifest_digest(manifest(**base)) == digest, "deterministic"
    assert manifest_digest(manifest(keys=base["keys"], cached=[False, True])) == digest
    changed = [
        manifest(keys=[(10, 3), (11, 3)], cached=[True, False]),  # span length
        manifest(keys=[(10, 3), (12, 2)], cached=[True, False]),  # content hash
        manifest(keys=[(11, 2), (10, 3)], cached=[False, True]),  # order
        manifest(keys=[(10, 3)], cached=[True]),  # one span fewer
        manifest(**base, rids=("r2",)),
        manifest(**base, dtype="torch.bfloat16"),
        manifest(**base, width=WIDTH + 1),
        Manifest(
            keys=[SpanManifestKey(content_hash=10, span_len=3, geometry=(4,)),
                  SpanManifestKey(content_hash=11, span_len=2, geometry=(2,))],
            cached=[True, False], dtype="torch.float32", width=WIDTH, request_ids=["r1"],
        ),  # geometry
    ]
    digests = {manifest_digest(m) for m in changed}
    assert digest not in digests and len(digests) == len(changed)


def test_hash_mod_baseline_is_content_hash_modulo_group_size():
    assert [owner_of(h, 4) for h in (0, 5, 10, 2**64 - 1)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "tp, dp, cp, pp, kind",
    [
        (8, 1, 1, 1, "attn_tp"),  # plain TP
        (8, 2, 1, 1, "attn_tp"),  # attention DP: replication inside each DP group
        (8, 8, 1, 1, None),  # pure attention DP: nothing replicated
        (8, 1, 8, 1, "attn_cp"),  # prefill CP over the whole TP group
        (8, 1, 4, 1, None),  # CP smaller than TP: members run different shards
        (8, 2, 4, 1, None),
        (1, 1, 1, 1, None),
        (8, 1, 1, 2, None),  # pipeline parallel: vision is refused upstream anyway
    ],
)
def test_owner_group_kind(tp, dp, cp, pp, kind):
    assert select_owner_group_kind(tp_size=tp, attn_dp_size=dp, attn_cp_size=cp, pp_size=pp) == kind


# ---------------------------------------------------------------- split


def test_split_of_one_batched_tensor():
    encoded = torch.arange(6 * WIDTH, dtype=torch.float32).view(6, WIDTH)
    spans = split_encoder_output(encoded, [2, 3, 1])
    assert [tuple(s.shape) for s in spans] == [(2, WIDTH), (3, WIDTH), (1, WIDTH)]
    assert torch.equal(torch.cat(spans), encoded)
    # a leading batch dimension is flattened away
    spans = split_encoder_output(encoded.view(1, 6, WIDTH), [4, 2])
    assert torch.equal(spans[1], encoded[4:])


def test_split_of_per_item_tensors():
    a, b = torch.ones(1, 2, WIDTH), torch.zeros(3, WIDTH)
    spans = split_encoder_output([a, b], [2, 3])
    assert tuple(spans[0].shape) == (2, WIDTH) and spans[1] is b


@pytest.mark.parametrize(
    "encoded, lens, message",
    [
        (torch.zeros(5, WIDTH), [2, 2], "5 rows for spans of \\[2, 2\\]"),
        ([torch.zeros(2, WIDTH)], [2, 2], "1 spans for 2 images"),
        ([torch.zeros(2, WIDTH), "x"], [2, 2], "str, not a tensor"),
        ({"a": 1}, [2], "dict, not tensors"),
    ],
)
def test_split_rejects_mismatched_output(encoded, lens, message):
    with pytest.raises((ValueError, TypeError), match=message):
        split_encoder_output(encoded, lens)


def test_canonical_geometry_is_plain_and_order_free():
    a = canonical_geometry((3, 4, {"b": 2, "a": [1, 2]}))
    b = canonical_geometry([3, 4, {"a": (1, 2), "b": 2}])
    assert a == b == (3, 4, (("a", (1, 2)), ("b", 2)))
    assert canonical_geometry(torch.zeros(2, 3)) == ("tensor", (2, 3), "torch.float32")


# ------------------------------------------------- sessions on a one-rank group


class OneRankGroup:
    """A real group of one: every collective returns this rank's own data."""

    def __init__(self, global_rank=7, fail_broadcast=False):
        self.rank_in_group = 0
        self.world_size = 1
        self.ranks = [global_rank]
        self.fail_broadcast = fail_broadcast
        self.calls = []

    def all_gather_object(self, obj):
        self.calls.append("all_gather_object")
        return [obj]

    def all_reduce_max(self, values):
        self.calls.append("all_reduce_max")
        return list(values)

    def broadcast(self, tensor, src=0):
        self.calls.append("broadcast")
        if self.fail_broadcast:
            raise RuntimeError("link down")
        return tensor


class DictCache:
    def __init__(self, entries=None):
        self.entries = dict(entries or {})
        self.freed = []

    def get(self, content_hash):
        return self.entries.get(content_hash)

    def set(self, content_hash, span):
        self.entries[content_hash] = span
        return True

    def free(self, content_hash):
        self.freed.append(content_hash)
        self.entries.pop(content_hash, None)


def span_for(content_hash, span_len, dtype=torch.float32):
    return torch.full((span_len, WIDTH), float(content_hash), dtype=dtype)


class Encoder:
    def __init__(self):
        self.calls = []

    def __call__(self, requests):
        self.calls.append([r.content_hash for r in requests])
        return [span_for(r.content_hash, r.span_len) for r in requests]


def session(group=None, **kwargs):
    args = dict(
        device=torch.device("cpu"),
        dtype=torch.float32,
        width=WIDTH,
        request_ids=["req-a", "req-b"],
        signature=lambda item, span_len: item,
    )
    args.update(kwargs)
    return OwnerSession(group or OneRankGroup(), **args)


def requests(*pairs, item=("grid", 1)):
    return [SpanRequest(content_hash=h, span_len=n, item=item) for h, n in pairs]


def run_preparation(owner, reqs, cache, encoder):
    with owner.fence():
        features = owner.resolve(reqs, cache, encoder)
        owner.features_ready()
    return features


def test_cache_validation_serves_valid_and_evicts_wrong_entries():
    cache = DictCache(
        {
            1: span_for(1, 3),  # valid
            2: span_for(2, 5),  # wrong span length
            3: span_for(3, 2, dtype=torch.float16),  # wrong dtype
            4: torch.empty(2, WIDTH, device="meta"),  # wrong device
            5: span_for(5, 2)[None],  # wrong rank (3-D)
            6: "not a tensor",
        }
    )
    encoder = Encoder()
    reqs = requests((1, 3), (2, 2), (3, 2), (4, 2), (5, 2), (6, 2))
    features = run_preparation(session(), reqs, cache, encoder)
    assert encoder.calls == [[2, 3, 4, 5, 6]], "the valid entry is served, the rest re-encoded"
    assert sorted(cache.freed) == [2, 3, 4, 5, 6]
    for h, n in [(1, 3), (2, 2), (3, 2), (4, 2), (5, 2), (6, 2)]:
        assert torch.equal(features[(h, n)], span_for(h, n))
        assert torch.equal(cache.entries[h], span_for(h, n))


def test_duplicate_spans_with_different_geometry_reuse_the_first_encode_as_stock_does():
    """A client chooses mm_hashes: one hash on two different images must not stop the group."""
    reqs = [
        SpanRequest(content_hash=9, span_len=4, item=(2, 2), duplicates=[(2, 2), (1, 4)]),
    ]
    cache, encoder = DictCache(), Encoder()
    before = protocol.duplicate_geometry_spans
    features = run_preparation(session(), reqs, cache, encoder)
    assert encoder.calls == [[9]] and list(features) == [(9, 4)]
    assert torch.equal(features[(9, 4)], span_for(9, 4))
    assert protocol.duplicate_geometry_spans == before + 1


def test_duplicate_spans_with_equal_geometry_are_one_span():
    reqs = [SpanRequest(content_hash=9, span_len=4, item=(2, 2), duplicates=[(2, 2)])]
    encoder = Encoder()
    features = run_preparation(session(), reqs, DictCache(), encoder)
    assert encoder.calls == [[9]] and list(features) == [(9, 4)]


def test_error_text_names_phase_ranks_and_requests():
    def failing_encoder(_requests):
        raise MemoryError("no room")

    with pytest.raises(OwnerProtocolError) as raised:
        run_preparation(session(OneRankGroup(global_rank=13)), requests((2, 3)), DictCache(), failing_encoder)
    text = str(raised.value)
    assert text.startswith("owner-broadcast embedding failed in phase 'encode' on group rank 0 ")
    assert "(global rank 13)" in text
    assert "requests ['req-a', 'req-b']" in text
    assert "owner encode of image hashes [2] failed: MemoryError: no room" in text
    # On the failing rank the local exception stays attached.
    assert isinstance(raised.value.__cause__.__cause__, MemoryError)


def test_span_without_hash_is_a_manifest_error():
    with pytest.raises(OwnerProtocolError, match="phase 'manifest'.*has no content hash"):
        run_preparation(session(), [SpanRequest(content_hash=None, span_len=2, item=1)],
                        DictCache(), Encoder())


def test_encoder_output_of_wrong_shape_or_dtype_is_an_encode_error():
    def wrong_dtype(reqs):
        return [span_for(r.content_hash, r.span_len, dtype=torch.float64) for r in reqs]

    with pytest.raises(OwnerProtocolError, match="phase 'encode'.*float64"):
        run_preparation(session(), requests((1, 2)), DictCache(), wrong_dtype)
    with pytest.raises(OwnerProtocolError, match="phase 'encode'.*7 rows"):
        run_preparation(session(), requests((1, 2)), DictCache(), lambda reqs: torch.zeros(7, WIDTH))


def test_no_agreement_after_a_failure_inside_a_collective():
    group = OneRankGroup(fail_broadcast=True)
    cache = DictCache()
    with pytest.raises(RuntimeError, match="link down") as raised:
        run_preparation(session(group), requests((3, 2)), cache, Encoder())
    assert not isinstance(raised.value, OwnerProtocolError)
    # manifest round, pre-broadcast round, the failed broadcast; nothing after
    assert group.calls == ["all_reduce_max", "all_reduce_max", "broadcast"]
    assert cache.entries == {}, "a span that never arrived must not be cached"


def test_fence_without_owner_path_is_an_agreed_error():
    group = OneRankGroup()
    with pytest.raises(OwnerProtocolError, match="no image span reached the owner path"):
        with session(group).fence():
            pass
    # the manifest round shows the failure; the detail round carries its text
    assert group.calls == ["all_reduce_max", "all_gather_object"]


def test_features_never_marked_ready_is_an_agreed_error():
    owner = session()
    with pytest.raises(OwnerProtocolError, match="before its image features were marked ready"):
        with owner.fence():
            owner.resolve(requests((1, 2)), DictCache(), Encoder())


def test_resolve_twice_is_refused():
    owner = session()
    with pytest.raises(OwnerProtocolError, match="phase 'features'.*resolved twice"):
        with owner.fence():
            owner.resolve(requests((1, 2)), DictCache(), Encoder())
            owner.resolve(requests((1, 2)), DictCache(), Encoder())


def test_session_not_engaged_does_nothing_and_refuses_the_owner_path():
    group = OneRankGroup()
    owner = session(group, engaged=False)
    with owner.fence():
        owner.features_ready()
        assert owner.embed_text(lambda: torch.ones(2), lambda t: t * 2).tolist() == [2.0, 2.0]
        with pytest.raises(RuntimeError, match="no image span"):
            owner.resolve(requests((1, 2)), DictCache(), Encoder())
    assert group.calls == []


def test_embed_text_agrees_a_lookup_failure_and_skips_the_reduce():
    reduced = []
    owner = session()
    with pytest.raises(OwnerProtocolError, match="phase 'text-embedding'.*IndexError: id 99"):
        with owner.fence():
            owner.resolve(requests((1, 2)), DictCache(), Encoder())

            def lookup():
                raise IndexError("id 99")

            owner.embed_text(lookup, reduced.append)
    assert reduced == []


def test_owner_path_runs_inside_the_allocation_context():
    # Production passes a context that suspends sglang's symmetric-memory pool.
    state = {"inside": False, "encoded_inside": None, "broadcast_inside": None}

    class Context:
        def __enter__(self):
            state["inside"] = True

        def __exit__(self, *exc):
            state["inside"] = False

    class Group(OneRankGroup):
        def broadcast(self, tensor, src=0):
            state["broadcast_inside"] = state["inside"]
            return super().broadcast(tensor, src)

    def encoder(reqs):
        state["encoded_inside"] = state["inside"]
        return Encoder()(reqs)

    run_preparation(session(Group(), allocation_context=Context), requests((1, 2)),
                    DictCache(), encoder)
    assert state == {"inside": False, "encoded_inside": True, "broadcast_inside": True}


def test_phase_hook_sees_the_phases_in_order():
    seen = []
    owner = session(on_phase=seen.append)
    with owner.fence():
        owner.resolve(requests((1, 2)), DictCache(), Encoder())
        owner.embed_text(lambda: torch.zeros(1))
    assert seen == [Phase.MANIFEST, Phase.PLAN, Phase.ENCODE, Phase.FEATURES,
                    Phase.TEXT_EMBEDDING]


def test_full_hit_resolves_with_one_status_round():
    group = OneRankGroup()
    cache = DictCache({1: span_for(1, 2), 2: span_for(2, 3)})
    encoder = Encoder()
    owner = session(group)
    with owner.fence():
        features = owner.resolve(requests((1, 2), (2, 3)), cache, encoder)
        assert group.calls == ["all_reduce_max"], "the fast path: one round in resolve"
        owner.features_ready()
    assert group.calls == ["all_reduce_max"] * 3  # + features_ready + fence end
    assert encoder.calls == [] and cache.freed == []
    assert features[(1, 2)] is cache.entries[1] and features[(2, 3)] is cache.entries[2]


def test_text_embedding_without_collective_leaves_features_ready_to_the_fence_end():
    group = OneRankGroup()
    owner = session(group)
    with owner.fence():
        owner.resolve(requests((1, 2)), DictCache({1: span_for(1, 2)}), Encoder())
        assert owner.embed_text(lambda: torch.ones(2)).tolist() == [1.0, 1.0]
    assert group.calls == ["all_reduce_max"] * 2  # manifest, fence end
    # Marking the features ready explicitly still costs its own round.
    group = OneRankGroup()
    owner = session(group)
    with owner.fence():
        owner.resolve(requests((1, 2)), DictCache({1: span_for(1, 2)}), Encoder())
        owner.embed_text(lambda: torch.ones(2))
        owner.features_ready()
    assert group.calls == ["all_reduce_max"] * 3


def test_local_text_lookup_failure_is_agreed_at_the_fence_end():
    group = OneRankGroup(global_rank=5)
    owner = session(group)

    def lookup():
        raise IndexError("id 77")

    with pytest.raises(OwnerProtocolError, match="phase 'text-embedding'.*global rank 5.*id 77"):
        with owner.fence():
            owner.resolve(requests((1, 2)), DictCache({1: span_for(1, 2)}), Encoder())
            owner.embed_text(lookup)
    # manifest round, then the round the peers' fence end meets, its details
    assert group.calls == ["all_reduce_max", "all_reduce_max", "all_gather_object"]
