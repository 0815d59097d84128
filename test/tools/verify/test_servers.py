"""The process steps verify and the e2e harness share: start in a group of its own, wait
for /health, stop the whole group (children that ignore SIGTERM included)."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from sglang_dsv41.tools.verify.servers import (
    ExitedBeforeHealthy,
    live_group_members,
    start_in_own_group,
    stop_process_group,
    wait_for_health,
)

# A parent and a child that both ignore SIGTERM: only the SIGKILL round can end the group.
STUBBORN = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(\"child up\", flush=True); time.sleep(600)']); "
            "time.sleep(600)")


def _wait_for_line(path, text, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path}: {path.read_text()!r}")


def test_a_group_that_ignores_sigterm_is_killed_whole_and_the_launcher_reaped(tmp_path):
    log = tmp_path / "stubborn.log"
    popen = start_in_own_group([sys.executable, "-c", STUBBORN], {}, log, cwd=tmp_path)
    _wait_for_line(log, "child up")
    assert len(live_group_members(popen.pid)) == 2
    stop_process_group(popen, ((signal.SIGTERM, 1), (signal.SIGKILL, 10)))
    assert live_group_members(popen.pid) == []
    assert popen.returncode == -signal.SIGKILL


def test_the_wait_names_an_exit_before_health_and_says_when_time_ran_out(tmp_path):
    exits = start_in_own_group([sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "exits.log")
    with pytest.raises(ExitedBeforeHealthy) as raised:
        wait_for_health(exits, "http://127.0.0.1:9/health", timeout=30)
    assert raised.value.returncode == 3

    silent = start_in_own_group([sys.executable, "-c", "import time; time.sleep(600)"], {}, tmp_path / "s.log")
    try:
        assert wait_for_health(silent, "http://127.0.0.1:9/health", timeout=1) is False
    finally:
        stop_process_group(silent, ((signal.SIGKILL, 10),))


def test_the_wait_returns_once_health_answers_200_and_logs_go_to_the_file(tmp_path):
    (tmp_path / "health").write_text("ok")
    port_file = tmp_path / "port"
    serve = ("import http.server, functools, sys; "
             "h = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1]); "
             "s = http.server.HTTPServer(('127.0.0.1', 0), h); "
             "open(sys.argv[2], 'w').write(str(s.server_port)); print('serving', flush=True); s.serve_forever()")
    log = tmp_path / "server.log"
    popen = start_in_own_group([sys.executable, "-c", serve, str(tmp_path), str(port_file)], {}, log)
    try:
        _wait_for_line(log, "serving")
        assert wait_for_health(popen, f"http://127.0.0.1:{port_file.read_text()}/health", timeout=30) is True
        assert "GET /health" in log.read_text()  # stderr lands in the same log
    finally:
        stop_process_group(popen, ((signal.SIGTERM, 10), (signal.SIGKILL, 10)))
