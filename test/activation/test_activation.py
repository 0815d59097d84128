"""The plugin through real entry-point discovery, in fresh processes.

Each case starts a new interpreter because sglang loads plugins once per
process and HookRegistry.reset() does not un-patch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path


from conftest import run_python

CHECK_ALL_ROLES = """
import json, logging, os
logging.basicConfig(level=logging.INFO)
os.environ["SGLANG_HTTP_SERVER_APP_PATH"] = "my_company.app:asgi"
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_dsv41.plugin.verify import role_status, verify_role, PatchNotActive
from sglang_dsv41.plugin.spec import Role
out = {"app_paths": [os.environ["SGLANG_HTTP_SERVER_APP_PATH"],
                     os.environ.get("SGLANG_DSV41_INNER_APP_PATH")]}
for role in Role:
    applied, missing = role_status(role)
    out[role.value] = {"applied": [p.id for p in applied], "missing": [p.id for p in missing]}
import sglang.srt.arg_groups.deepseek_v4_hook as h
out["validator_wrapped"] = hasattr(h.validate_deepseek_v41_features, "__wrapped__")
if out["validator_wrapped"]:
    # The scheduler's first constructor logs the role status line.
    from sglang.srt.managers.scheduler import Scheduler
    try:
        Scheduler.__init__(object.__new__(Scheduler), None, None)
    except Exception as exc:  # the real constructor cannot run without a GPU
        out["scheduler_ctor"] = "failed after hook: " + type(exc).__name__
    # Undo one patch the way a later monkeypatch or a stale import would.
    h.validate_deepseek_v41_features = h.validate_deepseek_v41_features.__wrapped__
    try:
        verify_role(Role.LAUNCHER)
    except PatchNotActive as exc:
        out["refused"] = str(exc)
print("RESULT" + json.dumps(out))
"""


def _result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_entry_point_discovery_applies_every_patch_and_each_role_checks_it():
    from sglang_dsv41.plugin.spec import Role
    from sglang_dsv41.plugin.table import PATCHES, owed_to

    proc = run_python(CHECK_ALL_ROLES)
    out = _result(proc)
    for role in Role:
        assert out[role.value]["missing"] == [], role
    applied = {pid for role in Role for pid in out[role.value]["applied"]}
    assert applied == {p.id for p in PATCHES}
    assert out["validator_wrapped"] is True
    # Status line from the scheduler's constructor hook.
    n = len(owed_to(Role.SCHEDULER))
    assert out["scheduler_ctor"].startswith("failed after hook")
    assert "role=scheduler pid=" in proc.stderr
    assert f"patches applied={n}/{n} owed" in proc.stderr
    # A patch removed after load is caught by the launcher's verification.
    assert "VCP-ARGS" in out["refused"] and "role=launcher" in out["refused"]
    # A custom worker app is kept behind ours.
    assert out["app_paths"] == ["sglang_dsv41.worker_app:app", "my_company.app:asgi"]


def test_sglang_plugins_filter_excluding_ours_leaves_stock_code():
    out = _result(run_python(CHECK_ALL_ROLES, env={"SGLANG_PLUGINS": "someone_else"}))
    assert out["validator_wrapped"] is False
    assert out["launcher"]["applied"] == []
    assert "VCP-ARGS" in out["launcher"]["missing"]
    assert out["app_paths"] == ["my_company.app:asgi", None]


def _shadow_sglang(tmp_path: Path) -> Path:
    """A copy of the installed sglang package (symlinks) that can be edited per file."""
    from sglang_dsv41.plugin.fingerprint import package_root

    shadow = tmp_path / "shadow"
    shadow.mkdir()
    subprocess.run(["cp", "-rs", str(package_root()), str(shadow / "sglang")], check=True)
    return shadow


def _edit_upstream_file(shadow: Path, rel: str, old: str, new: str) -> None:
    path = shadow / "sglang" / rel
    text = path.read_text()
    assert old in text
    path.unlink()  # drop the symlink, write a real edited file
    path.write_text(text.replace(old, new, 1))


def test_a_patch_that_cannot_register_stops_loading_without_the_drift_hint():
    """ALLOW_DRIFT cannot let a registration failure pass: the refusal does not offer it."""
    code = ("from sglang.srt.managers.schedule_policy import PrefillAdder\n"
            "PrefillAdder.can_share_extend_batch = lambda self: None  # upstream grew the name\n"
            "from sglang.srt.plugins import load_plugins\nload_plugins()\nprint('LOADED')")
    proc = run_python(code)
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert "EMB-CAN-SHARE" in proc.stderr and "adding ours would shadow it" in proc.stderr
    assert "ALLOW_DRIFT" not in proc.stderr


def test_edited_upstream_target_stops_loading_and_names_the_patch(tmp_path):
    shadow = _shadow_sglang(tmp_path)
    _edit_upstream_file(
        shadow,
        "srt/arg_groups/deepseek_v4_hook.py",
        '"--enable-encoder-swa-bounded-replay requires DeepSeek-V4.1"',
        '"--enable-encoder-swa-bounded-replay needs DeepSeek-V4.1"',
    )
    code = "from sglang.srt.plugins import load_plugins\nload_plugins()\nprint('LOADED')"
    env = {"PYTHONPATH": str(shadow)}
    proc = run_python(code, env=env)
    assert proc.returncode != 0
    assert "LOADED" not in proc.stdout
    assert "VCP-ARGS" in proc.stderr
    assert "sglang.srt.arg_groups.deepseek_v4_hook.validate_deepseek_v41_features" in proc.stderr
    assert "source drifted" in proc.stderr
    assert "set SGLANG_DSV41_ALLOW_DRIFT=1 to run anyway" in proc.stderr  # drift can be let pass
    # Only the edited target is reported.
    assert "ACT-SCHED" not in proc.stderr

    allowed = run_python(code, env={**env, "SGLANG_DSV41_ALLOW_DRIFT": "1"})
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "LOADED" in allowed.stdout
    assert allowed.stderr.count("DRIFT ALLOWED") == 1
    assert "VCP-ARGS" in allowed.stderr


def test_other_sglang_version_stops_loading(tmp_path):
    shadow = _shadow_sglang(tmp_path)
    from importlib.metadata import distribution

    dist_info = Path(distribution("sglang")._path)  # noqa: SLF001 - the installed record
    fake = shadow / "sglang-0.5.24.dist-info"
    shutil.copytree(dist_info, fake)
    meta = (fake / "METADATA").read_text().replace("Version: 0.5.23", "Version: 0.5.24", 1)
    (fake / "METADATA").write_text(meta)
    proc = run_python(
        "from sglang.srt.plugins import load_plugins\nload_plugins()\nprint('LOADED')",
        env={"PYTHONPATH": str(shadow)},
    )
    assert proc.returncode != 0
    assert "sglang 0.5.24 is installed" in proc.stderr
    assert "sglang==0.5.23" in proc.stderr


WORKER = """
import logging, os, sys
logging.basicConfig(level=logging.INFO)
from uvicorn.importer import import_from_string
import_from_string(os.environ["SGLANG_HTTP_SERVER_APP_PATH"])  # what the HTTP server does
import sglang.srt.plugins as plugins
print("PLUGINS_LOADED", plugins._plugins_loaded)
from sglang.srt.managers.multi_tokenizer_mixin import TokenizerWorker
try:
    TokenizerWorker.__init__(object.__new__(TokenizerWorker), None, None)
except Exception as exc:
    print("CTOR-FAILED-AFTER-HOOK", type(exc).__name__)
"""


def test_multi_tokenizer_worker_app_path_activates_the_plugin():
    # The launcher sets this (checked in the entry-point test above).
    from sglang_dsv41.loader import WORKER_APP_PATH as app_path

    # A worker started with that environment, as granian/uvicorn start it.
    worker = run_python(WORKER, env={"SGLANG_HTTP_SERVER_APP_PATH": app_path})
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert "PLUGINS_LOADED True" in worker.stdout
    assert "CTOR-FAILED-AFTER-HOOK" in worker.stdout
    assert "role=tokenizer_worker" in worker.stderr
    assert "NOT ACTIVE" not in worker.stderr

    # Stock app path: the worker never loads plugins (the gap being closed).
    stock = run_python(
        WORKER, env={"SGLANG_HTTP_SERVER_APP_PATH": "sglang.srt.entrypoints.http_server:app"}
    )
    assert stock.returncode == 0, stock.stderr[-3000:]
    assert "PLUGINS_LOADED False" in stock.stdout
    assert "role=tokenizer_worker" not in stock.stderr
