"""The routing of a full-hit chunk, this checkout against a baseline, inside the same chunks.

``owner_routing_overhead.py`` times one version of the routing per process;
on a shared VM whose speed moves from run to run, two such runs compare two
machines as much as two versions. This script times both versions inside the
same real chunks of sglang 0.5.23's input preparation (as in that script:
``DeepseekV4ForCausalLM.prepare_language_model_inputs`` with OWN-FENCE,
OWN-TEXT-EMBED and OWN-ENCODE installed, every span known): on each chunk it
calls the baseline's ``route_chunk`` and this checkout's, in a random order,
timing each (the first call finds the chunk's objects colder; the random order
shares that evenly), and hands this checkout's route on to the chunk.

The baseline is another commit's ``python/`` directory, for example:

  git archive f86e912 python | tar -x -C /tmp/baseline
  PYTHONPATH=python python benchmarks/owner_broadcast/owner_routing_ab.py --baseline /tmp/baseline/python

Its ``owner_broadcast/routing.py`` and ``owner_broadcast/hooks.py`` are loaded
under other module names (the rest of the package is this checkout's), with
their own router and their own per-request table attribute. It prints, per
image count and kind of request (seen: chunks of a request routed before;
new: each chunk from a new request, as its first chunk), the median in-place
time of each version and the median over blocks of this checkout's time over
the baseline's.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import owner_routing_overhead as overhead  # noqa: E402

BASELINE_TABLE_ATTRIBUTE = "_sglang_dsv41_baseline_image_table"


def load_baseline(python_dir: str):
    """The baseline's routing core and hooks as modules of their own."""
    def load(name, relative, replace=()):
        path = os.path.join(python_dir, "sglang_dsv41", relative)
        with open(path) as handle:
            source = handle.read()
        for old, new in replace:
            source = source.replace(old, new)
        spec = importlib.util.spec_from_loader(name, loader=None, origin=path)
        module = importlib.util.module_from_spec(spec)
        module.__file__ = path
        sys.modules[name] = module
        exec(compile(source, path, "exec"), module.__dict__)
        return module

    core = load("baseline_owner_routing", "owner_broadcast/routing.py")
    hooks = load("baseline_owner_broadcast", "owner_broadcast/hooks.py",
                 [("sglang_dsv41.owner_broadcast.routing", "baseline_owner_routing")])
    hooks.TABLE_ATTRIBUTE = BASELINE_TABLE_ATTRIBUTE  # its tables apart from ours
    return core, hooks


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a commit's python/ directory")
    parser.add_argument("--images", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=60, help="blocks per kind of request")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--width", type=int, default=overhead.WIDTH)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)

    from sglang_dsv41.owner_broadcast import hooks as owner_broadcast
    from sglang_dsv41.plugin.testing import patches_installed

    base_core, base_hooks = load_baseline(args.baseline)
    print(f"route_chunk in place, full-hit chunks, width {args.width}, group of {args.world}: "
          f"baseline {args.baseline} against this checkout, {args.rounds} blocks of "
          f"{overhead.BLOCK} chunks per kind (wall time of each call, random order per chunk)")
    print(f"{'images':>6} {'request':>7} {'baseline us':>11} {'this us':>8} {'this/baseline':>13}")
    for images in [int(v) for v in args.images.split(",")]:
        model, input_ids, make_batch = overhead.build(images, args.width)
        model._bench_batch = make_batch
        batches = [make_batch() for _ in range(overhead.BLOCK)]
        seen_request = batches[0].mm_inputs[0]
        with torch.inference_mode():
            overhead.attach_router(model, args.world)
            # The baseline's router, on a stand-in that carries only what its
            # route_chunk reads for a known chunk; its directory knows every span.
            mm_schedule = sys.modules["sglang.srt.managers.mm_schedule"]
            shadow = SimpleNamespace(mm_owner_group=model.mm_owner_group, mm_owner_router=base_core.OwnerRouter(
                args.world, base_core.RoutingPolicy(), base_core.SpanDirectory(mm_schedule.embedding_cache.max_size),
                model.config.hidden_size * model.image_start.element_size()))
            # Recorded from the baseline's own route of the seen request, as
            # attach_router does for ours: the directory then holds that
            # table's span objects (a lookup of the very key object skips the
            # tuple comparison, for both versions alike). No session opens.
            open_session = base_hooks.open_session
            base_hooks.open_session = lambda *args, **kwargs: None
            try:
                shadow.mm_owner_router.completed(base_hooks.route_chunk(shadow, batches[0]).spans)
            finally:
                base_hooks.open_session = open_session
            assert base_hooks.route_chunk(shadow, batches[0]).route.value == "known"
            real_route = owner_broadcast.route_chunk
            spent = {"baseline": 0.0, "this": 0.0}

            def both(model, forward_batch):
                clock = time.perf_counter
                if rng.random() < 0.5:
                    start = clock()
                    base_hooks.route_chunk(shadow, forward_batch)
                    middle = clock()
                    chunk = real_route(model, forward_batch)
                    end = clock()
                    spent["baseline"] += middle - start
                    spent["this"] += end - middle
                else:
                    start = clock()
                    chunk = real_route(model, forward_batch)
                    middle = clock()
                    base_hooks.route_chunk(shadow, forward_batch)
                    end = clock()
                    spent["this"] += middle - start
                    spent["baseline"] += end - middle
                assert chunk.route is owner_broadcast.Route.KNOWN
                return chunk

            results = {kind: {"baseline": [], "this": []} for kind in ("seen", "new")}
            gc.collect()
            gc.freeze()
            with patches_installed(*overhead.PATCHES):
                owner_broadcast.route_chunk = both
                try:
                    for _ in range(args.rounds):
                        for kind in ("seen", "new"):
                            for batch in batches:
                                batch.mm_input_embeds = None
                                batch.mm_inputs = [overhead.fresh_request(seen_request) if kind == "new"
                                                   else seen_request]
                            gc.collect()
                            spent["baseline"] = spent["this"] = 0.0
                            for batch in batches:
                                model.prepare_language_model_inputs(input_ids, batch, None)
                            for version in ("baseline", "this"):
                                results[kind][version].append(spent[version] / overhead.BLOCK * 1e6)
                finally:
                    owner_broadcast.route_chunk = real_route
        assert model.encoder_calls == 0
        for kind in ("seen", "new"):
            base, this = results[kind]["baseline"], results[kind]["this"]
            ratio = statistics.median(t / b for t, b in zip(this, base))
            print(f"{images:>6} {kind:>7} {statistics.median(base):>11.1f} {statistics.median(this):>8.1f} "
                  f"{ratio:>13.3f}", flush=True)


if __name__ == "__main__":
    main()
