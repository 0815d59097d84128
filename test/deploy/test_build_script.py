"""deploy/b300-build/build.sh: tags, and the fast path that skips the plugin's
dependency resolution while python/pyproject.toml and the base image are those of
the last successful build. No Docker engine here: a stand-in `docker` records
its arguments (and can fail), everything else is the real script on a real git
checkout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "deploy" / "b300-build" / "build.sh"

FAKE_DOCKER = """#!/bin/sh
echo "$*" >> "$DOCKER_LOG"
if [ "$1" = build ] && [ -n "$DOCKER_FAIL" ]; then exit 1; fi
exit 0
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "repo"
    (repo / "deploy" / "b300-build").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "deploy" / "b300-build" / "build.sh")
    (repo / "python").mkdir()
    shutil.copy(REPO_ROOT / "python" / "pyproject.toml", repo / "python" / "pyproject.toml")
    _git(repo, "init", "-q", "-b", "release/2.0")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "init")
    docker = tmp_path / "docker"
    docker.write_text(FAKE_DOCKER)
    docker.chmod(0o755)
    env = {**os.environ, "DOCKER": str(docker), "DOCKER_LOG": str(tmp_path / "docker.log"),
           "BUILD_STATE_DIR": str(tmp_path / "state")}
    for name in ("FULL", "BASE_IMAGE", "IMAGE_REPO", "PIP_INDEX_URL", "DOCKER_FAIL"):
        env.pop(name, None)
    return repo, env, tmp_path / "docker.log"


def _build(repo: Path, env: dict, log: Path, *args: str, **extra) -> tuple[subprocess.CompletedProcess, list[str]]:
    log.write_text("")
    result = subprocess.run(["bash", str(repo / "deploy" / "b300-build" / "build.sh"), *args], cwd=repo / "python",
                            env={**env, **extra}, capture_output=True, text=True, timeout=60)
    return result, log.read_text().splitlines()


def _plugin_deps(calls: list[str]) -> str:
    build = next(c for c in calls if c.startswith("build "))
    return re.search(r"PLUGIN_DEPS=(\w+)", build).group(1)


def test_fast_path_only_while_pyproject_and_base_are_unchanged(checkout):
    repo, env, log = checkout
    result, calls = _build(repo, env, log)
    assert result.returncode == 0, result.stderr
    assert _plugin_deps(calls) == "resolve"  # nothing remembered yet

    result, calls = _build(repo, env, log)
    assert _plugin_deps(calls) == "skip" and "fast path" in result.stdout

    assert _plugin_deps(_build(repo, env, log, FULL="1")[1]) == "resolve"
    assert _plugin_deps(_build(repo, env, log, BASE_IMAGE="mirror.example/sglang:v0.5.23")[1]) == "resolve"
    assert _plugin_deps(_build(repo, env, log)[1]) == "resolve"  # back to the default base: changed again
    assert _plugin_deps(_build(repo, env, log)[1]) == "skip"

    pyproject = repo / "python" / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"pyyaml",', '"pyyaml",\n    "rich",'))
    # A failed build is not remembered: the next one resolves again.
    result, calls = _build(repo, env, log, DOCKER_FAIL="1")
    assert result.returncode != 0
    assert _plugin_deps(calls) == "resolve"
    assert not any(c.startswith("tag ") for c in calls)
    assert _plugin_deps(_build(repo, env, log)[1]) == "resolve"
    assert _plugin_deps(_build(repo, env, log)[1]) == "skip"


def test_tags_and_build_arguments(checkout):
    repo, env, log = checkout
    result, calls = _build(repo, env, log, IMAGE_REPO="team/sglang-dsv41", PIP_INDEX_URL="https://mirror.example/simple")
    assert result.returncode == 0, result.stderr
    sha9 = _git(repo, "rev-parse", "--short=9", "HEAD")
    build = next(c for c in calls if c.startswith("build "))
    tag = re.search(r"-t (\S+)", build).group(1)
    assert re.fullmatch(rf"team/sglang-dsv41:release-2\.0-{sha9}-local-\d{{8}}-\d{{4}}", tag), tag
    assert "-f docker/Dockerfile" in build
    assert "--build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.23" in build
    assert "--build-arg PIP_INDEX_URL=https://mirror.example/simple" in build
    assert calls[-1] == f"tag {tag} team/sglang-dsv41:release-2.0-latest-local"
    explicit = _build(repo, env, log, "registry.example/ds41:mine", IMAGE_REPO="x")[1]
    assert "-t registry.example/ds41:mine ." in explicit[0]
    assert explicit[-1] == "tag registry.example/ds41:mine x:release-2.0-latest-local"


def test_no_personal_paths():
    text = SCRIPT.read_text()
    assert not re.search(r"/data/|/home/|ymk|D:\\\\", text)
