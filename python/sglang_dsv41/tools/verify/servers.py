"""Start a side's processes, wait until they answer, stop them through their process groups.

Each process gets a session (so a process group) of its own and one log file;
stopping sends SIGTERM to the group, then SIGKILL to what is left after a
grace, and waits until no live member remains. ``RUNNING`` holds every process
started and not yet stopped, so an interrupt stops them all. The module-level
steps (``start_in_own_group``, ``wait_for_health``, ``stop_process_group``) are
also the e2e tests' server harness.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

from sglang_dsv41.tools.verify.plan import CONTROLLED_ENV, Proc

RUNNING: list = []
STARTED: list = []  # every process started in this run
STOP_GRACE_S = 60


def progress(message: str) -> None:
    print(f"verify: {message}", file=sys.stderr, flush=True)


def live_group_members(pgid: int) -> list[int]:
    """PIDs of the group that are not zombies (a container's init may never reap them)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def start_in_own_group(argv, env: dict, log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start ``argv`` in a session (so a process group) of its own, stdin closed, all output in ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


class ExitedBeforeHealthy(Exception):
    def __init__(self, returncode: int):
        super().__init__(f"exited with {returncode}")
        self.returncode = returncode


def wait_for_health(popen: subprocess.Popen, url: str, timeout: float, *,
                    still_waiting: Callable[[], None] | None = None) -> bool:
    """Poll ``url`` every 2 s: True once it answers 200, False when ``timeout`` passes first.

    Raises ``ExitedBeforeHealthy`` when the process ends first; ``still_waiting``
    is called after each further 30 s without an answer.
    """
    deadline = time.monotonic() + timeout
    told = time.monotonic()
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise ExitedBeforeHealthy(popen.returncode)
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return True
        except OSError:  # not listening yet, or an error status
            pass
        if still_waiting is not None and time.monotonic() - told >= 30:
            told = time.monotonic()
            still_waiting()
        time.sleep(2)
    return False


def stop_process_group(popen: subprocess.Popen, signals) -> None:
    """Send each ``(signal, grace_s)`` to ``popen``'s group in turn until no live member is left,
    then reap ``popen`` (10 s at most)."""
    pgid = popen.pid  # start_new_session: the group is the launched process's own
    for sig, grace in signals:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            popen.poll()  # reap the launcher
            if not live_group_members(pgid):
                break
            time.sleep(0.5)
        if not live_group_members(pgid):
            break
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class ServerFailed(Exception):
    pass


class Started:
    def __init__(self, proc: Proc, log_dir: Path):
        self.proc = proc
        self.log_path = log_dir / f"{proc.name}.log"
        self.popen: subprocess.Popen | None = None
        self.started_at = 0.0
        self.healthy_after_s: float | None = None

    def start(self) -> "Started":
        env = {k: v for k, v in os.environ.items() if k not in CONTROLLED_ENV}
        env.update(self.proc.env, PYTHONUNBUFFERED="1")
        self.started_at = time.monotonic()
        self.popen = start_in_own_group(self.proc.argv, env, self.log_path)
        RUNNING.append(self)
        STARTED.append(self)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> None:
        def still_waiting() -> None:
            progress(f"still waiting for {self.proc.name} ({time.monotonic() - self.started_at:.0f} s, "
                     f"log {self.log_path})")

        try:
            healthy = wait_for_health(self.popen, f"http://127.0.0.1:{self.proc.port}/health", timeout,
                                      still_waiting=still_waiting)
        except ExitedBeforeHealthy as exited:
            tail = " | ".join(self.log().strip().splitlines()[-3:])[-600:]
            raise ServerFailed(f"{self.proc.name} exited with {exited.returncode} before "
                               f"/health answered (log {self.log_path}): {tail}") from None
        if not healthy:
            raise ServerFailed(f"{self.proc.name}: /health did not answer within {timeout:.0f} s "
                               f"(log {self.log_path})")
        self.healthy_after_s = time.monotonic() - self.started_at
        progress(f"{self.proc.name} is up after {self.healthy_after_s:.0f} s")

    def stop(self) -> None:
        if self.popen is None:
            return
        stop_process_group(self.popen, ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)))
        if self in RUNNING:
            RUNNING.remove(self)


def stop_all() -> int:
    """Stop what still runs; how many processes this run started in all."""
    for started in reversed(list(RUNNING)):
        started.stop()
    return len(STARTED)
