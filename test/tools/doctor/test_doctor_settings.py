"""doctor and the runtime agree on every setting of the registry.

Each name in ``plugin/settings.py`` SETTINGS has a row here: invalid samples
that doctor must fail and the runtime must refuse (checked both ways: doctor
through its own findings, the runtime in a fresh interpreter through the code
that reads the setting when the server starts: the CP graph's check at plugin
load, the owner-broadcast hook at a vision model's build, KV staging's reader),
or the reason no value of it is invalid. A setting added to the registry
without a row fails here until it gets one. One doctor run through the CLI
shows the failures reach its output and exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dsv41.cp_bcg.setting import CP_BCG_ENV
from sglang_dsv41.mooncake_nvlink.kv_staging.setting import STAGING_ENV
from sglang_dsv41.owner_broadcast.routing import ENV_MIN_SAVING, ENV_MODE, ENV_PER_IMAGE_COST
from sglang_dsv41.plugin.settings import SETTINGS
from sglang_dsv41.tools.doctor import setting_findings

pytestmark = pytest.mark.timeout(600)

# name -> (invalid samples, what else the sample needs set, which runtime reader refuses it)
INVALID = {
    CP_BCG_ENV: (["yes", "true", "2", "on", "1 1", "１"], {}, "plugin-load"),
    ENV_MODE: (["sometimes", "2", "auto,guarded", "off!"], {}, "model-build"),
    ENV_PER_IMAGE_COST: (["lots", "-1", "1.5", "nan", "inf", "1e3"], {}, "model-build"),
    ENV_MIN_SAVING: (["lots", "-5", "0x10", "nan"], {}, "model-build"),
    STAGING_ENV: (["peers", "2", "yes", "1"], {}, "kv-staging"),  # 1: slot staging, removed
    "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS": (["big", "-1", "nan", "0"], {STAGING_ENV: "peer"}, "kv-staging"),
    # removed with slot staging: any value set is refused, staging on or off
    "SGLANG_DSV41_KV_STAGING_SLOTS": (["8", "big"], {}, "kv-staging"),
    "SGLANG_DSV41_KV_STAGING_SLOT_MB": (["32"], {STAGING_ENV: "peer"}, "kv-staging"),
    "SGLANG_DSV41_KV_STAGING_ACK_TIMEOUT_S": (["30"], {}, "kv-staging"),
}
NO_INVALID_VALUE = {
    "SGLANG_DSV41_ALLOW_DRIFT": "only `1` allows drift; any other value keeps the refusal at load (fail closed)",
    "MC_INTRANODE_NVLINK": "Mooncake's own flag, read (set or not), never parsed by this package",
    "MC_INTRA_NVLINK": "Mooncake's own flag, read (set or not), never parsed by this package",
    "MOONCAKE_PROTOCOL": "Mooncake's own; any protocol but the NVLink ones leaves the package's paths off",
    "SGLANG_PLUGINS": "sglang's own filter: doctor fails a list without dsv41 (test_doctor.py)",
    # Not "every value valid": read only by the launch guard, for a DSpark server under the CP
    # graph opt-in (test_launch_guards.py); doctor reads it with the guard's own function.
    "SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED": "read by the launch guard only (dspark_verification_problem)",
}
REGISTERED = [name for setting in SETTINGS for name in setting.names]
CASES = [(name, sample) for name in REGISTERED if name in INVALID for sample in INVALID[name][0]]


def test_every_registered_setting_has_a_row():
    missing = [name for name in REGISTERED if name not in INVALID and name not in NO_INVALID_VALUE]
    assert not missing, (f"settings without a row here: {missing}. Give doctor a finding that reads each with "
                         "the runtime's own parser (tools/doctor.py) and add its invalid samples to INVALID, "
                         "or say in NO_INVALID_VALUE why every value is valid")


@pytest.fixture
def doctor_verdict(monkeypatch):
    """doctor's failing setting lines for an environment of only these settings."""
    def verdict(environ: dict[str, str]) -> list[str]:
        for key in [k for k in os.environ if k.startswith("SGLANG_DSV41_")]:
            monkeypatch.delenv(key)
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
        return [f.message for f in setting_findings() if f.status == "fail"]
    return verdict


@pytest.mark.parametrize("name, sample", CASES, ids=[f"{n}={s}" for n, s in CASES])
def test_doctor_fails_each_invalid_sample(doctor_verdict, name, sample):
    failures = doctor_verdict({**INVALID[name][1], name: sample})
    assert len(failures) == 1 and name in failures[0], failures


RUNTIME = r"""
import importlib, json, os, sys
cases = json.loads(sys.argv[1])

class VisionModel:  # what the owner-broadcast hook reads of DeepseekV4ForCausalLM at its build
    vision = object()

def refused(name, sample, extra, reader):
    os.environ.update(extra)
    os.environ[name] = sample
    try:
        if reader == "plugin-load":  # the CP graph module checks the setting as it is imported
            sys.modules.pop("sglang_dsv41.cp_bcg.rules", None)
            importlib.import_module("sglang_dsv41.cp_bcg.rules")
        elif reader == "model-build":
            from sglang_dsv41.owner_broadcast.hooks import after_model_init
            after_model_init(None, VisionModel())
        else:
            from sglang_dsv41.mooncake_nvlink.kv_staging.setting import staging_config
            staging_config()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        for key in (name, *extra):
            os.environ.pop(key, None)
    return None

print("RUNTIME " + json.dumps({f"{n}={s}": refused(n, s, extra, reader) for n, s, extra, reader in cases}))
"""


@pytest.fixture(scope="module")
def runtime_refusals():
    cases = [(name, sample, INVALID[name][1], INVALID[name][2]) for name, sample in CASES]
    proc = subprocess.run([sys.executable, "-c", RUNTIME, json.dumps(cases)], capture_output=True, text=True,
                          timeout=400, env={k: v for k, v in os.environ.items() if not k.startswith("SGLANG_DSV41_")})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RUNTIME ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0][len("RUNTIME "):])


@pytest.mark.parametrize("name, sample", CASES, ids=[f"{n}={s}" for n, s in CASES])
def test_the_runtime_refuses_each_invalid_sample(runtime_refusals, name, sample):
    refusal = runtime_refusals[f"{name}={sample}"]
    assert refusal is not None, f"the runtime took {name}={sample!r}, which doctor fails"
    assert name in refusal and refusal.startswith(("ValueError", "StagingConfigError")), refusal


def test_valid_values_pass_doctor(doctor_verdict):
    for environ in ({CP_BCG_ENV: "1"}, {CP_BCG_ENV: " 0 "}, {ENV_MODE: "always", ENV_PER_IMAGE_COST: "0"},
                    {ENV_MODE: "0", ENV_MIN_SAVING: "lots"}, {ENV_MIN_SAVING: "100"}):
        assert doctor_verdict(environ) == [], environ
        ok = [f for f in setting_findings() if f.status == "ok"]
        assert len(ok) == 1, environ


def test_the_cli_fails_every_bad_setting_in_one_line_each():
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "SGLANG_PLATFORM")
           and not k.startswith("SGLANG_DSV41_")}
    env.update({CP_BCG_ENV: "yes", ENV_MODE: "sometimes"})
    proc = subprocess.run([str(Path(sys.executable).parent / "sglang-dsv41"), "doctor"], env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert f"[FAIL] {CP_BCG_ENV} must be 0 or 1 (unset means 0), got 'yes': the server would stop at plugin load" \
        in lines
    assert (f"[FAIL] {ENV_MODE}='sometimes': expected 0, 1, auto, guarded or always: a vision model's build "
            "would stop") in lines
    assert lines[-1] == "doctor: PROBLEMS FOUND"
