"""What the plugin's Prometheus counters cost on the paths that increment them.

Each mode runs in a fresh interpreter, because ``core.plugin_metrics`` decides
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
CPU time), then the cost per image chunk (one route count; an owner-routed
chunk adds its agreement rounds and encodes saved) and per Mooncake transfer
batch (one side-channel count), and the flusher's cost per export.

    PYTHONPATH=python python benchmarks/plugin_metrics_overhead.py [--calls 200000]
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
from sglang_dsv41.core import plugin_metrics as m
from sglang_dsv41.core.owner_routing import Route

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
    out["route"] = timed(m.count_owner_route, Route.KNOWN)
    out["round"] = timed(m.count_agreement_round)
    out["saved"] = timed(m.count_encodes_saved, 2)
    out["side_channel"] = timed(m.count_side_channel, "sent", 4, 65536)
    if mode == "on":
        for label in ("no-spans", "not-worth", "owner"):
            m.count_owner_route(label)
        m.count_side_channel("written", 1, 1)
        flushes = []
        for _ in range(50):
            m.count_owner_route(Route.KNOWN)
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
    for key, name in (("route", "count_owner_route"), ("round", "count_agreement_round"),
                      ("saved", "count_encodes_saved"), ("side_channel", "count_side_channel")):
        print(f"{name:<28}{off[key]:>10.0f}{on[key]:>10.0f}")
    print(f"{'empty Python call':<28}{empty['call']:>10.0f}")
    print(f"{'prometheus_client inc()':<28}{'':>10}{prom['inc']:>10.0f}  (multiprocess mode, for comparison)")
    print(f"flush (export of 8 series, on): {on['flush'] / 1000:.1f} us, once per second per process")
    per_chunk_on = on["route"]
    owner_chunk_on = on["route"] + 3 * on["round"] + on["saved"]
    print(f"per image chunk: off {off['route']:.0f} ns, on {per_chunk_on:.0f} ns "
          f"(owner-routed chunk with 3 agreement rounds: on {owner_chunk_on:.0f} ns)")
    print(f"per transfer batch with host blocks: off {off['side_channel']:.0f} ns, "
          f"on {on['side_channel']:.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
