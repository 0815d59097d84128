"""The scheduled upgrade canary: a valid Gitea workflow that runs upgrade-check
against the newest sglang and publishes its report, with no repository variables."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO_ROOT

WORKFLOW = REPO_ROOT / ".gitea" / "workflows" / "upgrade-canary.yaml"


def _actionlint() -> str:
    path = Path(sys.executable).parent / "actionlint"
    found = str(path) if path.exists() else shutil.which("actionlint")
    assert found, "actionlint is not installed (make setup installs it with the test extra)"
    return found


def test_canary_passes_actionlint():
    result = subprocess.run([_actionlint(), "-no-color", str(WORKFLOW)], capture_output=True,
                            text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_canary_runs_upgrade_check_on_a_schedule_and_reports_it():
    text = WORKFLOW.read_text()
    flow = yaml.safe_load(text)
    triggers = flow[True] if True in flow else flow["on"]  # YAML 1.1 reads `on` as True
    assert triggers["schedule"][0]["cron"]
    assert "workflow_dispatch" in triggers
    assert "vars." not in text and "secrets." not in text
    steps = flow["jobs"]["upgrade-check"]["steps"]
    script = "\n".join(s.get("run", "") for s in steps)
    assert "sglang-dsv41 upgrade-check --pinned \"$pinned\" latest" in script
    assert 'exit "$rc"' in script  # a drift fails the job
    assert '>> "$GITHUB_STEP_SUMMARY"' in script
    assert "--no-deps -e python" in script  # upgrade-check needs no sglang install
