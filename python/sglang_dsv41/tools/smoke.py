"""``sglang-dsv41 smoke``: after ``docker compose up``, do the servers work with the plugin active?

Targets are compose files (every ``sglang serve`` service and every sglang
router in them, at the port its command names) or server URLs. For each:

- ``health``: ``GET /health`` answers 200;
- ``chat``: one short chat completion comes back with at least one token
  (not on a PD prefill or decode server alone: they answer only in a pair,
  through the router);
- ``image``: where the server understands images (``/model_info``), one chat
  completion with a small generated PNG as a data URL, which must count more
  prompt tokens than the same text alone;
- ``metrics``: ``/metrics`` (sglang's ``--enable-metrics``) carries the
  plugin's ``sglang_dsv41_patches_applied`` series with every owed patch
  applied in the scheduler role (not on routers: they run no plugin).

One line per server, or one JSON document with ``--json``. Exit status 0 when
every check passed, 1 when one failed, 2 for input that cannot be used. Every
request has a timeout; nothing waits forever.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import struct
import sys
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_SERVER_PORT = 30000
DEFAULT_ROUTER_PORT = 30000
PROMPT = "Reply with the single word OK."
_SERIES = re.compile(r'^sglang_dsv41_(patches_applied|patches_owed)\{role="([a-z_]+)"\}\s+(\S+)$')


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
    try:
        return int(text)
    except ValueError:
        raise SmokeInputError(f"{where}: --port {text!r} is not a number") from None


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
        endpoints.append(Endpoint(where, f"http://{machine}:{reachable}", kind, path))
    if not endpoints:
        raise SmokeInputError(f"{path}: no `sglang serve` or router service")
    return endpoints


def url_endpoint(text: str) -> Endpoint:
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SmokeInputError(f"{text}: not an http(s) URL")
    try:
        parsed.port
    except ValueError:
        raise SmokeInputError(f"{text}: bad port") from None
    return Endpoint(text, text.rstrip("/"), "server", "url")


def endpoints_of(targets: list[str], host: str) -> list[Endpoint]:
    out = []
    for target in targets:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", target):
            out.append(url_endpoint(target))
        elif target.endswith((".yml", ".yaml")) or Path(target).is_file():
            out.extend(compose_endpoints(target, host))
        else:
            raise SmokeInputError(f"{target}: neither a compose file nor an http(s) URL")
    return out


# --------------------------------------------------------------------------
# HTTP


class _HttpError(Exception):
    pass


def _request(url: str, timeout: float, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()[:2000]
    except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, reset, timeout
        reason = getattr(exc, "reason", exc)
        raise _HttpError(f"{type(reason).__name__}: {reason}") from None


def _json(url: str, timeout: float, body: dict | None = None) -> dict:
    status, raw = _request(url, timeout, body)
    if status != 200:
        raise _HttpError(f"HTTP {status}: {raw[:200].decode(errors='replace').strip()}")
    try:
        value = json.loads(raw)
    except ValueError:
        raise _HttpError(f"not JSON: {raw[:120]!r}") from None
    if not isinstance(value, dict):
        raise _HttpError(f"unexpected JSON: {raw[:120]!r}")
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


def _completion(url: str, model: str, content, timeout: float) -> dict:
    reply = _json(f"{url}/v1/chat/completions", timeout, {
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": 8, "temperature": 0,
    })
    choices = reply.get("choices")
    usage = reply.get("usage") or {}
    if not choices or not isinstance(choices, list):
        raise _HttpError(f"no choices in the reply: {json.dumps(reply)[:200]}")
    if int(usage.get("completion_tokens") or 0) < 1:
        raise _HttpError(f"no completion tokens: usage {usage}")
    return reply


def plugin_status(metrics_text: str) -> dict[str, tuple[float, float]]:
    """Per role: (patches applied, patches owed), from the plugin's series."""
    seen: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        match = _SERIES.match(line.strip())
        if match:
            seen.setdefault(match.group(2), {})[match.group(1)] = float(match.group(3))
    return {role: (v.get("patches_applied", 0.0), v.get("patches_owed", 0.0))
            for role, v in seen.items()}


def check_endpoint(endpoint: Endpoint, timeout: float, router_vision: bool = False) -> ServerResult:
    """``router_vision``: a server behind this router understands images."""
    result = ServerResult(endpoint.name, endpoint.url, endpoint.kind, endpoint.source)
    url = endpoint.url
    try:
        status, _body = _request(f"{url}/health", timeout)
    except _HttpError as exc:
        result.add("health", "fail", str(exc))
        return result
    if status != 200:
        result.add("health", "fail", f"HTTP {status}")
        return result
    result.add("health", "ok", "HTTP 200")

    vision, pd_mode = False, None
    if endpoint.kind == "server":
        try:
            info = _json(f"{url}/model_info", timeout)
            vision = bool(info.get("has_image_understanding"))
            pd_mode = info.get("disaggregation_mode")
            pd_mode = None if pd_mode in (None, "null") else pd_mode
            result.add("model-info", "ok", f"vision={'on' if vision else 'off'}"
                       + (f", PD {pd_mode}" if pd_mode else ""))
        except _HttpError as exc:
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


def _chat_checks(result: ServerResult, url: str, vision: bool, timeout: float) -> None:
    try:
        models = _json(f"{url}/v1/models", timeout).get("data") or []
        model = models[0]["id"] if models and isinstance(models[0], dict) else "default"
        text = _completion(url, model, PROMPT, timeout)
    except _HttpError as exc:
        result.add("chat", "fail", str(exc))
        return
    text_tokens = int(text["usage"].get("prompt_tokens") or 0)
    result.add("chat", "ok", f"{text['usage'].get('completion_tokens')} tokens from {model}")
    if not vision:
        result.add("image", "skip", "the server does not understand images")
        return
    content = [{"type": "text", "text": PROMPT},
               {"type": "image_url", "image_url": {"url": png_data_url()}}]
    try:
        image = _completion(url, model, content, timeout)
    except _HttpError as exc:
        result.add("image", "fail", str(exc))
        return
    image_tokens = int(image["usage"].get("prompt_tokens") or 0)
    if image_tokens <= text_tokens:
        result.add("image", "fail", f"the image added no prompt tokens ({image_tokens} vs "
                                    f"{text_tokens} for the text alone): it was not read")
        return
    result.add("image", "ok", f"{image_tokens - text_tokens} image prompt tokens")


def _metrics_check(result: ServerResult, url: str, timeout: float) -> None:
    try:
        status, raw = _request(f"{url}/metrics", timeout)
    except _HttpError as exc:
        result.add("metrics", "fail", str(exc))
        return
    if status == 404:
        result.add("metrics", "fail", "no /metrics: start the server with --enable-metrics")
        return
    if status != 200:
        result.add("metrics", "fail", f"/metrics: HTTP {status}")
        return
    roles = plugin_status(raw.decode(errors="replace"))
    if not roles:
        result.add("metrics", "fail", "no sglang_dsv41_ series: the plugin is not active "
                                      "(stock sglang?)")
        return
    summary = ", ".join(f"{role} {applied:g}/{owed:g}" for role, (applied, owed) in sorted(roles.items()))
    short = [role for role, (applied, owed) in roles.items() if owed <= 0 or applied < owed]
    if "scheduler" not in roles:
        result.add("metrics", "fail", f"no scheduler reported the plugin ({summary})")
    elif short:
        result.add("metrics", "fail", f"patches missing in {', '.join(sorted(short))} ({summary})")
    else:
        result.add("metrics", "ok", f"plugin active: {summary}")


# --------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("targets", nargs="+", metavar="COMPOSE_FILE_OR_URL",
                        help="compose files (every sglang server and router in them) or server URLs")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds for each request (default 60)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="where compose services without a host label listen (default 127.0.0.1)")


def _line(result: ServerResult) -> str:
    verdict = "ok  " if result.ok else "FAIL"
    parts = [f"{c.check}: {c.detail}" if c.status != "ok" or c.check in ("metrics", "image")
             else f"{c.check} ok" for c in result.checks]
    where = result.url if result.name == result.url else f"{result.name} {result.url}"
    return f"[{verdict}] {where}: " + "; ".join(parts)


def main(args) -> int:
    if args.timeout <= 0:
        print("smoke: --timeout must be positive", file=sys.stderr)
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
            results[index] = check_endpoint(endpoint, args.timeout)
            if any(c.check == "model-info" and "vision=on" in c.detail for c in results[index].checks):
                vision_sources.add(endpoint.source)
    for index, endpoint in enumerate(endpoints):
        if endpoint.kind == "router":
            results[index] = check_endpoint(endpoint, args.timeout,
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
