"""Mooncake intra-node NVLink routing on real GPUs (skips without CUDA).

Two processes on one GPU (Mooncake's nvlink_intra works there; NCCL would
not), each with a real Mooncake engine (MC_INTRANODE_NVLINK=1, protocol
nvlink_intra), device KV/state pools and pinned host aux/state buffers:
- with our registration plan and router: registration succeeds, device blocks
  move over NVLink, host blocks over the side channel, everything byte-exact;
- registering the same regions the stock way (one batch, host included) fails,
  which is the bug the routing exists for;
- GPU0 -> GPU1 when two GPUs exist (skipped otherwise).

Imports only torch, mooncake and sglang_dsv41.core. Runs under pytest or as a
script: ``PYTHONPATH=python python test/gpu/test_mooncake_nvlink_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_mooncake_nvlink_worker.py"
PYTHON_DIR = HERE.parent.parent / "python"

KV_BLOCKS = 4 * 5  # KV buffers x page pairs, see the worker
DEVICE_BLOCKS = KV_BLOCKS + 1  # + state0 (device on both sides)
HOST_BLOCKS = 2 + 2  # aux0, aux1, state1 (host -> host), state2 (host -> device)


def _result(out: str, err: str, prefix: str = "RESULT ") -> dict:
    lines = [l for l in out.splitlines() if l.startswith(prefix)]
    if not lines:
        raise AssertionError(f"no {prefix.strip()} line; stderr tail:\n{err[-3000:]}")
    return json.loads(lines[-1][len(prefix):])


def run_pair(receiver_cfg: dict, sender_cfg: dict, timeout: float = 240) -> tuple[dict, dict]:
    """Receiver and sender as two processes; returns their RESULT dicts."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    rx = subprocess.Popen([sys.executable, str(WORKER), "receiver", json.dumps(receiver_cfg)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready_line = ""
        while not ready_line.startswith(("READY ", "RESULT ")):
            ready_line = rx.stdout.readline()
            if not ready_line:
                break
        if not ready_line.startswith("READY "):
            rx.kill()
            out, err = rx.communicate(timeout=30)
            raise AssertionError(f"receiver not ready: {ready_line}{out}\n{err[-3000:]}")
        ready = json.loads(ready_line[len("READY "):])
        tx = subprocess.run(
            [sys.executable, str(WORKER), "sender", json.dumps(sender_cfg), json.dumps(ready)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )
        sender = _result(tx.stdout, tx.stderr)
        out, err = rx.communicate(timeout=timeout)
        receiver = _result(ready_line + out, err)
    finally:
        if rx.poll() is None:
            rx.kill()
    for side in (sender, receiver):
        assert "error" not in side, f"{side['role']}: {side['error']}"
    return receiver, sender


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


def check_routed(receiver: dict, sender: dict) -> None:
    for side in (receiver, sender):
        assert side["nvlink_intra"], side
        assert side["register_rc"] == 0, f"{side['role']} registration failed: {side}"
    assert sender["left_out"] == 4 and receiver["left_out"] == 3, (sender, receiver)
    assert sender["route_rc"] == 0, sender
    assert sender["device_blocks"] == DEVICE_BLOCKS and sender["host_blocks"] == HOST_BLOCKS
    assert receiver["mismatch"] == [], receiver
    assert receiver["host_messages_written"] >= 1 and receiver["host_messages_dropped"] == 0
    assert sender["receiver_ack"] is True


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
