"""A real ``sglang serve`` with the plugin, 2 tokenizer workers and 2 detokenizer workers.

Every process role of that topology must load the plugin and print exactly one
status line: the launcher, the scheduler, each multi-tokenizer HTTP worker,
each detokenizer and the detokenizer router. The test configures no logging of
its own; what shows is what a user of ``sglang serve`` sees. Real requests go
through every front door the workers serve.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import psutil
import pytest
import requests

from _e2e_server import Server, override_with_media, start_healthy, tiny_model  # noqa: F401
from sglang_dsv41.embed_overrides.rules import ADMISSION_ERROR
from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.table import owed_to

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXPECTED_ROLES = {
    Role.LAUNCHER.value: 1,
    Role.SCHEDULER.value: 1,
    Role.TOKENIZER_WORKER.value: 2,
    Role.DETOKENIZER.value: 2,
    Role.DETOKENIZER_ROUTER.value: 1,
}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = Server(
        tiny_model, tmp_path_factory.mktemp("workers"),
        tokenizer_workers=2, detokenizer_workers=2, metrics=True,
    )
    start_healthy(srv)
    srv.wait_for_roles(EXPECTED_ROLES, timeout=900)
    yield srv
    srv.stop()
    print(f"\nworkers server: /health after {srv.healthy_after_s:.0f} s")


def test_generate_completions_and_chat_answer(server):
    max_tokens = 4
    for _ in range(3):  # a few of each, so both workers are likely to serve some
        gen = server.post("/generate", {
            "text": "The quick brown fox",
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
        })
        assert gen.status_code == 200, gen.text
        body = gen.json()
        assert isinstance(body["text"], str)
        assert body["meta_info"]["completion_tokens"] == max_tokens

        comp = server.post("/v1/completions", {
            "model": str(server.model), "prompt": "hello", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True,
        })
        assert comp.status_code == 200, comp.text
        assert comp.json()["usage"]["completion_tokens"] == max_tokens
        assert isinstance(comp.json()["choices"][0]["text"], str)

        chat = server.post("/v1/chat/completions", {
            "model": str(server.model), "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "how are you today?"}],
            "ignore_eos": True,
        })
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == max_tokens
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"


def test_every_role_prints_exactly_one_status_line_per_process(server):
    lines = server.status_lines()
    per_process = Counter((line.role, line.pid) for line in lines)
    assert all(n == 1 for n in per_process.values()), per_process
    roles = Counter(role for role, _pid in per_process)
    assert dict(roles) == EXPECTED_ROLES, (dict(roles), server.log_tail())
    for line in lines:
        owed = len(owed_to(Role(line.role)))
        assert (line.applied, line.owed) == (owed, owed), line
    assert "NOT ACTIVE" not in server.log()
    # The lines come from this server's own processes, one process per line.
    pids = [line.pid for line in lines]
    assert len(set(pids)) == len(pids)
    launcher = psutil.Process(server.pid)
    children = {p.pid for p in launcher.children(recursive=True)}
    for line in lines:
        if line.role == Role.LAUNCHER.value:
            assert line.pid == server.pid
        else:
            assert line.pid in children, (line, sorted(children))


def test_override_with_media_is_refused_by_the_tokenizer_worker(server):
    """The request reaches a multi-tokenizer worker; only the plugin refuses the
    combination there (stock would answer that this is not an embedding model)."""
    resp = server.post("/v1/embeddings", override_with_media(server.model))
    assert resp.status_code == 400, resp.text
    assert ADMISSION_ERROR in resp.text


def test_no_stand_in_kernel_was_called(server):
    assert not server.kernel_calls.exists(), server.kernel_calls.read_text()
    assert "sgl_kernel stand-in" not in server.log()


def test_metrics_endpoint_carries_the_plugins_series(server):
    """With --enable-metrics, sglang's own /metrics shows the plugin's series,
    written by the scheduler and the other roles' processes."""
    text = requests.get(server.base + "/metrics", timeout=60).text
    applied = {}
    for line in text.splitlines():
        if line.startswith("sglang_dsv41_patches_applied{"):
            role = line.split('role="', 1)[1].split('"', 1)[0]
            applied[role] = float(line.rsplit(" ", 1)[1])
    assert applied.get(Role.SCHEDULER.value) == len(owed_to(Role.SCHEDULER)), text[-3000:]
    assert applied.get(Role.TOKENIZER_WORKER.value) == len(owed_to(Role.TOKENIZER_WORKER)), applied
    # The launcher exports nothing itself (sglang imports prometheus_client there
    # before it sets the multiprocess directory); its count reaches /metrics from the
    # scheduler, with the server's arguments.
    assert applied.get(Role.LAUNCHER.value) == len(owed_to(Role.LAUNCHER)), applied
    # The launch guard's verdict, decided in the launcher, published by the
    # scheduler: no known-crash rule applies to this tiny single-GPU layout.
    guard = [line for line in text.splitlines() if line.startswith("sglang_dsv41_launch_guard_active{")]
    assert guard == ['sglang_dsv41_launch_guard_active{rule="none"} 1.0'], guard
    assert "sglang:" in text  # sglang's own series beside ours, on the same endpoint


def test_smoke_passes_against_the_real_server(server):
    done = subprocess.run(
        [sys.executable, "-m", "sglang_dsv41.tools.cli", "smoke", "--json", "--timeout", "300", server.base],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    checks = {c["check"]: c["status"] for c in report["servers"][0]["checks"]}
    assert checks["health"] == "ok" and checks["metrics"] == "ok", report
    assert checks["image"] == "skip", report  # the tiny model has no vision tower
