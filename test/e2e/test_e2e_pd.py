"""A real prefill/decode deployment with the plugin, behind sglang's router, and its faults.

One prefill and two decode ``sglang serve`` (the tiny Llama on the CPU, the KV
over Mooncake's TCP transport on 127.0.0.1: see ``_pd.py`` for why each CPU
setting is there) and sglang's router in PD mode in front of all three, started
with the fault settings of the shipped ``deploy/b300-ds41/pd-1p1d.yml`` router
(round robin over the decodes, so each is used). The stock comparison is a
single server with the plugin filtered out: its greedy tokens are the
reference, so equal tokens say that neither the plugin nor the PD path changed
one. A third decode with another page size is never routed to: it is the
refused pairing. Every server starts at once and is shared by every case; the
fault cases run last, in file order, and leave a restarted deployment.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from _e2e_server import PNG_1x1, Server, free_port, start_healthy, tiny_model  # noqa: F401
from conftest import REPO_ROOT
from _pd import DECODE_STEP_LINE, MOONCAKE_THROUGHPUT, Router, greedy, metric_total, pd_server
from sglang_dsv41.embed_overrides.rules import OVERRIDE_FORM_ERROR
from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.table import owed_to

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPT = "The quick brown fox"
EXPECTED_ROLES = {Role.LAUNCHER.value: 1, Role.SCHEDULER.value: 1, Role.DETOKENIZER.value: 1}
SHIPPED_TOPOLOGY = REPO_ROOT / "deploy" / "b300-ds41" / "pd-1p1d.yml"
# The bounds: an error within 15 s of the decode's death, the restarted
# decode serving again within 30 s of its /health.
ERROR_WITHIN_S = 15
READMITTED_WITHIN_S = 30
# Router flags that say where traffic goes; the test gives its own.
_TOPOLOGY_FLAGS = {"--prefill": 2, "--decode": 1, "--host": 1, "--port": 1, "--prometheus-port": 1,
                   "--pd-disaggregation": 0}
# Gauges a server reports that must fall back to zero once no request is left.
PREFILL_STATE = ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_inflight_queue_reqs",
                 "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:kv_used_tokens")
# The router spreads requests over both decodes; the tests say which one they mean.
TEST_ROUTER_FLAGS = ("--decode-policy", "round_robin")
DECODE_STATE = ("sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs",
                "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:kv_used_tokens")


def shipped_router_fault_flags() -> list[str]:
    """The shipped PD router's flags other than its topology (the fault settings)."""
    command = yaml.safe_load(SHIPPED_TOPOLOGY.read_text())["services"]["router"]["command"]
    words = shlex.split(command)
    words = words[words.index("sglang_router.launch_router") + 1:]
    kept, i = [], 0
    while i < len(words):
        if words[i] in _TOPOLOGY_FLAGS:
            i += 1 + _TOPOLOGY_FLAGS[words[i]]
            continue
        kept.append(words[i])
        i += 1
    return kept


class Deployment:
    def __init__(self, model, tmp):
        self.model, self.tmp = model, tmp
        self.bootstrap_port = free_port()
        self.prefill = pd_server("prefill", model, tmp / "prefill", bootstrap_port=self.bootstrap_port)
        self.decode = pd_server("decode", model, tmp / "decode")
        self.decode2 = pd_server("decode", model, tmp / "decode2")
        # Page size 16 against the prefill's 1: sglang refuses the pair at the bootstrap.
        self.refused = pd_server("decode", model, tmp / "refused", extra_args=("--page-size", "16"))
        self.single = Server(model, tmp / "single", plugin=False)
        self.router: Router | None = None
        self.startup_s: dict[str, float] = {}
        self.retired: list[Server] = []

    def restart(self, role: str) -> Server:
        """The same role again on the same ports, in a fresh work folder."""
        old = getattr(self, role)
        self.retired.append(old)
        new = pd_server(role, self.model, self.tmp / f"{role}-{len(self.retired)}", port=old.port,
                        bootstrap_port=self.bootstrap_port if role == "prefill" else None)
        start_healthy(new)
        self.startup_s[f"{role} restart"] = new.healthy_after_s
        setattr(self, role, new)
        return new


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    dep = Deployment(tiny_model, tmp_path_factory.mktemp("pd"))
    servers = {"prefill": dep.prefill, "decode": dep.decode, "decode2": dep.decode2,
               "refused decode": dep.refused, "stock single": dep.single}
    try:
        for srv in servers.values():
            srv.start()
        for name, srv in servers.items():
            srv.wait_healthy()
            dep.startup_s[name] = srv.healthy_after_s
        for srv in (dep.prefill, dep.decode, dep.decode2):
            srv.wait_for_roles(EXPECTED_ROLES, timeout=300)
        dep.router = Router(dep.prefill, dep.bootstrap_port, [dep.decode, dep.decode2], dep.tmp / "router",
                            extra_args=(*shipped_router_fault_flags(), *TEST_ROUTER_FLAGS)).start()
        wait_served(dep.router, READMITTED_WITHIN_S * 4)
        yield dep
    finally:
        if dep.router is not None:
            dep.router.stop()
        for srv in [dep.prefill, dep.decode, dep.decode2, dep.refused, dep.single, *dep.retired]:
            srv.stop()
        print("\nPD start-up, /health after: "
              + ", ".join(f"{k} {v:.0f} s" for k, v in dep.startup_s.items() if v is not None))


def wait_served(router: Router, timeout: float) -> float:
    """Seconds until the router serves a request (it admits workers after its checks)."""
    start = time.monotonic()
    while True:
        resp = router.generate(greedy(PROMPT, 1), timeout=120)
        if resp.status_code == 200:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, (resp.status_code, resp.text, router.log()[-3000:])
        time.sleep(1)


def kv_moved(prefill: Server) -> tuple[float, int]:
    """What says KV left the prefill: sglang's count of completed KV sends (a send is
    complete when Mooncake's engine reported the write done) and the transfer
    statistics lines Mooncake's engine logs while it moves bytes."""
    return (metric_total(prefill, "sglang:kv_transfer_total_mb_count"),
            len(MOONCAKE_THROUGHPUT.findall(prefill.log())))


def assert_kv_moved(before: tuple[float, int], after: tuple[float, int], requests_sent: int) -> None:
    assert after[0] - before[0] == requests_sent, f"completed KV sends {before[0]} -> {after[0]}"
    assert after[1] > before[1], "Mooncake's engine logged no transfer"


def settle(server: Server, gauges: tuple[str, ...], timeout: float = 30) -> dict[str, float]:
    """The server's own gauges once they are all zero, or the last values seen."""
    deadline = time.monotonic() + timeout
    while True:
        values = {g: metric_total(server, g) for g in gauges}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(1)


def single_reference(pd, max_new_tokens: int, payload: dict | None = None) -> list[int]:
    """The stock single server's greedy tokens."""
    resp = pd.single.post("/generate", payload or greedy(PROMPT, max_new_tokens))
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def decode_steps(server: Server) -> int:
    """Decode steps the server has logged (one line per step, see ``_pd.DECODE_ARGS``)."""
    return server.log().count(DECODE_STEP_LINE)


# --------------------------------------------------------------------------- the healthy pair


def test_every_role_prints_its_status_line_on_both_servers(pd):
    for server in (pd.prefill, pd.decode, pd.decode2):
        lines = server.status_lines()
        assert dict(Counter(line.role for line in lines)) == EXPECTED_ROLES, server.log_tail()
        for line in lines:
            owed = len(owed_to(Role(line.role)))
            assert (line.applied, line.owed) == (owed, owed), line
        assert not server.kernel_calls.exists(), server.kernel_calls.read_text()


@pytest.mark.parametrize("max_new_tokens", [8, 200])
def test_greedy_tokens_through_the_router_equal_a_single_server(pd, max_new_tokens):
    before = kv_moved(pd.prefill)
    resp = pd.router.generate(greedy(PROMPT, max_new_tokens))
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == single_reference(pd, max_new_tokens)
    time.sleep(1.5)  # Mooncake's engine logs its statistics once a second
    assert_kv_moved(before, kv_moved(pd.prefill), requests_sent=1)


def test_the_kv_check_fails_when_the_transfer_is_cut(pd):
    """sglang's warm-up address makes the decode serve a request with no transfer
    at all (its KV is whatever the pool held): tokens come back, the check fails."""
    before = kv_moved(pd.prefill)
    payload = dict(greedy(PROMPT, 8), bootstrap_host="2.2.2.2", bootstrap_port=pd.bootstrap_port,
                   bootstrap_room=random.getrandbits(63))
    resp = pd.decode.post("/generate", payload)
    assert resp.status_code == 200, resp.text
    time.sleep(1.5)
    with pytest.raises(AssertionError, match="completed KV sends"):
        assert_kv_moved(before, kv_moved(pd.prefill), requests_sent=1)


def test_a_refused_pairing_fails_its_request_and_neither_server_goes_down(pd):
    """A decode with page size 16 asks the prefill's real bootstrap server to pair.

    sglang 0.5.23 refuses the pair by raising out of the decode scheduler's loop,
    which takes that decode down at its first request (seen with the plugin's
    PDH-PAIRING alone). With PDH-REFUSAL the request fails with the plugin's one
    line naming the field, counted, and the decode keeps serving. (The plugin's
    DSpark rule itself needs a DeepSeek-V4 KV layout, out of reach on the CPU; the
    real bootstrap path of that rule is test/pd_handshake's.) Only the decode's
    half is sent, so the prefill holds nothing for it.
    """
    payload = dict(greedy(PROMPT, 8), bootstrap_host="127.0.0.1", bootstrap_port=pd.bootstrap_port,
                   bootstrap_room=random.getrandbits(63))
    started = time.monotonic()
    resp = pd.refused.post("/generate", payload, timeout=120)
    print(f"\nrefused pairing: client answered {resp.status_code} after {time.monotonic() - started:.1f} s")
    assert resp.status_code != 200, resp.text
    refusal = "[sglang-dsv41] pd-handshake: refused to pair with the prefill at"
    assert refusal in resp.text and "page_size=16" in resp.text, resp.text
    # The plugin's own line (sglang then logs the failed request with its reason too).
    lines = [line for line in pd.refused.log().splitlines() if f"] {refusal}" in line]
    assert len(lines) == 1 and "page_size" in lines[0], lines
    assert metric_total(pd.refused, "sglang_dsv41_pd_pairings_refused_total") == 1
    for server in (pd.refused, pd.prefill):
        assert server.proc.poll() is None
        assert requests.get(f"{server.base}/health", timeout=30).status_code == 200
    assert settle(pd.refused, DECODE_STATE) == dict.fromkeys(DECODE_STATE, 0)
    assert settle(pd.prefill, PREFILL_STATE) == dict.fromkeys(PREFILL_STATE, 0)
    pd.refused.stop()  # its part is done: the CPU goes to the other cases


def test_override_with_media_through_the_router_never_reaches_the_servers(pd):
    """A single server with the plugin refuses overrides with media (400,
    test_e2e_single.py). Through sglang-router 0.3.2 there is nothing to refuse:
    its /generate request type has no ``positional_embed_overrides`` and drops
    it, so the pair serves the media-only request: the stock single server's
    tokens for the request without the overrides, with nothing to tell the
    client. A router that forwards the field fails this test; the refusal must
    then be asserted here (the next case shows it once the field arrives)."""
    media_only = {"text": "a picture <emb> of a fox", "image_data": PNG_1x1,
                  "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    with_overrides = dict(media_only, positional_embed_overrides={"embeds": [[0.25] * 64], "positions": [1]})
    resp = pd.router.generate(with_overrides)
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == single_reference(pd, 4, media_only)


def test_override_with_media_sent_as_is_to_the_pair_is_refused_as_on_a_single_server(pd, tmp_path):
    """What docs/design/embed_overrides.md tells an operator to do for override
    requests in PD: send the body as it is to a prefill and a decode with one
    bootstrap room. The router package's MiniLB (``--mini-lb``) does exactly that
    (test/embed_overrides/test_router_carriage.py). Each server's admission
    refuses the overrides as a single server does (posted as JSON they are never
    sglang's object: test_e2e_single.py), before anything is queued or bootstrapped."""
    mini_lb = Router(pd.prefill, pd.bootstrap_port, [pd.decode], tmp_path / "mini-lb",
                     extra_args=("--mini-lb",)).start()
    try:
        resp = mini_lb.generate({"text": "a picture <emb> of a fox", "image_data": PNG_1x1,
                                 "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                                 "positional_embed_overrides": {"embeds": [[0.25] * 64], "positions": [1]}})
    finally:
        mini_lb.stop()
    refusal = OVERRIDE_FORM_ERROR.format(kind="dict")
    assert resp.status_code == 400, resp.text
    assert refusal in resp.text, resp.text
    for server in (pd.prefill, pd.decode):  # each refused it itself (sglang logs the 400's reason)
        assert server.log().count(f"[http_server] Error: {refusal}") == 1, server.log_tail()
    assert settle(pd.decode, DECODE_STATE) == dict.fromkeys(DECODE_STATE, 0)
    assert settle(pd.prefill, PREFILL_STATE) == dict.fromkeys(PREFILL_STATE, 0)


# --------------------------------------------------------------------------- faults


def in_background(call):
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


def timed_generate(router: Router, max_new_tokens: int):
    start = time.monotonic()
    try:
        resp = router.generate(greedy(PROMPT, max_new_tokens), timeout=900)
        return resp.status_code, resp.text[:300], time.monotonic()
    except requests.RequestException as exc:
        return "no answer", repr(exc)[:300], time.monotonic()


def wait_for_gauge(servers: list[Server], gauge: str, timeout: float = 60) -> Server:
    """The first of ``servers`` whose gauge rises."""
    deadline = time.monotonic() + timeout
    while True:
        for server in servers:
            if metric_total(server, gauge) >= 1:
                return server
        assert time.monotonic() < deadline, f"{gauge} never rose on {[s.base for s in servers]}"
        time.sleep(0.2)


def test_decode_killed_mid_request_fails_fast_and_a_healthy_decode_serves_the_next(pd):
    pending = in_background(lambda: timed_generate(pd.router, 200))
    victim = wait_for_gauge([pd.decode, pd.decode2], "sglang:num_running_reqs")  # decoding its 200 tokens
    survivor = pd.decode2 if victim is pd.decode else pd.decode
    if victim is pd.decode2:  # the restart case below restarts ``decode``
        pd.decode, pd.decode2 = pd.decode2, pd.decode
    killed = time.monotonic()
    victim.stop(graceful=False)
    status, text, answered = pending.result(timeout=600)
    took = answered - killed
    print(f"\ndecode killed mid-request: client answered {status} after {took:.1f} s")
    assert status != 200, text
    assert took < ERROR_WITHIN_S, (status, text, took)
    # Later requests go to the surviving decode, with the same tokens.
    before = decode_steps(survivor)
    wait_served(pd.router, ERROR_WITHIN_S)
    print(f"decode killed: the healthy decode served a request {time.monotonic() - killed:.1f} s after the kill")
    resp = pd.router.generate(greedy(PROMPT, 8))
    assert resp.status_code == 200 and resp.json()["output_ids"] == single_reference(pd, 8), resp.text
    assert victim.proc.poll() is not None and decode_steps(survivor) > before
    assert pd.prefill.proc.poll() is None
    assert settle(pd.prefill, PREFILL_STATE) == dict.fromkeys(PREFILL_STATE, 0)
    assert settle(survivor, DECODE_STATE) == dict.fromkeys(DECODE_STATE, 0)


def test_restarted_decode_is_used_again(pd):
    decode = pd.restart("decode")
    deadline = time.monotonic() + READMITTED_WITHIN_S
    while decode_steps(decode) == 0:  # round robin: it gets every other request once admitted
        assert time.monotonic() < deadline, "the router never sent a request to the restarted decode"
        resp = pd.router.generate(greedy(PROMPT, 8), timeout=120)
        if resp.status_code == 503:  # the prefill's circuit, opened by the kill's failures, is still open
            time.sleep(1)
            continue
        assert resp.status_code == 200 and resp.json()["output_ids"] == single_reference(pd, 8), resp.text
    readmitted = READMITTED_WITHIN_S - (deadline - time.monotonic())
    print(f"\nrestarted decode: served through the router {readmitted:.1f} s after its /health")
    assert [line.role for line in decode.status_lines()].count(Role.SCHEDULER.value) == 1
    for server in (decode, pd.decode2):
        assert settle(server, DECODE_STATE) == dict.fromkeys(DECODE_STATE, 0)


def test_prefill_killed_mid_request_fails_and_leaves_nothing_on_the_decodes(pd):
    """The prefill is stopped before it answers, so the request is held by it, then killed."""
    os.killpg(pd.prefill.pid, signal.SIGSTOP)
    try:
        pending = in_background(lambda: timed_generate(pd.router, 8))
        time.sleep(3)  # the router has sent both halves; a decode holds its half
    finally:
        killed = time.monotonic()
        pd.prefill.stop(graceful=False)  # SIGKILL reaches stopped processes too
    status, text, answered = pending.result(timeout=600)
    took = answered - killed
    print(f"\nprefill killed mid-request: client answered {status} after {took:.1f} s")
    assert status != 200, text
    assert took < ERROR_WITHIN_S, (status, text, took)
    for decode in (pd.decode, pd.decode2):
        assert decode.proc.poll() is None
        assert requests.get(f"{decode.base}/health", timeout=30).status_code == 200
        assert settle(decode, DECODE_STATE) == dict.fromkeys(DECODE_STATE, 0)
    pd.restart("prefill")
    wait_served(pd.router, READMITTED_WITHIN_S)
    resp = pd.router.generate(greedy(PROMPT, 8))
    assert resp.status_code == 200 and resp.json()["output_ids"] == single_reference(pd, 8), resp.text
    assert settle(pd.prefill, PREFILL_STATE) == dict.fromkeys(PREFILL_STATE, 0)
