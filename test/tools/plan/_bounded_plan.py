"""`sglang-dsv41 plan` in a subprocess with a memory cap and a deadline.

For inputs that ask for gigabytes (expansion bombs, endless subprocess output):
when a bound regresses, the child meets the cap or the deadline and the test
fails in seconds, instead of the machine filling its memory.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

MEMORY_CAP_BYTES = 1 << 30  # the reader needs a few hundred MiB; an expansion needs far more
DEADLINE_S = 60


def plan_command() -> list[str]:
    script = Path(sys.executable).parent / "sglang-dsv41"
    return [str(script), "plan"] if script.exists() else [sys.executable, "-m", "sglang_dsv41.tools.cli", "plan"]


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP_BYTES, MEMORY_CAP_BYTES))


def run_plan_bounded(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """plan with ``args``; its whole process group is killed at the deadline (then returncode is None)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SGLANG_"))}
    environ.update(env or {})
    proc = subprocess.Popen(plan_command() + args, cwd=cwd, env=environ, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_cap_memory, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return subprocess.CompletedProcess(proc.args, code, out, err)


def one_line(done: subprocess.CompletedProcess) -> str:
    """The single line plan printed; fails with what it printed otherwise."""
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-2000:]
    assert len(lines) == 1, f"rc {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    return lines[0]
