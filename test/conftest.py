"""Shared test helpers. Tests import the real sglang 0.5.23; only hardware is mocked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"
# Helpers shared across feature folders; a folder's own helpers are its _*.py.
sys.path.insert(0, str(HELPERS))


def run_python(code: str, *, env: dict | None = None, timeout: float = 240,
               cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this venv (plugins load once per process)."""
    full_env = dict(os.environ)
    full_env.pop("SGLANG_PLUGINS", None)
    full_env.pop("SGLANG_DSV41_ALLOW_DRIFT", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def python_subprocess():
    return run_python
