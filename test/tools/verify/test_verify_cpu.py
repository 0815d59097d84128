"""`sglang-dsv41 verify --device cpu` against real ``sglang serve`` processes on the CPU.

The e2e tests' tiny Llama (built by its own script) on sglang's CPU engine, with
only the hardware kernel library replaced (test/e2e/stand_ins). Four server
start-ups in all, and one cut short: one passing run (plugin against stock), one failing run whose
stock side serves a copy of the model with its output layer negated (the
reference-model test aid), with a GPU check skipped for its reason; a third run
is interrupted while its first server starts.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
CLI = str(Path(sys.executable).parent / "sglang-dsv41")
E2E = REPO_ROOT / "test" / "e2e"
CPU_ARGS = ("--attention-backend torch_native --sampling-backend pytorch --max-total-tokens 4096 "
            "--skip-server-warmup --sleep-on-idle")  # an idle scheduler otherwise spins


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("verify-models")
    subprocess.run([sys.executable, str(E2E / "_tiny_model.py"), str(base / "tiny")], check=True,
                   capture_output=True, timeout=600)
    reference = base / "tiny-negated"
    subprocess.run(["cp", "-r", str(base / "tiny"), str(reference)], check=True)
    from safetensors.torch import load_file, save_file

    weights = load_file(reference / "model.safetensors")
    weights["lm_head.weight"] = -weights["lm_head.weight"]  # the greedy token becomes another one
    save_file(weights, reference / "model.safetensors", metadata={"format": "pt"})
    return base / "tiny", reference


def free_port_span(span: int = 9) -> int:
    while True:
        first = random.randrange(20000, 60000)
        try:
            for port in range(first, first + span):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


def verify_cmd(model: Path, out: Path, *extra, port: int | None = None) -> list:
    return [CLI, "verify", "--device", "cpu", "--model-path", str(model), "--out", str(out),
            "--port", str(port or free_port_span()), "--prompt-words", "5 20", "--max-new-tokens", "8",
            "--repeats", "1", "--wait-s", "1200", "--extra-args", CPU_ARGS, *extra]


def cpu_env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(E2E / "stand_ins"), env.get("PYTHONPATH")) if p),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT="600")
    return env


def run(cmd) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(), timeout=1700)
    print(f"\nverify run: {time.monotonic() - started:.0f} s")
    return done


def test_plugin_against_stock_passes_with_one_report(models, tmp_path):
    done = run(verify_cmd(models[0], tmp_path, "--features", "status,stock"))
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "verify: PASSED (2 passed, 0 failed, 0 skipped)" in done.stdout
    assert "verify: starting plugin:" in done.stderr and "plugin is up after" in done.stderr
    report = json.loads((tmp_path / "verify-report.json").read_text())
    status, stock = report["checks"]
    assert report["ok"] is True and (status["status"], stock["status"]) == ("pass", "pass")
    plugin_server = report["sides"]["plugin_stock"][0]["servers"][0]
    assert plugin_server["argv"][1:3] == ["serve", "--model-path"] and "--enable-metrics" in plugin_server["argv"]
    assert report["sides"]["plugin_stock"][1]["servers"][0]["env"]["SGLANG_PLUGINS"] == "not_dsv41"
    assert status["figures"]["plugin"]["launch_guard"] == ["none"]
    assert report["versions"]["sglang"] == "0.5.23" and report["device"] == "cpu"
    answers = [side["prompts"] for side in report["sides"]["plugin_stock"]]
    assert answers[0][0]["output_ids"] and [p["output_ids"] for p in answers[0]] == [
        p["output_ids"] for p in answers[1]]


def test_a_different_reference_fails_naming_the_mismatch_and_a_gpu_check_is_skipped(models, tmp_path):
    done = run(verify_cmd(models[0], tmp_path, "--features", "stock,vision_cp",
                          "--reference-model-path", str(models[1])))
    assert done.returncode == 1, done.stdout + done.stderr[-4000:]
    report = json.loads((tmp_path / "verify-report.json").read_text())
    stock, vision = report["checks"]
    assert stock["status"] == "fail" and "greedy tokens differ between plugin and stock" in stock["detail"]
    assert stock["figures"]["mismatches"][0].startswith("text-5w: tokens differ from position 0")
    assert vision == {"check": "vision_cp", "status": "skip",
                      "detail": "CPU-only run: this check needs GPUs", "figures": {}}
    assert re.search(r"^stock +FAIL ", done.stdout, re.M) and re.search(r"^vision_cp +SKIP ", done.stdout, re.M)
    assert "NOT PASSED (0 passed, 1 failed, 1 skipped)" in done.stdout


def test_an_interrupt_stops_the_server_it_started(models, tmp_path):
    port = free_port_span()
    # A shell without job control starts background commands with SIGINT ignored, and the
    # tool would inherit that; Ctrl-C at a terminal reaches a tool whose SIGINT is the default.
    proc = subprocess.Popen(verify_cmd(models[0], tmp_path, "--features", "status", port=port),
                            env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    server = []
    while not server and time.monotonic() < deadline:
        time.sleep(0.5)
        server = [pid for pid in _pids() if f"serve --model-path {models[0]} " in _cmdline(pid)
                  and f"--port {port} " in _cmdline(pid)]
    assert server, "the server was never seen running"
    group = os.getpgid(server[0])
    assert group == server[0]  # a session of its own: its launcher leads the group
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the tool (the server's group is its own)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted; every server it started is stopped (1 in all)" in err
    assert not [pid for pid in _pids() if _alive(pid) and _pgid(pid) == group]


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").glob("[0-9]*")]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def _pgid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[2]) if fields else None
