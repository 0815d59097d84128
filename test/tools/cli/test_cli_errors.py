"""`sglang-dsv41` itself: what no command handles still ends in one line, never a traceback.

Through the installed console script, as a user runs it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CLI = str(Path(sys.executable).parent / "sglang-dsv41")
TOO_LONG = "a" * 300  # past the 255 bytes a file name may have


@pytest.mark.parametrize("args", [
    ["smoke", TOO_LONG],
    ["upgrade-check", TOO_LONG],
    ["plan", TOO_LONG],
])
def test_an_os_error_no_command_expects_is_one_line_and_exit_2(args):
    done = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    out = (done.stdout + done.stderr).strip().splitlines()
    assert len(out) == 1 and "File name too long" in out[0] and "Traceback" not in done.stderr, out


def test_a_reader_that_goes_away_ends_the_command_quietly():
    # `| true`: the pipe is closed before the command writes its first line
    proc = subprocess.Popen([CLI, "fingerprint"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_a_full_stdout_is_one_line_on_stderr():
    with open("/dev/full", "w") as full:
        done = subprocess.run([CLI, "--version"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], lines
