"""Mooncake intra-node NVLink routing on real GPUs (skips without CUDA).

Two processes on one GPU (Mooncake's nvlink_intra works there; NCCL would
not), each with a real Mooncake engine (MC_INTRANODE_NVLINK=1, protocol
nvlink_intra), device KV/state pools and pinned host aux/state buffers:
- with our registration plan and router: registration succeeds, device blocks
  move over NVLink, host blocks over the side channel, everything byte-exact;
- registering the same regions the stock way (one batch, host included) fails,
  which is the bug the routing exists for;
- GPU0 -> GPU1 when two GPUs exist (skipped otherwise).

Imports only torch, mooncake and sglang_dsv41.mooncake_nvlink's plain modules
(routing, memory; no sglang). Runs under pytest or as a script: ``PYTHONPATH=python python test/mooncake_nvlink/test_mooncake_nvlink_gpu.py``.
"""

from __future__ import annotations

import sys
import unittest

from _gpu_pair import check_routed, run_pair  # noqa: E402


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError as exc:
        raise unittest.SkipTest(f"torch not importable: {exc}")
    if not torch.cuda.is_available():
        raise unittest.SkipTest("no CUDA device")
    return torch.cuda.device_count()


def _cfg(gpu: int, routing: bool) -> dict:
    return {"gpu": gpu, "device": "cuda", "protocol": "nvlink_intra", "routing": routing}


def test_routing_two_processes_one_gpu():
    _cuda_devices()
    receiver, sender = run_pair(_cfg(0, True), _cfg(0, True))
    check_routed(receiver, sender)
    print(f"one GPU: memory backend {sender['memory_backend']}, route {sender['route_s'] * 1e3:.1f} ms")


def test_stock_registration_fails_with_host_regions():
    """Without our routing: one batch with host regions fails, and device transfers with it."""
    _cuda_devices()
    receiver, sender = run_pair(_cfg(0, False), _cfg(0, False))
    failed = [s["role"] for s in (receiver, sender) if s["register_rc"] != 0]
    assert failed, (
        "Mooncake accepted host regions under nvlink_intra: the bug our routing works "
        f"around was not reproduced with this wheel ({receiver}, {sender})"
    )
    assert sender["device_rc"] != 0, f"device transfer succeeded after a failed registration: {sender}"
    assert receiver["mismatch"], receiver


def test_routing_gpu0_to_gpu1():
    if _cuda_devices() < 2:
        raise unittest.SkipTest("needs two GPUs")
    receiver, sender = run_pair(_cfg(0, True), _cfg(1, True))
    check_routed(receiver, sender)


if __name__ == "__main__":
    failures = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}", flush=True)
            except unittest.SkipTest as exc:
                print(f"SKIP {name}: {exc}", flush=True)
            except Exception as exc:  # report every case, then fail
                failures += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1 if failures else 0)
