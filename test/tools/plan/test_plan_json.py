"""`sglang-dsv41 plan --json` through the real console entry: one schema-checked document on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources

import jsonschema
import pytest

from conftest import REPO_ROOT

BAD = REPO_ROOT / "test" / "tools" / "plan" / "bad"
SCHEMA = json.loads(resources.files("sglang_dsv41").joinpath("data/schemas/plan.schema.json").read_text())


def _plan_json(*argv: str, timeout: float = 600) -> tuple[int, dict, str]:
    env = dict(os.environ)
    env.pop("SGLANG_PLUGINS", None)
    env.update(IMAGE="registry.invalid/sglang-dsv41:test", MODEL_PATH="/data/models/DeepSeek-V4.1-Flash",
               SGLANG_CACHE_DIR="/data/cache/sglang")
    done = subprocess.run([sys.executable, "-m", "sglang_dsv41.tools.cli", "plan", "--json", *argv],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO_ROOT)
    document = json.loads(done.stdout)  # nothing but the document on stdout
    jsonschema.validate(document, SCHEMA)
    return done.returncode, document, done.stderr


@pytest.mark.timeout(120)
def test_unreadable_input_is_an_error_document(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_bytes(b"services: [\xff\xfe")
    rc, document, _ = _plan_json(str(broken))
    assert rc == 2 == document["exit_code"]
    assert document["verdict"] == "error" and "broken.yml" in document["error"]
    assert document["servers"] == [] and document["problems"] == []


@pytest.mark.timeout(900)
def test_resolved_servers_and_grouped_gpu_conflicts():
    rc, document, stderr = _plan_json(str(BAD / "gpu-overlap.yml"))
    assert rc == 1 == document["exit_code"] and document["verdict"] == "problems"
    servers = {s["service"]: s for s in document["servers"]}
    assert set(servers) == {"gpu-overlap.yml/a", "gpu-overlap.yml/b"}, servers
    assert servers["gpu-overlap.yml/a"]["gpus"] == ["0", "1"]
    assert servers["gpu-overlap.yml/b"]["layout"]["tp_size"] == 2
    assert servers["gpu-overlap.yml/b"]["launch_guard"] == "no known-crash rule applies"
    assert servers["gpu-overlap.yml/b"]["prefill_cuda_graph"] == "disabled"
    assert document["problems"] == [
        {"service": "gpu-overlap.yml/b", "reason": "GPU 1 is also used by gpu-overlap.yml/a (host local)"}]
    # Progress goes to stderr; sglang's import noise goes nowhere.
    assert "loading sglang" in stderr and "UserWarning" not in stderr


def test_gpu_ranges_are_compact():
    from sglang_dsv41.tools.plan.cli import gpu_ranges

    assert gpu_ranges(("0", "1", "2", "3", "6")) == "0-3,6"
    assert gpu_ranges(("4",)) == "4"
    assert gpu_ranges(("GPU-abc", "GPU-def")) == "GPU-abc,GPU-def"
    assert gpu_ranges(()) == "?"


@pytest.mark.timeout(900)
def test_text_output_ends_with_one_table_row_per_server():
    env = dict(os.environ)
    env.pop("SGLANG_PLUGINS", None)
    env.update(IMAGE="registry.invalid/sglang-dsv41:test", MODEL_PATH="/data/models/DeepSeek-V4.1-Flash",
               SGLANG_CACHE_DIR="/data/cache/sglang")
    done = subprocess.run([sys.executable, "-m", "sglang_dsv41.tools.cli", "plan", str(BAD / "gpu-overlap.yml")],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    header = next(n for n, line in enumerate(lines) if line.startswith("server "))
    assert lines[header].split() == ["server", "host", "GPUs", "port", "layout", "PD", "DSpark",
                                     "prefill", "graph", "launch", "guard"]
    rows = [line.split() for line in lines[header + 1:header + 3]]
    assert [r[:4] for r in rows] == [["gpu-overlap.yml/a", "local", "0-1", "30010"],
                                     ["gpu-overlap.yml/b", "local", "1-2", "30020"]]
    assert all(r[-1] == "-" for r in rows)
