"""Candidate sglang trees for upgrade-check tests: real copies of the installed 0.5.23
files that the patch table and the pinned internals name, laid out as an sglang
package in a temporary folder, then edited the way a new release would edit them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from sglang_dsv41.plugin import fingerprint as fp
from sglang_dsv41.plugin.table import PATCHES
from sglang_dsv41.plugin.internals import INTERNALS

CLI = str(Path(sys.executable).parent / "sglang-dsv41")


def needed_files() -> set[str]:
    """The files of the installed sglang that fingerprints read, plus every
    package __init__.py on their way and the version file."""
    installed = fp.installed_tree()
    files = {"sglang/__init__.py", "sglang/_version.py"}
    for item in PATCHES + INTERNALS:
        rel, _ = fp.locate(item.fingerprint_target, installed)
        files.add(rel)
        parts = rel.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            init = "/".join(parts[:depth]) + "/__init__.py"
            if installed.text(init) is not None:
                files.add(init)
    return files


def copy_installed(dest: Path) -> Path:
    """A folder holding an ``sglang`` package made of real 0.5.23 files."""
    root = fp.installed_tree().root
    for rel in sorted(needed_files()):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, target)
    return dest


def edit(root: Path, rel: str, old: str, new: str) -> None:
    """Replace one exact occurrence of ``old`` in a copied file."""
    path = root / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {rel}"
    path.write_text(text.replace(old, new))


def append(root: Path, rel: str, lines: str) -> None:
    path = root / rel
    path.write_text(path.read_text() + "\n" + lines + "\n")


def zip_as_wheel(root: Path, wheel: Path) -> Path:
    with zipfile.ZipFile(wheel, "w") as z:
        for path in sorted((root / "sglang").rglob("*.py")):
            z.write(path, path.relative_to(root).as_posix())
    return wheel


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([CLI, "upgrade-check", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def status_lines(stdout: str) -> dict[str, str]:
    """patch id -> its report line."""
    out = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in ("same", "DRIFT", "GONE"):
            out[words[1]] = line.strip()
    return out
