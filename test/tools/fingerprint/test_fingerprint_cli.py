"""`sglang-dsv41 fingerprint` through its real console entry: ids honoured, JSON, no writes outside a checkout."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(240)

SCHEMA = json.loads(resources.files("sglang_dsv41").joinpath("data/schemas/fingerprint.schema.json").read_text())


def _cli(*argv: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("SGLANG_PLUGINS", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "sglang_dsv41.tools.cli", "fingerprint", *argv],
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
    from sglang_dsv41.plugin.table import PATCHES
    from sglang_dsv41.plugin.internals import INTERNALS

    done = _cli("--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    jsonschema.validate(report, SCHEMA)
    assert report["sglang"] == "0.5.23" and report["drifted"] == 0
    assert [t["id"] for t in report["targets"]] == [p.id for p in PATCHES + INTERNALS]
    for row in report["targets"]:
        assert row["verdict"] == "same"
        assert row["found"] == row["expected"]


def _checkout_copy(tmp_path: Path) -> Path:
    checkout = tmp_path / "python"
    shutil.copytree(REPO_ROOT / "python", checkout,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return checkout


def test_json_of_a_drifted_and_a_missing_target_follows_the_schema_with_exit_1(tmp_path: Path):
    """A table whose ACT-SCHED hash is stale and whose ACT-TOKENIZER target is gone."""
    checkout = _checkout_copy(tmp_path)
    table = checkout / "sglang_dsv41" / "activation" / "patches.py"
    from sglang_dsv41.plugin.table import PATCHES

    by_id = {p.id: p for p in PATCHES}
    text = table.read_text()
    for patch_id, old, new in (
            ("ACT-SCHED", f'ast_sha="{by_id["ACT-SCHED"].ast_sha}"', 'ast_sha="0000000000000000"'),
            ("ACT-TOKENIZER", f'target="{by_id["ACT-TOKENIZER"].target}"',
             'target="sglang.srt.managers.tokenizer_manager.TokenizerManager.no_such_method"')):
        # The first occurrence after the entry's id: other entries share targets.
        head, entry = text.split(f'id="{patch_id}"', 1)
        assert old in entry.split("Patch(", 1)[0], (patch_id, old)
        text = head + f'id="{patch_id}"' + entry.replace(old, new, 1)
    table.write_text(text)
    done = _cli("--json", "ACT-SCHED", "ACT-TOKENIZER", pythonpath=str(checkout))
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    jsonschema.validate(report, SCHEMA)
    assert report["drifted"] == 2
    drifted, missing = report["targets"]
    assert (drifted["id"], drifted["verdict"]) == ("ACT-SCHED", "DRIFT")
    assert drifted["found"]["ast_sha"] == by_id["ACT-SCHED"].ast_sha != drifted["expected"]["ast_sha"]
    assert (missing["id"], missing["verdict"], missing["found"]) == ("ACT-TOKENIZER", "MISSING", None)
    assert "no_such_method" in missing["reason"]


def test_the_fingerprint_schema_rejects_what_a_consumer_could_not_use():
    report = json.loads(_cli("--json", "ACT-SCHED").stdout)
    jsonschema.validate(report, SCHEMA)
    for change in (lambda r: r.pop("targets"),
                   lambda r: r.update(drifted="0"),
                   lambda r: r["targets"][0].update(verdict="ok"),
                   lambda r: r["targets"][0].update(found=None),  # same, yet nothing found
                   lambda r: r["targets"][0].update(verdict="MISSING"),  # missing without a reason
                   lambda r: r["targets"][0]["expected"].pop("ast_sha")):
        candidate = copy.deepcopy(report)
        change(candidate)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(candidate, SCHEMA)


def test_update_refuses_an_installed_copy_and_leaves_it_unchanged(tmp_path: Path):
    site = tmp_path / "site-packages"
    shutil.copytree(REPO_ROOT / "python" / "sglang_dsv41", site / "sglang_dsv41",
                    ignore=shutil.ignore_patterns("__pycache__"))
    table = site / "sglang_dsv41" / "activation" / "patches.py"
    before = table.read_bytes()
    done = _cli("--update", pythonpath=str(site))
    assert done.returncode == 2
    assert "refusing to rewrite" in done.stderr and str(site / "sglang_dsv41") in done.stderr
    assert "Traceback" not in done.stderr
    assert table.read_bytes() == before


def test_update_of_one_id_in_the_checkout_rewrites_only_its_feature_entry(tmp_path: Path):
    from sglang_dsv41.plugin.table import by_id

    checkout = _checkout_copy(tmp_path)
    table = checkout / "sglang_dsv41" / "mooncake_nvlink" / "kv_staging" / "patches.py"
    before = table.read_bytes()
    done = _cli("--update", "MC-KVS-PAGES", pythonpath=str(checkout))
    assert done.returncode == 0, done.stderr
    assert "fingerprints of 1 patches" in done.stdout
    assert table.read_bytes() == before  # current: nothing to change
    good = f'ast_sha="{by_id()["MC-KVS-PAGES"].ast_sha}"'
    table.write_text(before.decode().replace(good, 'ast_sha="0000000000000000"', 1))
    done = _cli("--update", "MC-KVS-PAGES", pythonpath=str(checkout))
    assert done.returncode == 0, done.stderr
    assert table.read_bytes() == before  # the stale literal is rewritten in its feature's file
