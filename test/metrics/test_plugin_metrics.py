"""The plugin's Prometheus series, exported the way sglang 0.5.23 exports its own.

Under ``--enable-metrics`` sglang sets ``PROMETHEUS_MULTIPROC_DIR`` in the
launcher before it spawns anything, and its HTTP server mounts ``/metrics``
with a ``MultiProcessCollector`` over that directory
(``sglang.srt.utils.add_prometheus_middleware``). Here a separate process
(standing in for a scheduler) counts through ``sglang_dsv41.metrics`` and the
test serves sglang's real middleware with uvicorn on 127.0.0.1 and reads
``/metrics`` over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from conftest import run_python
from sglang_dsv41.launch_guards.rules import REPLAY_UNDER_DP_ATTENTION as DP_RULE

pytestmark = pytest.mark.timeout(120)

SCHEDULER_LIKE = """
import json, sys
from sglang_dsv41 import metrics as m
from sglang_dsv41.owner_broadcast.routing import Route
imported_early = "prometheus_client" in sys.modules
m.count_pairing_refused()                          # before the decision: kept
m.count_cross_host_peer()
decided = m.configure({enabled})
m.role_verified("scheduler", 9, 9)
m.launch_guard_verdict({guard_rule!r})
routes = {{route: 0 for route in Route}}  # as an owner router keeps them
m.export_route_counts(routes)
for route in (Route.KNOWN, Route.KNOWN, Route.OWNER, Route.NOT_WORTH):
    routes[route] += 1
for _ in range(3):
    m.count_agreement_round()
m.count_encodes_saved(2)
m.count_side_channel("sent", 4, 4096)
m.count_side_channel_drop("receive")
m.count_agreement_failure()
for label in ("peer_pages", "peer_pages", "failed"):
    m.count_kv_staging("kv_staging_batches", label)
m.count_kv_staging("kv_staging_held_writes", "written")
print(json.dumps({{"decided": decided, "imported_early": imported_early,
                   "imported_now": "prometheus_client" in sys.modules}}))
"""  # exits without an explicit flush: the exit handler exports the last counts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_SERVER = """
import sys, uvicorn
from fastapi import FastAPI
from sglang.srt.utils import add_prometheus_middleware
app = FastAPI()
add_prometheus_middleware(app)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
"""


@contextlib.contextmanager
def sglang_metrics_server(directory, monkeypatch):
    """sglang's own /metrics mount on a FastAPI app, served on 127.0.0.1.

    In a process of its own: importing prometheus_client in multiprocess mode
    here would leave this test process's later sglang imports creating their
    metrics under a directory that is gone.
    """
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(directory))
    env.pop("SGLANG_PLUGINS", None)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", METRICS_SERVER, str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"metrics server exited: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the metrics server did not start"
            try:
                requests.get(f"{url}/metrics", timeout=2)
                break
            except requests.ConnectionError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def samples(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line.startswith("sglang_dsv41_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def count_in_another_process(directory, enabled: bool, guard_rule: str | None = DP_RULE) -> dict:
    done = run_python(SCHEDULER_LIKE.format(enabled=enabled, guard_rule=guard_rule),
                      env={"PROMETHEUS_MULTIPROC_DIR": str(directory)}, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_counts_of_another_process_reach_sglangs_metrics_endpoint(tmp_path, monkeypatch):
    state = count_in_another_process(tmp_path, enabled=True)
    assert state == {"decided": True, "imported_early": False, "imported_now": True}
    with sglang_metrics_server(tmp_path, monkeypatch) as url:
        response = requests.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    got = samples(response.text)
    assert got == {
        'sglang_dsv41_patches_applied{role="scheduler"}': 9.0,
        'sglang_dsv41_patches_owed{role="scheduler"}': 9.0,
        'sglang_dsv41_processes_verified_total{role="scheduler"}': 1.0,
        'sglang_dsv41_owner_routes_total{route="known"}': 2.0,
        'sglang_dsv41_owner_routes_total{route="owner"}': 1.0,
        'sglang_dsv41_owner_routes_total{route="not-worth"}': 1.0,
        'sglang_dsv41_owner_agreement_rounds_total': 3.0,
        'sglang_dsv41_owner_encodes_saved_total': 2.0,
        'sglang_dsv41_owner_agreement_failures_total': 1.0,
        'sglang_dsv41_side_channel_blocks_total{direction="sent"}': 4.0,
        'sglang_dsv41_side_channel_bytes_total{direction="sent"}': 4096.0,
        'sglang_dsv41_side_channel_drops_total{direction="receive"}': 1.0,
        'sglang_dsv41_pd_pairings_refused_total': 1.0,
        'sglang_dsv41_nvlink_cross_host_peers_total': 1.0,
        'sglang_dsv41_kv_staging_batches_total{path="peer_pages"}': 2.0,
        'sglang_dsv41_kv_staging_batches_total{path="failed"}': 1.0,
        'sglang_dsv41_kv_staging_held_writes_total{outcome="written"}': 1.0,
        f'sglang_dsv41_launch_guard_active{{rule="{DP_RULE}"}}': 1.0,
    }



def test_counters_sum_over_processes_and_gauges_do_not(tmp_path, monkeypatch):
    # Two schedulers of a server no launch guard rule applied to.
    count_in_another_process(tmp_path, enabled=True, guard_rule=None)
    count_in_another_process(tmp_path, enabled=True, guard_rule=None)
    with sglang_metrics_server(tmp_path, monkeypatch) as url:
        got = samples(requests.get(f"{url}/metrics", timeout=10).text)
    assert got['sglang_dsv41_owner_routes_total{route="known"}'] == 4.0
    assert got['sglang_dsv41_processes_verified_total{role="scheduler"}'] == 2.0
    assert got['sglang_dsv41_patches_applied{role="scheduler"}'] == 9.0
    guard = {name: value for name, value in got.items() if "launch_guard" in name}
    assert guard == {'sglang_dsv41_launch_guard_active{rule="none"}': 1.0}


def test_metrics_off_writes_nothing_and_never_imports_prometheus(tmp_path):
    state = count_in_another_process(tmp_path, enabled=False)
    assert state == {"decided": False, "imported_early": False, "imported_now": False}
    assert list(tmp_path.iterdir()) == []


def test_enabled_without_sglangs_directory_stays_off_with_a_warning():
    done = run_python("""
        import logging, os, sys
        logging.basicConfig(level=logging.WARNING)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        from sglang_dsv41 import metrics as m
        print(m.configure(True), "prometheus_client" in sys.modules)
    """, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
    assert "PROMETHEUS_MULTIPROC_DIR is not set" in done.stderr


def test_counts_from_many_threads_are_exact(tmp_path):
    done = run_python("""
        import threading
        from sglang_dsv41 import metrics as m
        m.configure(True)
        def worker():
            for _ in range(20000):
                m.count_side_channel("sent", 1, 10)
                m.count_agreement_round()
                m.count_kv_staging("kv_staging_batches", "peer_pages")
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        t = m.totals()
        print(t["side_channel_blocks"]["sent"], t["side_channel_bytes"]["sent"], t["owner_agreement_rounds"][""],
              t["kv_staging_batches"]["peer_pages"])
        try:
            m.count_kv_staging("kv_staging_batchez", "peer")
        except KeyError as exc:
            print("refused", exc)
    """, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:4] == ["80000", "800000", "80000", "80000"]
    assert "refused" in done.stdout and "kv_staging_batchez" in done.stdout


@pytest.mark.timeout(400)
def test_the_plugin_in_a_real_scheduler_role_reports_its_patches(tmp_path):
    """sglang's load_plugins(), then the real ACT-SCHED hook on Scheduler.__init__
    (its verification and metrics decision run before the scheduler's own body,
    which needs a GPU and fails here on purpose)."""
    done = run_python("""
        import json
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from types import SimpleNamespace
        from sglang.srt.managers.scheduler import Scheduler
        from sglang_dsv41 import metrics as m
        from sglang_dsv41.launch_guards.rules import GuardAction, GuardVerdict, REPLAY_UNDER_DP_ATTENTION
        from sglang_dsv41.launch_guards.verdict import VERDICT_ATTRIBUTE
        # Only what the hook reads (the flag, and the verdict the launcher's guard
        # leaves on the record); the scheduler body fails without a GPU.
        args = SimpleNamespace(enable_metrics=True)
        setattr(args, VERDICT_ATTRIBUTE,
                GuardVerdict(GuardAction.TURN_OFF_REPLAY, REPLAY_UNDER_DP_ATTENTION, "turned off"))
        try:
            Scheduler.__init__(object.__new__(Scheduler), args, None)
        except Exception:
            pass  # the BEFORE hook already ran
        m.flush()
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        print(json.dumps([l for l in generate_latest(registry).decode().splitlines()
                          if l.startswith(("sglang_dsv41_p", "sglang_dsv41_launch"))]))
    """, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = json.loads(done.stdout.strip().splitlines()[-1])
    from sglang_dsv41.plugin.spec import Role
    from sglang_dsv41.plugin.table import owed_to

    owed = len(owed_to(Role.SCHEDULER))
    assert f'sglang_dsv41_patches_applied{{role="scheduler"}} {float(owed)}' in lines
    assert f'sglang_dsv41_patches_owed{{role="scheduler"}} {float(owed)}' in lines
    assert 'sglang_dsv41_processes_verified_total{role="scheduler"} 1.0' in lines
    assert f'sglang_dsv41_launch_guard_active{{rule="{DP_RULE}"}} 1.0' in lines


def test_docs_metrics_is_generated_from_the_series():
    from conftest import REPO_ROOT
    from sglang_dsv41.metrics import SERIES, render_markdown

    text = (REPO_ROOT / "docs" / "METRICS.md").read_text()
    assert text == render_markdown(), (
        "docs/METRICS.md is stale: PYTHONPATH=python python -m "
        "sglang_dsv41.metrics > docs/METRICS.md")
    for series in SERIES:
        assert series.exported_name.startswith("sglang_dsv41_") and series.exported_name in text
