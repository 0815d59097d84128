"""`patches-doc --write` and `settings-doc --write` onto paths they cannot use:
one line naming the path and why, exit 2, nothing written; through the
installed console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = str(Path(sys.executable).parent / "sglang-dsv41")


def write(command: str, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, command, "--write", str(target)], capture_output=True, text=True, timeout=60)


def _a_file(tmp: Path) -> Path:
    (tmp / "plain").write_text("x")
    return tmp / "plain" / "PATCHES.md"


def _a_folder(tmp: Path) -> Path:
    (tmp / "docs").mkdir()
    return tmp / "docs"


def _a_pipe(tmp: Path) -> Path:
    os.mkfifo(tmp / "pipe")  # reading or writing it would wait for the other end for ever
    return tmp / "pipe"


TARGETS = {
    "a missing folder": (lambda tmp: tmp / "no" / "such" / "PATCHES.md", "No such file or directory"),
    "a folder": (_a_folder, "Is a directory"),
    "below a file": (_a_file, "Not a directory"),
    "a pipe": (_a_pipe, "not a regular file"),
    "a device": (lambda tmp: Path("/dev/zero"), "not a regular file"),
}


@pytest.mark.parametrize("command", ["patches-doc", "settings-doc"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_a_path_the_writer_cannot_use_is_one_line_and_exit_2(tmp_path, command, name):
    make, why = TARGETS[name]
    target = make(tmp_path)
    proc = write(command, target)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{command}: cannot ") and str(target) in lines[0], lines
    assert why in lines[0], lines[0]


def test_settings_doc_refuses_a_readme_it_cannot_read(tmp_path):
    for content, why in ((b"# no table here\n", "it has no generated runtime-switches table"),
                         (b"\xff\xfe text", "codec can't decode byte 0xff")):
        readme = tmp_path / "README.md"
        readme.write_bytes(content)
        proc = write("settings-doc", readme)
        assert proc.returncode == 2 and why in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert readme.read_bytes() == content


def test_patches_doc_writes_where_it_can(tmp_path):
    target = tmp_path / "PATCHES.md"
    proc = write("patches-doc", target)
    assert proc.returncode == 0 and proc.stdout.strip() == f"wrote {target}"
    assert target.read_text().startswith("# Patches carried by sglang-dsv41")
