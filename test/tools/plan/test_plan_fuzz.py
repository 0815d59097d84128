"""Property tests of plan's compose reader: whatever the input, it returns a
project or raises its own error type (ComposeError) with a one-line message;
never another exception, a hang or unbounded growth. The checks that run
before sglang is imported (what each service is, compose's own rules) are held
to the same standard, and so is the shell-script reader.

Pure code: the reader is called directly and sglang is never imported here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_dsv41.tools.plan.compose import ComposeError, load_compose_config, load_project
from sglang_dsv41.tools.plan.commands import ShellRefused, unwrap
from sglang_dsv41.tools.plan.checks import (
    PlanOptions,
    check_projects,
    classify_services,
    sglang_serve_args,
)

# PLAN_FUZZ_EXAMPLES=5000 for a deeper run than CI's.
EXAMPLES = int(os.environ.get("PLAN_FUZZ_EXAMPLES", "250"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

SERVICE_KEYS = ["image", "command", "entrypoint", "environment", "env_file", "ports", "volumes", "deploy",
                "gpus", "labels", "depends_on", "healthcheck", "network_mode", "container_name", "extends",
                "profiles", "pid", "ipc", "extra_hosts", "resources", "reservations", "devices", "device_ids",
                "count", "driver", "capabilities", "published", "target", "source", "type", "test", "service",
                "file", "path", "required", "condition", "<<"]
WORDS = ["all", "host", "gpu", "nvidia", "bind", "${X}", "${X:-d}", "${X:?no}", "$$", "$", "8080:80",
         "127.0.0.1:1-3:1-3/udp", "/x:/y:ro", "./rel:/y", "sglang serve --tp 2", "mooncake_master",
         "python3 -m sglang_router.launch_router --port 1", "0,1", "service:a", "a", "b", "-1", "70000",
         "sh -c 'sglang serve $(x)'", "SGLANG_PLUGINS=x", "CUDA_VISIBLE_DEVICES=9", "NVIDIA_VISIBLE_DEVICES"]

scalars = (st.none() | st.booleans() | st.integers(-3, 70_000) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | st.sampled_from(WORDS))
keys = st.sampled_from(SERVICE_KEYS) | st.sampled_from(["a", "b", "x-y"]) | st.integers(0, 3)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(keys, inner, max_size=5), max_leaves=25)
service_bodies = st.dictionaries(st.sampled_from(SERVICE_KEYS), values, max_size=7) | values
service_names = st.sampled_from(["a", "b", "c", "bad name", "1"])
documents = st.fixed_dictionaries(
    {"services": st.dictionaries(service_names, service_bodies, max_size=4) | values},
    optional={"name": values, "include": values, "x-anchor": values, "profiles": values},
)
yaml_text = st.text(alphabet=st.sampled_from(list("ab: -[]{}&*!|>'\"#\n\t,?%@`$\\") + ["\x00", "\ufeff", "é"]),
                    max_size=200)


def _pre_resolution(project) -> None:
    """What plan runs on a project before sglang: must not raise either."""
    classified = classify_services(project.services)
    check_projects([project], classified.services, PlanOptions())


def _read(text: str | bytes, reader) -> str | None:
    """The reader's one-line error for this input, or None when it read it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "compose.yml"
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
        (Path(tmp) / "a.env").write_text("A=1\n")
        try:
            project = reader(path)
        except ComposeError as exc:
            message = str(exc)
            assert message and "\n" not in message and len(message) <= 500
            return message
        _pre_resolution(project)
        return None


def _compose(path: Path):
    return load_project(path, environ={"X": "x"}, profiles=None)


def _compose_all_profiles(path: Path):
    return load_project(path, environ={}, profiles=["*"])


def _config(path: Path):
    return load_compose_config(str(path))


@FUZZ
@given(documents)
def test_any_compose_structure_reads_or_raises_compose_error(document):
    text = yaml.safe_dump(document, allow_unicode=True)
    _read(text, _compose)
    _read(text, _compose_all_profiles)
    _read(text, _config)


field_values = scalars | st.lists(scalars, max_size=3) | st.dictionaries(keys, scalars, max_size=3) | values


@settings(max_examples=EXAMPLES * 2, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(SERVICE_KEYS[:19]), field_values, st.sampled_from(SERVICE_KEYS[:19]), field_values)
def test_any_value_of_any_service_field(field, value, other_field, other_value):
    body = {"image": "x", other_field: other_value, field: value}
    text = yaml.safe_dump({"name": "p", "services": {"a": body, "b": {"image": "y"}}}, allow_unicode=True)
    _read(text, _compose)
    _read(text, _config)


@FUZZ
@given(yaml_text)
def test_any_text_reads_or_raises_compose_error(text):
    _read(text, _compose)
    _read("services:\n  a:\n    " + text.replace("\n", "\n    "), _compose)


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_read_or_raise_compose_error(data):
    _read(data, _compose)
    _read(b"services:\n  a: {image: '" + data + b"'}\n", _config)


@FUZZ
@given(st.lists(st.sampled_from(list("-$&|;<>()'\"`\\{}#=AB \n12:")
                                + ["sglang ", "serve ", "exec ", "env ", "export ", "${A}", "$B", "2>&1", "-u "]),
                max_size=30).map("".join))
def test_any_shell_script_is_followed_or_refused(script):
    for argv in (["sh", "-c", script], ["bash", "-lc", script], ["env", *script.split()]):
        try:
            result = unwrap(argv, {"A": "1"}, lambda words: sglang_serve_args(words) is not None)
        except ShellRefused as exc:
            assert str(exc) and "\n" not in str(exc)
            continue
        assert all(isinstance(w, str) for w in result.argv)


@pytest.mark.timeout(60)
def test_alias_bomb_is_refused_quickly():
    levels = ["l0: &l0 [" + ", ".join(["lol"] * 10) + "]"]
    levels += [f"l{n}: &l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]" for n in range(1, 12)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bomb.yml"
        path.write_text("\n".join(levels) + "\nservices: {}\n")
        with pytest.raises(ComposeError, match="an alias bomb"):
            load_project(path, environ={})
        # Merge keys expand too.
        merge = ["b0: &b0 {k0: 1, k1: 2, k2: 3, k3: 4, k4: 5, k5: 6, k6: 7, k7: 8, k8: 9, k9: 0}"]
        merge += [f"b{n}: &b{n} [" + ", ".join([f"*b{n - 1}"] * 10) + "]" for n in range(1, 8)]
        path.write_text("\n".join(merge) + "\nservices: {}\n")
        with pytest.raises(ComposeError, match="an alias bomb"):
            load_project(path, environ={})


def _big_inputs() -> dict[str, str]:
    many = 90_000
    return {
        # extends merges two long lists (compose appends the new items).
        "long lists merged by extends": "services:\n  base: {image: x, dns: [" + ",".join(f"a{n}" for n in range(50_000))
        + "]}\n  top: {extends: base, dns: [" + ",".join(f"b{n}" for n in range(50_000)) + "]}\n",
        # Port ranges: each one is 60000 ports.
        "many port ranges": "services:\n" + "".join(
            f"  s{n}: {{image: x, ports: ['1000-61000:1000-61000']}}\n" for n in range(40)),
        # A command of a hundred thousand assignments in front of the program.
        "long env prefix": "services:\n  a: {image: x, command: [env, " + ",".join(f"'A{n}=1'" for n in range(many))
        + ", sglang, serve]}\n",
        "long shell script": "services:\n  a:\n    image: x\n    command: [sh, -c, '" + "echo a; " * 7_000
        + "sglang serve --tp 2']\n",
        "many services": "services:\n" + "".join(f"  s{n}: {{image: x, depends_on: [s{max(n - 1, 0)}]}}\n"
                                                 for n in range(1, 20_000)) + "  s0: {image: x}\n",
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(_big_inputs()))
def test_large_inputs_stay_bounded(name):
    """Inputs near the size limits are read (or refused) in seconds, not hours."""
    import time

    started = time.monotonic()
    error = _read(_big_inputs()[name], _compose)
    assert time.monotonic() - started < 60
    if name == "many port ranges":  # 2.4 million published ports: refused, not built
        assert error and "the files publish more than 262144 ports in all" in error
    else:
        assert error is None, error


def test_reader_and_pre_resolution_checks_do_not_import_sglang():
    code = ("import sys; import sglang_dsv41.tools.plan.compose, sglang_dsv41.tools.plan.checks, "
            "sglang_dsv41.tools.plan.commands; "
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
