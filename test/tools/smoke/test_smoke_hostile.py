"""`sglang-dsv41 smoke` against servers and input that try to fool or hold it.

A raw-socket stand-in on 127.0.0.1 answers sglang's endpoints correctly except
for one route per case, which misbehaves: a head or a body sent a byte at a
time, a broken status line, a body cut short, a head line or a body far over
the limits, JSON of another shape, plugin counts that are not whole numbers.
Every case runs the installed console script in a subprocess with a timeout
and expects exit 1 with one ``[FAIL]`` line naming the check and the problem,
within a few seconds of ``--timeout``. Bad URLs and numbers are exit 2 with one
line; the parsers behind them are also fuzzed in-process with hypothesis. The
stand-in stops by itself after its lifetime even if a test forgets it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.table import owed_to
from sglang_dsv41.tools import smoke as smoke_module

CLI = str(Path(sys.executable).parent / "sglang-dsv41")
TIMEOUT_S = 2  # the --timeout each case runs with
SLACK_S = 12  # interpreter start and the checks that pass before the bad one
pytestmark = pytest.mark.timeout(120)


def answer(status: int = 200, body: bytes | str = b"", kind: str = "application/json",
           extra: str = "") -> bytes:
    body = body.encode() if isinstance(body, str) else body
    return (f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n{extra}\r\n").encode() + body


def metrics_page(scheduler: str | None = None, extra: str = "") -> bytes:
    n = len(owed_to(Role.SCHEDULER))
    applied = scheduler if scheduler is not None else f"{n}.0"
    launcher = len(owed_to(Role.LAUNCHER))
    return answer(200, f'sglang_dsv41_patches_applied{{role="scheduler"}} {applied}\n'
                       f'sglang_dsv41_patches_owed{{role="scheduler"}} {n}.0\n'
                       f'sglang_dsv41_patches_applied{{role="launcher"}} {launcher}.0\n'
                       f'sglang_dsv41_patches_owed{{role="launcher"}} {launcher}.0\n'
                       f'sglang_dsv41_launch_guard_active{{rule="none"}} 1.0\n{extra}', "text/plain")


def chat_reply(usage) -> bytes:
    return answer(200, json.dumps({"choices": [{"message": {"content": "OK"}}], "usage": usage}))


GOOD = {
    "/health": answer(200),
    "/model_info": answer(200, json.dumps({"has_image_understanding": False, "disaggregation_mode": "null"})),
    "/v1/models": answer(200, json.dumps({"data": [{"id": "m"}]})),
    "/v1/chat/completions": chat_reply({"prompt_tokens": 12, "completion_tokens": 2}),
    "/metrics": metrics_page(),
}


def drip(data: bytes, every_s: float = 0.25, forever: bytes = b""):
    """Send ``data`` one byte at a time, then ``forever`` the same way, until stopped."""
    def send(conn: socket.socket, stop: threading.Event) -> None:
        stream = iter(data)
        while not stop.wait(every_s):
            byte = next(stream, None)
            if byte is None:
                if not forever:
                    return
                stream = iter(forever)
                byte = next(stream)
            conn.sendall(bytes([byte]))
    return send


def flood(head: bytes, block: bytes = b"0" * 65536, limit_bytes: int = 1 << 30):
    """``head``, then ``block`` again and again (a body of gigabytes)."""
    def send(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(head)
        sent = 0
        while not stop.is_set() and sent < limit_bytes:
            conn.sendall(block)
            sent += len(block)
    return send


def cut_short(data: bytes):
    def send(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(data)
    return send


def reset(conn: socket.socket, stop: threading.Event) -> None:
    import struct

    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class HostileServer:
    """sglang's routes on 127.0.0.1, one of them replaced; gone after ``lifetime_s``."""

    def __init__(self, routes: dict, lifetime_s: float = 90):
        self.routes = {**GOOD, **routes}
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.deadline = time.monotonic() + lifetime_s
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        self.stop.set()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                path = head.split(b" ", 2)[1].decode()
                action = self.routes.get(path, answer(404, '{"detail":"Not Found"}'))
                if isinstance(action, bytes):
                    conn.sendall(action)
                else:
                    action(conn, self.stop)
            except OSError:  # the client gave up: what these cases expect
                pass


def run_smoke(*args: str, timeout: float = TIMEOUT_S + SLACK_S + 30) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "http_proxy", "HTTP_PROXY")}
    started = time.monotonic()
    proc = subprocess.run([CLI, "smoke", *args], env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


N = len(owed_to(Role.SCHEDULER))
DEEP = "[" * 100_000 + "]" * 100_000

# route -> what it sends; the check that must fail and a fragment of its line
SERVERS: dict[str, tuple[dict, str, str]] = {
    # ---- held: the deadline covers the whole request, not each socket read
    "head sent a byte at a time, forever": (
        {"/health": drip(b"HTTP/1.1 200 OK\r\n", forever=b"X-Slow: 1\r\n")},
        "health", f"timed out: no complete answer within {TIMEOUT_S} s"),
    "body sent a byte at a time": (
        {"/model_info": drip(answer(200, " " * 100_000 + "{}"), every_s=0.1)},
        "model-info", f"timed out: no complete answer within {TIMEOUT_S} s"),
    "metrics sent a byte at a time": (
        {"/metrics": drip(b"HTTP/1.1 200 OK\r\nContent-Length: 99999\r\n\r\n", forever=b"# x\n")},
        "metrics", f"timed out: no complete answer within {TIMEOUT_S} s"),
    "accepts and says nothing": (
        {"/v1/models": lambda conn, stop: stop.wait()}, "chat", "timed out"),
    # ---- not HTTP, or broken HTTP
    "bad status line": ({"/health": b"HELLO THERE\r\n\r\n"}, "health", "not an HTTP answer (status line"),
    "status out of range": ({"/health": b"HTTP/1.1 2000 OK\r\n\r\n"}, "health", "not an HTTP answer"),
    "binary garbage": ({"/health": bytes(range(256)) * 8}, "health", "not an HTTP answer"),
    "closes without a word": ({"/health": b""}, "health", "the server closed the connection without an answer"),
    "resets the connection": ({"/health": reset}, "health", "Connection"),
    "overlong status line": ({"/health": b"HTTP/1.1 200 " + b"O" * 70_000 + b"\r\n\r\n"}, "health",
                             "longer than 64 KiB"),
    "overlong header line": ({"/health": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"},
                             "health", "longer than 64 KiB"),
    "a thousand header lines": ({"/health": b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 1000 + b"\r\n"},
                                "health", "got more than 100 headers"),
    "body cut short": ({"/model_info": cut_short(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"has_")},
                       "model-info", "the body ended after 6 of its 1000 bytes"),
    "chunked body cut short": ({"/model_info": cut_short(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                                         b"100\r\n{\"a\"")}, "model-info", "the answer ended early"),
    "chunk size not a number": ({"/model_info": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}"},
                                "model-info", "the answer ended early"),
    # ---- too much
    "declares a body of ten gigabytes": (
        {"/model_info": flood(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n")},
        "model-info", "with a body of 10000000000 bytes, over the 1024 KiB this check reads"),
    "sends gigabytes without a length": ({"/model_info": flood(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")},
                                         "model-info", "with a body over the 1024 KiB this check reads"),
    "metrics of gigabytes, chunked": (
        {"/metrics": flood(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                           b"10000\r\n" + b"#" * 65536 + b"\r\n")},
        "metrics", "with a body over the 65536 KiB this check reads"),
    # ---- JSON of another shape
    "model_info is a list": ({"/model_info": answer(200, "[1, 2]")}, "model-info", "unexpected JSON (not an object)"),
    "model_info nested past the parser": ({"/model_info": answer(200, DEEP)}, "model-info", "not JSON"),
    "model_info not UTF-8": ({"/model_info": answer(200, b'{"a": "\xff\xfe"}')}, "model-info", "not JSON"),
    "vision flag is a string": ({"/model_info": answer(200, '{"has_image_understanding": "false"}')},
                                "model-info", 'has_image_understanding is "false", not true or false'),
    "unknown PD mode": ({"/model_info": answer(200, '{"disaggregation_mode": ["prefill"]}')},
                        "model-info", 'disaggregation_mode is ["prefill"], not null, prefill or decode'),
    "models data is a mapping": ({"/v1/models": answer(200, '{"data": {"0": {"id": "m"}}}')},
                                 "chat", "data is {\"0\": {\"id\": \"m\"}}, not a list of models"),
    "model id is a number": ({"/v1/models": answer(200, '{"data": [{"id": 7}]}')}, "chat",
                             "the first model's id is 7"),
    "choices is a string": ({"/v1/chat/completions": answer(200, '{"choices": "OK", "usage": {}}')},
                            "chat", "no choices in the reply"),
    "usage is a list": ({"/v1/chat/completions": answer(200, '{"choices": [{}], "usage": [2]}')},
                        "chat", "no usage object in the reply"),
    "token count is a string": ({"/v1/chat/completions": chat_reply({"prompt_tokens": 1, "completion_tokens": "2"})},
                                "chat", 'usage.completion_tokens is "2", not a token count'),
    "token count is Infinity": ({"/v1/chat/completions": answer(
        200, '{"choices": [{}], "usage": {"prompt_tokens": 1, "completion_tokens": Infinity}}')},
        "chat", "usage.completion_tokens is Infinity, not a token count"),
    "token count is true": ({"/v1/chat/completions": chat_reply({"prompt_tokens": 1, "completion_tokens": True})},
                            "chat", "usage.completion_tokens is true, not a token count"),
    "token count of 5000 digits": ({"/v1/chat/completions": answer(
        200, '{"choices": [{}], "usage": {"completion_tokens": ' + "9" * 5000 + "}}")}, "chat", "not JSON"),
    # ---- plugin counts that prove nothing: never "plugin active"
    "applied is NaN": ({"/metrics": metrics_page("NaN")}, "metrics",
                       'sglang_dsv41_patches_applied{role="scheduler"} is \'NaN\', not a patch count'),
    "applied is +Inf": ({"/metrics": metrics_page("+Inf")}, "metrics", "is '+Inf', not a patch count"),
    "applied overflows to inf": ({"/metrics": metrics_page("1e400")}, "metrics", "is '1e400', not a patch count"),
    "applied is a fraction": ({"/metrics": metrics_page(f"{N - 0.5}")}, "metrics", "not a patch count"),
    "applied is negative": ({"/metrics": metrics_page("-3")}, "metrics", "is '-3', not a patch count"),
    "applied is a word": ({"/metrics": metrics_page("lots")}, "metrics", "is 'lots', not a patch count"),
    "applied more than owed": ({"/metrics": metrics_page(f"{N + 1}")}, "metrics", "patches missing in scheduler"),
    "applied given twice": ({"/metrics": metrics_page(extra=f'sglang_dsv41_patches_applied{{role="scheduler"}} 0\n')},
                            "metrics", "is given twice, with two values"),
    "owed is zero": ({"/metrics": answer(200, 'sglang_dsv41_patches_applied{role="scheduler"} 0\n'
                                              'sglang_dsv41_patches_owed{role="scheduler"} 0\n', "text/plain")},
                     "metrics", "patches missing in scheduler"),
    "metrics not UTF-8": ({"/metrics": answer(200, b"\xff\xfe\x00garbage", "text/plain")}, "metrics",
                          "no sglang_dsv41_ series"),
    # ---- control characters in what the server says stay off the terminal
    "error body with escapes": ({"/v1/models": answer(500, b'\x1b[2J\x1b[31mboom\r\nsecond line')}, "chat",
                                "HTTP 500: [2J [31mboom second line"),
}


@pytest.mark.parametrize("name", list(SERVERS))
def test_a_hostile_server_fails_its_check_in_one_line_and_bounded_time(name):
    routes, check, fragment = SERVERS[name]
    with HostileServer(routes) as server:
        proc, elapsed = run_smoke("--timeout", str(TIMEOUT_S), server.url)
    out = proc.stdout
    assert proc.returncode == 1, f"rc {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert proc.stderr == "" and "Traceback" not in out
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"[FAIL] {server.url}: "), out
    assert f"{check}: " in lines[0] and fragment in lines[0], out
    if check == "metrics":
        assert "plugin active" not in out
    # each request is cut off at the deadline, whatever the server does
    assert elapsed < 3 * TIMEOUT_S + SLACK_S, f"took {elapsed:.1f} s"


def test_the_deadline_is_per_request_not_per_read():
    """A head that keeps coming a byte every quarter second never lets one read
    wait 2 s, yet the request stops at 2 s."""
    with HostileServer({"/health": drip(b"HTTP/1.1 200 OK\r\n", forever=b"X: 1\r\n")}) as server:
        proc, elapsed = run_smoke("--timeout", str(TIMEOUT_S), server.url)
    assert proc.returncode == 1 and "timed out" in proc.stdout
    assert elapsed < TIMEOUT_S + SLACK_S


def test_the_json_report_carries_the_same_failure():
    with HostileServer({"/metrics": metrics_page("NaN")}) as server:
        proc, _ = run_smoke("--json", "--timeout", str(TIMEOUT_S), server.url)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["ok"] is False
    metrics = [c for c in report["servers"][0]["checks"] if c["check"] == "metrics"]
    assert metrics[0]["status"] == "fail" and "not a patch count" in metrics[0]["detail"]


def test_the_good_stand_in_passes():
    """The cases above fail for their one bad route, not for the stand-in."""
    with HostileServer({}) as server:
        proc, _ = run_smoke("--timeout", str(TIMEOUT_S), server.url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launcher = len(owed_to(Role.LAUNCHER))
    assert f"plugin active: launcher {launcher}/{launcher}, scheduler {N}/{N}; launch guard: none" in proc.stdout


# ---------------------------------------------------------------- URLs and numbers: exit 2, one line
BAD_INPUT = [
    (["http://[::1"], "smoke: http://[::1: not an http(s) URL (Invalid IPv6 URL)"),
    (["http://a b"], "smoke: 'http://a b': not an http(s) URL (spaces, control characters, non-ASCII"),
    (["http://exa\nmple.com"], "not an http(s) URL (spaces, control characters"),
    (["http://bücher.example"], "not an http(s) URL (spaces, control characters, non-ASCII"),
    (["http://" + "a" * 3000], "or over 2000 characters"),
    (["http://h:0/"], "smoke: http://h:0/: bad port"),
    (["http://h:+80"], "smoke: http://h:+80: bad port"),
    (["http://h:8o"], "smoke: http://h:8o: bad port"),
    (["http://h:99999999999999999999"], "bad port"),
    (["http://user:pw@h/"], "smoke: http://user:pw@h/: a server URL has no user, query or fragment"),
    (["http://h/?q=1"], "a server URL has no user, query or fragment"),
    (["http://-bad-/"], "smoke: http://-bad-/: '-bad-' is not a host name or IP address"),
    (["http://a..b/"], "'a..b' is not a host name or IP address"),
    (["http://"], "smoke: http://: not an http(s) URL"),
    (["localhost:30000"], "smoke: localhost:30000: not an http(s) URL"),
    (["javascript:alert(1)"], "not an http(s) URL"),
    (["--host", "a b", "http://h"], "smoke: --host 'a b': not a host name or IP address"),
    (["--timeout", "nan", "http://h"], "smoke: --timeout 'nan': expected seconds from 0.1 to 86400"),
    (["--timeout", "inf", "http://h"], "smoke: --timeout 'inf': expected seconds"),
    (["--timeout=-inf", "http://h"], "smoke: --timeout '-inf': expected seconds"),
    (["--timeout", "1e400", "http://h"], "smoke: --timeout '1e400': expected seconds"),
    (["--timeout=-1", "http://h"], "smoke: --timeout '-1': expected seconds"),
    (["--timeout", "0.01", "http://h"], "smoke: --timeout '0.01': expected seconds"),
    (["--timeout", "1e9", "http://h"], "smoke: --timeout '1e9': expected seconds"),
    (["--timeout", "ten", "http://h"], "smoke: --timeout 'ten': expected seconds"),
    (["--timeout", "", "http://h"], "smoke: --timeout '': expected seconds"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[" ".join(a)[:40] for a, _ in BAD_INPUT])
def test_bad_urls_and_numbers_are_one_line_and_exit_2(args, message):
    proc, _ = run_smoke(*args, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_compose_ports_and_hosts_are_checked(tmp_path):
    for name, body, message in (
        ("port.yml", "command: sglang serve --port 1_0\n    network_mode: host", "--port '1_0' is not a port"),
        ("big.yml", "command: sglang serve --port 70000\n    network_mode: host", "--port '70000' is not a port"),
        ("host.yml", "command: sglang serve --port 30000\n    network_mode: host\n"
                     "    labels: {sglang-dsv41.host: 'bad host'}", "host 'bad host': not a host name"),
    ):
        path = tmp_path / name
        path.write_text(f"services:\n  s:\n    image: x\n    {body}\n")
        proc, _ = run_smoke(str(path), timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr


# ---------------------------------------------------------------- the parsers, fuzzed in-process
FUZZ = settings(max_examples=int(os.environ.get("SMOKE_FUZZ_EXAMPLES", "400")), deadline=None,
                suppress_health_check=list(HealthCheck))
url_parts = st.sampled_from(["http://", "https://", "ftp://", "http:", "//", "[", "]", "::1", "@", ":", "::",
                             "127.0.0.1", "h", "-", ".", "..", "/", "?", "#", "%", "%00", "80", "0", "65536",
                             "+1", " ", "\t", "\n", "\x00", "é", "\u200b", "a" * 70, "_"])


@FUZZ
@given(st.lists(url_parts, max_size=12).map("".join) | st.text(max_size=40))
def test_any_url_text_is_an_endpoint_or_one_line(text):
    try:
        endpoint = smoke_module.url_endpoint(text)
    except smoke_module.SmokeInputError as exc:
        assert str(exc) and "\n" not in str(exc) and len(str(exc)) < 2200
        return
    import urllib.parse

    parsed = urllib.parse.urlsplit(endpoint.url)
    assert parsed.scheme in ("http", "https") and parsed.hostname
    assert parsed.port is None or 1 <= parsed.port <= 65535
    assert not (parsed.query or parsed.fragment or parsed.username)


values = st.sampled_from(["0", "1", "48", "48.0", "NaN", "nan", "+Inf", "-Inf", "1e400", "-1", "0.5",
                          "1e3", "x", "", "4.8e1", "99999999999", "0x10", "１"])


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["applied", "owed"]), st.sampled_from(["scheduler", "launcher"]),
                          values), max_size=6))
def test_plugin_counts_are_whole_numbers_or_an_error(series):
    page = "".join(f'sglang_dsv41_patches_{kind}{{role="{role}"}} {value}\n' for kind, role, value in series)
    try:
        roles = smoke_module.plugin_status(page)
    except smoke_module.MetricsError as exc:
        assert "\n" not in str(exc)
        return
    for applied, owed in roles.values():
        assert type(applied) is int and type(owed) is int and applied >= 0 and owed >= 0
