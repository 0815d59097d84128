"""One rank of real gloo groups running the owner protocol through many scenarios.

Run as ``python gloo_scenarios.py RANK 4 STORE_FILE OUT_FILE`` in four
processes. Every member of a group runs the same scenario list in the same
order, the way every rank of a TP group prepares the same chunks; each
scenario writes one JSON line per rank.
A failure scenario that left a collective dangling would hang the next
scenario, so finishing the list is itself evidence that nothing hangs.

The input preparation mimics the production call order: fallible work
before the owner path, ``resolve``, assembly, the text embedding (a
vocab-parallel lookup plus a real all-reduce over the group), work after
the features are ready, all inside the session's fence.
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from sglang_dsv41.core.owner_embedding import (
    OwnerProtocolError,
    OwnerSession,
    Phase,
    SpanRequest,
    TorchDistributedGroup,
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
    def __init__(self):
        self.entries = {}

    def get(self, content_hash):
        return self.entries.get(content_hash)

    def set(self, content_hash, span):
        self.entries[content_hash] = span.clone()
        return True

    def free(self, content_hash):
        self.entries.pop(content_hash, None)


class CountingGroup:
    """The real group, counting span broadcasts."""

    def __init__(self, inner):
        self.inner = inner
        self.rank_in_group = inner.rank_in_group
        self.world_size = inner.world_size
        self.ranks = inner.ranks
        self.broadcasts = 0

    def all_gather_object(self, obj):
        return self.inner.all_gather_object(obj)

    def broadcast_object(self, obj=None, src=0):
        return self.inner.broadcast_object(obj, src)

    def broadcast(self, tensor, src=0):
        self.broadcasts += 1
        return self.inner.broadcast(tensor, src)


def text_table() -> torch.Tensor:
    return torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(7), dtype=DTYPE)


def run_scenario(group: CountingGroup, scenario: dict) -> dict:
    me = group.rank_in_group
    fault = scenario.get("fault")
    faulty = fault is not None and scenario["fault_rank"] == me

    def maybe_fail(phase: str):
        if faulty and fault == phase:
            raise InjectedFault(f"injected {phase} fault")

    spans = [tuple(s) for s in scenario["spans"]]  # (hash, span_len)
    cache = DictCache()
    for content_hash, span_len in scenario.get("cached_on", {}).get(str(me), []):
        cache.set(content_hash, reference_span(content_hash, span_len))
    for content_hash, bad in scenario.get("bad_cache", {}).get(str(me), []):
        cache.entries[content_hash] = {
            "shape": torch.zeros(3, WIDTH, dtype=DTYPE),
            "dtype": torch.zeros(2, WIDTH, dtype=torch.float16),
        }[bad]
    preloaded = set(cache.entries)

    encoded_hashes = []

    def encode(requests):
        maybe_fail("encode")
        encoded_hashes.extend(r.content_hash for r in requests)
        return torch.cat([reference_span(r.content_hash, r.span_len) for r in requests])

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
    requests = [
        SpanRequest(
            content_hash=h,
            span_len=n,
            item={"grid": (n, 1)},
            duplicates=[
                {"grid": (n, 2) if (fault == "geometry" and faulty) else (n, 1)}
            ],
        )
        for h, n in spans
    ]

    session = OwnerSession(
        group,
        device=torch.device("cpu"),
        dtype=DTYPE,
        width=WIDTH,
        request_ids=rids,
        signature=signature,
        allocate=allocate,
        on_phase=on_phase,
    )
    table = text_table()
    shard = torch.arange(VOCAB) % group.world_size == me
    ids = torch.tensor(scenario.get("text_ids", [1, 5, 9, 33]))

    def lookup():
        maybe_fail("text-embedding")
        return table[ids] * shard[ids].unsqueeze(1).to(DTYPE)

    def reduce(partial):
        dist.all_reduce(partial, group=group.inner.tensor_group)
        return partial

    result = {"scenario": scenario["name"], "rank": me, "global_rank": group.ranks[me]}
    try:
        with session.fence():
            maybe_fail("prepare")
            features = session.resolve(requests, cache, encode)
            ordered = torch.cat([features[key] for key in spans])
            text = session.embed_text(lookup, reduce)
            maybe_fail("finalize")
        digest = hashlib.sha256(ordered.numpy().tobytes() + text.numpy().tobytes()).hexdigest()
        expected = torch.cat([reference_span(h, n) for h, n in spans])
        result.update(
            status="ok",
            digest=digest,
            features_match_reference=bool(torch.equal(ordered, expected)),
            text_matches_reference=bool(torch.equal(text, table[ids])),
        )
    except OwnerProtocolError as exc:
        result.update(status="agreed-error", error=str(exc))
    except Exception as exc:  # not agreed: a defect in the protocol
        result.update(status="local-error", error=f"{type(exc).__name__}: {exc}")
    result["encoded"] = encoded_hashes
    result["broadcasts"] = group.broadcasts
    new_entries = sorted(set(cache.entries) - preloaded)
    result["new_cache_entries"] = new_entries
    # Every entry left in the cache is a complete, correct span.
    result["cache_all_valid"] = all(
        isinstance(entry, torch.Tensor)
        and entry.shape == (dict(spans)[h], WIDTH)
        and torch.equal(entry, reference_span(h, dict(spans)[h]))
        for h, entry in cache.entries.items()
    )
    group.broadcasts = 0
    return result


def scenarios(world: int) -> list:
    # Hashes 0..2*world-1 give every rank two spans to own; lengths vary.
    spans = [[h, 3 + (h * 5) % 7] for h in range(2 * world)]
    everyone = {str(r): spans for r in range(world)}
    out = [
        dict(name="cold", spans=spans, rids=["a", "b"]),
        dict(name="all-cached", spans=spans, rids=["a"], cached_on=everyone),
        # Rank 0's cache: its own spans broadcast from cache, the rest encoded.
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
    out.append(dict(name="after-faults", spans=spans, rids=["z"]))
    return out


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
    with open(out_path, "w") as handle:
        for result in results:
            handle.write(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
