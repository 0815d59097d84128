"""`sglang-dsv41 doctor` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sglang_dsv41.plugin.table import PATCHES

DOCTOR = [str(Path(sys.executable).parent / "sglang-dsv41"), "doctor"]


def _run(extra_env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "SGLANG_PLATFORM")}
    env.update(extra_env or {})
    return subprocess.run(DOCTOR, env=env, capture_output=True, text=True, timeout=300)


def test_doctor_passes_on_this_install_with_one_line_per_patch():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "sglang 0.5.23 matches the pin" in lines[0]
    for p in PATCHES:
        assert sum(p.id in l and l.startswith("[ok  ]") for l in lines) == 1, p.id
    assert "entry point dsv41" in proc.stdout
    assert lines[-1] == "doctor: all checks passed"


def test_doctor_fails_when_sglang_plugins_filters_us_out():
    proc = _run({"SGLANG_PLUGINS": "another_plugin"})
    assert proc.returncode == 1
    assert "filters out dsv41" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "doctor: PROBLEMS FOUND"


def test_doctor_checks_kv_staging_settings_when_they_are_set():
    import json

    import jsonschema
    from importlib import resources

    off = _run()
    assert "kv-staging" not in off.stdout and "KV_STAGING" not in off.stdout
    bad = _run({"SGLANG_DSV41_KV_STAGING": "peer", "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS": "big"})
    assert bad.returncode == 1
    assert "[FAIL] SGLANG_DSV41_KV_STAGING_MIN_BLOCKS='big' is not an integer" in bad.stdout
    removed = _run({"SGLANG_DSV41_KV_STAGING": "1"})
    assert removed.returncode == 1 and "[FAIL] SGLANG_DSV41_KV_STAGING=1 (slot staging) was removed" in removed.stdout
    on = subprocess.run(DOCTOR + ["--json"], capture_output=True, text=True, timeout=300,
                        env={**{k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"},
                             "SGLANG_DSV41_KV_STAGING": "peer", "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS": "4"})
    report = json.loads(on.stdout)
    jsonschema.validate(report, json.loads(resources.files("sglang_dsv41").joinpath(
        "data/schemas/doctor.schema.json").read_text()))
    staging = [f for f in report["findings"] if f["check"] == "kv-staging"]
    assert len(staging) == 1 and staging[0]["status"] == "ok"  # triton ships with sglang
    assert "sends of 4+ device blocks" in staging[0]["message"]
    peer = _run({"SGLANG_DSV41_KV_STAGING": "peer"})
    assert peer.returncode == 0 and "SGLANG_DSV41_KV_STAGING=peer: KV and state sends of 8+ device blocks" in peer.stdout
    assert "compiled and probed at every access width" in peer.stdout
    wrong = _run({"SGLANG_DSV41_KV_STAGING": "peers"})
    assert wrong.returncode == 1 and "'peers': use peer (peer writes) or 0 / unset (off)" in wrong.stdout


def test_a_platform_no_plugin_provides_is_a_finding_not_a_traceback():
    # sglang picks its platform while its plugin machinery imports: nothing could start
    proc = _run({"SGLANG_PLATFORM": "no_such_platform"})
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout.splitlines()[-1] == "doctor: PROBLEMS FOUND"
    (fail,) = [line for line in proc.stdout.splitlines() if line.startswith("[FAIL]")]
    assert "sglang's plugin machinery does not import here" in fail and "no_such_platform" in fail
