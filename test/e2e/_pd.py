"""A real prefill/decode pair of ``sglang serve`` on the CPU, with sglang's router in front.

Both servers are ``_e2e_server.Server`` (the tiny Llama, the CPU engine) with
the disaggregation flags; the KV moves through Mooncake's transfer engine over
TCP on 127.0.0.1, so every byte really travels between the two processes.
The router is PyPI ``sglang-router`` (a pinned test dependency) in PD mode.
Each process runs in a process group of its own and is stopped through it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from _e2e_server import Server, free_port, live_group_members

# Both sides. Mooncake's transfer engine over TCP (no RDMA device here), and
# the address sglang registers at the bootstrap server pinned to loopback
# (by default sglang registers the NIC's address, which a sandbox may not route).
PD_ENV = {
    "MOONCAKE_PROTOCOL": "tcp",
    "SGLANG_HOST_IP": "127.0.0.1",
    # Mooncake's own transfer counters, logged by its engine: what proves bytes
    # moved between the processes, independently of sglang's bookkeeping.
    "MC_TE_METRIC": "1",
    "MC_TE_METRIC_INTERVAL_SECONDS": "1",
}
# The prefill's KV send pins a host copy and records a CUDA event unless every
# CP rank sends its own KV; at CP size 1 (this pair) that changes nothing else.
# A cached-prefix early send records a CUDA event under the overlap scheduler;
# off, the cached prefix goes with the first chunk as it does without the flag.
PREFILL_ENV = {
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}
# The decode's default retraction backup is a host pool registered with
# cudaHostRegister; a plain CPU tensor is sglang's own alternative.
# A "Decode batch" line at every decode step (40 by default): the decode's own
# log says whether it served a request.
DECODE_ARGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor", "--decode-log-interval", "1")
DECODE_STEP_LINE = "Decode batch"

# Mooncake's engine logs "... Throughput: <value> <unit>" lines while it moves bytes.
MOONCAKE_THROUGHPUT = re.compile(r"Throughput: (?P<value>[0-9.]+) ?(?P<unit>[KMG]?B)/s")


def pd_server(role: str, model: Path, workdir: Path, *, plugin: bool = True,
              bootstrap_port: int | None = None, port: int | None = None,
              env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> Server:
    args = ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "mooncake"]
    full_env = dict(PD_ENV)
    if role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        full_env.update(PREFILL_ENV)
    else:
        args += DECODE_ARGS
    full_env.update(env or {})
    return Server(model, workdir, plugin=plugin, metrics=True, port=port,
                  extra_args=(*args, *extra_args), extra_env=full_env)


class Router:
    """``python -m sglang_router.launch_router --pd-disaggregation`` on 127.0.0.1."""

    def __init__(self, prefill: Server, bootstrap_port: int, decodes: list[Server], workdir: Path,
                 *, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.log_path = workdir / "router.log"
        workdir.mkdir(parents=True, exist_ok=True)
        self.command = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.base, str(bootstrap_port),
            *(word for decode in decodes for word in ("--decode", decode.base)),
            "--host", "127.0.0.1", "--port", str(self.port),
            # Its own metrics port: the default 29000 is one per machine.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            *extra_args,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> "Router":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if requests.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise AssertionError(f"router /health did not answer within {timeout:.0f} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def generate(self, payload: dict, timeout: float = 600) -> requests.Response:
        return requests.post(f"{self.base}/generate", json=payload, timeout=timeout)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        assert not live_group_members(self.proc.pid)


def greedy(text: str, max_new_tokens: int) -> dict:
    return {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0},
    }


def metric_values(server: Server, name: str) -> dict[str, float]:
    """``{labels: value}`` of one series on the server's /metrics (labels as written there)."""
    text = requests.get(f"{server.base}/metrics", timeout=60).text
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            found[head[len(name):]] = float(value)
    return found


def metric_total(server: Server, name: str) -> float:
    return sum(metric_values(server, name).values())
