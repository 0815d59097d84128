"""The Kubernetes manifest reader on its own (no sglang): what a RoleBasedGroup's pods run,
where they are addressed, what they get, and one line for what it cannot read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _bounded_plan import one_line, run_plan_bounded
from conftest import REPO_ROOT
from sglang_dsv41.tools.plan.compose import ComposeError
from sglang_dsv41.tools.plan.k8s import is_manifest, load_manifests

K8S = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())


def _rbg(roles: str, api: str = "workloads.x-k8s.io/v1alpha2", kind: str = "RoleBasedGroup") -> str:
    return textwrap.dedent(f"""\
        apiVersion: {api}
        kind: {kind}
        metadata: {{name: g}}
        spec:
          roles:
        """) + textwrap.indent(textwrap.dedent(roles), "    ")


ROLES = """\
- name: prefill
  replicas: 2
  standalonePattern:
    template:
      spec:
        containers:
          - name: s
            command: [sglang, serve, --tp, "$(TP)", --port, "30010", --dist-init-addr, "$(RBG_LWP_LEADER_ADDRESS):5000"]
            env: [{name: TP, value: "4"}, {name: CUDA_VISIBLE_DEVICES, value: "1,3"}]
            resources: {limits: {nvidia.com/gpu: 4}}
- name: router
  dependencies: [prefill]
  standalonePattern:
    template:
      spec:
        containers: [{name: r, command: [python3, -m, sglang_router.launch_router]}]
"""


def test_the_shipped_overlays_are_what_plan_reads():
    assert OVERLAYS == ["cp-instances", "pd-1node", "pd-2node"]
    for name in OVERLAYS:
        assert is_manifest(K8S / "overlays" / name)
        project = load_manifests(K8S / "overlays" / name)
        assert project.services, name


def test_the_common_flags_are_the_compose_topologies_own():
    assert (K8S / "base" / "sglang-common.yaml").read_text() == \
        (REPO_ROOT / "deploy" / "b300-ds41" / "base" / "sglang-common.yaml").read_text()

def _deployment(container: str, pod: str = "") -> str:
    """A one-container Deployment running sglang serve; ``container``/``pod``: extra YAML
    lines of the container and of the pod spec, each starting with a newline."""
    return ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  template:\n"
            "    spec:\n      containers:\n        - name: s\n"
            + container.replace("\n", "\n          ") + pod.replace("\n", "\n      ") + "\n")


def _config_mounted(name: str, data: str = "{a.yaml: 'x: 1'}") -> str:
    """A ConfigMap and a Deployment that mounts it as files."""
    return (f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: '{name}'}}\ndata: {data}\n---\n"
            + _deployment("\ncommand: [sglang, serve, --model-path, /m]"
                          "\nvolumeMounts: [{name: v, mountPath: /etc/x}]",
                          f"\nvolumes: [{{name: v, configMap: {{name: '{name}'}}}}]"))


def test_a_config_map_with_a_dotted_key_is_mounted(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(_config_mounted("sglang.common", data="{.hidden: a, 1: b, sglang-common.yaml: c}"))
    pod = load_manifests(path).services[0]
    assert pod.host_path("/etc/x/.hidden").read_text() == "a"
    assert pod.host_path("/etc/x/1").read_text() == "b"
    assert pod.host_path("/etc/x/sglang-common.yaml").read_text() == "c"


def test_a_config_map_name_never_writes_outside_plans_temp_dir(tmp_path):
    outside = tmp_path / "outside"  # an absolute name: joined to the temp dir, it would replace it
    (tmp_path / "m.yaml").write_text(_config_mounted(str(outside)))
    done = run_plan_bounded(["m.yaml"], tmp_path)
    line = one_line(done)
    assert done.returncode == 2 and line.startswith(f"plan: cannot read m.yaml: ConfigMap '{outside}': "
                                                    "metadata.name is not a Kubernetes object name"), line
    assert not outside.exists()


def _alias_bomb(levels: int = 9) -> str:
    """Ten-fold nested aliases: a few hundred bytes that load as 10**levels strings."""
    lines = ['  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  l{n}: &l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]" for n in range(1, levels + 1)]
    return "\n".join(lines)


def _env_from(data: str = "", env: str = "[]") -> str:
    """A ConfigMap and a Deployment that takes its environment from it."""
    return (f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c}}\ndata:\n{data or '  a: b'}\n---\n"
            + _deployment('\ncommand: [sglang, serve, --model-path, /m, --served-model-name, "$(A39)"]'
                          "\nenvFrom: [{configMapRef: {name: c}}]"
                          f"\nenv: {env}"))


DOUBLING_ENV = "[" + ", ".join(['{name: A0, value: "xxxxxxxxxx"}']
                               + [f'{{name: A{n}, value: "$(A{n - 1})$(A{n - 1})"}}' for n in range(1, 40)]) + "]"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text, reason", [
    # ~850 bytes that load as a billion strings in ConfigMap data envFrom reads
    (_env_from(data=_alias_bomb()), r"more than \d+ YAML nodes once aliases are expanded \(an alias bomb\?\)"),
    # each env entry doubles the one before it: forty of them are ten terabytes
    (_env_from(env=DOUBLING_ENV), r"pod d-0: env A\d+: \$\(VAR\) references expand past \d+ characters"),
], ids=["alias bomb", "doubling env"])
def test_a_manifest_that_expands_to_gigabytes_is_one_line_in_bounded_memory(tmp_path, text, reason):
    (tmp_path / "m.yaml").write_text(text)
    done = run_plan_bounded(["m.yaml"], tmp_path)
    line = one_line(done)
    assert done.returncode == 2 and re.fullmatch("plan: cannot read m.yaml: " + reason, line), line


@pytest.mark.timeout(120)
def test_kubectl_kustomize_output_is_capped(tmp_path):
    """A kustomization that renders without end (a generator gone wrong): refused, not read into memory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "kubectl"
    fake.write_text("#!/bin/sh\nexec yes 'apiVersion: v1'\n")
    fake.chmod(0o755)
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "kustomization.yaml").write_text("resources: []\n")
    done = run_plan_bounded(["k"], tmp_path, env={"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"})
    line = one_line(done)
    assert done.returncode == 2 and re.search(r": kubectl kustomize rendered more than \d+ KiB for it", line), line


# The prefill role's server container, and the path plan names its pod spec by.
SERVER_SPEC = "        containers:\n          - name: s\n"
SERVER_POD = "spec.roles[0].standalonePattern.template.spec"


def test_replicas_names_variables_gpus_and_dependencies(tmp_path):
    path = tmp_path / "rbg.yaml"
    path.write_text(_rbg(ROLES))
    project = load_manifests(path)
    pods = {s.name: s for s in project.services}
    assert sorted(pods) == ["prefill-0", "prefill-1", "router-0"]
    first = pods["prefill-0"]
    assert first.container_name == "g-prefill-0.s-g-prefill"  # the pod's DNS name in the group
    assert first.argv == ["sglang", "serve", "--tp", "4", "--port", "30010",
                          "--dist-init-addr", "g-prefill-0.s-g-prefill:5000"]
    assert first.gpu_reservation.visible == ("rbg.yaml/prefill-0#1", "rbg.yaml/prefill-0#3")
    assert first.gpu_reservation.count == 4
    assert pods["router-0"].depends_on == {"prefill-0": "service_healthy", "prefill-1": "service_healthy"}


def test_a_config_map_mounted_as_files_is_readable(tmp_path):
    project = load_manifests(K8S / "overlays" / "pd-1node")
    prefill = next(s for s in project.services if s.name == "prefill-0")
    config = prefill.host_path("/etc/sglang-dsv41/sglang-common.yaml")
    assert config is not None and "attention-backend: dsv4" in config.read_text()


@pytest.mark.parametrize("text, reason", [
    (_rbg(ROLES, kind="StatefulSet", api="apps/v1"), "StatefulSet g (apiVersion apps/v1) is not a kind plan reads"),
    (_rbg(ROLES, api="workloads.x-k8s.io/v1alpha1"), "RoleBasedGroup g (apiVersion workloads.x-k8s.io/v1alpha1)"),
    (_rbg(ROLES.replace("replicas: 2", "replicas: two")), "replicas must be a whole number"),
    (_rbg(ROLES.replace("dependencies: [prefill]", "dependencies: [decode]")), "depends on role decode"),
    (_rbg(ROLES.replace("nvidia.com/gpu: 4", "nvidia.com/gpu: 1")), "names a GPU the pod does not get"),
    # refused before anything is built per GPU (a list of 300 million ids would fill the memory)
    (_rbg(ROLES.replace("nvidia.com/gpu: 4", "nvidia.com/gpu: 300000000")), "is not a GPU count a pod can get"),
    (_rbg(ROLES.replace("standalonePattern", "customComponentsPattern", 1)), "exactly one of"),
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n", "no workload"),
    # a field of another type than the API's: named by its path, with the type it must have
    (_rbg(ROLES.replace(SERVER_SPEC, "        nodeSelector: [gpu-node-a]\n" + SERVER_SPEC)),
     f"RoleBasedGroup g: {SERVER_POD}.nodeSelector must be a mapping, not a list"),
    (_rbg(ROLES.replace(SERVER_SPEC, SERVER_SPEC + "            readinessProbe: {periodSeconds: 30s}\n")),
     f"{SERVER_POD}.containers[0].readinessProbe.periodSeconds must be a whole number, not a string ('30s')"),
    (_rbg(ROLES.replace('env: [{name: TP, value: "4"}, {name: CUDA_VISIBLE_DEVICES, value: "1,3"}]',
                        'env: {TP: "4"}')),
     f"{SERVER_POD}.containers[0].env must be a list, not a mapping"),
    (_rbg(ROLES.replace("nvidia.com/gpu: 4", "nvidia.com/gpu: 1.5")),
     f"{SERVER_POD}.containers[0].resources.limits.nvidia.com/gpu must be a whole number, not a number (1.5)"),
    (_rbg(ROLES.replace(SERVER_SPEC, "        hostIPC: 'yes'\n" + SERVER_SPEC)),
     f"{SERVER_POD}.hostIPC must be true or false, not a string ('yes')"),
    (_rbg(ROLES.replace("dependencies: [prefill]", "dependencies: prefill")),
     "spec.roles[1].dependencies must be a list, not a string ('prefill')"),
    ("apiVersion: v1\nkind: [\n", "not valid YAML"),
    # names and keys the API server refuses: plan writes ConfigMaps out as files by them
    (_config_mounted("../../x"), "ConfigMap '../../x': metadata.name is not a Kubernetes object name"),
    (_config_mounted("Upper"), "ConfigMap 'Upper': metadata.name is not a Kubernetes object name"),
    (_config_mounted("c" * 254), "metadata.name is not a Kubernetes object name"),
    (_rbg(ROLES).replace("metadata: {name: g}", "metadata: {name: g/h}"),
     "RoleBasedGroup 'g/h': metadata.name is not a Kubernetes object name"),
    (_config_mounted("c", data="{'': x}"), "ConfigMap c: data key '' is not a ConfigMap key"),
    (_config_mounted("c", data="{..data: x}"), "ConfigMap c: data key '..data' is not a ConfigMap key"),
    (_config_mounted("c", data="{.: x}"), "ConfigMap c: data key '.' is not a ConfigMap key"),
    (_config_mounted("c", data="{a/b: x}"), "ConfigMap c: data key 'a/b' is not a ConfigMap key"),
    (_config_mounted("c", data="{a: [x, y]}"), "ConfigMap c: data.a must be a string, not a list"),
    (_config_mounted("c", data="{a: 8}"), "ConfigMap c: data.a must be a string, not a number (8)"),
])
def test_what_the_reader_cannot_read_is_one_line(tmp_path, text, reason):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(ComposeError, match=None) as info:
        load_manifests(path)
    message = str(info.value)
    assert reason in message and "\n" not in message


def test_the_command_line_answers_an_unknown_kind_with_one_line_and_exit_2(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(_rbg(ROLES, api="workloads.x-k8s.io/v1alpha1"))
    done = subprocess.run([sys.executable, "-m", "sglang_dsv41.tools.cli", "plan", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is not a kind plan reads" in lines[0] and "Traceback" not in done.stderr


@pytest.mark.parametrize("field, expected", [
    ("nodeSelector: [gpu-node-a]", f"{SERVER_POD}.nodeSelector must be a mapping, not a list"),
    ("hostIPC: 'false'", f"{SERVER_POD}.hostIPC must be true or false"),
])
def test_the_command_line_names_a_field_of_the_wrong_type_before_loading_sglang(tmp_path, field, expected):
    """A server the checks after sglang's resolution would trip over: refused while reading."""
    path = tmp_path / "m.yaml"
    path.write_text(_rbg(ROLES.replace(SERVER_SPEC, f"        {field}\n" + SERVER_SPEC)))
    script = Path(sys.executable).parent / "sglang-dsv41"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    done = subprocess.run([str(script), "plan", str(path)], capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPROFILEIMPORTTIME": "1"})
    assert done.returncode == 2, done.stdout + done.stderr[-2000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("plan: cannot read m.yaml: RoleBasedGroup g: ") \
        and expected in lines[0], lines
    assert "Traceback" not in done.stderr
    assert not re.search(r"\|\s*sglang(\.\S+)?\s*$", done.stderr, re.M), "sglang was imported"
