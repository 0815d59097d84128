"""Start a side's processes, wait until they answer, stop them through their process groups.

Each process gets a session (so a process group) of its own and one log file;
stopping sends SIGTERM to the group, then SIGKILL to what is left after a
grace, and waits until no live member remains. ``RUNNING`` holds every process
started and not yet stopped, so an interrupt stops them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
        with open(self.log_path, "wb") as log:
            self.started_at = time.monotonic()
            self.popen = subprocess.Popen(self.proc.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        RUNNING.append(self)
        STARTED.append(self)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> None:
        url = f"http://127.0.0.1:{self.proc.port}/health"
        deadline = time.monotonic() + timeout
        told = time.monotonic()
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                tail = " | ".join(self.log().strip().splitlines()[-3:])[-600:]
                raise ServerFailed(f"{self.proc.name} exited with {self.popen.returncode} before "
                                   f"/health answered (log {self.log_path}): {tail}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        self.healthy_after_s = time.monotonic() - self.started_at
                        progress(f"{self.proc.name} is up after {self.healthy_after_s:.0f} s")
                        return
            except OSError:
                pass
            if time.monotonic() - told >= 30:
                told = time.monotonic()
                progress(f"still waiting for {self.proc.name} ({told - self.started_at:.0f} s, "
                         f"log {self.log_path})")
            time.sleep(2)
        raise ServerFailed(f"{self.proc.name}: /health did not answer within {timeout:.0f} s "
                           f"(log {self.log_path})")

    def stop(self) -> None:
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session: the group is the launcher's own
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline:
                self.popen.poll()
                if not live_group_members(pgid):
                    break
                time.sleep(0.5)
            if not live_group_members(pgid):
                break
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self in RUNNING:
            RUNNING.remove(self)


def stop_all() -> int:
    """Stop what still runs; how many processes this run started in all."""
    for started in reversed(list(RUNNING)):
        started.stop()
    return len(STARTED)
