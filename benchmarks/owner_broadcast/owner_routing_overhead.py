"""What routing adds to a full-cache-hit chunk in sglang 0.5.23's real input preparation.

A chunk whose images every rank already holds is served by stock sglang with
cache lookups and assembly; with the plugin the chunk is first routed
(``owner_broadcast.routing``: the request's image table, built on its first chunk;
the chunk's spans; a directory lookup unless the request is known already;
the directory touched afterwards) and, routed ``known``, runs the same stock
code with no collective. This script times
``DeepseekV4ForCausalLM.prepare_language_model_inputs`` (the real method, the
real ``embed_mm_inputs`` and per-image scheduling code underneath) on one
process, for chunks of 1, 8 and 32 cached images:

  stock    the upstream methods, no patch installed, each chunk from one request
           seen before
  stock new
           the same, each chunk from a new request (new MultimodalInputs and
           new item objects, same hashes and offsets: what a request that
           arrives from the tokenizer brings), so stock reads cold objects too
  hooks    OWN-FENCE, OWN-TEXT-EMBED and OWN-ENCODE installed (sglang's own
           hook wrappers), the owner path off for this model: the wrappers'
           own cost (hooks new: the same with new requests)
  plugin   the same hooks, the model's router knowing every span (route
           ``known``), each chunk from a request the router has seen before
           (its per-request table is reused: later chunks of a request, or a
           request retried)
  new req  the same, each chunk from a new request holding the same cached
           images, the table built on the chunk (a request whose table
           admission did not build: with OWN-ADMIT a scheduler builds it when
           it hands the request its media, timed by ``--admission``)
  routing  route_chunk alone (a known chunk needs nothing else), on the same batches
           (seen requests) in a tight loop
  in place route_chunk and the directory update (when the route needs one)
           timed inside the plugin and new-req chunks (wall time of the
           calls: the routing as it runs between the rest of the chunk's code)

in blocks of ten chunks, timed in this thread's CPU time (time spent
descheduled on a shared machine is left out), in phases: stock and stock-new
blocks taking turns, then with the patches in, hooks, hooks-new, plugin,
new-req and routing blocks taking turns; the phases repeat, so drift over the
run hits every variant. It prints the median per chunk of each; hooks/stock;
plugin/hooks and new-req/hooks-new as the median of each block's ratio to the
block of its own round that ran the same kind of request with the owner path
off (the routing's end-to-end cost, drift cancelled as far as pairing can);
the in-place routing as a share of stock (new requests: of stock new); the
block shares: per plugin (new-req) block, its in-place routing against the
rest of the same block's chunks, median over blocks (the same chunks in the
same minutes of the machine: drift between phases cancels, so these are the
steadiest share columns on a shared VM); the timer: the same timing in the
hooks-new blocks, where route_chunk returns at its first check (the timer's
and the call's own cost, included in every in-place figure, not taken off);
and the stock spread: how far apart the per-phase medians of stock itself land
((max - min) / median), the resolution of the end-to-end columns on this
machine (the in-place columns time the routing directly). The width is small on
purpose: torch's copies then cost little and the Python work the plugin adds
is as large a share of the chunk as it can be (a V4.1 chunk on a GPU copies
7168-wide rows, which only adds to the stock side); ``--width 7168`` runs the
same chunks at DeepSeek-V4.1's hidden size, still on the CPU.

``--admission`` times a new request's whole full-hit path instead: its
admission by the real ``Scheduler.handle_generate_request`` (media prepared
with ``MultimodalInputs.from_processor_output``, DeepSeek-V4's
``pad_input_ids``, the ``Req`` built and handed its media, checks, queued),
on a scheduler built from the tests' CPU rig, whose subsystems that a plain
single-rank prefill server leaves off (metrics, sessions, grammar, KV events)
are stand-ins; then its first chunk. Receiving and unpickling the request
are not timed. Stock, then with OWN-ADMIT and the chunk patches in (the table
built at admission, the chunk routed ``known``), in alternating phases, new
requests throughout. It prints both steps' medians per variant, our OWN-ADMIT
hook (the table build) and the routing timed in place, and their shares of
stock: of the admission, of the chunk, of the two together, and per block
against the rest of the same block (as ``block share`` above).

``--guarded`` times what mode ``guarded`` (the default) adds to a chunk that
encodes on every rank (one new image, routed ``not-worth``): two CPU
processes form a real gloo group (sglang's ``GroupCoordinator``, the TP text
embedding all-reducing over it, as in sglang with TP 2), and each runs the
real input preparation of the same new-image chunks, in blocks that take
turns: stock (no patch), ``auto`` (no session), ``guarded`` (the
status-only session: a round before the text embedding's all-reduce and one
at the fence end) and ``auto+rounds`` (auto's chunk followed by two bare
status rounds: what the rounds themselves cost, apart from the session). The vision tower is a stand-in that returns the span at
once, so the chunk is as cheap as it can be and the guarded share as large;
a real encoder (milliseconds per image) only adds to the chunk. Wall time
per block (the rounds wait for the peer, as in production), median over
blocks; guarded/auto as the median of each round's pair of blocks.

Needs sglang 0.5.23 (CPU is enough):
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_routing_overhead.py
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_routing_overhead.py --width 7168 --rounds 10
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_routing_overhead.py --bytecodes
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_routing_overhead.py --admission
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_routing_overhead.py --guarded
"""

from __future__ import annotations

import argparse
import gc
import itertools
from array import array
from pathlib import Path
import statistics
import sys
import time
from types import SimpleNamespace

import msgspec
import torch
from torch import nn

WIDTH = 64  # default: see the docstring; --width 7168 is DeepSeek-V4.1's hidden size
VOCAB = 1024
IMAGE_TOKEN_ID = VOCAB - 1
GRID = (32, 32)  # ViT patches; downsample 2 -> 16 x 17 + 2 = 274 tokens
RATIO = 2
PATCHES = ("OWN-FENCE", "OWN-TEXT-EMBED", "OWN-ENCODE")
ADMISSION_PATCHES = ("OWN-ADMIT", *PATCHES)
BLOCK = 10  # chunks per timed block
FRESH = ("stock_new", "hooks_new", "new_req")  # variants whose chunks come from new requests


def timed_into(totals, key, fn):
    """fn, adding its wall time to totals[key]: our code as it runs in place,
    between the rest of stock's code."""
    def call(*args):
        # perf_counter: ~0.1 us a call here, where thread_time is a ~1 us
        # system call that would swamp a few-microsecond interval.
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            totals[key] += time.perf_counter() - start
    return call


def span_tokens(grid):
    n_h, n_w = -(-grid[0] // RATIO), -(-grid[1] // RATIO)
    return 2 + n_h * (n_w + 1)


def build(images: int, width: int = WIDTH):
    from sglang.srt.managers import mm_schedule
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(VOCAB, width)

        def get_input_embeddings(self):
            return self.embed_tokens

    class CachedVisionModel(DeepseekV4ForCausalLM):
        """The real class; only what input preparation reads is built."""

        def __init__(self):
            nn.Module.__init__(self)
            self.config = SimpleNamespace(hidden_size=width, image_token_id=IMAGE_TOKEN_ID,
                                          vision_downsample_ratio=RATIO)
            self.vision = object()
            self.image_start = nn.Parameter(torch.zeros(width))
            self.model = Body()
            self.encoder_calls = 0

        def get_image_feature(self, items):
            self.encoder_calls += 1
            raise AssertionError("a full-hit chunk reached the encoder")

    tokens = span_tokens(GRID)
    length = images * (tokens + 4) + 8
    ids = [(7 * i + 1) % (VOCAB - 1) for i in range(length)]
    items = []
    mm_schedule.init_mm_embedding_cache(1 << 30)
    for index in range(images):
        start = 4 + index * (tokens + 4)
        item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(3, 4),
                                  offsets=[(start, start + tokens - 1)])
        item.set_hash(10_000_019 * (index + 1))
        item.model_specific_data.update(n_vit_h=GRID[0], n_vit_w=GRID[1])
        ids[start : start + tokens] = item.padding_sequence(tokens)
        mm_schedule.embedding_cache.set(item.hash, EmbeddingResult(embedding=torch.randn(tokens, width)))
        items.append(item)
    mm_input = MultimodalInputs(mm_items=items, im_token_id=IMAGE_TOKEN_ID)
    input_ids = torch.tensor(ids, dtype=torch.long)

    def batch():
        return SimpleNamespace(forward_mode=ForwardMode.EXTEND, mm_inputs=[mm_input],
                               extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[length],
                               rids=["bench"], mm_input_embeds=None)

    return CachedVisionModel(), input_ids, batch


def attach_router(model, world):
    from sglang.srt.managers import mm_schedule

    from sglang_dsv41.owner_broadcast.routing import OwnerRouter, RoutingPolicy, SpanDirectory
    from sglang_dsv41.owner_broadcast import hooks as owner_broadcast

    # The known route never touches the group: a stand-in names its size.
    model.mm_owner_group = SimpleNamespace(world_size=world)
    capacity = mm_schedule.embedding_cache.max_size  # the directory shadows the cache
    model.mm_owner_router = OwnerRouter(world, RoutingPolicy(), SpanDirectory(capacity),
                                        model.config.hidden_size * model.image_start.element_size())
    batch = model._bench_batch()
    model.mm_owner_router.completed(owner_broadcast.route_chunk(model, batch).spans)
    assert owner_broadcast.route_chunk(model, batch).route.value == "known"


def fresh_request(mm_input):
    """A new request holding the same images: new MultimodalInputs and new
    item objects (same hashes and offsets), as a request from the tokenizer
    brings."""
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    items = [msgspec.structs.replace(item) for item in mm_input.mm_items]
    return MultimodalInputs(mm_items=items, im_token_id=IMAGE_TOKEN_ID)


def traced(fn, *args):
    """fn(*args) under a tracer: (bytecode instructions, Python calls) it ran."""
    counts = [0, 0]

    def tracer(frame, event, _arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[0] += 1
        elif event == "call":
            counts[1] += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return counts


def per_call_ns(route, model, batches, seen_batch):
    """route_chunk timed call by call (perf_counter_ns, collector off): for
    each new request, its first chunk, then the seen request's chunk. The
    minimum and the 10th percentile are what a loaded machine's noise
    leaves alone; each call runs hot (a tight loop), unlike in place."""
    clock = time.perf_counter_ns
    new, seen, timer = [], [], []
    gc.collect()
    gc.disable()
    try:
        for batch in batches:
            start = clock()
            route(model, batch)
            new.append(clock() - start)
            start = clock()
            route(model, seen_batch)
            seen.append(clock() - start)
            start = clock()
            timer.append(clock() - start)
    finally:
        gc.enable()
    low = min(timer)  # the clock's own cost, taken off

    def summary(values):
        values = sorted(values)
        return values[0] - low, values[len(values) // 10] - low

    return summary(new), summary(seen)


def count_bytecodes(args):
    from sglang_dsv41.owner_broadcast import hooks as owner_broadcast

    print("route_chunk on a full-hit chunk (known route): bytecode instructions and Python calls "
          "(route_chunk's own included), counted with sys.settrace (opcode events); then the "
          f"call timed alone, hot, over {args.calls} new requests: minimum and 10th percentile, ns")
    print(f"{'images':>6} {'seen req ops':>12} {'calls':>5} {'new req ops':>11} {'calls':>5} "
          f"{'seen min ns':>11} {'seen p10':>8} {'new min ns':>10} {'new p10':>8}")
    for images in [int(v) for v in args.images.split(",")]:
        model, _input_ids, make_batch = build(images, args.width)
        model._bench_batch = make_batch
        attach_router(model, args.world)
        batch = make_batch()
        seen = batch.mm_inputs[0]
        route = owner_broadcast.route_chunk
        seen_ops, seen_calls = traced(route, model, batch)
        batch.mm_inputs = [fresh_request(seen)]
        new_ops, new_calls = traced(route, model, batch)
        assert route(model, batch).route is owner_broadcast.Route.KNOWN
        seen_batch = make_batch()
        fresh = []
        for _ in range(args.calls):
            fresh.append(make_batch())
            fresh[-1].mm_inputs = [fresh_request(seen)]
        (new_min, new_p10), (seen_min, seen_p10) = per_call_ns(route, model, fresh, seen_batch)
        print(f"{images:>6} {seen_ops:>12} {seen_calls:>5} {new_ops:>11} {new_calls:>5} "
              f"{seen_min:>11} {seen_p10:>8} {new_min:>10} {new_p10:>8}")


def admission_scheduler(model):
    """A real Scheduler whose ``handle_generate_request`` runs whole on the
    CPU: the tests' scheduler rig (real pools, radix cache, policy and queue;
    test/helpers/embed_harness.py), with ``model``'s real DeepSeek-V4
    ``pad_input_ids``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "helpers"))
    import embed_harness

    rig = embed_harness.SchedulerRig(kv_tokens=1 << 16, rows=256)
    rig.receive_generate_requests(model.pad_input_ids)
    return rig.scheduler


def guarded_worker(rank, store, args, queue):
    """One rank of --guarded (see the module docstring)."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.managers import mm_schedule
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.runtime_context import get_parallel

    from sglang_dsv41.owner_broadcast.protocol import CoordinatorGroup
    from sglang_dsv41.owner_broadcast.routing import OwnerRouter, Route, RoutingPolicy, SpanDirectory
    from sglang_dsv41.plugin.testing import patches_installed

    coordinator = GroupCoordinator(
        [[0, 1]], local_rank=rank, torch_distributed_backend="gloo", use_pynccl=False,
        use_mscclpp=False, use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False, use_xpu_communicator=False, group_name="owner_guarded_bench",
    )
    width, tokens = args.width, span_tokens(GRID)
    with get_parallel().override(
        tp_size=2, tp_rank=rank, attn_dp_size=1, attn_cp_size=1, attn_tp_size=2,
        attn_tp_rank=rank, tp_group=coordinator, attn_tp_group=coordinator,
        pp_group=SimpleNamespace(world_size=1, is_last_rank=True),
    ):
        text_embedding = VocabParallelEmbedding(VOCAB, width)

        class Body(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed_tokens = text_embedding

            def get_input_embeddings(self):
                return self.embed_tokens

        class ColdVisionModel(DeepseekV4ForCausalLM):
            """The real class; only what input preparation reads is built."""

            def __init__(self):
                nn.Module.__init__(self)
                self.config = SimpleNamespace(hidden_size=width, image_token_id=IMAGE_TOKEN_ID,
                                              vision_downsample_ratio=RATIO)
                self.vision = object()
                self.image_start = nn.Parameter(torch.zeros(width))
                self.model = Body()
                self.span = torch.randn(tokens, width)

            def get_image_feature(self, items):  # a vision tower that costs nothing
                return [self.span for _ in items]

        model = ColdVisionModel()
        model.mm_owner_group = CoordinatorGroup(coordinator)
        model.mm_owner_router = router = OwnerRouter(
            2, RoutingPolicy(mode="guarded"), SpanDirectory(0), width * model.image_start.element_size())
        length = tokens + 8
        ids = [(7 * i + 1) % (VOCAB - 1) for i in range(length)]
        hashes = itertools.count(10_000_019, 7919)  # the same new image per chunk on both ranks

        def new_chunk():
            item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(3, 4),
                                      offsets=[(4, 4 + tokens - 1)])
            item.set_hash(next(hashes))
            item.model_specific_data.update(n_vit_h=GRID[0], n_vit_w=GRID[1])
            prompt = list(ids)
            prompt[4 : 4 + tokens] = item.padding_sequence(tokens)
            batch = SimpleNamespace(
                forward_mode=ForwardMode.EXTEND,
                mm_inputs=[MultimodalInputs(mm_items=[item], im_token_id=IMAGE_TOKEN_ID)],
                extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[length], rids=["bench"],
                mm_input_embeds=None)
            return torch.tensor(prompt, dtype=torch.long), batch

        times = {f"{variant} {clock}": [] for variant in ("stock", "auto", "guarded", "auto+rounds")
                 for clock in ("wall", "cpu")}
        group = model.mm_owner_group

        def block(variant, timed=True):
            chunks = [new_chunk() for _ in range(BLOCK)]
            mm_schedule.init_mm_embedding_cache(1 << 30)
            router.guards_stock_encodes = variant == "guarded"  # auto+rounds: auto's routing
            gc.collect()
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.thread_time()
            for input_ids, batch in chunks:
                model.prepare_language_model_inputs(input_ids, batch, None)
                if variant == "auto+rounds":  # auto's chunk plus two bare status rounds
                    group.all_reduce_max([0] * 5)
                    group.all_reduce_max([0] * 5)
            if timed:
                times[f"{variant} cpu"].append((time.thread_time() - cpu_start) / BLOCK)
                times[f"{variant} wall"].append((time.perf_counter() - start) / BLOCK)

        with torch.inference_mode():
            block("stock", timed=False)  # warm-up
            with patches_installed(*PATCHES):
                block("auto", timed=False)
                block("guarded", timed=False)
            for _ in range(args.phases):
                for _ in range(args.rounds):
                    block("stock")
                with patches_installed(*PATCHES):
                    for _ in range(args.rounds):
                        block("auto")
                        block("guarded")
                        block("auto+rounds")
        routes = {route.value: n for route, n in router.routes.items() if n}
        assert routes == {"not-worth": (3 * args.phases * args.rounds + 2) * BLOCK}, routes
    queue.put({"rank": rank, "times": times})
    dist.barrier()
    dist.destroy_process_group()


def guarded_run(args):
    import tempfile

    import torch.multiprocessing as mp

    print(f"one new image per chunk ({span_tokens(GRID)} tokens, routed not-worth), real sglang "
          f"0.5.23 input preparation on two gloo CPU ranks (TP 2, the text embedding all-reduced), "
          f"width {args.width}, a vision tower that costs nothing; median over {args.phases} x "
          f"{args.rounds} blocks of {BLOCK} chunks per variant, per rank: CPU time of the "
          "rank's thread (what the variant computes) and wall time (with the peer waits)")
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [context.Process(target=guarded_worker, args=(rank, f"{tmp}/store", args, queue))
                 for rank in (0, 1)]
        for proc in procs:
            proc.start()
        results = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
        for proc in procs:
            proc.join(timeout=120)
    if any(proc.exitcode != 0 for proc in procs):
        print(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}", file=sys.stderr)
        return 1
    print(f"{'rank':>4} {'clock':>5} {'stock us':>9} {'auto us':>8} {'guarded us':>10} "
          f"{'guarded-auto us':>15} {'guarded/auto':>12} {'added/stock':>11} {'auto+2 rounds us':>16}")
    shares = []
    for result in results:
        times = result["times"]
        for clock in ("cpu", "wall"):
            stock, auto, guarded, rounds = (statistics.median(times[f"{k} {clock}"]) * 1e6
                                            for k in ("stock", "auto", "guarded", "auto+rounds"))
            paired = statistics.median(g / a for g, a in zip(times[f"guarded {clock}"],
                                                             times[f"auto {clock}"]))
            shares.append((clock, paired - 1))
            print(f"{result['rank']:>4} {clock:>5} {stock:>9.1f} {auto:>8.1f} {guarded:>10.1f} "
                  f"{guarded - auto:>15.1f} {paired:>12.3f} {(guarded - auto) / stock:>11.3f} "
                  f"{rounds:>16.1f}")
    for clock in ("cpu", "wall"):
        values = [share for c, share in shares if c == clock]
        print(f"guarded adds {min(values):.3f}-{max(values):.3f} of the auto chunk ({clock} time, "
              "paired blocks, both ranks)")
    return 0


def admission_run(args):
    """--admission: a new request's admission and first chunk, stock against
    the plugin (see the module docstring)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import MultimodalProcessorOutput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_dsv41.owner_broadcast import hooks as owner_broadcast
    from sglang_dsv41.plugin.testing import patches_installed

    print(f"new full-hit requests, real sglang 0.5.23 admission (Scheduler.handle_generate_request) "
          f"and first chunk on {torch.get_num_threads()} CPU thread(s), width {args.width}, "
          f"{span_tokens(GRID)} tokens per image, group of {args.world}; median over {args.phases} x "
          f"{args.rounds} blocks of {BLOCK} requests per variant (CPU time of this thread)")
    print(f"{'images':>6} {'stock adm us':>12} {'stock chunk':>11} {'plugin adm':>10} {'plugin chunk':>12} "
          f"{'hook us':>8} {'routing us':>10} {'hook/adm':>9} {'routing/chunk':>13} {'both/both':>9} "
          f"{'block adm':>9} {'block chunk':>11} {'block both':>10}")
    for images in [int(v) for v in args.images.split(",")]:
        model, input_ids, make_batch = build(images, args.width)
        model._bench_batch = make_batch
        scheduler = admission_scheduler(model)
        seen = make_batch().mm_inputs[0]
        prompt = array("q", input_ids.tolist())
        batches = [make_batch() for _ in range(BLOCK)]
        times = {key: [] for key in ("stock_adm", "stock_chunk", "plugin_adm", "plugin_chunk",
                                     "table", "routing")}
        in_place = {"table": 0.0, "routing": 0.0}  # our CPU time inside the current block
        arrivals_made = itertools.count()

        def arrival():
            """What the tokenizer sends for a new request with the same images."""
            params = SamplingParams(max_new_tokens=1)
            params.normalize(None)
            media = MultimodalProcessorOutput(mm_items=fresh_request(seen).mm_items,
                                              input_ids=list(prompt), im_token_id=IMAGE_TOKEN_ID)
            return TokenizedGenerateReqInput(
                rid=f"bench-{next(arrivals_made)}", input_text="", input_ids=prompt, input_embeds=None,
                mm_inputs=media, token_type_ids=None, sampling_params=params, return_logprob=False,
                logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)

        gc.collect()
        gc.freeze()

        def block(variant):
            received = [arrival() for _ in batches]  # untimed: the tokenizer's side
            gc.collect()
            in_place["table"] = in_place["routing"] = 0.0
            queue = scheduler.waiting_queue
            start = time.thread_time()
            for recv in received:
                scheduler.handle_generate_request(recv)
            admitted = time.thread_time()
            # untimed: every request queued whole, its table built where OWN-ADMIT is in
            assert len(queue) == BLOCK and all(req.finished_reason is None for req in queue)
            tables = [owner_broadcast.TABLE_ATTRIBUTE in req.multimodal_inputs.__dict__ for req in queue]
            assert tables == [variant == "plugin"] * BLOCK
            chunks_start = time.thread_time()
            for batch, req in zip(batches, queue):
                batch.mm_input_embeds = None
                batch.mm_inputs = [req.multimodal_inputs]
                model.prepare_language_model_inputs(input_ids, batch, None)
            done = time.thread_time()
            queue.clear()
            times[f"{variant}_adm"].append((admitted - start) / BLOCK)
            times[f"{variant}_chunk"].append((done - chunks_start) / BLOCK)
            if variant == "plugin":
                times["table"].append(in_place["table"] / BLOCK)
                times["routing"].append(in_place["routing"] / BLOCK)

        with torch.inference_mode():
            attach_router(model, args.world)
            router = model.mm_owner_router
            for _ in range(args.phases):
                for _ in range(args.rounds):
                    block("stock")
                # Our whole AFTER hook is timed (sglang's wrapper around it is
                # not: see "Hook wrapper overhead"); installing resolves the
                # hook by name, so the timed one goes in first.
                real = (owner_broadcast.after_extend_image_inputs, owner_broadcast.route_chunk,
                        router.completed)
                owner_broadcast.after_extend_image_inputs = timed_into(in_place, "table", real[0])
                try:
                    with patches_installed(*ADMISSION_PATCHES):
                        owner_broadcast.route_chunk = timed_into(in_place, "routing", real[1])
                        router.completed = timed_into(in_place, "routing", real[2])
                        owner_broadcast.routes_in_process = True  # as attach_owner_path leaves it
                        for _ in range(args.rounds):
                            block("plugin")
                finally:
                    owner_broadcast.after_extend_image_inputs, owner_broadcast.route_chunk = real[:2]
                    del router.completed
                    owner_broadcast.routes_in_process = False
        assert model.encoder_calls == 0
        # every plugin chunk routed known (and attach_router's own check)
        assert router.routes[owner_broadcast.Route.KNOWN] == 1 + args.phases * args.rounds * BLOCK, router.routes
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        # Our in-place time against the rest of its own block (see block share).
        ours = {"adm": times["table"], "chunk": times["routing"],
                "both": [t + r for t, r in zip(times["table"], times["routing"])]}
        totals = {"adm": times["plugin_adm"], "chunk": times["plugin_chunk"],
                  "both": [a + c for a, c in zip(times["plugin_adm"], times["plugin_chunk"])]}
        block_adm, block_chunk, block_both = (
            statistics.median(o / (t - o) for o, t in zip(ours[k], totals[k]))
            for k in ("adm", "chunk", "both"))
        print(f"{images:>6} {med['stock_adm']:>12.1f} {med['stock_chunk']:>11.1f} "
              f"{med['plugin_adm']:>10.1f} {med['plugin_chunk']:>12.1f} {med['table']:>8.1f} "
              f"{med['routing']:>10.1f} {med['table'] / med['stock_adm']:>9.3f} "
              f"{med['routing'] / med['stock_chunk']:>13.3f} "
              f"{(med['table'] + med['routing']) / (med['stock_adm'] + med['stock_chunk']):>9.3f} "
              f"{block_adm:>9.3f} {block_chunk:>11.3f} {block_both:>10.3f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=20, help="blocks per phase")
    parser.add_argument("--phases", type=int, default=3)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--width", type=int, default=WIDTH,
                        help="embedding width (default %(default)s: stock as cheap as it gets)")
    parser.add_argument("--bytecodes", action="store_true",
                        help="count the bytecode instructions route_chunk runs (deterministic: the "
                             "same on every machine) and time it call by call, instead of in place")
    parser.add_argument("--admission", action="store_true",
                        help="time new requests' admission and first chunk, stock against the "
                             "plugin with OWN-ADMIT")
    parser.add_argument("--guarded", action="store_true",
                        help="what mode guarded adds to a chunk that encodes, on two gloo ranks")
    parser.add_argument("--calls", type=int, default=3000,
                        help="new requests timed call by call with --bytecodes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.bytecodes:
        count_bytecodes(args)
        return
    if args.admission:
        admission_run(args)
        return
    if args.guarded:
        return guarded_run(args)

    from sglang_dsv41.owner_broadcast import hooks as owner_broadcast
    from sglang_dsv41.plugin.testing import patches_installed

    print(f"full-hit chunks, real sglang 0.5.23 input preparation on {torch.get_num_threads()} "
          f"CPU thread(s), width {args.width}, {span_tokens(GRID)} tokens per image, group of "
          f"{args.world}; median over {args.phases} x {args.rounds} blocks of {BLOCK} chunks "
          "per variant (CPU time of this thread)")
    print(f"{'images':>6} {'stock us':>9} {'stock new':>10} {'hooks us':>9} {'plugin us':>9} "
          f"{'new req us':>10} {'hooks/stock':>11} {'plugin/hooks':>12} {'new/hooks new':>13} {'routing us':>10} "
          f"{'in place us':>11} {'in place new':>12} {'in place/stock':>13} {'in place new/st':>14} "
          f"{'block share':>11} {'block new':>11} {'timer us':>8} {'stock spread':>12}")
    for images in [int(v) for v in args.images.split(",")]:
        model, input_ids, make_batch = build(images, args.width)
        model._bench_batch = make_batch
        batches = [make_batch() for _ in range(BLOCK)]
        times = {key: [] for key in ("stock", "stock_new", "hooks", "hooks_new", "plugin", "new_req", "routing",
                                     "in_place", "in_place_new", "timer")}
        in_place = [0.0]  # routing CPU time spent inside the current plugin block
        seen_request = batches[0].mm_inputs[0]
        real_route_chunk = owner_broadcast.route_chunk

        # sglang's objects move to the permanent generation: a collection then
        # scans only what the chunks allocate, for stock and plugin alike.
        gc.collect()
        gc.freeze()

        def block(variant):
            for batch in batches:
                batch.mm_input_embeds = None
                if variant in FRESH:
                    # A new request with the same images: new objects throughout, as a
                    # request that arrives from the tokenizer brings (same hashes and
                    # offsets; the features and model data are shared, unread here).
                    batch.mm_inputs = [fresh_request(seen_request)]
                else:
                    batch.mm_inputs = [seen_request]
            gc.collect()  # the previous block's requests go (their tables with them) untimed
            start = time.thread_time()  # CPU time of this thread: a shared VM's
            if variant == "routing":        # preemptions do not count
                route = real_route_chunk  # untimed: this block is all routing
                for batch in batches:  # a known chunk is routed and nothing else
                    route(model, batch)
            else:
                in_place[0] = 0.0
                for batch in batches:
                    model.prepare_language_model_inputs(input_ids, batch, None)
            times[variant].append((time.thread_time() - start) / BLOCK)
            if variant == "plugin":
                times["in_place"].append(in_place[0] / BLOCK)
            elif variant == "new_req":
                times["in_place_new"].append(in_place[0] / BLOCK)
            elif variant == "hooks_new":
                # route_chunk returns at its first check (no router): what
                # the timer and the call cost in place, inside every in-place figure
                times["timer"].append(in_place[0] / BLOCK)

        with torch.inference_mode():
            attach_router(model, args.world)
            router = model.mm_owner_router
            # Phases: stock blocks, then the patches go in and hooks, plugin,
            # new-req and routing blocks take turns (so drift hits all four
            # alike, and plugin and new-req pair with the hooks block of their
            # own round); then the patches come out again; repeated.
            # Re-patching a class resets CPython's attribute caches (a cost a
            # server pays once), so patches change only between phases.
            for _ in range(args.phases):
                for _ in range(args.rounds):
                    block("stock")
                    block("stock_new")
                with patches_installed(*PATCHES):
                    real_route, real_completed = owner_broadcast.route_chunk, router.completed
                    owner_broadcast.route_chunk = timed_into(in_place, 0, real_route)
                    router.completed = timed_into(in_place, 0, real_completed)
                    try:
                        for _ in range(args.rounds):
                            # patches on, owner path off for this model
                            model.mm_owner_group, model.mm_owner_router = None, None
                            block("hooks")
                            block("hooks_new")
                            model.mm_owner_group = SimpleNamespace(world_size=args.world)
                            model.mm_owner_router = router
                            block("plugin")
                            block("new_req")
                            block("routing")
                    finally:
                        owner_broadcast.route_chunk = real_route
                        del router.completed  # back to the class's method
        assert model.encoder_calls == 0
        assert router.routes[owner_broadcast.Route.KNOWN] >= 3 * args.rounds * BLOCK
        stock, stock_new, hooks, plugin, new_req, routing, placed, placed_new = (
            statistics.median(times[k]) * 1e6
            for k in ("stock", "stock_new", "hooks", "plugin", "new_req", "routing", "in_place",
                      "in_place_new"))
        # Each plugin / new-req block against the hooks block of its round
        # that ran the same kind of request.
        plugin_paired, new_paired = (
            statistics.median(v / h for v, h in zip(times[k], times[base]))
            for k, base in (("plugin", "hooks"), ("new_req", "hooks_new")))
        # The routing against the rest of its own block's chunks (the same
        # chunks, the same minutes of this machine): drift between phases
        # and rounds cancels, which the stock-based shares cannot do.
        block_share, block_share_new = (
            statistics.median(r / (total - r) for r, total in zip(times[placed_key], times[k]))
            for placed_key, k in (("in_place", "plugin"), ("in_place_new", "new_req")))
        # How far apart the phases of one variant land: differences smaller
        # than this are below what this machine can resolve.
        phase_medians = [statistics.median(times["stock"][i:i + args.rounds])
                         for i in range(0, len(times["stock"]), args.rounds)]
        spread = (max(phase_medians) - min(phase_medians)) / statistics.median(phase_medians)
        timer = statistics.median(times["timer"]) * 1e6
        print(f"{images:>6} {stock:>9.1f} {stock_new:>10.1f} {hooks:>9.1f} {plugin:>9.1f} "
              f"{new_req:>10.1f} {hooks / stock:>11.3f} {plugin_paired:>12.3f} {new_paired:>13.3f} "
              f"{routing:>10.1f} {placed:>11.1f} {placed_new:>12.1f} {placed / stock:>13.3f} "
              f"{placed_new / stock_new:>14.3f} {block_share:>11.3f} {block_share_new:>11.3f} "
              f"{timer:>8.1f} {spread:>12.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
