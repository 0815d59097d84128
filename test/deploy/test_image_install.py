"""The image's install step, on the CPU machine (no Docker engine here).

The Dockerfiles build a wheel of python/ and run docker/install-plugin.sh in
the upstream sglang image. Here the same script runs in a fresh virtual
environment that already has sglang 0.5.23 (this venv's packages, made visible
through a .pth file, without this package's editable install) and the same
wheel; pip is forbidden to reach an index, so nothing can be downloaded or
re-resolved. The script must install only sglang-dsv41 and end with a passing
`sglang-dsv41 doctor`; a base missing one of the plugin's requirements must
fail the build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "docker" / "install-plugin.sh"
MAIN_SITE = Path(sysconfig.get_paths()["purelib"])


def _run(argv, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=env)


def _overlay(target: Path, leave_out: tuple[str, ...]) -> Path:
    """This venv's site-packages as symlinks, minus this package and ``leave_out``."""
    target.mkdir()
    for entry in MAIN_SITE.iterdir():
        name = entry.name.lower()
        if "sglang_dsv41" in name or "sglang-dsv41" in name or name.startswith(leave_out):
            continue
        (target / entry.name).symlink_to(entry)
    return target


@pytest.fixture(scope="module")
def image_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("image")
    # What the Dockerfile's wheel stage COPYs: python/.
    src = root / "src"
    src.mkdir()
    shutil.copytree(REPO_ROOT / "python", src / "python",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    wheels = root / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "--wheel-dir", wheels, src / "python"])
    assert built.returncode == 0, built.stdout + built.stderr
    shutil.copy(SCRIPT, wheels / SCRIPT.name)

    venv = root / "venv"
    # No pip of its own: the base's pip (seen through the .pth) installs into this venv.
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site_dir = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return {"root": root, "wheels": wheels, "python": python, "site": site_dir, "env": env}


def _use_base(ctx, overlay: Path) -> None:
    # addsitedir also runs the .pth files of the base, as in the real image.
    (ctx["site"] / "zz_sglang_base.pth").write_text(f"import site; site.addsitedir({str(overlay)!r})\n")


def _own_packages(ctx) -> set[str]:
    listing = _run([ctx["python"], "-m", "pip", "list", "--format=freeze", "--path", ctx["site"]], env=ctx["env"])
    return {line.split("==")[0].lower() for line in listing.stdout.split()}


def _older_sglang(overlay: Path) -> None:
    """Make the base report sglang 0.5.22 (its metadata only)."""
    dist = next(overlay.glob("sglang-0.5.23.dist-info"))
    fake = overlay / "sglang-0.5.22.dist-info"
    shutil.copytree(dist.resolve(), fake)
    dist.unlink()
    metadata = fake / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.5.23", "Version: 0.5.22", 1))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("base, expected", [
    ("without-msgspec", "msgspec"),
    ("older-sglang", "sglang 0.5.22 does not satisfy 'sglang==0.5.23'"),
])
def test_install_step_fails_when_the_base_does_not_fit(image_env, base, expected):
    ctx = image_env
    overlay = _overlay(ctx["root"] / f"base-{base}", ("msgspec",) if base == "without-msgspec" else ())
    if base == "older-sglang":
        _older_sglang(overlay)
    _use_base(ctx, overlay)
    result = _run(["sh", ctx["wheels"] / SCRIPT.name, ctx["wheels"]], env={**ctx["env"], "PLUGIN_DEPS": "resolve"})
    assert result.returncode != 0
    assert expected in result.stdout + result.stderr
    assert "doctor" not in result.stdout  # the build stops before doctor


@pytest.mark.timeout(420)
def test_install_step_adds_only_the_plugin_and_doctor_passes(image_env):
    ctx = image_env
    _use_base(ctx, _overlay(ctx["root"] / "base", ()))
    _run([ctx["python"], "-m", "pip", "uninstall", "-y", "sglang-dsv41"], env=ctx["env"])
    before = _own_packages(ctx)
    assert "sglang-dsv41" not in before
    probe = _run([ctx["python"], "-c", "import importlib.metadata as m; print(m.version('sglang'))"], env=ctx["env"])
    assert probe.stdout.strip() == "0.5.23", probe.stderr

    result = _run(["sh", ctx["wheels"] / SCRIPT.name, ctx["wheels"]], env={**ctx["env"], "PLUGIN_DEPS": "resolve"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "plugin requirements all present in the base" in result.stdout
    assert "doctor: all checks passed" in result.stdout
    assert _own_packages(ctx) - before == {"sglang-dsv41"}

    where = _run([ctx["python"], "-c", "import sglang_dsv41, sglang; print(sglang_dsv41.__file__); print(sglang.__file__)"],
                 env=ctx["env"])
    ours, theirs = where.stdout.split()
    assert ours.startswith(str(ctx["site"])), "the wheel, not the editable checkout, must be imported"
    assert theirs.startswith(str(ctx["root"] / "base"))
