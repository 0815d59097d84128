"""`sglang-dsv41 --version` and `doctor --json`, run as an operator runs them."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO_ROOT, run_python
from sglang_dsv41.plugin.table import PATCHES

CLI = str(Path(sys.executable).parent / "sglang-dsv41")
pytestmark = pytest.mark.timeout(400)


def schema(name: str) -> dict:
    return json.loads(resources.files("sglang_dsv41").joinpath(f"data/schemas/{name}").read_text())


def test_version_names_the_package_the_pin_and_the_installed_sglang():
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    proc = subprocess.run([CLI, "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    declared = tomllib.loads((REPO_ROOT / "python" / "pyproject.toml").read_text())["project"]
    from importlib.metadata import version

    assert proc.stdout.strip() == (
        f"sglang-dsv41 {declared['version']} (pinned sglang==0.5.23; "
        f"installed sglang {version('sglang')})"
    )
    assert proc.stderr == ""


# doctor imports sglang (its plugin machinery); one interpreter runs every variant.
DOCTOR_VARIANTS = """
import contextlib, io, json, os
from sglang_dsv41.tools.cli import main
out = {}
for name, argv, plugins in (("json", ["doctor", "--json"], None), ("text", ["doctor"], None),
                            ("json_filtered", ["doctor", "--json"], "another_plugin"),
                            ("text_filtered", ["doctor"], "another_plugin")):
    if plugins: os.environ["SGLANG_PLUGINS"] = plugins
    else: os.environ.pop("SGLANG_PLUGINS", None)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = main(argv)
    out[name] = {"rc": rc, "stdout": buffer.getvalue()}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def doctor_runs():
    proc = run_python(DOCTOR_VARIANTS, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_doctor_json_follows_its_schema_and_covers_every_patch(doctor_runs):
    run = doctor_runs["json"]
    assert run["rc"] == 0
    report = json.loads(run["stdout"])  # nothing but the JSON document on stdout
    jsonschema.validate(report, schema("doctor.schema.json"))
    assert report["ok"] is True and report["installed_sglang"] == "0.5.23"
    patch_findings = [f for f in report["findings"] if f["check"] == "patch"]
    assert sorted(f["patch_id"] for f in patch_findings) == sorted(p.id for p in PATCHES)
    assert all(f["status"] == "ok" for f in report["findings"])


def test_doctor_text_and_json_are_the_same_findings(doctor_runs):
    report = json.loads(doctor_runs["json"]["stdout"])
    verdict = {"ok": "ok  ", "fail": "FAIL", "warn": "warn"}
    expected = [f"[{verdict[f['status']]}] {f['message']}" for f in report["findings"]]
    assert doctor_runs["text"]["stdout"].splitlines() == expected + ["doctor: all checks passed"]


def test_doctor_json_reports_a_problem_with_exit_1(doctor_runs):
    run = doctor_runs["json_filtered"]
    assert run["rc"] == 1 and doctor_runs["text_filtered"]["rc"] == 1
    report = json.loads(run["stdout"])
    jsonschema.validate(report, schema("doctor.schema.json"))
    assert report["ok"] is False
    failed = [f for f in report["findings"] if f["status"] == "fail"]
    assert [f["check"] for f in failed] == ["plugin-filter"]
    assert "filters out dsv41" in failed[0]["message"]


def test_the_doctor_schema_rejects_what_a_consumer_could_not_use(doctor_runs):
    report = json.loads(doctor_runs["json"]["stdout"])
    doctor_schema = schema("doctor.schema.json")
    broken = []
    for change in (lambda r: r.pop("findings"),
                   lambda r: r["findings"][0].update(status="passed"),
                   lambda r: r.update(ok="yes"),
                   lambda r: next(f for f in r["findings"] if f["check"] == "patch").update(patch_id=None)):
        candidate = copy.deepcopy(report)
        change(candidate)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(candidate, doctor_schema)
        broken.append(candidate)
    assert len(broken) == 4


def test_check_jsonschema_accepts_the_report(doctor_runs, tmp_path):
    """The same check a CI job would run with the check-jsonschema tool."""
    report = tmp_path / "doctor.json"
    report.write_text(doctor_runs["json"]["stdout"])
    schema_path = resources.files("sglang_dsv41").joinpath("data/schemas/doctor.schema.json")
    tool = str(Path(sys.executable).parent / "check-jsonschema")
    proc = subprocess.run([tool, "--schemafile", str(schema_path), str(report)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
