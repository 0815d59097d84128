"""The fixed prompt set and the requests verify sends to a side.

Text prompts go to ``/generate`` (greedy output ids, and the verify steps a
speculative server reports), image prompts to ``/v1/chat/completions`` with
``return_token_ids`` and PNGs made here. Each text prompt's time to first token
is the median of streamed one-token requests.
"""

from __future__ import annotations

import base64
import json
import statistics
import time
import urllib.request

from sglang_dsv41.tools.smoke import MAX_METRICS_BYTES, HttpFailure, call_within, fetch, fetch_json, tiny_png

VOCABULARY = ("river stone market ledger signal harbor copper lantern orchard quartz "
              "meadow engine violet summit canyon ember glacier falcon prairie tunnel").split()
DEFAULT_WORDS = (40, 300, 1200, 3000, 6000)
# (width, height) of each image of the image prompts; the last prompt carries several,
# so an owner-broadcast group has images to spread over its ranks.
IMAGE_PROMPTS = (((224, 224),), ((448, 320),), ((224, 224), (336, 336), (448, 448), (640, 480)))


class RequestError(Exception):
    """A side answered a prompt with something verify cannot compare."""


def text_prompt(words: int) -> str:
    body = " ".join(VOCABULARY[(i * 7 + words) % len(VOCABULARY)] for i in range(words))
    return f"Summarize the following list in one sentence.\n{body}\nSummary:"


def describe_prompts(words, images: bool) -> list[str]:
    if images:
        return [f"image prompt {i}: {len(sizes)} image(s) " + ", ".join(f"{w}x{h}" for w, h in sizes)
                for i, sizes in enumerate(IMAGE_PROMPTS)]
    return [f"text prompt of {n} words" for n in words]


def _json_reply(url: str, payload: dict, timeout: float) -> dict:
    """The JSON object a server answers, all of it within ``timeout`` (size capped)."""
    try:
        return fetch_json(url, timeout, payload)
    except HttpFailure as exc:
        raise RequestError(f"{url}: {exc}") from None


def _token_ids(value, where: str) -> list:
    """The greedy output's token ids: what the sides are compared on, so never absent."""
    if not isinstance(value, list) or not value or not all(type(t) is int for t in value):
        raise RequestError(f"{where}: the answer carries no output token ids to compare")
    return value


def _ttft(url: str, text: str, timeout: float) -> float:
    """Seconds to the first streamed line of a one-token request; the whole wait is bounded."""
    payload = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
               "stream": True}

    def first_line() -> float:
        start = time.perf_counter()
        request = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            while line := response.readline(1 << 16):
                if line.strip():
                    return time.perf_counter() - start
        raise RequestError("the stream was empty")

    try:
        return call_within(timeout, first_line, RequestError("no token within the timeout"), "verify-ttft")
    except Exception as exc:  # whatever the server made the client raise, or RequestError
        why = str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"
    raise RequestError(f"{url}/generate (streamed): {why}")


def measure_text(url: str, words, max_new_tokens: int, repeats: int, timeout: float) -> list[dict]:
    results = []
    for n in words:
        text = text_prompt(n)
        started = time.perf_counter()
        reply = _json_reply(url + "/generate", {
            "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}},
            timeout)
        latency = time.perf_counter() - started
        meta = reply.get("meta_info") if isinstance(reply.get("meta_info"), dict) else {}
        ttfts = [_ttft(url, text, timeout) for _ in range(repeats)]
        results.append({"prompt": f"text-{n}w", "output_ids": _token_ids(reply.get("output_ids"), url + "/generate"),
                        "text": reply.get("text"), "completion_tokens": meta.get("completion_tokens"),
                        "spec_verify_ct": meta.get("spec_verify_ct"), "latency_s": latency,
                        "ttft_s": statistics.median(ttfts) if ttfts else None})
    return results


def _data_url(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(tiny_png(width, height)).decode()


def measure_images(url: str, max_new_tokens: int, timeout: float) -> list[dict]:
    results = []
    for index, sizes in enumerate(IMAGE_PROMPTS):
        content = [{"type": "text", "text": "Describe every image in one sentence each."}]
        content += [{"type": "image_url", "image_url": {"url": _data_url(w, h)}} for w, h in sizes]
        started = time.perf_counter()
        reply = _json_reply(url + "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": max_new_tokens, "return_token_ids": True}, timeout)
        latency = time.perf_counter() - started
        choices = reply.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise RequestError(f"{url}/v1/chat/completions: no choices in the answer")
        message = choices[0].get("message") or {}
        usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
        results.append({"prompt": f"image-{index}",
                        "output_ids": _token_ids(choices[0].get("token_ids"), url + "/v1/chat/completions"),
                        "text": message.get("content"),
                        "completion_tokens": usage.get("completion_tokens"),
                        "spec_verify_ct": None, "latency_s": latency, "ttft_s": None})
    return results


def fetch_metrics(url: str, timeout: float) -> str | None:
    try:
        status, body = fetch(url + "/metrics", timeout, limit=MAX_METRICS_BYTES)
    except HttpFailure:
        return None
    return body.decode(errors="replace") if status == 200 else None


def metric_values(text: str | None, name: str) -> dict[str, float]:
    """``{labels: value}`` of one series of a /metrics page (labels as written there)."""
    found = {}
    for line in (text or "").splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            try:
                found[head[len(name):]] = float(value)
            except ValueError:
                continue
    return found
