"""`sglang-dsv41 fingerprint` through its real console entry: ids honoured, JSON, no writes outside a checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(240)


def _cli(*argv: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("SGLANG_PLUGINS", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "sglang_dsv41.cli", "fingerprint", *argv],
                          capture_output=True, text=True, env=env, timeout=200)


def test_an_id_selects_only_that_target():
    done = _cli("ACT-SCHED")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ACT-SCHED: same ")


def test_an_unknown_id_is_one_line_and_exit_2():
    done = _cli("ACT-SCHED", "NO-SUCH-PATCH")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "NO-SUCH-PATCH" in done.stderr and "Traceback" not in done.stderr


def test_json_lists_every_patch_and_internal_with_a_verdict():
    from sglang_dsv41.patch_table import PATCHES
    from sglang_dsv41.pinned_internals import INTERNALS

    done = _cli("--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["sglang"] == "0.5.23" and report["drifted"] == 0
    assert [t["id"] for t in report["targets"]] == [p.id for p in PATCHES + INTERNALS]
    for row in report["targets"]:
        assert row["verdict"] == "same"
        assert row["found"] == row["expected"]


def test_update_refuses_an_installed_copy_and_leaves_it_unchanged(tmp_path: Path):
    site = tmp_path / "site-packages"
    shutil.copytree(REPO_ROOT / "python" / "sglang_dsv41", site / "sglang_dsv41",
                    ignore=shutil.ignore_patterns("__pycache__"))
    table = site / "sglang_dsv41" / "patch_table.py"
    before = table.read_bytes()
    done = _cli("--update", pythonpath=str(site))
    assert done.returncode == 2
    assert "refusing to rewrite" in done.stderr and str(table) in done.stderr
    assert "Traceback" not in done.stderr
    assert table.read_bytes() == before


def test_update_of_one_id_in_the_checkout_is_allowed_and_changes_nothing_when_current(tmp_path: Path):
    checkout = tmp_path / "python"
    shutil.copytree(REPO_ROOT / "python", checkout,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    table = checkout / "sglang_dsv41" / "patch_table.py"
    before = table.read_bytes()
    done = _cli("--update", "ACT-SCHED", pythonpath=str(checkout))
    assert done.returncode == 0, done.stderr
    assert str(table) in done.stdout
    assert table.read_bytes() == before
