"""Start and stop a real ``sglang serve`` on the CPU for the end-to-end tests.

The server runs sglang 0.5.23's CPU engine (``--device cpu`` with
``SGLANG_USE_CPU_ENGINE=1``) on a tiny random Llama, ``torch_native``
attention and pytorch sampling, bound to 127.0.0.1 on free ports. Only the
hardware kernel library is replaced (``stand_ins/sgl_kernel``). The server
runs in a process group of its own and is stopped through that group, never
by process name; its whole output goes to one log file the tests read.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from _tiny_model import HIDDEN_SIZE

# One way to start a server, wait for its health and stop its group, shared with `sglang-dsv41 verify`;
# live_group_members is also what _pd.py checks a stopped group with.
from sglang_dsv41.tools.verify.servers import (  # noqa: F401
    ExitedBeforeHealthy,
    live_group_members,
    start_in_own_group,
    stop_process_group,
    wait_for_health,
)

HERE = Path(__file__).resolve().parent
STAND_INS = HERE / "stand_ins"
KERNEL_CALLS_ENV = "SGLANG_DSV41_E2E_KERNEL_CALLS"
# sglang's uvicorn supervisor kills a tokenizer worker that has not answered
# its health ping within this many seconds; on a loaded 2-core machine a worker
# can still be importing sglang minutes after the first worker serves /health.
WORKER_HEALTHCHECK_TIMEOUT_S = 600
HEALTH_TIMEOUT_S = float(os.environ.get("SGLANG_DSV41_E2E_HEALTH_TIMEOUT", "1200"))

STATUS_LINE = re.compile(
    r"\[sglang-dsv41\] role=(?P<role>\w+) pid=(?P<pid>\d+) "
    r"patches applied=(?P<applied>\d+)/(?P<owed>\d+) owed"
)
PLUGIN_MARK = "[sglang-dsv41]"
# uvicorn logs this (with a handler of its own) once a worker's app has started.
WORKER_STARTED = "Application startup complete."
# A 1x1 PNG: a text-only model never decodes it, but the request carries media.
PNG_1x1 = "data:image/png;base64," + base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()
# Variables that would change which plugins load or where workers start.
_PLUGIN_ENV = (
    "SGLANG_PLUGINS",
    "SGLANG_PLATFORM",
    "SGLANG_DSV41_ALLOW_DRIFT",
    "SGLANG_HTTP_SERVER_APP_PATH",
    "SGLANG_DSV41_INNER_APP_PATH",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class StatusLine:
    role: str
    pid: int
    applied: int
    owed: int


def sglang_executable() -> str:
    beside = Path(sys.executable).with_name("sglang")
    return str(beside) if beside.exists() else shutil.which("sglang") or "sglang"


class Server:
    def __init__(
        self,
        model: Path,
        workdir: Path,
        *,
        tokenizer_workers: int = 1,
        detokenizer_workers: int = 1,
        plugin: bool = True,
        embedding: bool = False,
        metrics: bool = False,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ):
        self.model = model
        self.workdir = workdir
        self.tokenizer_workers = tokenizer_workers
        self.detokenizer_workers = detokenizer_workers
        self.plugin = plugin
        self.embedding = embedding
        self.metrics = metrics
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(extra_env or {})
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self.kernel_calls = workdir / "kernel_calls.log"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.healthy_after_s: float | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _PLUGIN_ENV}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(STAND_INS), os.environ.get("PYTHONPATH", "")) if p
        )
        env.update(
            SGLANG_USE_CPU_ENGINE="1",
            SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT=str(WORKER_HEALTHCHECK_TIMEOUT_S),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
            **{KERNEL_CALLS_ENV: str(self.kernel_calls)},
        )
        if not self.plugin:
            env["SGLANG_PLUGINS"] = "not_dsv41"  # sglang's own filter: ours is skipped
        env.update(self.extra_env)
        return env

    def command(self) -> list[str]:
        cmd = [
            sglang_executable(), "serve",
            "--model-path", str(self.model),
            "--device", "cpu",
            "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--nccl-port", str(free_port()),
            "--engine-info-bootstrap-port", str(free_port()),
            "--tokenizer-worker-num", str(self.tokenizer_workers),
            "--detokenizer-worker-num", str(self.detokenizer_workers),
            # The default sizes the KV pool from free host memory (gigabytes).
            "--max-total-tokens", "4096",
            "--skip-server-warmup",
            "--random-seed", "0",
            # An idle scheduler otherwise spins on its sockets: a module's shared servers
            # would take most of the 2-core CI machine while other cases run.
            "--sleep-on-idle",
        ]
        if self.embedding:
            cmd.append("--is-embedding")
        if self.metrics:
            cmd.append("--enable-metrics")
        return cmd + list(self.extra_args)

    def start(self) -> "Server":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        self.proc = start_in_own_group(self.command(), self.env(), self.log_path, cwd=self.workdir)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log()[-chars:]

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        try:
            healthy = wait_for_health(self.proc, f"{self.base}/health", timeout)
        except ExitedBeforeHealthy as exited:
            raise AssertionError(
                f"server exited with {exited.returncode} before /health answered:\n" + self.log_tail()
            ) from None
        if not healthy:
            raise AssertionError(f"/health did not answer within {timeout:.0f} s:\n" + self.log_tail())
        self.healthy_after_s = time.monotonic() - self.started_at

    def status_lines(self) -> list[StatusLine]:
        return [
            StatusLine(m["role"], int(m["pid"]), int(m["applied"]), int(m["owed"]))
            for m in STATUS_LINE.finditer(self.log())
        ]

    def wait_for_roles(self, counts: dict[str, int], timeout: float) -> None:
        """Wait until the log holds ``counts[role]`` status lines per role, or every
        tokenizer worker has finished starting (its line, if any, comes before).

        The other roles log theirs before /health answers; the tokenizer workers
        may still be importing sglang then. The assertions come after, in the tests.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            log = self.log()
            seen = [m["role"] for m in STATUS_LINE.finditer(log)]
            if all(seen.count(role) >= n for role, n in counts.items()):
                return
            if log.count(WORKER_STARTED) >= self.tokenizer_workers:
                return
            time.sleep(2)

    def post(self, path: str, payload: dict, timeout: float = 300) -> requests.Response:
        return requests.post(f"{self.base}{path}", json=payload, timeout=timeout)

    def stop(self, *, graceful: bool = True) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after a grace;
        ``graceful=False``: SIGKILL at once, as a crashed host or an OOM kill would."""
        if self.proc is None:
            return
        signals = ((signal.SIGTERM, 30), (signal.SIGKILL, 30)) if graceful else ((signal.SIGKILL, 30),)
        stop_process_group(self.proc, signals)


def start_healthy(server: Server) -> Server:
    server.start()
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny Llama, built once per test session (every e2e module imports this)."""
    from _tiny_model import build_tiny_llama

    dest = tmp_path_factory.getbasetemp() / "tiny_llama"
    if not (dest / "model.safetensors").exists():
        build_tiny_llama(dest)
    return dest


def token_id(model: Path, token: str) -> int:
    from tokenizers import Tokenizer

    found = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id(token)
    assert found is not None, token
    return found


def override_with_media(model: Path, *, with_image: bool = True) -> dict:
    """An /v1/embeddings request of two inputs, each overriding the embedding of its ``<emb>`` token.

    Two inputs, because sglang 0.5.23 answers a single-input request with
    overrides with a server error (its per-input nesting is not unwrapped).
    """
    items = [{"text": "a picture <emb> of a fox"}, {"text": "the lazy <emb> dog"}]
    if with_image:
        for item in items:
            item["image"] = PNG_1x1
    return {
        "model": str(model),
        "input": items,
        "embed_override_token_id": token_id(model, "<emb>"),
        "embed_overrides": [[[0.25] * HIDDEN_SIZE], [[-0.5] * HIDDEN_SIZE]],
    }
