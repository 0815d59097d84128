"""One batched local copy on the GPU for DeepSeek-V4.1 request patterns, from one run.

For each request pattern (8k / 32k tokens; contiguous, runs of 8, fragmented
pages; the sliding-window and request state alone), the request's blocks are
gathered from KV pools into one packed buffer on the same GPU: the batched
copy a peer write makes, with a local destination instead of the decode's
mapped KV.
Three paths, taking turns round by round on the same buffers:
- batched:     ``CudaBatchCopy.copy`` (the chosen backend: one Triton launch);
- per-entry:   ``CudaBatchCopy(prefer="memcpy-async")``: one cudaMemcpyAsync
               per block, then one synchronize;
- contiguous:  one cudaMemcpyAsync of the same total bytes, then one synchronize.
Each is a whole call (table upload, launch, synchronize). A time is the median
over runs of each run's median over rounds; "submit" is the CPU time of a call
before it waits for the GPU (validation, launch table, launches).

Block geometry: ``benchmarks/mooncake_nvlink/mooncake_routing.py`` (sglang 0.5.23's
DeepSeek-V4 pool for a V4.1-Flash-shaped layer plan; see its docstring).

    PYTHONPATH=python python benchmarks/mooncake_nvlink/kv_staging/batch_copy.py [--runs 3 --rounds 50 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "test" / "helpers"))
from dsv41_kv_pattern import DSV41_CASES, dsv41_batches, dsv41_buffer_sizes  # noqa: E402

MiB = 1 << 20


def request_batch(tokens: int, layout: str, pools, packed_ptr: int):
    """(srcs, dsts, lengths) gathering one request's blocks into one buffer, in the engine's order."""
    spans = [span for batch in dsv41_batches(tokens, layout) for span in batch]
    buf, src_off, _, lengths = (np.array(col, dtype=np.uint64) for col in zip(*spans))
    bases = np.array([t.data_ptr() for t in pools], dtype=np.uint64)
    srcs = bases[buf.astype(np.intp)] + src_off
    dsts = np.uint64(packed_ptr) + np.cumsum(lengths) - lengths
    return srcs, dsts, lengths


def timed_call(copier, batch) -> tuple[float, float]:
    t0 = time.perf_counter()
    copier.copy(*batch)
    return time.perf_counter() - t0, copier.last_submit_s


def submit_breakdown(copier, batch, rounds: int = 200) -> dict:
    """Median CPU microseconds of each step of one triton-path call, as ``copy`` runs them."""
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import converted, fill_launch_table

    lane = copier._lanes[-1]
    kernels = copier._kernels
    rt = copier._runtime
    steps = {"convert": [], "validate + launch table": [], "table upload": [], "kernel launch": [],
             "synchronize (wall, includes the GPU)": []}

    def clock(name, fn):
        t0 = time.perf_counter()
        out = fn()
        steps[name].append(time.perf_counter() - t0)
        return out

    for _ in range(rounds):
        s, d, n = clock("convert", lambda: converted(*batch))
        _, word, chunk, pieces, used = clock("validate + launch table", lambda: fill_launch_table(
            lane.reserve, s, d, n, kernels.MIN_CHUNK_BYTES))
        clock("table upload", lambda: rt.lib.cudaMemcpyAsync(lane.device_ptr, lane.host_ptr, used, 1,
                                                              lane.stream_handle))
        compiled = copier._compiled[word]
        clock("kernel launch", lambda: compiled[(len(n), pieces, 1)](
            lane.device_ptr, len(n), chunk, word, kernels.BLOCK_ELEMENTS[word], stream=lane.stream_handle))
        clock("synchronize (wall, includes the GPU)", lambda: rt.lib.cudaStreamSynchronize(lane.stream_handle))
    return {k: statistics.median(v) * 1e6 for k, v in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import torch

    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import CudaBatchCopy, batch_copy_for

    torch.cuda.set_device(args.device)
    batched = batch_copy_for(args.device)
    per_entry = CudaBatchCopy(args.device, prefer="memcpy-async")
    gen = torch.Generator(device="cuda").manual_seed(7)
    pools = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
             for n in dsv41_buffer_sizes()]
    largest = dsv41_buffer_sizes()[-1]
    packed = batched.allocate(largest)
    flat = batched.allocate(largest)
    torch.cuda.synchronize()

    print(f"device: {torch.cuda.get_device_name(args.device)}; torch {torch.__version__}; "
          f"batched backend: {batched.backend}"
          + (f" (fallback: {batched.fallback_reason})" if batched.fallback_reason else ""), flush=True)
    results = []
    for name, tokens, layout in DSV41_CASES:
        batch = request_batch(tokens, layout, pools, packed.ptr)
        total = int(batch[2].sum())
        one = (np.array([flat.ptr], np.uint64), np.array([packed.ptr], np.uint64), np.array([total], np.uint64))
        paths = {"batched": (batched, batch), "per-entry": (per_entry, batch), "contiguous": (per_entry, one)}
        # Byte-exact before timing: the packed buffer holds the blocks in order.
        packed.keepalive[0].zero_()
        torch.cuda.synchronize()
        batched.copy(*batch)
        offsets = np.cumsum(batch[2]) - batch[2]
        for k in np.linspace(0, len(batch[2]) - 1, 16).astype(int).tolist() + [len(batch[2]) - 1]:
            src_buf = next(t for t in pools if t.data_ptr() <= int(batch[0][k]) < t.data_ptr() + t.numel())
            a = int(batch[0][k]) - src_buf.data_ptr()
            n = int(batch[2][k])
            assert torch.equal(packed.keepalive[0][int(offsets[k]):int(offsets[k]) + n], src_buf[a:a + n]), (name, k)
        for copier, b in paths.values():  # warm-up (compile, lanes, tables)
            for _ in range(3):
                copier.copy(*b)
        run_medians = {p: [] for p in paths}
        submit_medians = {p: [] for p in paths}
        for _ in range(args.runs):
            times = {p: [] for p in paths}
            submits = {p: [] for p in paths}
            for _ in range(args.rounds):
                for p, (copier, b) in paths.items():
                    wall, submit = timed_call(copier, b)
                    times[p].append(wall)
                    submits[p].append(submit)
            for p in paths:
                run_medians[p].append(statistics.median(times[p]))
                submit_medians[p].append(statistics.median(submits[p]))
        row = {"case": name, "entries": len(batch[2]), "bytes": total,
               **{f"{p}_us": statistics.median(run_medians[p]) * 1e6 for p in paths},
               **{f"{p}_submit_us": statistics.median(submit_medians[p]) * 1e6 for p in paths},
               "runs_us": {p: [round(t * 1e6, 1) for t in run_medians[p]] for p in paths}}
        results.append(row)
        print(f"{name:16s} {row['entries']:5d} blocks {total / 1e6:6.1f} MB | batched {row['batched_us']:7.1f} us "
              f"(submit {row['batched_submit_us']:5.1f}) | per-entry {row['per-entry_us']:8.1f} us "
              f"(submit {row['per-entry_submit_us']:7.1f}) | contiguous {row['contiguous_us']:6.1f} us | "
              f"batched/contiguous {row['batched_us'] / row['contiguous_us']:4.2f}x, "
              f"per-entry/batched {row['per-entry_us'] / row['batched_us']:5.1f}x", flush=True)
    breakdown = None
    if batched.backend == "triton" and batched._fast_launch and batched._runtime is not None:
        batch = request_batch(32768, "fragmented", pools, packed.ptr)
        breakdown = submit_breakdown(batched, batch)
        print("32k fragmented, CPU per step (median us): "
              + ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items()), flush=True)
    out = {"device": torch.cuda.get_device_name(args.device), "torch": torch.__version__,
           "breakdown_us": breakdown, "runtime": getattr(batched._runtime, "path", None),
           "backend": batched.backend, "fast_launch": getattr(batched, "_fast_launch", None),
           "runs": args.runs, "rounds": args.rounds, "results": results}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    print("RESULT " + json.dumps(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
