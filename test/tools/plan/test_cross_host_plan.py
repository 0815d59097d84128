"""`sglang-dsv41 plan` beyond one node: the shipped RoleBasedGroup overlays and the
cross-node compose pair pass; broken variants fail naming the role and the reason.

Every case goes through sglang 0.5.23's real parser and resolution with the plugin
loaded, in ONE interpreter. No cluster and no RDMA fabric is involved: the overlays
are rendered with `kubectl kustomize` where it is installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT, run_python

HERE = Path(__file__).resolve().parent
K8S = REPO_ROOT / "deploy" / "k8s"
MULTINODE = REPO_ROOT / "deploy" / "b300-ds41-multinode"
ENV = {"IMAGE": "registry.invalid/sglang-dsv41:test", "MODEL_PATH": "/data/models/DeepSeek-V4.1-Flash",
       "SGLANG_CACHE_DIR": "/data/cache/sglang"}
OVERLAYS = ("pd-1node", "pd-2node", "cp-instances")

def _role(docs, name):
    group = next(d for d in docs if d["kind"] == "RoleBasedGroup")
    return next(r for r in group["spec"]["roles"] if r["name"] == name)


def _container(docs, name):
    return _role(docs, name)["standalonePattern"]["template"]["spec"]["containers"][0]


def _replace_token(tokens, old, new):
    tokens[tokens.index(old)] = new


def _block_size_4(docs):
    command = _container(docs, "decode")["command"]
    command[command.index("--speculative-dspark-block-size") + 1] = "4"


def _env(docs, role, old, new_name, new_value):
    env = _container(docs, role)["env"]
    item = next(e for e in env if e["name"] == old)
    item["name"], item["value"] = new_name, new_value


def _limits(docs, role, **changes):
    for limits in _container(docs, role)["resources"].values():  # requests and limits alike
        for key, value in changes.items():
            key = key.replace("__", "/").replace("_", ".")
            if value is None:
                limits.pop(key)
            else:
                limits[key] = value


# Broken variant -> (overlay, change, label blamed (after the file name), fragment of the reason).
K8S_BROKEN = {
    "pairing": ("pd-2node", _block_size_4, "prefill-0 -> ", "the PD handshake would reject this pair"),
    "router-target": ("pd-2node", lambda d: _replace_token(
        _container(d, "router")["command"], "http://ds41-pd2-decode-0.s-ds41-pd2-decode:30020",
        "http://ds41-pd2-decode-1.s-ds41-pd2-decode:30020"),
        "router-0", "host ds41-pd2-decode-1.s-ds41-pd2-decode is not an sglang service"),
    "gpu-count": ("pd-2node", lambda d: _limits(d, "prefill", nvidia_com__gpu=2), "prefill-0", "needs 4 GPUs"),
    "nvlink-across-nodes": ("pd-2node", lambda d: (_env(d, "prefill", "MOONCAKE_PROTOCOL", "MC_INTRANODE_NVLINK", "true"),
                                                  _env(d, "decode", "MOONCAKE_PROTOCOL", "MC_INTRANODE_NVLINK", "true")),
                            "prefill-0 -> ", "the sides run on different machines"),
    "no-rdma-resource": ("pd-2node", lambda d: _limits(d, "prefill", rdma__ib=None), "prefill-0",
                         "its container cannot open it"),
    "restart-uncoupled": ("pd-1node", lambda d: _role(d, "prefill").update(restartPolicy="None"), "prefill-0",
                          "restartPolicy None"),
    "short-startup": ("cp-instances", lambda d: _container(d, "cp")["startupProbe"].update(failureThreshold=8),
                      "cp-0", "startupProbe allows 240 s"),
    "unknown-kind": ("cp-instances", lambda d: next(x for x in d if x["kind"] == "RoleBasedGroup").update(
        kind="RoleBasedGroupSet"), None,
        "RoleBasedGroupSet ds41-cp (apiVersion workloads.x-k8s.io/v1alpha2) is not a kind plan reads"),
}

# Broken variant of the compose pair -> (file, replaced, replacement, label blamed, reason).
PAIR_BROKEN = {
    "nvlink-across-hosts": ("pd-2node-decode.yml", "MOONCAKE_PROTOCOL: rdma", 'MC_INTRANODE_NVLINK: "true"',
                            "pd-2node-prefill.yml/prefill -> pd-2node-decode.yml/decode",
                            "Mooncake's intra-node NVLink transport"),
    "no-ib-device": ("pd-2node-decode.yml", "--disaggregation-ib-device ${PD_IB_DEVICE:-mlx5_0}\n", "",
                     "pd-2node-decode.yml/decode", "names no RDMA device"),
    "loopback-bootstrap": ("pd-2node-prefill.yml", "--prefill http://${PD_PREFILL_HOST:-10.0.0.1}",
                           "--prefill http://127.0.0.1", "pd-2node-prefill.yml/router", "a loopback address"),
    "decode-unreachable": ("pd-2node-prefill.yml", "--decode http://${PD_DECODE_HOST:-10.0.0.2}:${PD_DECODE_PORT:-30020}",
                           "--decode http://${PD_DECODE_HOST:-10.0.0.2}:30021", "pd-2node-prefill.yml/router",
                           "host 10.0.0.2 is not an sglang service"),
}


def _render(overlay: str, into: Path) -> Path:
    out = into / f"{overlay}.yaml"
    done = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out.write_text(done.stdout)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl renders the kustomize overlays")
    cases: dict = {f"k8s:{o}": [str(K8S / "overlays" / o)] for o in OVERLAYS}
    pair = tmp_path_factory.mktemp("pair") / "b300-ds41-multinode"
    shutil.copytree(MULTINODE, pair, ignore=shutil.ignore_patterns(".env"))
    (pair.parent / "b300-ds41").symlink_to(REPO_ROOT / "deploy" / "b300-ds41")
    files = ["pd-2node-prefill.yml", "pd-2node-decode.yml"]
    cases["pair"] = [str(pair / f) for f in files]
    rendered = tmp_path_factory.mktemp("rendered")
    for case, (overlay, change, _, _) in K8S_BROKEN.items():
        docs = list(yaml.safe_load_all(_render(overlay, rendered).read_text()))
        change(docs)
        broken = rendered / f"{case}.yaml"
        broken.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        cases[f"k8s-broken:{case}"] = [str(broken)]
    for case, (name, old, new, _, _) in PAIR_BROKEN.items():
        copy = tmp_path_factory.mktemp(case) / "b300-ds41-multinode"
        shutil.copytree(MULTINODE, copy, ignore=shutil.ignore_patterns(".env"))
        (copy.parent / "b300-ds41").symlink_to(REPO_ROOT / "deploy" / "b300-ds41")
        text = (copy / name).read_text()
        assert old in text, (case, old)
        (copy / name).write_text(text.replace(old, new, 1))
        cases[f"pair-broken:{case}"] = [str(copy / f) for f in files]
    code = f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        import _plan_harness
        print("PLAN-RESULTS " + json.dumps(_plan_harness.run({cases!r})))
    """
    proc = run_python(textwrap.dedent(code), env=ENV, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PLAN-RESULTS ")), None)
    assert line, f"harness failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("PLAN-RESULTS "):])


def _errors(output: str) -> list[str]:
    return [ln.strip()[len("ERROR "):] for ln in output.splitlines() if ln.strip().startswith("ERROR ")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shipped_overlay_passes(results, overlay):
    result = results[f"k8s:{overlay}"]
    assert result["rc"] == 0, result["output"][-3000:]
    assert "plan: OK" in result["output"]


def test_cross_node_compose_pair_passes(results):
    result = results["pair"]
    assert result["rc"] == 0, result["output"][-3000:]
    out = result["output"]
    assert "pd-2node-prefill.yml/prefill [host 10.0.0.1]" in out and "pd-2node-decode.yml/decode [host 10.0.0.2]" in out
    assert "decode http://10.0.0.2:30020" in out


@pytest.mark.parametrize("case", sorted(K8S_BROKEN))
def test_broken_manifest_fails_naming_the_role_and_the_reason(results, case):
    _, _, blamed, reason = K8S_BROKEN[case]
    result = results[f"k8s-broken:{case}"]
    if blamed is None:  # unreadable: one line, exit 2
        assert result["rc"] == 2, result["output"][-2000:]
        lines = [ln for ln in result["output"].splitlines() if ln.strip()]
        assert len(lines) == 1 and reason in lines[0], result["output"]
        return
    assert result["rc"] == 1, result["output"][-3000:]
    errors = _errors(result["output"])
    assert any(f"{case}.yaml/{blamed}" in e and reason in e for e in errors), errors


@pytest.mark.parametrize("case", sorted(PAIR_BROKEN))
def test_broken_compose_pair_fails_naming_the_service_and_the_reason(results, case):
    _, _, _, blamed, reason = PAIR_BROKEN[case]
    result = results[f"pair-broken:{case}"]
    assert result["rc"] == 1, result["output"][-3000:]
    errors = _errors(result["output"])
    assert any(e.startswith(blamed) and reason in e for e in errors), errors


def test_generated_overlays_are_up_to_date(tmp_path):
    done = subprocess.run([sys.executable, str(K8S / "generate.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for written in (tmp_path / "overlays").rglob("*.yaml"):
        shipped = K8S / written.relative_to(tmp_path)
        assert shipped.read_text() == written.read_text(), f"{shipped} is stale: run deploy/k8s/generate.py"
