"""Replicated image encode vs owner broadcast, per batch of images, from one run.

Stock sglang encodes every image of a chunk on every rank of a TP group. The
owner protocol (sglang_dsv41.owner_broadcast.protocol) encodes each image once, on
its owner, and broadcasts it. This script times both for a batch of images
through a ViT-shaped encoder with random weights, for several image sizes and
cache-hit rates, and prints time per batch and ours/replicated.

"ours" is what the plugin does with a batch: the router
(sglang_dsv41.owner_broadcast.routing) decides from the batch alone, and the
`route` column says what it chose: `owner` (the protocol), `known` (every
span recorded in the group's directory: stock lookups), `not-worth` (the
owner path would not save encoder time: stock encode; with `--routing
guarded` inside a status-only session, two status rounds). Cache hits are
preloaded into the cache and recorded in the directory, as an earlier chunk
of the same images would have left them. `--routing always` sends every
batch through the protocol (the behaviour before routing).

`--assembly` adds to both variants what every rank then does with the
chunk's features in sglang (text embedding, spans scattered over their
placeholder rows; ChunkAssembly): without it a full hit is a bare dict lookup
per image, far cheaper than any real chunk, and `known` rows overstate what
the routing adds.

Imports only torch and sglang_dsv41.owner_broadcast's plain modules (protocol,
routing; no sglang; run with PYTHONPATH=python).

Modes
  --mode gloo --world N      N CPU processes, real gloo group, real protocol.
                             Both variants run in every rank; the time of a batch
                             is the slowest rank's (the group waits for it).
  --mode single-gpu --world R
                             What one GPU can measure for a group of R:
                               measured  encoder time for all cache misses
                               measured  encoder time for each owner's share
                                         (owners as the protocol balances them;
                                         --owners hash: hash mod R); the largest counts
                               measured  device copy of each owner's payload
                                         bytes (a stand-in for the broadcast)
                               measured  the protocol's agreements: the real
                                         protocol over R gloo CPU processes with
                                         one-wide spans and a no-op encoder (its
                                         status rounds are gloo all-reduces here;
                                         production runs them on NCCL)
                               measured  one status round on this GPU: a one-rank
                                         NCCL group, host list -> device MAX
                                         all-reduce -> host list (the device floor
                                         of a round, without peer latency)
                               derived   owner = max share + copies + agreements;
                                         replicated = all misses
  --mode nccl --world 2      Two GPUs, NCCL for spans and status rounds, gloo for
                             the object gathers that follow a failure,
                             real protocol; skips (exit 0) with fewer GPUs.
  --mode shares --world R --images N
                             CPU only, no encoder: how evenly the owners share
                             the encoder work of N cold images (cost = per-image
                             cost + patches, the routing's units), for batches
                             of a realistic size mix drawn from a fixed seed,
                             under hash mod R and under the balanced rule the
                             protocol uses. The busiest owner's work against
                             the ideal (an R-th of the batch); the last line is
                             the balanced rule's worst batch, `busiest/ideal X.XX`.

Examples
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_embedding.py --mode gloo --world 2
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_embedding.py --mode single-gpu --world 8
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_embedding.py --mode nccl --world 2
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_embedding.py --mode shares --world 8 --images 32
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from sglang_dsv41.owner_broadcast.protocol import OwnerSession, SpanRequest, TorchDistributedGroup
from sglang_dsv41.owner_broadcast.routing import (ChunkSpan, OwnerRouter, RequestImages, Route,
                                             RoutingPolicy, SpanDirectory, balanced_owners,
                                             owner_loads, owner_of)

PRESETS = {
    # Sized like DeepSeek-V4.1's vision tower and hidden size.
    "gpu": dict(dim=1024, heads=16, inter=2816, layers=24, hidden=7168, dtype="bfloat16",
                sizes="8x8,32x32,64x64", images=8, hit_rates="0,0.5,1", iters=10, warmup=2),
    # Same shape, narrower and shallower, so a 2-core CPU finishes in a minute or two.
    "cpu": dict(dim=256, heads=4, inter=704, layers=4, hidden=1024, dtype="float32",
                sizes="4x4,16x16,32x32", images=8, hit_rates="0,0.5,1", iters=3, warmup=1),
}
PATCH = 14
RATIO = 3


# ---------------------------------------------------------------- the encoder


class Block(nn.Module):
    def __init__(self, dim, heads, inter):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, inter), nn.Linear(inter, dim)

    def forward(self, x):
        tokens, dim = x.shape
        # [1, heads, tokens, head_dim]: the layout fused attention kernels take
        q, k, v = self.qkv(self.norm1(x)).view(1, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(tokens, dim)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ViTLike(nn.Module):
    """Patch embedding, transformer blocks, an r x r merge into the LM width,
    and start / newline / end rows around the grid, like DeepSeek-V4.1's spans."""

    def __init__(self, dim, heads, inter, layers, hidden):
        super().__init__()
        self.patch_embed = nn.Linear(3 * PATCH * PATCH, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, inter) for _ in range(layers))
        self.aligner = nn.Linear(dim * RATIO * RATIO, hidden)
        self.specials = nn.Parameter(torch.randn(3, hidden))

    @staticmethod
    def span_len(grid_h, grid_w):
        n_h, n_w = math.ceil(grid_h / RATIO), math.ceil(grid_w / RATIO)
        return 2 + n_h * (n_w + 1)

    @torch.inference_mode()
    def encode_image(self, pixels, grid_h, grid_w):
        x = self.patch_embed(pixels)
        for block in self.blocks:
            x = block(x)
        n_h, n_w = math.ceil(grid_h / RATIO), math.ceil(grid_w / RATIO)
        grid = x.view(grid_h, grid_w, -1)
        grid = F.pad(grid, (0, 0, 0, n_w * RATIO - grid_w, 0, n_h * RATIO - grid_h))
        merged = grid.view(n_h, RATIO, n_w, RATIO, -1).permute(0, 2, 1, 3, 4).reshape(n_h, n_w, -1)
        rows = self.aligner(merged)  # [n_h, n_w, hidden]
        newline = self.specials[1].expand(n_h, 1, -1)
        body = torch.cat([rows, newline], dim=1).reshape(-1, rows.shape[-1])
        return torch.cat([self.specials[:1], body, self.specials[2:]])

    def __call__(self, requests):
        # One call for all of a rank's misses; images are encoded one by one
        # inside, as DeepSeek-V4.1's get_image_feature does.
        return [self.encode_image(r.item.pixels, r.item.grid_h, r.item.grid_w) for r in requests]


# ---------------------------------------------------------------- pieces


class DictCache:
    def __init__(self):
        self.entries = {}

    def get(self, content_hash):
        return self.entries.get(content_hash)

    def set(self, content_hash, span):
        self.entries[content_hash] = span
        return True

    def free(self, content_hash):
        self.entries.pop(content_hash, None)


def parse_sizes(text):
    return [tuple(int(v) for v in size.split("x")) for size in text.split(",")]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_requests(seed, images, grid, pixels):
    """One batch: distinct content hashes (fresh per batch, so nothing leaks
    between measurements), one grid size."""
    generator = torch.Generator().manual_seed(seed)
    hashes = torch.randint(0, 2**62, (images,), generator=generator).tolist()
    span_len = ViTLike.span_len(*grid)
    item = SimpleNamespace(pixels=pixels, grid_h=grid[0], grid_w=grid[1])
    return [SpanRequest(content_hash=h, span_len=span_len, item=item, inside_chunk=True)
            for h in hashes]


def preload(cache, requests, hit_rate, hidden, dtype, device):
    hits = round(hit_rate * len(requests))
    for request in requests[:hits]:
        cache.set(request.content_hash, torch.zeros(request.span_len, hidden, dtype=dtype, device=device))


def replicated_encode(requests, cache, encoder):
    """What every rank does in stock sglang: serve hits, encode every miss."""
    features, misses = {}, []
    for request in requests:
        span = cache.get(request.content_hash)
        if span is not None and span.shape[0] == request.span_len:
            features[request.key] = span
        else:
            misses.append(request)
    if misses:
        for request, span in zip(misses, encoder(misses)):
            cache.set(request.content_hash, span)
            features[request.key] = span
    return features


def make_router(args, world, requests, hit_rate, hidden, dtype):
    """A router whose directory knows the preloaded hits."""
    policy = RoutingPolicy(mode=args.routing, per_image_cost=args.per_image_cost,
                           min_saving=args.min_saving)
    router = OwnerRouter(world, policy, SpanDirectory(1 << 40), hidden * torch.finfo(dtype).bits // 8)
    router.completed(chunk_spans(requests[: round(hit_rate * len(requests))]))
    return router


def chunk_spans(requests):
    return [ChunkSpan(r.content_hash, r.span_len, (r.item.grid_h, r.item.grid_w)) for r in requests]


def routed_encode(router, group, requests, cache, encoder, hidden, dtype, device):
    """What the plugin does with a chunk: route it from its metadata as
    OWN-FENCE does on a request's first chunk (the batch as one new request:
    its items read into a table, the table routed), then the protocol or
    stock's replicated path (with --routing guarded, a not-worth batch runs
    it inside a status-only session: two status rounds; without a group, as
    in single-gpu mode, the caller adds them); record the spans unless the
    chunk was known. Returns the route and the features."""
    rows, start = [], 0
    for request in requests:
        # (offsets, precomputed, content hash, grid): ItemMeta's fields as the
        # plain tuple OWN-FENCE reads each sglang item into
        end = start + request.span_len
        rows.append(([(start, end - 1)], False, request.content_hash,
                     (request.item.grid_h, request.item.grid_w)))
        start = end
    route, spans = router.route_requests([RequestImages(rows)], [0], [start])
    if route is Route.OWNER:
        features = owner_encode(group, requests, cache, encoder, hidden, dtype, device)
    elif route is Route.NOT_WORTH and group is not None and router.guards_stock_encodes:
        session = OwnerSession(group, device=device, dtype=dtype, width=hidden, request_ids=["bench"],
                               signature=lambda item, n: (item.grid_h, item.grid_w), local_encode=True)
        with session.fence():
            features = replicated_encode(requests, cache, encoder)
            session.features_ready()
    else:
        features = replicated_encode(requests, cache, encoder)
    if route is not Route.KNOWN:
        router.completed(spans)
    return route, features


class ChunkAssembly:
    """What every rank does with a chunk's image features once they are
    resolved, cached or not, in either variant: sglang's embed_mm_inputs
    clamps the chunk's ids, looks the text up and scatters the spans over
    their placeholder rows. Here: a chunk of the batch's spans plus 64 text
    tokens, an embedding of VOCAB rows, the spans concatenated and
    masked-scattered (no TP all-reduce of the text embedding: one process)."""

    VOCAB = 32768
    TEXT_TOKENS = 64

    def __init__(self, requests, hidden, dtype, device):
        self.embedding = nn.Embedding(self.VOCAB, hidden).to(device, dtype)
        placeholder = torch.full((sum(r.span_len for r in requests),), self.VOCAB + 7)
        text = torch.arange(self.TEXT_TOKENS) % self.VOCAB
        self.ids = torch.cat([text[:32], placeholder, text[32:]]).to(device)
        self.keys = [r.key for r in requests]

    def __call__(self, features):
        ids = self.ids.clone()
        mask = (ids >= self.VOCAB).unsqueeze(-1)
        embeds = self.embedding(ids.clamp_(max=self.VOCAB - 1))
        return embeds.masked_scatter_(mask, torch.cat([features[key] for key in self.keys]))


def owner_encode(group, requests, cache, encoder, hidden, dtype, device):
    session = OwnerSession(group, device=device, dtype=dtype, width=hidden,
                           request_ids=["bench"], signature=lambda item, n: (item.grid_h, item.grid_w))
    with session.fence():
        features = session.resolve(requests, cache, encoder)
        session.features_ready()
    return features


# ---------------------------------------------------------------- distributed modes


def group_worker(rank, world, backend, store, args, queue):
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    torch.set_num_threads(args.threads)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    object_group = dist.new_group(list(range(world)), backend="gloo") if backend == "nccl" else None
    group = TorchDistributedGroup(dist.group.WORLD, object_group)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    encoder = ViTLike(args.dim, args.heads, args.inter, args.layers, args.hidden).to(device, dtype)

    def slowest(seconds):
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=object_group)
        return value.item()

    rows = []
    seed = 0
    for grid in parse_sizes(args.sizes):
        pixels = torch.randn(grid[0] * grid[1], 3 * PATCH * PATCH, device=device, dtype=dtype)
        for hit_rate in [float(v) for v in args.hit_rates.split(",")]:
            timings = {"replicated": [], "ours": []}
            routes = set()
            for iteration in range(args.warmup + args.iters):
                for variant in ("replicated", "ours"):
                    seed += 1
                    requests = batch_requests(seed, args.images, grid, pixels)
                    cache = DictCache()
                    preload(cache, requests, hit_rate, args.hidden, dtype, device)
                    router = make_router(args, world, requests, hit_rate, args.hidden, dtype)
                    assemble = ChunkAssembly(requests, args.hidden, dtype, device) if args.assembly else None
                    dist.barrier(group=object_group)
                    start = time.perf_counter()
                    if variant == "replicated":
                        features = replicated_encode(requests, cache, encoder)
                    else:
                        route, features = routed_encode(router, group, requests, cache, encoder,
                                                        args.hidden, dtype, device)
                        routes.add(route.value)
                    if assemble is not None:
                        assemble(features)
                    synchronize(device)
                    elapsed = slowest(time.perf_counter() - start)
                    if iteration >= args.warmup:
                        timings[variant].append(elapsed)
            rows.append((grid, hit_rate, ViTLike.span_len(*grid), "/".join(sorted(routes)),
                         statistics.median(timings["replicated"]), statistics.median(timings["ours"])))
    if rank == 0:
        queue.put(rows)
    dist.barrier(group=object_group)
    dist.destroy_process_group()


def _spawn_ranks(world, target, worker_args):
    """Start ``world`` spawned ranks sharing a file store; return what rank 0 puts on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=worker_args(rank, store, queue))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        result = queue.get()
        for proc in procs:
            proc.join()
    return result


def run_group(args, backend):
    rows = _spawn_ranks(args.world, group_worker, lambda rank, store, queue: (
        rank, args.world, backend, store, args, queue))
    header = (f"mode={args.mode} world={args.world} images/batch={args.images} "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
              f"encoder: dim={args.dim} heads={args.heads} inter={args.inter} layers={args.layers} "
              f"hidden={args.hidden} {args.dtype} threads/rank={args.threads} "
              f"median of {args.iters} batches; time = slowest rank; {policy_text(args)}; "
              f"{assembly_text(args)}")
    print(header)
    print(f"{'grid':>7} {'span':>5} {'hits':>5} {'route':>9} {'replicated ms':>14} {'ours ms':>10} "
          f"{'ours/repl':>10}")
    for grid, hit_rate, span_len, route, replicated, ours in rows:
        print(f"{grid[0]:>3}x{grid[1]:<3} {span_len:>5} {hit_rate:>5.2f} {route:>9} "
              f"{replicated * 1e3:>14.3f} {ours * 1e3:>10.3f} {ours / replicated:>10.2f}")


def assembly_text(args):
    if args.assembly:
        return "both variants include the chunk assembly (--assembly)"
    return "features only (no chunk assembly)"


def policy_text(args):
    if args.routing == "always":
        return "routing always (every batch through the protocol)"
    return (f"routing {args.routing} (per-image cost {args.per_image_cost}, "
            f"min saving {args.min_saving})")


# ---------------------------------------------------------------- single GPU


def agreement_worker(rank, world, store, args, plans, queue):
    """The real protocol on gloo CPU processes with one-wide spans and a
    no-op encoder: what the agreements and span bookkeeping cost."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    group = TorchDistributedGroup(dist.group.WORLD)

    def no_op_encoder(requests):
        return [torch.zeros(r.span_len, 1) for r in requests]

    out = {}
    for plan_index, (key, (span_lens, hits)) in enumerate(plans.items()):
        times = []
        for iteration in range(args.warmup + args.iters):
            generator = torch.Generator().manual_seed(10_000 * plan_index + iteration)
            hashes = torch.randint(0, 2**62, (len(span_lens),), generator=generator).tolist()
            requests = [SpanRequest(content_hash=h, span_len=n, item=SimpleNamespace(grid_h=n, grid_w=1))
                        for h, n in zip(hashes, span_lens)]
            cache = DictCache()
            preload(cache, requests, hits / max(len(requests), 1), 1, torch.float32, torch.device("cpu"))
            dist.barrier()
            start = time.perf_counter()
            owner_encode(group, requests, cache, no_op_encoder, 1, torch.float32, torch.device("cpu"))
            value = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            if iteration >= args.warmup:
                times.append(value.item())
        out[key] = statistics.median(times)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_agreements(args, plans):
    return _spawn_ranks(args.world, agreement_worker, lambda rank, store, queue: (
        rank, args.world, store, args, plans, queue))


def time_on(fn, device, repeats):
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def status_round_floor(device, iters):
    """Median seconds of one status round on a one-rank NCCL group in this
    process: what a round costs on the device before any peer latency."""
    with tempfile.TemporaryDirectory() as tmp:
        if device.index is not None:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            group = TorchDistributedGroup(dist.group.WORLD)
            status = [0, 1, 12345, -12345]
            for _ in range(20):
                group.all_reduce_max(status)
            times = []
            for _ in range(max(iters, 50)):
                start = time.perf_counter()
                group.all_reduce_max(status)
                times.append(time.perf_counter() - start)
        finally:
            dist.destroy_process_group()
    return statistics.median(times)


def run_single_gpu(args):
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("single-gpu mode: no CUDA device; nothing measured (--device cpu runs it on the CPU)")
        return
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    encoder = ViTLike(args.dim, args.heads, args.inter, args.layers, args.hidden).to(device, dtype)
    world = args.world
    rows, plans = [], {}
    for grid in parse_sizes(args.sizes):
        pixels = torch.randn(grid[0] * grid[1], 3 * PATCH * PATCH, device=device, dtype=dtype)
        for hit_rate in [float(v) for v in args.hit_rates.split(",")]:
            requests = batch_requests(1000 + len(rows), args.images, grid, pixels)
            hits = round(hit_rate * len(requests))
            misses = requests[hits:]
            for _ in range(args.warmup):
                encoder(misses)
            synchronize(device)
            # Replicated: cache lookups plus every miss, with a fresh cache each time.
            caches = []
            for _ in range(args.iters):
                caches.append(DictCache())
                preload(caches[-1], requests, hit_rate, args.hidden, dtype, device)
            assemble = ChunkAssembly(requests, args.hidden, dtype, device) if args.assembly else None

            def replicated_chunk():
                features = replicated_encode(requests, caches.pop(), encoder)
                if assemble is not None:
                    assemble(features)

            all_misses = time_on(replicated_chunk, device, args.iters)
            assembly_time = 0.0
            if assemble is not None:  # the owner rows are derived: add it to them too
                resolved = {r.key: torch.zeros(r.span_len, args.hidden, dtype=dtype, device=device)
                            for r in requests}
                assemble(resolved)
                assembly_time = time_on(lambda: assemble(resolved), device, args.iters)
            route = make_router(args, world, requests, hit_rate, args.hidden, dtype).route(
                chunk_spans(requests))
            routed_stock = None
            if route is not Route.OWNER:
                # No protocol: what runs is measured whole, routing included.
                states = []
                for _ in range(args.iters):
                    states.append((DictCache(), make_router(args, world, requests, hit_rate,
                                                            args.hidden, dtype)))
                    preload(states[-1][0], requests, hit_rate, args.hidden, dtype, device)

                def one_batch():
                    cache, router = states.pop()
                    _route, features = routed_encode(router, None, requests, cache, encoder,
                                                     args.hidden, dtype, device)
                    if assemble is not None:
                        assemble(features)

                routed_stock = time_on(one_batch, device, args.iters)
            if args.owners == "hash":
                owners = [owner_of(r.content_hash, world) for r in misses]
            else:  # the protocol's rule, with the routing's costs
                owners = balanced_owners([args.per_image_cost + grid[0] * grid[1]] * len(misses),
                                         [r.content_hash for r in misses], world)
            shares = [[r for r, o in zip(misses, owners) if o == owner] for owner in range(world)]
            share_times = [time_on(lambda s=s: encoder(s), device, args.iters) if s else 0.0
                           for s in shares]
            # Every non-local span moves once, from its owner: with cold caches
            # on the other ranks that is every miss.
            copy_total = 0.0
            for share in shares:
                if not share:
                    continue
                rows_total = sum(r.span_len for r in share)
                src = torch.empty(rows_total, args.hidden, device=device, dtype=dtype)
                dst = torch.empty_like(src)
                copy_total += time_on(lambda: dst.copy_(src), device, args.iters)
            payload_bytes = sum(r.span_len for r in misses) * args.hidden * torch.finfo(dtype).bits // 8
            key = f"{grid[0]}x{grid[1]}@{hit_rate}"
            if route is Route.OWNER:
                plans[key] = ([r.span_len for r in requests], hits)
            rows.append(dict(key=key, grid=grid, hit_rate=hit_rate, span_len=requests[0].span_len,
                             route=route.value, routed_stock=routed_stock,
                             all_misses=all_misses, max_share=max(share_times), copies=copy_total,
                             payload_mb=payload_bytes / 2**20, assembly=assembly_time,
                             largest_share=max(len(s) for s in shares)))
    agreements = measure_agreements(args, plans) if plans else {}
    print(f"mode=single-gpu device={device} group size R={world} (derived) images/batch={args.images} "
          f"encoder: dim={args.dim} heads={args.heads} inter={args.inter} layers={args.layers} "
          f"hidden={args.hidden} {args.dtype}; median of {args.iters}; {policy_text(args)}; "
          f"{assembly_text(args)}")
    floor = None
    if device.type == "cuda":
        try:
            floor = status_round_floor(device, args.iters)
        except Exception as exc:  # the table below stands on its own
            print(f"status round on {device} not measured: {type(exc).__name__}: {exc}")
    print("route owner: measured encoder(all misses), encoder(each owner's share), device copy of "
          f"payload bytes, agreements (real protocol, {world} gloo CPU processes); derived: ours, "
          "ratio. Other routes: ours measured whole (routing + stock path); with --routing guarded "
          "not-worth adds two status rounds at the one-rank NCCL floor below (derived; none "
          "without a GPU).")
    print(f"{'grid':>7} {'span':>5} {'hits':>5} {'route':>9} {'repl ms':>9} {'max share ms':>12} "
          f"{'imgs':>4} {'copy ms':>8} {'MiB':>7} {'agree ms':>9} {'ours ms':>9} {'ours/repl':>10}")
    for row in rows:
        replicated = row["all_misses"]
        grid = row["grid"]
        if row["routed_stock"] is None:
            agree = agreements[row["key"]]
            ours = row["max_share"] + row["copies"] + agree + row["assembly"]
            detail = (f"{row['max_share'] * 1e3:>12.2f} {row['largest_share']:>4} "
                      f"{row['copies'] * 1e3:>8.3f} {row['payload_mb']:>7.1f} {agree * 1e3:>9.3f}")
        elif row["route"] == "not-worth" and args.routing == "guarded":
            agree = 2 * (floor or 0.0)
            ours = row["routed_stock"] + agree
            detail = f"{'-':>12} {'-':>4} {'-':>8} {'-':>7} {agree * 1e3:>9.3f}"
        else:
            ours = row["routed_stock"]
            detail = f"{'-':>12} {'-':>4} {'-':>8} {'-':>7} {'-':>9}"
        print(f"{grid[0]:>3}x{grid[1]:<3} {row['span_len']:>5} {row['hit_rate']:>5.2f} "
              f"{row['route']:>9} {replicated * 1e3:>9.3f} {detail} {ours * 1e3:>9.3f} "
              f"{ours / replicated:>10.2f}")
    if floor is not None:
        print(f"one status round on {device} (one-rank NCCL group, no peer latency): "
              f"{floor * 1e6:.1f} us median")


# ---------------------------------------------------------------- main


# Original sizes (width, height) of images as users send them, with weights:
# phone photos, camera photos, screenshots, scans, web images, small icons.
IMAGE_MIX = [
    ((4032, 3024), 6), ((3024, 4032), 4), ((1920, 1080), 5), ((1080, 1920), 3),
    ((2560, 1440), 3), ((1440, 900), 3), ((1280, 720), 4), ((1024, 768), 3),
    ((800, 600), 3), ((640, 480), 3), ((512, 512), 2), ((2480, 3508), 2),
    ((1200, 628), 2), ((300, 300), 1), ((128, 128), 1),
]
MIN_PIXELS = 544 * 544  # DeepSeek-V4.1's processor scales smaller images up to this area
MAX_SPAN_TOKENS = 1024  # ... and larger ones down to this many span tokens


def vit_grid(width, height):
    """An image's ViT patch grid, by the processor's rules as its settings
    describe them (scale up to the minimum area, round up to whole patches,
    shrink keeping the aspect until the span fits the token budget)."""
    if width * height < MIN_PIXELS:
        scale = math.sqrt(MIN_PIXELS / (width * height))
        width, height = int(width * scale), int(height * scale)
    grid_w, grid_h = math.ceil(width / PATCH), math.ceil(height / PATCH)
    while ViTLike.span_len(grid_h, grid_w) > MAX_SPAN_TOKENS:
        shrink = math.sqrt(MAX_SPAN_TOKENS / ViTLike.span_len(grid_h, grid_w))
        grid_w, grid_h = max(1, int(grid_w * min(shrink, 0.99))), max(1, int(grid_h * min(shrink, 0.99)))
    return grid_h, grid_w


def run_shares(args):
    import random

    rng = random.Random(args.seed)
    sizes = [size for size, weight in IMAGE_MIX for _ in range(weight)]
    rules = {"hash mod R": lambda costs, hashes: [owner_of(h, args.world) for h in hashes],
             "balanced": lambda costs, hashes: balanced_owners(costs, hashes, args.world)}
    ratios = {name: [] for name in rules}
    grids = []
    for _ in range(args.batches):
        batch = [vit_grid(*rng.choice(sizes)) for _ in range(args.images)]
        grids.extend(batch)
        hashes = [rng.getrandbits(63) for _ in batch]
        costs = [args.per_image_cost + h * w for h, w in batch]
        ideal = sum(costs) / args.world
        for name, rule in rules.items():
            loads = owner_loads(costs, rule(costs, hashes), args.world)
            ratios[name].append(max(loads) / ideal)
    patches = sorted(h * w for h, w in grids)
    print(f"{args.batches} batches of {args.images} cold images over R = {args.world} owners, seed "
          f"{args.seed}; ViT grids {min(patches)}-{max(patches)} patches (median "
          f"{patches[len(patches) // 2]}); cost per image = {args.per_image_cost} + its patches")
    print(f"{'ownership':<12} {'busiest/ideal: median':>22} {'p90':>6} {'worst':>6} "
          f"{'busiest share of the batch (worst)':>36}")
    for name, values in ratios.items():
        values = sorted(values)
        print(f"{name:<12} {values[len(values) // 2]:>22.3f} {values[(len(values) * 9) // 10]:>6.3f} "
              f"{values[-1]:>6.3f} {values[-1] / args.world:>36.3f}")
    print(f"balanced, worst of the {args.batches} batches (the floor is 1.00):")
    print(f"busiest/ideal {max(ratios['balanced']):.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["gloo", "single-gpu", "nccl", "shares"], default="gloo")
    parser.add_argument("--owners", choices=["balanced", "hash"], default="balanced",
                        help="single-gpu mode: how the owners' shares are formed")
    parser.add_argument("--batches", type=int, default=200, help="shares mode: batches drawn")
    parser.add_argument("--seed", type=int, default=2026, help="shares mode: the batches' seed")
    parser.add_argument("--backend", choices=["gloo", "nccl"], help="alias: --backend gloo is --mode gloo")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS))
    for name in ("dim", "heads", "inter", "layers", "hidden", "images", "iters", "warmup"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--sizes", help="ViT patch grids, e.g. 4x4,16x16,32x32")
    parser.add_argument("--hit-rates", dest="hit_rates", help="e.g. 0,0.5,1")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    parser.add_argument("--device", default="cuda", help="single-gpu mode only (cpu: smoke test)")
    defaults = RoutingPolicy()
    parser.add_argument("--routing", choices=["auto", "guarded", "always"], default="auto")
    parser.add_argument("--per-image-cost", dest="per_image_cost", type=int,
                        default=defaults.per_image_cost)
    parser.add_argument("--min-saving", dest="min_saving", type=int, default=defaults.min_saving)
    parser.add_argument("--assembly", action="store_true",
                        help="both variants also assemble the chunk from its features (text "
                             "embedding, spans scattered over their rows), as every rank does in sglang")
    args = parser.parse_args()
    if args.backend:
        args.mode = args.backend
    preset = PRESETS[args.preset or ("cpu" if args.mode == "gloo" else "gpu")]
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.mode == "shares":
        if args.world < 1 or args.images < 1 or args.batches < 1:
            print("shares mode: --world, --images and --batches must be at least 1", file=sys.stderr)
            return 2
        run_shares(args)
    elif args.mode == "gloo":
        run_group(args, "gloo")
    elif args.mode == "nccl":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < args.world:
            print(f"nccl mode: needs {args.world} GPUs, found {available}; skipped")
            return
        run_group(args, "nccl")
    else:
        run_single_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
