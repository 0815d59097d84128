"""Cost one sglang HookRegistry wrapper adds to a call, wrapped vs unwrapped in one run.

Uses sglang 0.5.23's real _wrap_fn for each hook kind our patches use, around a
trivial method, and reports ns/call for each and the difference to the bare call.

    .venv/bin/python benchmarks/plugin/wrapper_overhead.py [--calls N] [--repeats R]
"""

from __future__ import annotations

import argparse
import timeit

from sglang.srt.plugins.hook_registry import HookType, _wrap_fn


class Target:
    def step(self, x, y=1):
        return x


def before_noop(self, *args, **kwargs):
    return None


def after_noop(result, self, *args, **kwargs):
    return None


def around_passthrough(original, self, *args, **kwargs):
    return original(self, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    bare = Target.step
    variants = {
        "bare": bare,
        "BEFORE": _wrap_fn(bare, before_noop, HookType.BEFORE),
        "AFTER": _wrap_fn(bare, after_noop, HookType.AFTER),
        "AROUND": _wrap_fn(bare, around_passthrough, HookType.AROUND),
    }
    obj = Target()
    results = {}
    for name, fn in variants.items():
        Target.step = fn
        best = min(
            timeit.repeat(lambda: obj.step(3, y=2), number=args.calls, repeat=args.repeats)
        )
        results[name] = best / args.calls * 1e9
    Target.step = bare
    base = results["bare"]
    print(f"calls={args.calls} repeats={args.repeats} (best of repeats, ns per call)")
    for name, ns in results.items():
        extra = "" if name == "bare" else f"  added {ns - base:6.1f} ns"
        print(f"{name:>7}: {ns:7.1f} ns{extra}")


if __name__ == "__main__":
    main()
