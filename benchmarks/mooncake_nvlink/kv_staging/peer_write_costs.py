"""Where a KV peer write's time goes, per call (one GPU, two processes).

A spawned "decode" process exports eight 64 MiB regions over CUDA IPC, as the
decode side does with ``SGLANG_DSV41_KV_STAGING=peer``. This process opens
them and times, for transfer batches shaped like a DeepSeek-V4.1 request's
(few large blocks to a thousand 32 KiB ones), each step of
``core.peer_copy.send_peer_batch``: turning the engine's block list into
arrays, translating the destinations into the mapping, the batched copy
(launch-table upload, kernel, synchronize), and the whole call. Then the page
path (``send_paged_batch``) for three DeepSeek-V4.1 send calls: taking the
call (its page lists as a ``PagedCopy``), the paged copy (launch table with
its page check, the launch that carries it, kernel, synchronize), the whole call, holding it
(``PeerWrites``); and a request's last sends held and written as one, through each way
the copier has of launching it (native writer, table as parameter from Python, table
uploaded first; all in each run). Medians of
``--iters`` calls, repeated ``--runs`` times; prints each run and the range.

    PYTHONPATH=python python benchmarks/mooncake_nvlink/kv_staging/peer_write_costs.py --runs 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

REGIONS = 8
REGION_BYTES = 64 << 20
SHAPES = ((1, 64 << 10), (27, 480 << 10), (54, 240 << 10), (302, 42 << 10), (1068, 32 << 10))


def _decode_side(conn) -> None:
    import torch

    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import batch_copy_for
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import CudaIpcTransport, encode_peer_map

    pool = torch.zeros(REGIONS * REGION_BYTES, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    transport = CudaIpcTransport(batch_copy_for(0), 0)
    regions = [(pool.data_ptr() + k * REGION_BYTES, REGION_BYTES) for k in range(REGIONS)]
    conn.send(encode_peer_map(transport.export(regions)))
    conn.recv()


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


def main() -> int:
    args = parse_runs("peer_write_costs", __doc__.splitlines()[0])
    if args is None:
        return 2
    try:
        import torch
    except ImportError as exc:
        print(f"peer_write_costs: needs torch with CUDA ({exc})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("peer_write_costs: no CUDA device", file=sys.stderr)
        return 2
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import batch_copy_for
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import CudaIpcTransport, as_triples, find_peer_map, send_peer_batch

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_decode_side, args=(child_conn,), daemon=True)
    child.start()
    if not conn.poll(120):
        print("peer_write_costs: the decode process did not export its regions", file=sys.stderr)
        return 1
    peer = find_peer_map(conn.recv())
    copier = batch_copy_for(0)
    target = CudaIpcTransport(copier, 0).open(peer)
    src = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda:0")
    rng = np.random.default_rng(2)
    steps = ("to arrays", "translate", "batched copy", "whole call")
    results: dict[tuple[int, int], list[list[float]]] = {}
    for run in range(args.runs):
        print(f"run {run + 1} of {args.runs} (us, median of {args.iters} calls)")
        print(f"  {'batch':>16} " + " ".join(f"{s:>13}" for s in steps))
        for n, size in SHAPES:
            slots = rng.permutation(REGIONS * (REGION_BYTES // size))[:n]
            blocks = []
            for i, slot in enumerate(slots):  # distinct destination pages spread over the regions
                region, page = divmod(int(slot), REGION_BYTES // size)
                blocks.append((src.data_ptr() + i * size, peer.regions[region].ptr + page * size, size))
            srcs, dsts, lengths = as_triples(blocks)
            local, _ = target.translate(dsts, lengths)
            row = [
                _median_us(lambda: as_triples(blocks), args.iters),
                _median_us(lambda: target.translate(dsts, lengths), args.iters),
                _median_us(lambda: copier.copy(srcs, local, lengths), args.iters),
                _median_us(lambda: send_peer_batch(blocks, target, 1, None), args.iters),
            ]
            results.setdefault((n, size), []).append(row)
            print(f"  {n:>5} x {size >> 10:>4} KiB " + " ".join(f"{v:>13.1f}" for v in row))
    print(f"\nover {args.runs} runs: min - max (us)")
    print(f"  {'batch':>16} " + " ".join(f"{s:>13}" for s in steps))
    for (n, size), rows in results.items():
        cells = [f"{min(c):.0f}-{max(c):.0f}" for c in zip(*rows)]
        print(f"  {n:>5} x {size >> 10:>4} KiB " + " ".join(f"{c:>13}" for c in cells))
    paged_costs(args, peer, target, copier, src)
    target.retire()
    conn.send("stop")
    child.join(30)
    return 0


# DeepSeek-V4.1 send calls as the page path gets them: (name, bytes per page of each
# buffer, src pages, dst pages); see mooncake_routing.py --pattern dsv41.
KV_ITEMS = (73728, 17408, 36864, 36864, 36864, 8704, 8704, 8704)
SEND_CALLS = (
    ("window state, 43 x 1 page", (135168,) * 43, [1], [2]),
    ("8k KV, contiguous", KV_ITEMS, list(range(1, 33)), list(range(2, 34))),
    ("16k KV chunk, fragmented", KV_ITEMS, list(range(1, 129, 2)), list(range(2, 130, 2))),
)


def paged_costs(args, peer, target, copier, src) -> None:
    """The page path per send call: taking the call, the paged copy, the whole call, holding it;
    then a request's last sends held and written as one."""
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PagedLayout, PeerWrites, bind_layout, paged_call, send_paged_batch

    span = REGION_BYTES // 64  # each buffer's share of the regions (43 buffers fit)
    end = src.data_ptr() + src.numel()
    steps = ("take call", "paged copy", "whole call", "hold")
    results: dict[str, list[list[float]]] = {}
    bound_calls = {}
    for name, items, sp, dp in SEND_CALLS:
        entries = [(src.data_ptr() + k * span, peer.regions[k % REGIONS].ptr + (k // REGIONS) * span, n)
                   for k, n in enumerate(items)]
        bound, why_not = bind_layout(PagedLayout.of(entries), target, lambda addr: end - addr)
        if bound is None:
            raise RuntimeError(f"{name}: {why_not}")
        bound_calls[name] = (bound, np.array(sp, dtype=np.int32), np.array(dp, dtype=np.int32))
    held = PeerWrites()

    def hold(bound, sp_, dp_):
        held.add_pages(bound, sp_, dp_)
        held.discard()

    def request(names):
        def run():
            for n in names:
                held.add_pages(*bound_calls[n])
            held.flush()
        return run

    requests = {"last 8k chunk + window state": ("8k KV, contiguous", "window state, 43 x 1 page"),
                "last 16k chunk fragmented + window state": ("16k KV chunk, fragmented",
                                                             "window state, 43 x 1 page")}
    for run in range(args.runs):
        print(f"\npage path, run {run + 1} of {args.runs} (us, median of {args.iters} calls)")
        print(f"  {'send call':>26} " + " ".join(f"{s:>13}" for s in steps))
        for name, (bound, sp_, dp_) in bound_calls.items():
            copy = paged_call(bound, sp_, dp_)[0]
            row = [
                _median_us(lambda: paged_call(bound, sp_, dp_), args.iters),
                _median_us(lambda: copier.copy_pages([copy]), args.iters),
                _median_us(lambda: send_paged_batch(bound, sp_, dp_, 1), args.iters),
                _median_us(lambda: hold(bound, sp_, dp_), args.iters),
            ]
            results.setdefault(name, []).append(row)
            print(f"  {name:>26} " + " ".join(f"{v:>13.1f}" for v in row))
        for name, names in requests.items():
            t = _median_us(request(names), args.iters)
            results.setdefault(name, []).append([t])
            print(f"  held and written as one: {name}: {t:.1f}")
    launchers = launcher_costs(args, copier, request, requests)
    print(f"\npage path over {args.runs} runs: min - max (us)")
    print(f"  {'send call':>26} " + " ".join(f"{s:>13}" for s in steps))
    for name, rows in results.items():
        if name in requests:
            print(f"  held and written as one: {name}: {min(r[0] for r in rows):.0f}-{max(r[0] for r in rows):.0f}")
            continue
        print(f"  {name:>26} " + " ".join(f"{min(c):.0f}-{max(c):.0f}".rjust(13) for c in zip(*rows)))
    for name, runs in launchers.items():
        spans = ", ".join(f"{way} {min(t[way] for t in runs):.0f}-{max(t[way] for t in runs):.0f}"
                          for way in runs[0])
        print(f"  held and written as one, {name}: {spans}")


def launcher_costs(args, copier, request, requests) -> dict[str, list[dict[str, float]]]:
    """The held requests again through each way of launching the copier has, in turns within each
    run: "native" (table filled, checked, launched and waited for in one native call), "parameter"
    (the table as the kernel's parameter, from Python), "uploaded" (the table uploaded first for
    the Triton kernel). Empty where the parameter-table kernel is not loaded."""
    if not copier.use_table_as_parameter(True):
        print(f"\n(no launcher comparison: {copier.param_reason})")
        return {}
    ways = {"native": lambda: copier.use_native_writer(True),
            "parameter": lambda: not copier.use_native_writer(False),
            "uploaded": lambda: not copier.use_table_as_parameter(False)}
    if not copier.use_native_writer(True):
        print(f"\n(no native writer: {copier.native_reason})")
        del ways["native"]
    times: dict[str, list[dict[str, float]]] = {}
    for run in range(args.runs):
        print(f"\nlaunchers, run {run + 1} of {args.runs} (us, median of {args.iters} calls)")
        for name, names in requests.items():
            row = {}
            for way, use in ways.items():
                copier.use_table_as_parameter(True)
                if not use():
                    raise SystemExit(f"peer_write_costs: the copier refused the launcher {way}")
                row[way] = _median_us(request(names), args.iters)
            copier.use_table_as_parameter(True)
            copier.use_native_writer(True)
            times.setdefault(name, []).append(row)
            print(f"  held and written as one, {name}: " + ", ".join(f"{w} {t:.1f}" for w, t in row.items()))
    return times


if __name__ == "__main__":
    sys.exit(main())
