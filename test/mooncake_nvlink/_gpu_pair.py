"""Run the GPU worker (_gpu_worker.py) as a receiver and a sender process, and check a routed pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_gpu_worker.py"
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
