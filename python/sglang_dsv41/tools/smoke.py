"""``sglang-dsv41 smoke``: after ``docker compose up``, do the servers work with the plugin active?

Targets are compose files (every ``sglang serve`` service and sglang router in
them, at the port its command names) or server URLs. Each server gets the checks
``health``, ``chat``, ``image`` and ``metrics`` where they apply. One line per
server, or one JSON document with ``--json``; exit status 0 when every check
passed, 1 when one failed, 2 for input that cannot be used. Every request is
bounded in time (``--timeout``) and size, proxies are not used, and an answer
not shaped as sglang's fails its check.

Design: docs/design/smoke.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import ipaddress
import json
import math
import re
import socket
import struct
import sys
import threading
import urllib.parse
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_SERVER_PORT = 30000
DEFAULT_ROUTER_PORT = 30000
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.1, 86400.0
PROMPT = "Reply with the single word OK."
_SERIES = re.compile(r'^sglang_dsv41_(patches_applied|patches_owed)\{role="([a-z_]+)"\}\s+(\S+)$')
_GUARD = re.compile(r'^sglang_dsv41_launch_guard_active\{rule="((?:[^"\\]|\\.)*)"\}\s+(\S+)$')


class SmokeInputError(ValueError):
    """A target that cannot be checked at all (reported as one line, exit 2)."""


@dataclass
class Endpoint:
    name: str
    url: str
    kind: str  # "server" (sglang serve) or "router" (sglang's router)
    source: str  # the compose file, or "url"


@dataclass
class Check:
    check: str  # health | model-info | chat | image | metrics
    status: str  # ok | fail | skip
    detail: str


@dataclass
class ServerResult:
    name: str
    url: str
    kind: str
    source: str
    ok: bool = True
    checks: list = field(default_factory=list)

    def add(self, check: str, status: str, detail: str) -> Check:
        # One line of printable text, whatever the server put in its answer.
        detail = " ".join("".join(c if c.isprintable() else " " for c in detail).split())
        self.checks.append(Check(check, status, detail))
        if status == "fail":
            self.ok = False
        return self.checks[-1]


# --------------------------------------------------------------------------
# Targets


def _option(args: list[str], name: str) -> str | None:
    for i, token in enumerate(args):
        if token == name and i + 1 < len(args):
            return args[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return None


def _port(args: list[str], default: int, where: str) -> int:
    text = _option(args, "--port")
    if text is None:
        return default
    if not re.fullmatch(r"[0-9]{1,5}", text) or not 1 <= int(text) <= 65535:
        raise SmokeInputError(f"{where}: --port {text!r} is not a port (1-65535)")
    return int(text)


def _reachable_port(service, port: int) -> int | None:
    """The host port that reaches ``port`` inside the service's container."""
    if service.network_mode == "host":
        return port
    for published in service.published_ports:
        if published.container_port == port:
            return published.host_port
    return None


def compose_endpoints(path: str, host: str) -> list[Endpoint]:
    from sglang_dsv41.tools.plan.compose import ComposeError, load_services
    from sglang_dsv41.tools.plan.checks import router_args, sglang_serve_args

    if not Path(path).is_file():
        raise SmokeInputError(f"{path}: no such file")
    try:
        services, _env = load_services(path)
    except (ComposeError, OSError, ValueError) as exc:
        text = " ".join(str(exc).split())  # YAML errors span several lines
        raise SmokeInputError(text if path in text else f"{path}: {text}") from None
    endpoints = []
    for service in services:
        serve = sglang_serve_args(service.argv)
        router = router_args(service.argv) if serve is None else None
        if serve is None and router is None:
            continue
        kind = "server" if serve is not None else "router"
        args = serve if serve is not None else router
        where = f"{Path(path).name}/{service.name}"
        port = _port(args, DEFAULT_SERVER_PORT if kind == "server" else DEFAULT_ROUTER_PORT, where)
        reachable = _reachable_port(service, port)
        if reachable is None:
            raise SmokeInputError(f"{where}: port {port} is neither published nor on the host network")
        machine = service.host if service.host != "local" else host
        problem = _host_problem(machine)
        if problem:
            raise SmokeInputError(f"{where}: host {machine!r}: {problem}")
        url = f"http://{f'[{machine}]' if ':' in machine else machine}:{reachable}"
        endpoints.append(Endpoint(where, url, kind, path))
    if not endpoints:
        raise SmokeInputError(f"{path}: no `sglang serve` or router service")
    return endpoints


_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _host_problem(host: str) -> str | None:
    """Why ``host`` is not a host name or IP address, or None."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return "not a host name or IP address"
    return None


def url_endpoint(text: str) -> Endpoint:
    """A server URL: http(s)://host[:port][/path], nothing else."""
    if not re.fullmatch(r"[!-~]{1,2000}", text):
        raise SmokeInputError(f"{text!r}: not an http(s) URL (spaces, control characters, non-ASCII "
                              "or over 2000 characters)")
    try:
        parsed = urllib.parse.urlsplit(text)
        host = parsed.hostname
    except ValueError as exc:  # a bracket left open
        raise SmokeInputError(f"{text}: not an http(s) URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not host:
        raise SmokeInputError(f"{text}: not an http(s) URL")
    try:
        if parsed.port == 0:
            raise ValueError
    except ValueError:  # not a number, or outside 1-65535
        raise SmokeInputError(f"{text}: bad port") from None
    if parsed.username is not None or parsed.query or parsed.fragment or "?" in text or "#" in text:
        raise SmokeInputError(f"{text}: a server URL has no user, query or fragment")
    problem = _host_problem(host)
    if problem:
        raise SmokeInputError(f"{text}: {host!r} is {problem}")
    return Endpoint(text, text.rstrip("/"), "server", "url")


def endpoints_of(targets: list[str], host: str) -> list[Endpoint]:
    out = []
    for target in targets:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not Path(target).exists():
            out.append(url_endpoint(target))
        elif target.endswith((".yml", ".yaml")) or Path(target).is_file():
            out.extend(compose_endpoints(target, host))
        else:
            raise SmokeInputError(f"{target}: neither a compose file nor an http(s) URL")
    return out


# --------------------------------------------------------------------------
# HTTP


class HttpFailure(Exception):
    pass


# What one answer may hold: sglang's JSON answers here are a few KiB, its
# /metrics a few MiB with every histogram.
MAX_JSON_BYTES = 1 << 20
MAX_METRICS_BYTES = 64 << 20


def _why(exc: BaseException) -> str:
    """One short line for what a broken server or network made http.client raise."""
    if isinstance(exc, http.client.LineTooLong):
        return f"a line of the answer's head is longer than 64 KiB ({exc})"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the server closed the connection without an answer"
    if isinstance(exc, http.client.BadStatusLine):
        return f"not an HTTP answer (status line {str(exc)[:60]!r})"
    if isinstance(exc, http.client.IncompleteRead):
        return "the answer ended early (a chunk cut short)"
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _exchange(url: str, timeout: float, data: bytes | None, limit: int,
              opened: list) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout)
    opened.append(connection)
    try:
        connection.request("GET" if data is None else "POST", parts.path or "/", body=data,
                           headers={"Content-Type": "application/json"} if data else {})
        response = connection.getresponse()
        declared = response.length  # None when the answer is chunked or read to the close
        if declared is not None and declared > limit:
            raise HttpFailure(f"HTTP {response.status} with a body of {declared} bytes, over the "
                             f"{limit >> 10} KiB this check reads")
        body, size = [], 0
        while chunk := response.read1(1 << 16):  # one socket read at a time
            size += len(chunk)
            if size > limit:
                raise HttpFailure(f"HTTP {response.status} with a body over the {limit >> 10} KiB "
                                 "this check reads")
            body.append(chunk)
        if declared is not None and size < declared:
            raise HttpFailure(f"HTTP {response.status}: the body ended after {size} of its "
                             f"{declared} bytes")
        return response.status, b"".join(body)
    finally:
        connection.close()


def call_within(seconds: float, work, late: Exception, name: str = "smoke-request"):
    """``work()`` in a daemon thread the caller waits ``seconds`` for: its value or its
    exception, else ``late`` raised (the thread is left to die). So a request's deadline
    covers every step (name lookup, connect, a server sending a byte at a time), not each
    socket read."""
    outcome: dict = {"error": late}

    def run() -> None:
        try:
            outcome.update(value=work(), error=None)
        except Exception as exc:  # raised again in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(seconds)
    if outcome["error"] is not None:
        raise outcome["error"]
    return outcome["value"]


def fetch(url: str, timeout: float, body: dict | None = None,
             limit: int = MAX_JSON_BYTES) -> tuple[int, bytes]:
    """(status, body) of one request, all of it within ``timeout`` seconds (``call_within``)."""
    data = None if body is None else json.dumps(body).encode()
    opened: list = []
    try:
        return call_within(timeout, lambda: _exchange(url, timeout, data, limit, opened),
                           HttpFailure(f"timed out: no complete answer within {timeout:g} s"))
    except Exception as exc:  # whatever the other side made the client raise is a finding
        raise exc if isinstance(exc, HttpFailure) else HttpFailure(_why(exc)) from None
    finally:  # cut off an exchange past its deadline (one that ended closed its own)
        for connection in opened:
            with contextlib.suppress(OSError, AttributeError):
                connection.sock.shutdown(socket.SHUT_RDWR)


def fetch_json(url: str, timeout: float, body: dict | None = None) -> dict:
    status, raw = fetch(url, timeout, body)
    if status != 200:
        raise HttpFailure(f"HTTP {status}: {raw[:200].decode(errors='replace').strip()}")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        raise HttpFailure(f"not JSON: {raw[:120]!r}") from None
    if not isinstance(value, dict):
        raise HttpFailure(f"unexpected JSON (not an object): {raw[:120]!r}")
    return value


def _count(mapping: dict, key: str, where: str) -> int:
    """A token count the server reported: a whole number, not a bool, a string or a float."""
    value = mapping.get(key)
    if type(value) is not int or not 0 <= value < 1 << 53:
        raise HttpFailure(f"{where}.{key} is {json.dumps(value)[:60]}, not a token count")
    return value


def tiny_png(width: int = 64, height: int = 64) -> bytes:
    """A small RGB PNG (a colour gradient) made here, so no file is needed."""
    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in (x * 4 % 256, y * 4 % 256, 128))
        for y in range(height)
    )

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (struct.pack(">I", len(payload)) + kind + payload
                + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def png_data_url() -> str:
    return "data:image/png;base64," + base64.b64encode(tiny_png()).decode()


# --------------------------------------------------------------------------
# Checks


def _completion(url: str, model: str, content, timeout: float) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of one short chat completion."""
    reply = fetch_json(f"{url}/v1/chat/completions", timeout, {
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": 8, "temperature": 0,
    })
    choices, usage = reply.get("choices"), reply.get("usage")
    if not isinstance(choices, list) or not choices:
        raise HttpFailure(f"no choices in the reply: {json.dumps(reply)[:200]}")
    if not isinstance(usage, dict):
        raise HttpFailure(f"no usage object in the reply: {json.dumps(reply)[:200]}")
    completion = _count(usage, "completion_tokens", "usage")
    if completion < 1:
        raise HttpFailure(f"no completion tokens: usage {json.dumps(usage)[:200]}")
    return _count(usage, "prompt_tokens", "usage"), completion


class MetricsError(ValueError):
    """The plugin's series are there but cannot be read as patch counts."""


def plugin_status(metrics_text: str) -> dict[str, tuple[int, int]]:
    """Per role: (patches applied, patches owed), from the plugin's series.

    A count that is not a whole, finite number, or a series given twice with
    two values, raises MetricsError: such a page proves nothing.
    """
    seen: dict[str, dict[str, int]] = {}
    for line in metrics_text.splitlines():
        match = _SERIES.match(line.strip())
        if not match:
            continue
        series, role, text = match.groups()
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value.is_integer() and 0 <= value < 1 << 31):
            raise MetricsError(f"sglang_dsv41_{series}{{role=\"{role}\"}} is {text[:40]!r}, "
                               "not a patch count")
        if seen.setdefault(role, {}).setdefault(series, int(value)) != int(value):
            raise MetricsError(f"sglang_dsv41_{series}{{role=\"{role}\"}} is given twice, "
                               "with two values")
    return {role: (v.get("patches_applied", 0), v.get("patches_owed", 0)) for role, v in seen.items()}


def launch_guard_rules(metrics_text: str) -> list[str]:
    """The launch guard verdicts the schedulers published (the rule, or "none")."""
    rules = []
    for line in metrics_text.splitlines():
        match = _GUARD.match(line.strip())
        if match and match.group(2) in ("1", "1.0"):
            rules.append(match.group(1))
    return sorted(set(rules))


def check_endpoint(endpoint: Endpoint, timeout: float, router_vision: bool = False) -> ServerResult:
    """``router_vision``: a server behind this router understands images."""
    result = ServerResult(endpoint.name, endpoint.url, endpoint.kind, endpoint.source)
    url = endpoint.url
    try:
        status, _body = fetch(f"{url}/health", timeout)
    except HttpFailure as exc:
        result.add("health", "fail", str(exc))
        return result
    if status != 200:
        result.add("health", "fail", f"HTTP {status}")
        return result
    result.add("health", "ok", "HTTP 200")

    vision, pd_mode = False, None
    if endpoint.kind == "server":
        try:
            info = fetch_json(f"{url}/model_info", timeout)
            vision = info.get("has_image_understanding", False)
            pd_mode = info.get("disaggregation_mode", "null")
            if type(vision) is not bool:
                raise HttpFailure(f"has_image_understanding is {json.dumps(vision)[:60]}, not true or false")
            if pd_mode not in (None, "null", "prefill", "decode"):
                raise HttpFailure(f"disaggregation_mode is {json.dumps(pd_mode)[:60]}, not null, "
                                 "prefill or decode")
            pd_mode = None if pd_mode in (None, "null") else pd_mode
            result.add("model-info", "ok", f"vision={'on' if vision else 'off'}"
                       + (f", PD {pd_mode}" if pd_mode else ""))
        except HttpFailure as exc:
            result.add("model-info", "fail", f"/model_info: {exc} (not an sglang server?)")
            return result

    if pd_mode in ("prefill", "decode"):
        result.add("chat", "skip", f"a PD {pd_mode} server answers only through its router")
    else:
        _chat_checks(result, url, vision or router_vision, timeout)

    if endpoint.kind == "router":
        result.add("metrics", "skip", "a router runs no plugin")
    else:
        _metrics_check(result, url, timeout)
    return result


def _model_id(url: str, timeout: float) -> str:
    models = fetch_json(f"{url}/v1/models", timeout).get("data", [])
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise HttpFailure(f"/v1/models: data is {json.dumps(models)[:80]}, not a list of models")
    if not models:
        return "default"
    model = models[0].get("id")
    if not isinstance(model, str) or not model:
        raise HttpFailure(f"/v1/models: the first model's id is {json.dumps(model)[:60]}")
    return model


def _chat_checks(result: ServerResult, url: str, vision: bool, timeout: float) -> None:
    try:
        model = _model_id(url, timeout)
        text_tokens, completion = _completion(url, model, PROMPT, timeout)
    except HttpFailure as exc:
        result.add("chat", "fail", str(exc))
        return
    result.add("chat", "ok", f"{completion} tokens from {model}")
    if not vision:
        result.add("image", "skip", "the server does not understand images")
        return
    content = [{"type": "text", "text": PROMPT},
               {"type": "image_url", "image_url": {"url": png_data_url()}}]
    try:
        image_tokens, _ = _completion(url, model, content, timeout)
    except HttpFailure as exc:
        result.add("image", "fail", str(exc))
        return
    if image_tokens <= text_tokens:
        result.add("image", "fail", f"the image added no prompt tokens ({image_tokens} vs "
                                    f"{text_tokens} for the text alone): it was not read")
        return
    result.add("image", "ok", f"{image_tokens - text_tokens} image prompt tokens")


def _metrics_check(result: ServerResult, url: str, timeout: float) -> None:
    try:
        status, raw = fetch(f"{url}/metrics", timeout, limit=MAX_METRICS_BYTES)
    except HttpFailure as exc:
        result.add("metrics", "fail", str(exc))
        return
    if status == 404:
        result.add("metrics", "fail", "no /metrics: start the server with --enable-metrics")
        return
    if status != 200:
        result.add("metrics", "fail", f"/metrics: HTTP {status}")
        return
    text = raw.decode(errors="replace")
    try:
        roles = plugin_status(text)
    except MetricsError as exc:
        result.add("metrics", "fail", f"/metrics: {exc}")
        return
    if not roles:
        result.add("metrics", "fail", "no sglang_dsv41_ series: the plugin is not active "
                                      "(stock sglang?)")
        return
    summary = ", ".join(f"{role} {applied}/{owed}" for role, (applied, owed) in sorted(roles.items()))
    short = [role for role, (applied, owed) in roles.items() if owed <= 0 or applied != owed]
    guard = launch_guard_rules(text)
    if "scheduler" not in roles:
        result.add("metrics", "fail", f"no scheduler reported the plugin ({summary})")
    elif short:
        result.add("metrics", "fail", f"patches missing in {', '.join(sorted(short))} ({summary})")
    elif "launcher" not in roles or not guard:
        result.add("metrics", "fail", f"no launch guard verdict or launcher patch count: the launcher "
                                      f"ran without the plugin ({summary})")
    else:
        result.add("metrics", "ok", f"plugin active: {summary}; launch guard: {', '.join(guard)}")


# --------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("targets", nargs="+", metavar="COMPOSE_FILE_OR_URL",
                        help="compose files (every sglang server and router in them) or server URLs")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    parser.add_argument("--timeout", default="60",
                        help="seconds each request may take in all, 0.1 to 86400 (default 60)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="where compose services without a host label listen (default 127.0.0.1)")


def _line(result: ServerResult) -> str:
    verdict = "ok  " if result.ok else "FAIL"
    parts = [f"{c.check}: {c.detail}" if c.status != "ok" or c.check in ("metrics", "image")
             else f"{c.check} ok" for c in result.checks]
    where = result.url if result.name == result.url else f"{result.name} {result.url}"
    return f"[{verdict}] {where}: " + "; ".join(parts)


def main(args) -> int:
    try:
        timeout = float(args.timeout)
    except ValueError:
        timeout = math.nan
    if not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S:  # NaN fails this too
        print(f"smoke: --timeout {args.timeout!r}: expected seconds from {MIN_TIMEOUT_S:g} to "
              f"{MAX_TIMEOUT_S:g}", file=sys.stderr)
        return 2
    problem = _host_problem(args.host)
    if problem:
        print(f"smoke: --host {args.host!r}: {problem}", file=sys.stderr)
        return 2
    try:
        endpoints = endpoints_of(args.targets, args.host)
    except SmokeInputError as exc:
        print(f"smoke: {exc}", file=sys.stderr)
        return 2
    # Servers first: a router of a compose file gets the image check when a
    # server of that file understands images.
    results: dict[int, ServerResult] = {}
    vision_sources = set()
    for index, endpoint in enumerate(endpoints):
        if endpoint.kind == "server":
            results[index] = check_endpoint(endpoint, timeout)
            if any(c.check == "model-info" and "vision=on" in c.detail for c in results[index].checks):
                vision_sources.add(endpoint.source)
    for index, endpoint in enumerate(endpoints):
        if endpoint.kind == "router":
            results[index] = check_endpoint(endpoint, timeout,
                                            router_vision=endpoint.source in vision_sources)
    results = [results[index] for index in range(len(endpoints))]
    ok = all(r.ok for r in results)
    if args.json:
        print(json.dumps({"tool": "sglang-dsv41", "command": "smoke", "ok": ok,
                          "servers": [asdict(r) for r in results]}, indent=2))
    else:
        for result in results:
            print(_line(result))
        print(f"smoke: {'OK' if ok else 'FAILED'} ({sum(r.ok for r in results)}/{len(results)} "
              "servers passed)")
    return 0 if ok else 1
