"""Writes overlays/*/rbg.yaml and their kustomization.yaml from one description of each
topology, with the same server flags as the compose topologies of ../b300-ds41.
Run from this folder after a change: `python3 generate.py` (a test checks the files are
what it writes)."""
import sys
from pathlib import Path

import yaml

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
IMAGE = "registry.example.com/sglang-dsv41:latest"  # set your image (kustomize `images:` can rewrite it)
def probes(port, startup=True):
    out = {}
    if startup:
        out["startupProbe"] = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 30,
                               "failureThreshold": 80, "timeoutSeconds": 20}
    out["readinessProbe"] = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 15, "timeoutSeconds": 20,
                             "failureThreshold": 2}
    out["livenessProbe"] = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 30, "timeoutSeconds": 30,
                            "failureThreshold": 3}
    return out
COMMON = "--config /etc/sglang-dsv41/sglang-common.yaml --model-path /model"
def server(name, args, port, gpus, env, node=None, rdma=False, host_pid=False):
    volumes = [{"name": "model", "persistentVolumeClaim": {"claimName": "ds41-model", "readOnly": True}},
               {"name": "sglang-common", "configMap": {"name": "ds41-sglang-common"}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}},
               {"name": "cache", "emptyDir": {}}]
    resources = {"nvidia.com/gpu": gpus}
    if rdma:
        resources["rdma/ib"] = 1
    container = {
        "name": "sglang", "image": IMAGE,
        "command": ["sglang", "serve"] + COMMON.split() + args.split() + ["--port", str(port)],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [{"name": "http", "containerPort": port}],
        "resources": {"limits": dict(resources), "requests": dict(resources)},
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": [{"name": "model", "mountPath": "/model", "readOnly": True},
                         {"name": "sglang-common", "mountPath": "/etc/sglang-dsv41", "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "cache", "mountPath": "/root/.cache/sglang"}],
        **probes(port),
    }
    spec = {"containers": [container], "volumes": volumes, "terminationGracePeriodSeconds": 60}
    if host_pid:
        spec["hostPID"] = True
        spec["hostIPC"] = True
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"metadata": {"labels": {"app": "ds41", "role": name}}, "spec": spec}
BASE_ENV = {"SGLANG_RAGGED_VERIFY_MODE": "static", "SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "120",
            "SGLANG_DSV41_CP_BCG": "0"}
PD_TUNE = {"SGLANG_DISAGGREGATION_QUEUE_SIZE": "16", "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": "32",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
PREFILL = ("--language-model-only --tp 4 --ep-size 4 --enable-prefill-cp --cp-strategy interleave "
           "--mem-fraction-static 0.75 --cuda-graph-max-bs-decode 64 "
           "--speculative-algorithm DSPARK --speculative-dspark-block-size 5 "
           "--enable-hierarchical-cache --hicache-ratio 2.5 --hicache-write-policy write_back "
           "--disaggregation-mode prefill --disaggregation-transfer-backend mooncake "
           "--disaggregation-bootstrap-port 8998")
DECODE = ("--language-model-only --tp 4 --ep-size 4 --attn-dp-size 4 --enable-dp-lm-head "
          "--mem-fraction-static 0.75 --cuda-graph-max-bs-decode 64 "
          "--speculative-algorithm DSPARK --speculative-dspark-block-size 5 "
          "--disaggregation-mode decode --disaggregation-transfer-backend mooncake")
ROUTER_FAIL_FAST = "--cb-failure-threshold 1 --cb-timeout-duration-secs 10 --health-check-interval-secs 5 --health-failure-threshold 1"
def router(args, deps):
    c = {"name": "router", "image": IMAGE,
         "command": ["python3", "-m", "sglang_router.launch_router"] + args.split() + ["--host", "0.0.0.0", "--port", "30000"],
         "ports": [{"name": "http", "containerPort": 30000}, {"name": "metrics", "containerPort": 29000}],
         "resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"cpu": "8", "memory": "16Gi"}},
         **probes(30000, startup=False)}
    c["readinessProbe"]["initialDelaySeconds"] = 10
    return {"name": "router", "replicas": 1, "dependencies": deps,
            "standalonePattern": {"template": {"metadata": {"labels": {"app": "ds41", "role": "router"}},
                                               "spec": {"containers": [c]}}}}
def pd(group, node_p, node_d, cross):
    if cross:
        transport = {"MOONCAKE_PROTOCOL": "rdma"}
        extra = " --disaggregation-ib-device mlx5_0"
    else:
        transport = {"MC_INTRANODE_NVLINK": "true"}
        extra = ""
    env = {**BASE_ENV, **transport, **PD_TUNE}
    p = server("prefill", PREFILL + extra, 30010, 4, env, node_p, rdma=cross, host_pid=not cross)
    d = server("decode", DECODE + extra, 30020, 4, env, node_d, rdma=cross, host_pid=not cross)
    roles = [
        {"name": "prefill", "replicas": 1, "restartPolicy": "RecreateRBGOnPodRestart",
         "standalonePattern": {"template": p}},
        {"name": "decode", "replicas": 1, "restartPolicy": "RecreateRBGOnPodRestart",
         "standalonePattern": {"template": d}},
        router(f"--pd-disaggregation --prefill http://{group}-prefill-0.s-{group}-prefill:30010 8998 "
               f"--decode http://{group}-decode-0.s-{group}-decode:30020 " + ROUTER_FAIL_FAST,
               ["prefill", "decode"]),
    ]
    return {"apiVersion": "workloads.x-k8s.io/v1alpha2", "kind": "RoleBasedGroup",
            "metadata": {"name": group, "labels": {"app": "ds41"}}, "spec": {"roles": roles}}
def cp(group):
    args = ("--tp 2 --ep-size 2 --enable-prefill-cp --cp-strategy interleave --mem-fraction-static 0.75 "
            "--speculative-algorithm DSPARK --speculative-dspark-block-size 5")
    env = {**BASE_ENV, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "SGLANG_ENGRAM_HOST_TABLE": "1"}
    t = server("cp", args, 30010, 2, env)
    urls = " ".join(f"http://{group}-cp-{i}.s-{group}-cp:30010" for i in range(4))
    roles = [{"name": "cp", "replicas": 4, "standalonePattern": {"template": t}},
             router(f"--worker-urls {urls} --policy round_robin", ["cp"])]
    return {"apiVersion": "workloads.x-k8s.io/v1alpha2", "kind": "RoleBasedGroup",
            "metadata": {"name": group, "labels": {"app": "ds41"}}, "spec": {"roles": roles}}
HEAD = {
 "pd-1node": """# PD on one node as a RoleBasedGroup: the roles of ../../b300-ds41/pd-1p1d.yml (CP 4 prefill,
# DP-attention 4 decode, DSpark on both, the router failing fast). Both servers land on
# one node (nodeSelector: set your node) and share its PID and IPC namespaces, so
# Mooncake's intra-node NVLink transport can open the other side's CUDA IPC handles.
# restartPolicy RecreateRBGOnPodRestart couples the pair: a restarted side brings the
# whole group back together, never one side paired with a peer that lost its state.
# The startup probe allows 40 minutes (80 x 30 s) for DeepSeek-V4.1 to load and capture
# graphs; liveness only starts counting after it. Generated by deploy/k8s/generate.py: edit it, not this file.
""",
 "pd-2node": """# PD across two nodes as a RoleBasedGroup: pd-1node's roles with each server on its own
# node (nodeSelector: set yours) and the KV over Mooncake RDMA (MOONCAKE_PROTOCOL=rdma,
# --disaggregation-ib-device naming the HCA, an rdma/ib device from the RDMA device
# plugin, IPC_LOCK for pinned memory). No intra-node NVLink transport and no KV peer
# writes between nodes: plan refuses them. The router reaches both by their pod DNS
# names; the bootstrap port (8998) and Mooncake's side channel use the pod addresses.
# Generated by deploy/k8s/generate.py: edit it, not this file.
""",
 "cp-instances": """# Four independent TP 2 / CP 2 DSpark servers behind sglang's router (round robin): the
# RoleBasedGroup form of ../../b300-ds41/cp-instances.yml without the Mooncake L3 tier
# (add a Mooncake master role to share one). The scheduler places the pods; each gets
# two GPUs from the device plugin. Generated by deploy/k8s/generate.py: edit it, not this file.
""",
}
docs = {"pd-1node": pd("ds41-pd", "gpu-node-a", "gpu-node-a", False),
        "pd-2node": pd("ds41-pd2", "gpu-node-a", "gpu-node-b", True),
        "cp-instances": cp("ds41-cp")}
for name, doc in docs.items():
    text = HEAD[name] + yaml.safe_dump(doc, sort_keys=False, width=120)
    folder = OUT / "overlays" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rbg.yaml").write_text(text)
    (folder / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - ../../base\n  - rbg.yaml\n")
