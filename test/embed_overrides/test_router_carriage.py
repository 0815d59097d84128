"""What sglang-router 0.3.2 forwards of an embedding-override request.

The real router (``python -m sglang_router.launch_router``, the pinned test
dependency, as the shipped topologies start it) in front of stand-in HTTP
workers on 127.0.0.1 that only record the bodies they receive: no sglang
server is needed to see what reaches one. Three routers, started at once:
the Rust router in PD mode, in regular mode, and the package's MiniLB
(``--pd-disaggregation --mini-lb``, which its own warning calls a debugging
balancer).

The Rust router parses /generate into a typed request that has no
``positional_embed_overrides`` (nor any way to nest it: unknown sampling
parameters are dropped too) and re-serialises it, so the field never reaches
a server and the request is served as if it had none. Its /v1/embeddings
drops ``embed_overrides`` the same way (regular mode; PD mode answers 501).
MiniLB forwards the body as it came. docs/design/embed_overrides.md says what
an operator does about it; test/e2e/test_e2e_pd.py shows both with real servers.
A router release that forwards the field fails here first.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from sglang_dsv41.tools.verify.servers import start_in_own_group, stop_process_group, wait_for_health

pytestmark = pytest.mark.slow

OVERRIDE = {"embeds": [[0.25] * 4], "positions": [1]}
IMAGE = "data:image/png;base64,AAAA"
ROUTER_START_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class StandInWorker:
    """Answers what a router asks a worker at start-up; records every POST body."""

    def __init__(self):
        self.bodies: list[tuple[str, dict]] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer({"model_path": "stand-in", "is_generation": True, "tp_size": 1, "dp_size": 1})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                worker.bodies.append((self.path, body))
                self._answer({"text": "x", "output_ids": [1], "meta_info": {"id": "r", "prompt_tokens": 1,
                              "completion_tokens": 1, "finish_reason": {"type": "length"}},
                              "object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.0]}],
                              "model": "stand-in", "usage": {"prompt_tokens": 1, "total_tokens": 1}})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def last_body(self, path: str) -> dict:
        bodies = [body for got, body in self.bodies if got == path]
        assert bodies, f"nothing reached {path}: {self.bodies}"
        return bodies[-1]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Router:
    def __init__(self, args: list[str], log_path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "sglang_router.launch_router", *args,
                     "--host", "127.0.0.1", "--port", str(self.port),
                     # Its own metrics port: the default 29000 is one per machine.
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self.popen = None

    def start(self) -> "Router":
        self.popen = start_in_own_group(self.argv, env=None, log_path=self.log_path)
        assert wait_for_health(self.popen, f"{self.base}/health", ROUTER_START_S), self.log_path.read_text()
        return self

    def post(self, path: str, payload: dict) -> requests.Response:
        return requests.post(f"{self.base}{path}", json=payload, timeout=60)

    def stop(self):
        if self.popen is not None and self.popen.poll() is None:
            stop_process_group(self.popen, [(signal.SIGTERM, 20), (signal.SIGKILL, 10)])


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    logs = tmp_path_factory.mktemp("routers")
    prefill, decode = StandInWorker(), StandInWorker()
    pd_pair = ["--pd-disaggregation", "--prefill", prefill.base, str(free_port()), "--decode", decode.base]
    routers = {
        "pd": Router(pd_pair, logs / "pd.log"),
        "regular": Router(["--worker-urls", decode.base], logs / "regular.log"),
        "mini_lb": Router([*pd_pair, "--mini-lb"], logs / "mini_lb.log"),
    }
    try:
        with ThreadPoolExecutor(len(routers)) as pool:
            list(pool.map(Router.start, routers.values()))
        yield routers, prefill, decode
    finally:
        for router in routers.values():
            router.stop()
        prefill.close()
        decode.close()


def generate_with_override(**extra) -> dict:
    return {"text": "a picture <emb> of a fox", "image_data": IMAGE,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra}


@pytest.mark.parametrize("mode", ["pd", "regular"])
def test_the_rust_router_drops_the_override_and_serves_the_media(routed, mode):
    routers, prefill, decode = routed
    resp = routers[mode].post("/generate", generate_with_override(positional_embed_overrides=OVERRIDE))
    assert resp.status_code == 200, resp.text
    reached = [prefill, decode] if mode == "pd" else [decode]
    for worker in reached:
        body = worker.last_body("/generate")
        assert "positional_embed_overrides" not in body, body
        assert body["image_data"] == IMAGE and body["text"] == "a picture <emb> of a fox"


def test_the_rust_router_drops_unknown_sampling_parameters(routed):
    """No nesting carries it either: the typed sampling parameters keep only their own fields."""
    routers, prefill, _ = routed
    payload = generate_with_override()
    payload["sampling_params"] = {**payload["sampling_params"], "positional_embed_overrides": OVERRIDE,
                                  "custom_params": {"k": 1}}
    assert routers["pd"].post("/generate", payload).status_code == 200
    assert prefill.last_body("/generate")["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0}


def test_the_rust_router_drops_embedding_overrides(routed):
    routers, _, decode = routed
    request = {"model": "stand-in", "input": "a picture <emb> of a fox",
               "embed_overrides": [[[0.25] * 4]], "embed_override_token_id": 5}
    assert routers["regular"].post("/v1/embeddings", request).status_code == 200
    body = decode.last_body("/v1/embeddings")
    assert "embed_overrides" not in body and "embed_override_token_id" not in body, body
    resp = routers["pd"].post("/v1/embeddings", request)
    assert resp.status_code == 501, resp.text


def test_mini_lb_forwards_the_override_to_both_servers(routed):
    routers, prefill, decode = routed
    payload = generate_with_override(positional_embed_overrides=OVERRIDE)
    assert routers["mini_lb"].post("/generate", payload).status_code == 200
    for worker in (prefill, decode):
        body = worker.last_body("/generate")
        assert body["positional_embed_overrides"] == OVERRIDE and body["image_data"] == IMAGE, body
        assert {"bootstrap_host", "bootstrap_port", "bootstrap_room"} <= body.keys()
