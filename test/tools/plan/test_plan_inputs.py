"""Bad and unusual inputs through the real `sglang-dsv41 plan` command line.

Each case writes its files into a fresh directory, runs the installed console
script in a subprocess with a timeout (a hang fails the test) and expects one
line naming the file (and the service) with the reason, and the exit status:
2 for input plan cannot read, 1 for problems found. All of these are decided
before sglang is imported, which the test checks through Python's import
trace, so they stay fast.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _bounded_plan import run_plan_bounded
from _plan_input_cases import CASES, Case
from sglang_dsv41.tools.plan.compose import MAX_TOTAL_CHARS

TIMEOUT_S = 45
_SGLANG_IMPORT = re.compile(r"\|\s*sglang(\.\S+)?\s*$")


def _plan_command() -> list[str]:
    """The built-in reader's messages are what these cases expect (test_compose_differential
    puts the same cases through Docker Compose)."""
    script = Path(sys.executable).parent / "sglang-dsv41"
    command = [str(script), "plan"] if script.exists() else [sys.executable, "-m", "sglang_dsv41.tools.cli", "plan"]
    return command + ["--reader", "builtin"]


def run_plan(tmp_path: Path, case: Case) -> subprocess.CompletedProcess:
    for name, content in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SGLANG_"))}
    env.update(case.env)
    env["PYTHONPROFILEIMPORTTIME"] = "1"
    # fd 0 closed in the child only, after subprocess has set up its pipes
    stdin = {"preexec_fn": lambda: os.close(0)} if case.stdin_closed else {"input": case.stdin or b""}
    return subprocess.run(_plan_command() + case.args, cwd=tmp_path, env=env, **stdin,
                          capture_output=True, timeout=TIMEOUT_S)


@pytest.mark.timeout(TIMEOUT_S + 15)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_one_line_and_the_right_status(tmp_path, name):
    case = CASES[name]
    proc = run_plan(tmp_path, case)
    out = proc.stdout.decode("utf-8", "replace")
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == case.rc, f"rc {proc.returncode}:\n{out}\n{err[-2000:]}"
    assert "Traceback" not in out + err
    lines = [ln for ln in out.splitlines() if ln.strip()]
    hits = [ln for ln in lines if case.message in ln]
    assert hits, f"{case.message!r} not on any line of:\n{out}"
    if case.rc == 2:
        assert lines == hits, f"an input error is exactly one line:\n{out}"
        assert hits[0].startswith("plan: ")
    # Decided before sglang is imported: bad input fails fast.
    imported = [ln for ln in err.splitlines() if _SGLANG_IMPORT.search(ln)]
    assert not imported, f"sglang was imported for this case: {imported[:3]}"


@pytest.mark.timeout(TIMEOUT_S + 15)
def test_stdin_from_a_terminal_is_refused_instead_of_waiting(tmp_path):
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(_plan_command() + ["--from-compose-config", "-"], cwd=tmp_path, stdin=follower,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.strip() == ("plan: cannot read --from-compose-config -: stdin is a terminal; "
                                   "pipe `docker compose config` into it")


def _compose_with_script(script: str, environment: str = "{}") -> str:
    # $$ is compose's escape: the shell gets $A
    return ("services:\n  s:\n    image: img\n    network_mode: host\n"
            f"    environment: {environment}\n    command: [sh, -c, '{script}']\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compose", [
    # forty doublings of a shell variable in a 500-byte file: ten terabytes
    _compose_with_script("A=xxxxxxxxxx; " + "A=$$A$$A; " * 40 + "sglang serve --model-path /m"),
    # one long value, many times over
    _compose_with_script("sglang serve --model-path /m --served-model-name " + "$$X" * 20_000,
                         "{X: '" + "x" * 60_000 + "'}"),
], ids=["doubling variable", "repeated long value"])
def test_a_script_that_expands_to_gigabytes_is_one_problem_in_bounded_memory(tmp_path, compose):
    (tmp_path / "c.yml").write_text(compose)
    done = run_plan_bounded(["--reader", "builtin", "c.yml"], tmp_path)
    assert done.returncode == 1, f"rc {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stdout + done.stderr
    problems = [ln.strip() for ln in done.stdout.splitlines() if ln.strip().startswith("ERROR")]
    assert problems == ["ERROR c.yml/s: its command is a shell script plan cannot follow (its variables "
                        f"expand past {MAX_TOTAL_CHARS} characters); write the sglang command as the service's "
                        "command (a list) so plan can check it"], done.stdout
