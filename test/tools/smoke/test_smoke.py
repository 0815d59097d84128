"""`sglang-dsv41 smoke` against HTTP servers on 127.0.0.1.

The protocol and the negative cases run against a stand-in written here with
``http.server``: it answers the endpoints an sglang 0.5.23 server answers
(``/health``, ``/model_info``, ``/v1/models``, ``/v1/chat/completions``,
``/metrics``) in their shapes, and each test makes it misbehave one way. The
command runs as the operator runs it, as a subprocess of the installed
console script.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path

import jsonschema
import pytest

from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.table import owed_to

CLI = str(Path(sys.executable).parent / "sglang-dsv41")
pytestmark = pytest.mark.timeout(120)
SCHEMA = json.loads(resources.files("sglang_dsv41").joinpath("data/schemas/smoke.schema.json").read_text())


def plugin_metrics_text(applied: dict[str, int] | None = None, *, launcher: bool = True) -> str:
    """What the schedulers of a server with the plugin publish; ``launcher=False``: a
    launcher that ran without it (no verdict, no launcher count reached them)."""
    owed = {"scheduler": len(owed_to(Role.SCHEDULER)), "launcher": len(owed_to(Role.LAUNCHER))}
    if not launcher:
        del owed["launcher"]
    applied = owed if applied is None else {**owed, **applied}
    lines = ["# HELP sglang:num_running_reqs The number of running requests.",
             "# TYPE sglang:num_running_reqs gauge",
             'sglang:num_running_reqs{model_name="m"} 0.0']
    for role in owed:
        lines.append(f'sglang_dsv41_patches_applied{{role="{role}"}} {float(applied[role])}')
        lines.append(f'sglang_dsv41_patches_owed{{role="{role}"}} {float(owed[role])}')
    if launcher:
        lines.append('sglang_dsv41_launch_guard_active{rule="none"} 1.0')
    return "\n".join(lines) + "\n"


class StandIn:
    """What an sglang server answers, and the ways to make it misbehave."""

    def __init__(self, *, vision=False, pd_mode=None, metrics: str | None = "plugin",
                 health_status=200, chat_status=200, chat_delay=0.0, image_tokens=500,
                 model_info_status=200):
        self.vision, self.pd_mode = vision, pd_mode
        self.metrics = plugin_metrics_text() if metrics == "plugin" else metrics
        self.health_status, self.chat_status = health_status, chat_status
        self.chat_delay, self.image_tokens = chat_delay, image_tokens
        self.model_info_status = model_info_status
        self.requests: list[tuple[str, dict | None]] = []
        self.images: list[tuple[int, int]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body=b"", kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                stand_in.requests.append((self.path, None))
                if self.path == "/health":
                    return self.reply(stand_in.health_status)
                if self.path == "/model_info":
                    info = {"model_path": "/model", "has_image_understanding": stand_in.vision,
                            "disaggregation_mode": stand_in.pd_mode or "null", "is_generation": True}
                    return self.reply(stand_in.model_info_status, json.dumps(info).encode())
                if self.path == "/v1/models":
                    return self.reply(200, json.dumps(
                        {"object": "list", "data": [{"id": "DeepSeek-V4.1-Flash", "object": "model"}]}).encode())
                if self.path == "/metrics" and stand_in.metrics is not None:
                    return self.reply(200, stand_in.metrics.encode(), "text/plain; version=0.0.4")
                return self.reply(404, b'{"detail":"Not Found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append((self.path, body))
                if self.path != "/v1/chat/completions":
                    return self.reply(404)
                time.sleep(stand_in.chat_delay)
                if stand_in.chat_status != 200:
                    return self.reply(stand_in.chat_status, b'{"error":"boom"}')
                content = body["messages"][0]["content"]
                prompt_tokens = 12
                if isinstance(content, list):
                    for part in content:
                        if part.get("type") == "image_url":
                            stand_in.images.append(decode_png_size(part["image_url"]["url"]))
                            prompt_tokens += stand_in.image_tokens
                reply = {"id": "x", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 2,
                                   "total_tokens": prompt_tokens + 2}}
                return self.reply(200, json.dumps(reply).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def decode_png_size(data_url: str) -> tuple[int, int]:
    """The image as a vision server would open it (PIL), or an error."""
    from PIL import Image

    prefix = "data:image/png;base64,"
    assert data_url.startswith(prefix), data_url[:40]
    image = Image.open(io.BytesIO(base64.b64decode(data_url[len(prefix):])))
    image.load()
    assert image.format == "PNG"
    return image.size


def smoke(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    return subprocess.run([CLI, "smoke", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def smoke_json(*args: str) -> tuple[int, dict]:
    proc = smoke("--json", *args)
    assert proc.stderr == "", proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    return proc.returncode, report


def checks_of(server: dict) -> dict[str, tuple[str, str]]:
    return {c["check"]: (c["status"], c["detail"]) for c in server["checks"]}


# ---------------------------------------------------------------- passing servers
def test_a_text_server_passes_with_one_line(tmp_path):
    with StandIn() as server:
        proc = smoke(server.url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"[ok  ] {server.url}: health ok")
    assert "image: the server does not understand images" in lines[0]
    n = len(owed_to(Role.SCHEDULER))
    assert "metrics: plugin active: launcher" in lines[0] and f"scheduler {n}/{n}" in lines[0]
    assert lines[1] == "smoke: OK (1/1 servers passed)"
    chats = [body for path, body in server.requests if path == "/v1/chat/completions"]
    assert len(chats) == 1 and chats[0]["model"] == "DeepSeek-V4.1-Flash"


def test_a_vision_server_gets_one_image_as_a_png_data_url():
    with StandIn(vision=True) as server:
        rc, report = smoke_json(server.url)
    assert rc == 0 and report["ok"] is True
    checks = checks_of(report["servers"][0])
    assert checks["image"] == ("ok", "500 image prompt tokens")
    assert server.images == [(64, 64)]  # PIL opened the generated PNG


def test_pd_servers_are_checked_without_a_chat_of_their_own():
    with StandIn(pd_mode="prefill") as prefill, StandIn(pd_mode="decode") as decode:
        rc, report = smoke_json(prefill.url, decode.url)
    assert rc == 0
    for server in report["servers"]:
        checks = checks_of(server)
        assert checks["chat"][0] == "skip" and "router" in checks["chat"][1]
        assert checks["metrics"][0] == "ok"
    assert not [p for p, _ in prefill.requests + decode.requests if p == "/v1/chat/completions"]


def write_compose(tmp_path: Path, prefill_port: int, decode_port: int, router_port: int) -> Path:
    compose = tmp_path / "pd.yml"
    compose.write_text(f"""
services:
  prefill:
    image: sglang
    network_mode: host
    command: sglang serve --model-path /model --disaggregation-mode prefill --port {prefill_port}
  decode:
    image: sglang
    network_mode: host
    command: sglang serve --model-path /model --disaggregation-mode decode --port {decode_port}
  router:
    image: sglang
    ports: ["{router_port}:8000"]
    command: python3 -m sglang_router.launch_router --pd-disaggregation --port 8000
  master:
    image: mooncake
    network_mode: host
    command: mooncake_master --port 50051
""")
    return compose


def test_a_compose_file_checks_every_server_and_its_router(tmp_path):
    with StandIn(vision=True, pd_mode="prefill") as prefill, \
            StandIn(vision=True, pd_mode="decode") as decode, \
            StandIn(metrics=None) as router:
        compose = write_compose(tmp_path, prefill.port, decode.port, router.port)
        rc, report = smoke_json(str(compose))
        text = smoke(str(compose))
    assert rc == 0, report
    names = [s["name"] for s in report["servers"]]
    assert names == ["pd.yml/prefill", "pd.yml/decode", "pd.yml/router"]
    assert [s["kind"] for s in report["servers"]] == ["server", "server", "router"]
    router_checks = checks_of(report["servers"][2])
    assert router_checks["chat"][0] == "ok"
    assert router_checks["image"][0] == "ok"  # its servers understand images
    assert router_checks["metrics"] == ("skip", "a router runs no plugin")
    assert len(text.stdout.splitlines()) == 4 and text.returncode == 0


# ---------------------------------------------------------------- failing servers
@pytest.mark.parametrize("stand_in, check, fragment", [
    (dict(metrics=None), "metrics", "start the server with --enable-metrics"),
    (dict(metrics="sglang:num_running_reqs 0.0\n"), "metrics", "the plugin is not active"),
    (dict(metrics=plugin_metrics_text({"scheduler": 1})), "metrics", "patches missing in scheduler"),
    (dict(metrics=plugin_metrics_text(launcher=False)), "metrics", "the launcher ran without the plugin"),
    (dict(health_status=503), "health", "HTTP 503"),
    (dict(chat_status=500), "chat", "HTTP 500"),
    (dict(vision=True, image_tokens=0), "image", "it was not read"),
    (dict(model_info_status=404), "model-info", "not an sglang server"),
])
def test_each_problem_fails_its_server_with_the_reason(stand_in, check, fragment):
    with StandIn(**stand_in) as server:
        proc = smoke(server.url)
        rc, report = smoke_json(server.url)
    assert proc.returncode == rc == 1
    assert proc.stdout.startswith(f"[FAIL] {server.url}:") and fragment in proc.stdout
    assert proc.stdout.splitlines()[-1] == "smoke: FAILED (0/1 servers passed)"
    status, detail = checks_of(report["servers"][0])[check]
    assert status == "fail" and fragment in detail
    assert report["ok"] is False and "Traceback" not in proc.stderr


def test_one_failing_server_fails_the_run_and_the_others_still_pass():
    with StandIn() as good, StandIn(metrics=None) as bad:
        rc, report = smoke_json(good.url, bad.url)
    assert rc == 1
    assert [s["ok"] for s in report["servers"]] == [True, False]


def test_a_server_that_never_answers_times_out_instead_of_hanging():
    with StandIn(chat_delay=30) as server:
        start = time.monotonic()
        proc = smoke("--timeout", "1", server.url, timeout=60)
        elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert "chat: " in proc.stdout and "timed out" in proc.stdout
    assert elapsed < 20


def test_nothing_listening_is_one_failed_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = smoke(f"http://127.0.0.1:{port}")
    assert proc.returncode == 1
    assert "health: ConnectionRefusedError" in proc.stdout


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, message", [
    (["missing.yml"], "smoke: missing.yml: no such file"),
    (["ftp://example.com"], "smoke: ftp://example.com: not an http(s) URL"),
    (["not-a-target"], "smoke: not-a-target: neither a compose file nor an http(s) URL"),
    (["http://127.0.0.1:99999"], "smoke: http://127.0.0.1:99999: bad port"),
    (["--timeout", "0", "http://127.0.0.1:1"], "smoke: --timeout '0': expected seconds from 0.1 to 86400"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = smoke(*args)
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.strip() == message


def test_compose_files_that_cannot_be_checked_are_one_line_and_exit_2(tmp_path):
    no_server = tmp_path / "none.yml"
    no_server.write_text("services:\n  db:\n    image: postgres\n")
    unpublished = tmp_path / "hidden.yml"
    unpublished.write_text("services:\n  s:\n    image: x\n    command: sglang serve --port 30000\n")
    broken = tmp_path / "broken.yml"
    broken.write_text("services: [\n")
    for path, fragment in ((no_server, "no `sglang serve` or router service"),
                           (unpublished, "port 30000 is neither published nor on the host network"),
                           (broken, "broken.yml: ")):
        proc = smoke(str(path))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and fragment in proc.stderr
        assert "Traceback" not in proc.stderr


# The real-server case (a CPU sglang server with --enable-metrics) is in
# test/e2e/test_e2e_workers.py::test_smoke_passes_against_the_real_server.
