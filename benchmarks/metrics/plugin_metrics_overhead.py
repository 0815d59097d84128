"""What the plugin's Prometheus counters cost on the paths that increment them.

Each mode runs in a fresh interpreter, because ``sglang_dsv41.metrics`` decides
once per process whether metrics are on:

  off         ``configure(False)``: the server runs without ``--enable-metrics``
  on          ``configure(True)`` with a ``PROMETHEUS_MULTIPROC_DIR`` (what sglang
              sets up under ``--enable-metrics``): an increment updates a plain
              dict under a lock, the flusher thread exports once per second
  prometheus  for comparison: a ``prometheus_client`` counter child's ``inc()``
              in multiprocess mode (a locked write to a memory-mapped file),
              what an increment would cost if it went straight to prometheus
  empty call  a Python function that does nothing (the floor of any hook call)

For each it prints the median ns per call over repeated blocks (this thread's
CPU time), then the cost per image chunk and per Mooncake transfer batch, and
the flusher's cost per export. An image chunk's route costs nothing extra: the
owner router counts its routes anyway and the flusher exports those counts; a
chunk that runs an owner-protocol session adds one call per agreement round
and one for the encodes it saved; a transfer batch with host blocks adds one
side-channel call per message.

    PYTHONPATH=python python benchmarks/metrics/plugin_metrics_overhead.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import json, statistics, sys, time
calls, mode = int(sys.argv[1]), sys.argv[2]
from sglang_dsv41 import metrics as m
from sglang_dsv41.owner_broadcast.routing import Route

def timed(fn, *args):
    blocks = []
    per_block = max(calls // 20, 1)
    for _ in range(20):
        start = time.thread_time_ns()
        for _ in range(per_block):
            fn(*args)
        blocks.append((time.thread_time_ns() - start) / per_block)
    return statistics.median(blocks)

def empty(*args):
    pass

out = {}
if mode == "prometheus":
    m.configure(True)
    child = m._metrics["owner_routes"].labels("known")
    out["inc"] = timed(child.inc)
elif mode == "empty":
    out["call"] = timed(empty, Route.KNOWN)
else:
    m.configure(mode == "on")
    out["round"] = timed(m.count_agreement_round)
    out["saved"] = timed(m.count_encodes_saved, 2)
    out["side_channel"] = timed(m.count_side_channel, "sent", 4, 65536)
    if mode == "on":
        routes = {route: 1 for route in Route}  # as an owner router keeps them
        m.export_route_counts(routes)
        m.count_side_channel("written", 1, 1)
        flushes = []
        for _ in range(50):
            routes[Route.KNOWN] += 1
            m.count_side_channel("sent", 1, 1)
            start = time.thread_time_ns()
            m.flush()
            flushes.append(time.thread_time_ns() - start)
        out["flush"] = statistics.median(flushes)
print(json.dumps(out))
"""


def run(mode: str, calls: int, directory: str) -> dict:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=directory)
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(calls), mode],
        env=env, capture_output=True, text=True, check=True, timeout=600,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        results = {mode: run(mode, args.calls, directory)
                   for mode in ("empty", "off", "on", "prometheus")}
    empty, off, on, prom = (results[k] for k in ("empty", "off", "on", "prometheus"))
    print(f"ns per call (median of 20 blocks of {args.calls // 20} calls, thread CPU time)")
    print(f"{'call':<28}{'off':>10}{'on':>10}")
    for key, name in (("round", "count_agreement_round"),
                      ("saved", "count_encodes_saved"), ("side_channel", "count_side_channel")):
        print(f"{name:<28}{off[key]:>10.0f}{on[key]:>10.0f}")
    print(f"{'empty Python call':<28}{empty['call']:>10.0f}")
    print(f"{'prometheus_client inc()':<28}{'':>10}{prom['inc']:>10.0f}  (multiprocess mode, for comparison)")
    print(f"flush (export of every series, on): {on['flush'] / 1000:.1f} us, once per second per process")
    owner_chunk = {mode: 4 * r["round"] + r["saved"] for mode, r in (("off", off), ("on", on))}
    print("per image chunk routed known / not-worth / no-spans: 0 ns (the router's own counts)")
    print(f"per owner-routed chunk (4 status rounds, encodes saved): off {owner_chunk['off']:.0f} ns, "
          f"on {owner_chunk['on']:.0f} ns")
    print(f"per transfer batch with host blocks: off {off['side_channel']:.0f} ns, "
          f"on {on['side_channel']:.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
