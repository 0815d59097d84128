"""The Python a DeepSeek-V4.1 request costs before its bytes move, per send path (CPU, sglang 0.5.23).

The GPU benchmark (``mooncake_routing.py --pattern dsv41``) starts its stock
and block paths from ready block lists; in a server sglang first builds those
lists from the page lists in ``MooncakeKVManager._send_kvcache_generic``. This
script runs that real method, on a manager object built without its
constructor (no engine, no threads), for each send call of the benchmark's
request patterns, and times three ways with every byte movement replaced by a
no-op:

  sglang   upstream's method alone: block lists built, engine call a no-op;
  blocks   the same with the plugin's transfer hook (router) in peer mode, each
           block list going the direct way (counted), the engine call a no-op;
  pages    the plugin's page path
           (``mooncake_nvlink.kv_staging.hooks.around_send_kvcache_generic``,
           each kind of call learnt beforehand as in a running server), the copy
           a no-op;
  held     the page path as a transfer worker runs a request: earlier chunks'
           KV sends at once, the last chunk's sends held and flushed as one
           (the flush's copy a no-op).

Medians of ``--iters`` requests per run, ``--runs`` runs; prints each run and the
range. Needs sglang 0.5.23 importable (the project's venv); no GPU.

    PYTHONPATH=python python benchmarks/mooncake_nvlink/kv_staging/send_call_python.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 3, "test", "helpers"))
import dsv41_kv_pattern as pattern  # noqa: E402  (the request patterns)


def _median_us(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def parse_runs(prog: str, description: str):
    """--runs and --iters, checked; None (after one line on stderr) when either is below 1."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    if args.runs < 1 or args.iters < 1:
        print(f"{prog}: --runs and --iters must be at least 1", file=sys.stderr)
        return None
    return args

SESSION = "127.0.0.1:17000"
BUFFER = 1 << 32  # address space per buffer (nothing is touched)
SRC0, DST0 = 0x100_0000_0000, 0x300_0000_0000


def _build(page_path: bool):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    from sglang_dsv41.mooncake_nvlink.kv_staging.mappings import SessionMappings
    from sglang_dsv41.mooncake_nvlink.kv_staging.setting import StagingConfig
    from sglang_dsv41.mooncake_nvlink.routing import KindTable, MemoryKind, TransferRouter
    from sglang_dsv41.mooncake_nvlink.state import RoutingState, set_routing_state
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import HANDLE_BYTES, PeerMap, PeerRegion, PeerTarget, host_identity
    from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging
    from sglang_dsv41.mooncake_nvlink import hooks as mooncake_nvlink

    class NoCopy:
        kind = "host-cma"

        def open(self, peer):
            return PeerTarget(peer, [r.ptr for r in peer.regions], self, [])

        def write_pages(self, target, copies):
            pass

        def close(self, opened):
            pass

    buffers = pattern.FLAT_BUFFER
    mgr = MooncakeKVManager.__new__(MooncakeKVManager)
    mgr.__dict__.update(
        is_mla_backend=True, is_hybrid_mla_backend=False, state_strides_validated=set(), pp_size=1,
        enable_custom_mem_pool=False, custom_mem_pool_type=None, max_transfer_batch_indices=0,
        kv_args=SimpleNamespace(prefill_start_layer=0, prefill_end_layer=buffers, num_draft_entries=0,
                                mla_compression_ratios=None),
    )
    src = [SRC0 + k * BUFFER for k in range(buffers)]
    dst = [DST0 + k * BUFFER for k in range(buffers)]

    def no_engine(self, session, blocks):
        return 0

    if page_path is None:  # sglang alone
        mgr._transfer_data = lambda session, blocks: 0
    else:
        mgr._transfer_data = lambda session, blocks: mooncake_nvlink.around_transfer_data(
            no_engine, mgr, session, blocks)
        kinds = KindTable([(p, BUFFER, MemoryKind.DEVICE) for p in src], lambda ptr: MemoryKind.HOST)
        set_routing_state(mgr, RoutingState(
            "benchmark", None, TransferRouter(kinds, None), kinds))
        transport = NoCopy()
        mgr.__dict__["_dsv41_kv_staging"] = kv_staging.StagingState(
            StagingConfig(), transport, mappings=SessionMappings(transport))
        peer = PeerMap("host-cma", host_identity(),
                       tuple(PeerRegion(p, BUFFER, 0, b"h" * HANDLE_BYTES) for p in dst))
        mgr.decode_kv_args_table = {SESSION: SimpleNamespace(**{kv_staging.PEER_MAP_ATTR: peer})}

    def upstream(self, **call):
        return MooncakeKVManager._send_kvcache_generic(self, **call)

    def send(bufs, items, src_pages, dst_pages):
        call = dict(mooncake_session_id=SESSION, src_data_ptrs=[src[b] for b in bufs],
                    dst_data_ptrs=[dst[b] for b in bufs], item_lens=list(items),
                    prefill_data_indices=src_pages, dst_data_indices=dst_pages, executor=None)
        if page_path:
            return lambda: kv_staging.around_send_kvcache_generic(upstream, mgr, **call)
        return lambda: upstream(mgr, **call)

    return send


def _request(send, tokens, layout, held: bool = False):
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PeerWrites
    from sglang_dsv41.mooncake_nvlink.kv_staging import held

    calls = []
    for bufs, items, sp, dp in pattern.dsv41_paged_calls(tokens, layout):
        # the lists as sglang holds them: one list object per buffer group, int32 page arrays
        calls.append(send(bufs, items, np.array(sp, dtype=np.int32), np.array(dp, dtype=np.int32)))
    last = len(calls) - 3 if held else len(calls)  # the last chunk: its KV call, then the two state calls
    writes = PeerWrites()

    def run():
        for i, call in enumerate(calls):
            if i == last:
                held.hold(writes)  # what the worker's queue does for a last chunk
            if call() != 0:
                raise RuntimeError("a send call failed")
        if held:  # the barrier: when the state sends return
            failed = held.flush_held("benchmark")
            held.hold(None)
            if failed is not None or len(writes):
                raise RuntimeError("the held writes were not flushed")
    return run


def main() -> int:
    args = parse_runs("send_call_python", __doc__.splitlines()[0])
    if args is None:
        return 2
    try:
        import sglang.srt.disaggregation.mooncake.conn  # noqa: F401
    except Exception as exc:  # not installed, or not importable here
        print(f"send_call_python: needs sglang importable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    ways = {"sglang": _build(None), "blocks": _build(False), "pages": _build(True), "held": _build(True)}
    results: dict[str, list[list[float]]] = {}
    for run in range(args.runs):
        print(f"run {run + 1} of {args.runs}: Python per request, us (median of {args.iters})")
        print(f"  {'request':>16} " + " ".join(f"{w:>9}" for w in ways))
        for name, tokens, layout in pattern.DSV41_CASES:
            row = [_median_us(_request(send, tokens, layout, held=(way == "held")), args.iters)
                   for way, send in ways.items()]
            results.setdefault(name, []).append(row)
            print(f"  {name:>16} " + " ".join(f"{v:9.0f}" for v in row))
    print(f"\nover {args.runs} runs: min - max (us); sglang's list building is paid by stock and "
          "the block path, the page path skips it")
    print(f"  {'request':>16} " + " ".join(f"{w:>11}" for w in ways))
    for name, rows in results.items():
        print(f"  {name:>16} " + " ".join(f"{min(c):5.0f}-{max(c):<5.0f}" for c in zip(*rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
