"""A real ``sglang serve`` with ``--enable-metrics``: ``/metrics`` carries what the launcher decided.

The launcher exports nothing itself (sglang imports ``prometheus_client`` there
before it sets the multiprocess directory). The launch guard's verdict and the
launcher's patch count travel to the scheduler on the pickled server arguments
and reach ``/metrics`` from there; ``sglang-dsv41 smoke`` reads both.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import requests

from _e2e_server import Server, start_healthy, tiny_model  # noqa: F401
from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.table import owed_to

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
PATCH_SERIES = re.compile(r'^sglang_dsv41_(patches_applied|patches_owed)\{role="launcher"\} (\S+)$')


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = Server(tiny_model, tmp_path_factory.mktemp("launcher-metrics"), metrics=True)
    start_healthy(srv)
    yield srv
    srv.stop()


def test_metrics_carry_the_guards_verdict_and_the_launchers_patch_count(server):
    text = requests.get(server.base + "/metrics", timeout=60).text
    launcher = {m.group(1): float(m.group(2)) for m in map(PATCH_SERIES.match, text.splitlines()) if m}
    owed = len(owed_to(Role.LAUNCHER))
    assert launcher == {"patches_applied": owed, "patches_owed": owed}, text[-3000:]
    # The count the launcher's own status line gives.
    assert "role=launcher pid=" in server.log() and f"patches applied={owed}/{owed} owed" in server.log()
    # No known-crash rule applies to this tiny single-CPU layout.
    guard = [line for line in text.splitlines() if line.startswith("sglang_dsv41_launch_guard_active{")]
    assert guard == ['sglang_dsv41_launch_guard_active{rule="none"} 1.0'], guard


def test_smoke_reads_the_launcher_and_the_guard(server):
    done = subprocess.run(
        [sys.executable, "-m", "sglang_dsv41.tools.cli", "smoke", "--json", "--timeout", "300", server.base],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (checked,) = json.loads(done.stdout)["servers"]
    metrics = next(c for c in checked["checks"] if c["check"] == "metrics")
    owed = len(owed_to(Role.LAUNCHER))
    assert metrics["status"] == "ok", metrics
    assert f"launcher {owed}/{owed}" in metrics["detail"] and "launch guard: none" in metrics["detail"], metrics
