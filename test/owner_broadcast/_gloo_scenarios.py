"""One rank of real gloo groups running the owner protocol through many scenarios.

Run as ``python _gloo_scenarios.py RANK 4 STORE_FILE OUT_FILE`` in four
processes (``--nccl RANK STORE_FILE OUT_FILE`` in two runs the same list over
NCCL on two GPUs: test/owner_broadcast/test_owner_nccl_gpu.py). Every member of a group runs the same scenario list in the same
order, the way every rank of a TP group prepares the same chunks; each
scenario writes one JSON line per rank.
A failure scenario that left a collective dangling would hang the next
scenario, so finishing the list is itself evidence that nothing hangs.

The input preparation mimics the production call order: fallible work
before the owner path, ``resolve``, assembly, the text embedding (a
vocab-parallel lookup plus a real all-reduce over the group, or, with
``text_local``, a replicated lookup without a collective), work after the
features are ready, all inside the session's fence. Each rank counts the
protocol's collectives (status rounds, object gathers, span broadcasts),
both inside ``resolve`` and for the whole preparation.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist

from sglang_dsv41.owner_broadcast.protocol import (
    OwnerProtocolError,
    OwnerSession,
    Phase,
    SpanRequest,
    TorchDistributedGroup,
)
from sglang_dsv41.owner_broadcast.routing import (
    ChunkSpan,
    OwnerRouter,
    Route,
    RoutingPolicy,
    SpanDirectory,
)

WIDTH = 16
VOCAB = 64
DTYPE = torch.float32


class InjectedFault(RuntimeError):
    pass


def reference_span(content_hash: int, span_len: int) -> torch.Tensor:
    """What the encoder produces for an image: a function of its content only."""
    generator = torch.Generator().manual_seed(content_hash * 1000 + span_len)
    return torch.randn(span_len, WIDTH, generator=generator, dtype=DTYPE)


class DictCache:
    def __init__(self, fail_get=False):
        self.entries = {}
        self.fail_get = fail_get

    def get(self, content_hash):
        if self.fail_get:
            raise InjectedFault("injected cache fault")
        return self.entries.get(content_hash)

    def set(self, content_hash, span):
        self.entries[content_hash] = span.clone()
        return True

    def free(self, content_hash):
        self.entries.pop(content_hash, None)


class CountingGroup:
    """The real group, counting the protocol's collectives."""

    def __init__(self, inner):
        self.inner = inner
        self.rank_in_group = inner.rank_in_group
        self.world_size = inner.world_size
        self.ranks = inner.ranks
        self.reset()

    def reset(self):
        self.counts = {"rounds": 0, "gathers": 0, "broadcasts": 0}

    def all_gather_object(self, obj):
        self.counts["gathers"] += 1
        return self.inner.all_gather_object(obj)

    def all_reduce_max(self, values):
        self.counts["rounds"] += 1
        return self.inner.all_reduce_max(values)

    def broadcast(self, tensor, src=0):
        self.counts["broadcasts"] += 1
        return self.inner.broadcast(tensor, src)


def text_table() -> torch.Tensor:
    return torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(7), dtype=DTYPE)


def run_scenario(group: CountingGroup, scenario: dict, device: torch.device = torch.device("cpu")) -> dict:
    """One scenario on this rank; ``device`` is where spans, caches and the
    text embedding live (cpu with gloo; this rank's GPU with NCCL)."""
    me = group.rank_in_group
    fault = scenario.get("fault")
    faulty = fault is not None and scenario["fault_rank"] == me

    def maybe_fail(phase: str):
        if faulty and fault == phase:
            raise InjectedFault(f"injected {phase} fault")

    spans = [tuple(s) for s in scenario.get("spans_on", {}).get(str(me), scenario["spans"])]
    cache = DictCache()
    for content_hash, span_len in scenario.get("cached_on", {}).get(str(me), []):
        cache.set(content_hash, reference_span(content_hash, span_len).to(device))
    for content_hash, bad in scenario.get("bad_cache", {}).get(str(me), []):
        cache.entries[content_hash] = {
            "shape": torch.zeros(3, WIDTH, dtype=DTYPE, device=device),
            "dtype": torch.zeros(2, WIDTH, dtype=torch.float16, device=device),
        }[bad]
    preloaded = set(cache.entries)
    cache.fail_get = faulty and fault == "cache"

    encoded_hashes = []

    def encode(requests):
        maybe_fail("encode")
        encoded_hashes.extend(r.content_hash for r in requests)
        return torch.cat([reference_span(r.content_hash, r.span_len) for r in requests]).to(device)

    def signature(item, span_len):
        maybe_fail("manifest")
        return {"grid": item["grid"]}

    def allocate(shape, dtype, device):
        maybe_fail("receive-buffer")
        return torch.empty(shape, dtype=dtype, device=device)

    def on_phase(phase: Phase):
        if phase is Phase.PLAN:
            maybe_fail("plan")
        if phase is Phase.FEATURES:
            maybe_fail("features")

    rids = list(scenario["rids"])
    if fault == "rids" and faulty:
        rids = rids + ["stray"]
    # The same grid written with floats: equal to Python, a different digest.
    grid_of = (lambda n: (float(n), 1.0)) if scenario.get("float_grid_rank") == me else (lambda n: (n, 1))
    requests = [
        SpanRequest(
            content_hash=h,
            span_len=n,
            item={"grid": grid_of(n)},
            duplicates=[
                {"grid": (n, 2) if (fault == "geometry" and faulty) else grid_of(n)}
            ],
        )
        for h, n in spans
    ]

    local_encode = bool(scenario.get("local_encode"))
    session = OwnerSession(
        group,
        device=device,
        dtype=DTYPE,
        width=WIDTH,
        request_ids=rids,
        signature=signature,
        allocate=allocate,
        on_phase=on_phase,
        local_encode=local_encode,
    )

    def stock_encode():
        """What stock sglang does on every rank: local lookups, every miss
        encoded and cached here (no resolve, no collective)."""
        features, misses = {}, []
        for h, n in spans:
            hit = cache.get(h)
            if hit is not None and hit.shape[0] == n:
                features[(h, n)] = hit
            else:
                misses.append(SpanRequest(content_hash=h, span_len=n, item={"grid": (n, 1)}))
        if misses:
            encoded = torch.split(encode(misses), [r.span_len for r in misses])
            for request, span in zip(misses, encoded):
                cache.set(request.content_hash, span.clone())
                features[request.key] = span
        return features
    table = text_table().to(device)
    shard = (torch.arange(VOCAB) % group.world_size == me).to(device)
    ids = torch.tensor(scenario.get("text_ids", [1, 5, 9, 33]), device=device)

    def lookup():
        maybe_fail("text-embedding")
        return table[ids] * shard[ids].unsqueeze(1).to(DTYPE)

    def replicated_lookup():
        maybe_fail("text-embedding")
        return table[ids].clone()

    def reduce(partial):
        dist.all_reduce(partial, group=group.inner.tensor_group)
        return partial

    result = {"scenario": scenario["name"], "rank": me, "global_rank": group.ranks[me],
              "resolve_counts": None}
    group.reset()
    try:
        with session.fence():
            maybe_fail("prepare")
            if local_encode:
                features = stock_encode()
            else:
                features = session.resolve(requests, cache, encode)
            result["resolve_counts"] = dict(group.counts)
            ordered = torch.cat([features[key] for key in spans])
            if scenario.get("text_local"):
                text = session.embed_text(replicated_lookup)
            else:
                text = session.embed_text(lookup, reduce)
            maybe_fail("finalize")
        ordered, text = ordered.cpu(), text.cpu()
        digest = hashlib.sha256(ordered.numpy().tobytes() + text.numpy().tobytes()).hexdigest()
        expected = torch.cat([reference_span(h, n) for h, n in spans])
        result.update(
            status="ok",
            digest=digest,
            features_match_reference=bool(torch.equal(ordered, expected)),
            text_matches_reference=bool(torch.equal(text, table[ids].cpu())),
        )
    except OwnerProtocolError as exc:
        result.update(status="agreed-error", error=str(exc))
    except Exception as exc:  # not agreed: a defect in the protocol
        result.update(status="local-error", error=f"{type(exc).__name__}: {exc}")
    result["encoded"] = encoded_hashes
    result["broadcasts"] = group.counts["broadcasts"]
    result["counts"] = dict(group.counts)
    new_entries = sorted(set(cache.entries) - preloaded)
    result["new_cache_entries"] = new_entries
    # Every entry left in the cache is a complete, correct span.
    result["cache_all_valid"] = all(
        isinstance(entry, torch.Tensor)
        and entry.shape == (dict(spans)[h], WIDTH)
        and entry.device == device
        and torch.equal(entry.cpu(), reference_span(h, dict(spans)[h]))
        for h, entry in cache.entries.items()
    )
    return result


def scenarios(world: int) -> list:
    # Hashes 0..2*world-1 give every rank two spans to own; lengths vary.
    spans = [[h, 3 + (h * 5) % 7] for h in range(2 * world)]
    everyone = {str(r): spans for r in range(world)}
    out = [
        dict(name="cold", spans=spans, rids=["a", "b"]),
        dict(name="all-cached", spans=spans, rids=["a"], cached_on=everyone),
        # Rank 0's cache holds every span: it sends them all, nobody encodes.
        dict(name="owner-cached", spans=spans, rids=["c"], cached_on={"0": spans}),
        dict(name="bad-cache", spans=spans, rids=["d"],
             cached_on={str(r): spans for r in range(1, world)},
             bad_cache={"0": [[1, "shape"], [2, "dtype"]]}),
        dict(name="duplicate-geometry", spans=spans, rids=["e"], fault="geometry", fault_rank=world - 1),
        dict(name="rid-mismatch", spans=spans, rids=["f"], fault="rids", fault_rank=world - 1),
    ]
    phases = ["prepare", "manifest", "plan", "encode", "receive-buffer", "features",
              "text-embedding", "finalize"]
    for phase in phases:
        for rank in range(world):
            out.append(dict(name=f"fault-{phase}-rank{rank}", spans=spans, rids=["g", "h"],
                            fault=phase, fault_rank=rank))
    out += fast_path_scenarios(world, spans, everyone)
    # Status-only sessions (the not-worth route): every rank encodes for
    # itself; a failure on one rank is still agreed.
    out.append(dict(name="local-cold", spans=spans, rids=["l"], local_encode=True))
    out.append(dict(name="local-cold-text-local", spans=spans, rids=["l"], local_encode=True,
                    text_local=True))
    for phase in LOCAL_FAULTS:
        for rank in range(world):
            out.append(dict(name=f"local-fault-{phase}-rank{rank}", spans=spans, rids=["m", "n"],
                            fault=phase, fault_rank=rank, local_encode=True))
    out.append(dict(name="after-faults", spans=spans, rids=["z"]))
    return out


FAST_FAULTS = ["prepare", "manifest", "cache", "features", "text-embedding", "finalize"]
LOCAL_FAULTS = ["prepare", "cache", "encode", "text-embedding", "finalize"]


def fast_path_scenarios(world: int, spans: list, everyone: dict) -> list:
    """Batches every rank holds in its cache (the fast path), and batches one
    rank away from it."""
    half = spans[::2]
    many = [[1000 + h, 1 + h % 3] for h in range(70)]  # more spans than the bit mask holds
    out = [
        dict(name="all-cached-local-text", spans=spans, rids=["l"], cached_on=everyone,
             text_local=True),
        # The same half of the spans cached on every rank: equal flags, no flags round.
        dict(name="half-cached-everywhere", spans=spans, rids=["p"],
             cached_on={str(r): half for r in range(world)}),
        dict(name="many-cached", spans=many, rids=["q"],
             cached_on={str(r): many for r in range(world)}),
        dict(name="many-cold", spans=many, rids=["q"]),
    ]
    for rank in range(world):
        # Rank `rank` lacks the span hash mod R would give it (hash `rank`):
        # a peer that holds it sends it.
        own = [s for s in spans if s[0] != rank]
        out.append(dict(name=f"missing-own-rank{rank}", spans=spans, rids=["m"],
                        cached_on={**everyone, str(rank): own}))
        # Rank `rank` lacks a span another rank owns: broadcast from that cache.
        other = (rank + 1) % world
        rest = [s for s in spans if s[0] != other]
        out.append(dict(name=f"missing-other-rank{rank}", spans=spans, rids=["m"],
                        cached_on={**everyone, str(rank): rest}))
        for phase in FAST_FAULTS:
            out.append(dict(name=f"cached-fault-{phase}-rank{rank}", spans=spans, rids=["g", "h"],
                            cached_on=everyone, fault=phase, fault_rank=rank))
        for phase in ("text-embedding", "finalize"):
            out.append(dict(name=f"cached-local-fault-{phase}-rank{rank}", spans=spans,
                            rids=["g", "h"], cached_on=everyone, text_local=True,
                            fault=phase, fault_rank=rank))
    last = world - 1
    longer = [[h, n + 1] if h == 0 else [h, n] for h, n in spans]
    extra = spans + [[2 * world + 1, 5]]
    out += [
        # Ranks handed different batches, every span cached: the fast round
        # must not let them through.
        dict(name="cached-span-length-mismatch", spans=spans, spans_on={str(last): longer},
             rids=["x"], cached_on={**everyone, str(last): longer}),
        dict(name="cached-extra-span", spans=spans, spans_on={str(last): extra},
             rids=["x"], cached_on={**everyone, str(last): extra}),
        dict(name="cached-rid-mismatch", spans=spans, rids=["f"], cached_on=everyone,
             fault="rids", fault_rank=last),
        # Equal geometry, different encoding: the digests differ, the
        # manifests compare equal, so the batch runs through the detail round.
        dict(name="cached-float-geometry", spans=spans, rids=["y"], cached_on=everyone,
             float_grid_rank=last),
    ]
    return out


class LruCache(DictCache):
    """Bounded by bytes and least-recently-used first, like sglang's
    MultiModalStaticCache, so a long history evicts."""

    def __init__(self, capacity_bytes):
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.entries = OrderedDict()

    def get(self, content_hash):
        entry = self.entries.get(content_hash)
        if entry is not None:
            self.entries.move_to_end(content_hash)
        return entry

    def set(self, content_hash, span):
        if content_hash in self.entries:
            self.entries.move_to_end(content_hash)
            return True
        size = span.numel() * span.element_size()
        if size > self.capacity_bytes:
            return False
        while sum(e.numel() * e.element_size() for e in self.entries.values()) + size > self.capacity_bytes:
            self.entries.popitem(last=False)
        self.entries[content_hash] = span.clone()
        return True


def routing_history(group: CountingGroup, chunks: int = 80) -> dict:
    """A long run of chunks through the router, as the OWN-FENCE hook runs
    them: the protocol for the owner route, stock's local lookups and
    encodes otherwise, the directory recorded after each chunk. Halfway
    through, the last rank loses its whole cache (its peers do not)."""
    me, world = group.rank_in_group, group.world_size
    rng = random.Random(11)  # the same chunks on every rank
    pool = [(content_hash, rng.choice([(2, 2), (3, 6), (8, 8)])) for content_hash in range(30)]
    span_len_of = lambda grid: 2 + grid[0] * (grid[1] + 1)
    row_bytes = WIDTH * torch.finfo(DTYPE).bits // 8
    capacity = 6 * span_len_of((8, 8)) * row_bytes
    # Mode guarded: its routes are auto's, and its not-worth chunks run in a
    # status-only session, which this history must keep aligned too.
    router = OwnerRouter(world, RoutingPolicy(mode="guarded", per_image_cost=20, min_saving=30),
                         SpanDirectory(capacity), row_bytes)
    cache = LruCache(capacity)
    table = text_table()
    ids = torch.tensor([1, 5, 9, 33])
    lines = []
    for index in range(chunks):
        if index == chunks // 2 and me == world - 1:
            cache.entries.clear()
        picked = rng.sample(pool[: 8 if index % 3 else 30], rng.randrange(1, 5))
        spans = [ChunkSpan(h, span_len_of(grid), grid) for h, grid in picked]
        route = router.route(spans)
        group.reset()
        encoded = []

        def encode(requests):
            encoded.extend(r.content_hash for r in requests)
            return [reference_span(r.content_hash, r.span_len) for r in requests]

        if route is Route.OWNER:
            # owners balanced by the router's own costs, as production sets them
            session = OwnerSession(group, device=torch.device("cpu"), dtype=DTYPE, width=WIDTH,
                                   request_ids=[f"chunk{index}"], signature=lambda item, n: item,
                                   span_cost=lambda r: 20 + r.item[0] * r.item[1])
            requests = [SpanRequest(content_hash=s.content_hash, span_len=s.span_len, item=s.grid)
                        for s in spans]
            with session.fence():
                features = session.resolve(requests, cache, encode)
                session.embed_text(lambda: table[ids].clone())
        else:  # stock: local lookups, every miss encoded here
            # not-worth: inside a status-only session, as the OWN-FENCE hook
            # runs it in mode guarded; known: no session at all.
            session = OwnerSession(group, device=torch.device("cpu"), dtype=DTYPE, width=WIDTH,
                                   request_ids=[f"chunk{index}"], signature=lambda item, n: item,
                                   local_encode=True,
                                   engaged=route is Route.NOT_WORTH and router.guards_stock_encodes)
            with session.fence():
                features, misses = {}, []
                for s in spans:
                    hit = cache.get(s.content_hash)
                    if hit is not None and hit.shape[0] == s.span_len:
                        features[(s.content_hash, s.span_len)] = hit
                    else:
                        misses.append(SpanRequest(content_hash=s.content_hash, span_len=s.span_len,
                                                  item=s.grid))
                for request, span in zip(misses, encode(misses)):
                    cache.set(request.content_hash, span)
                    features[request.key] = span
                session.embed_text(lambda: table[ids].clone())
        router.completed(spans)
        ordered = torch.cat([features[(s.content_hash, s.span_len)] for s in spans])
        expected = torch.cat([reference_span(s.content_hash, s.span_len) for s in spans])
        lines.append({
            "route": route.value,
            "counts": dict(group.counts),
            "encoded": encoded,
            "matches_reference": bool(torch.equal(ordered, expected)),
            "directory": router.directory.digest(),
        })
    return {"scenario": "routing-history", "rank": me, "global_rank": group.ranks[me],
            "status": "ok", "chunks": lines,
            "directory_bytes": router.directory.bytes, "capacity": capacity}


GROUPS = {2: [2, 3], 3: [1, 2, 3], 4: [0, 1, 2, 3]}  # size -> global ranks


def main():
    """Four processes; groups of 2, 3 and 4 of them run the scenario list in
    turn. The smaller groups start above global rank 0, so group ranks and
    global ranks differ there."""
    rank, world, store, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    results = []
    for size, members in sorted(GROUPS.items()):
        members = [m for m in members if m < world]
        handle = dist.group.WORLD if len(members) == world else dist.new_group(members)
        if rank not in members:
            continue
        group = CountingGroup(TorchDistributedGroup(handle))
        for scenario in scenarios(len(members)):
            result = run_scenario(group, scenario)
            result["world"] = len(members)
            results.append(result)
        result = routing_history(group)
        result["world"] = len(members)
        results.append(result)
    with open(out_path, "w") as handle:
        for result in results:
            handle.write(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def nccl_main():
    """``python _gloo_scenarios.py --nccl RANK STORE_FILE OUT_FILE`` in two
    processes on two GPUs: the same scenario list over NCCL, as production
    runs it (status rounds, span broadcasts and the text all-reduce on the
    GPUs; object gathers on a gloo group), spans and caches on each rank's
    GPU."""
    rank, store, out_path = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60), device_id=device)
    object_group = dist.new_group([0, 1], backend="gloo")
    group = CountingGroup(TorchDistributedGroup(dist.group.WORLD, object_group))
    with open(out_path, "w") as handle:
        for scenario in scenarios(2):
            result = run_scenario(group, scenario, device)
            result["world"] = 2
            handle.write(json.dumps(result) + "\n")
    dist.barrier(group=object_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--nccl":
        nccl_main()
    else:
        main()
