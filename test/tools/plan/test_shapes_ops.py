"""Operational settings of every shipped topology, read the way docker compose
reads the files (extends and interpolation applied, variables from .env.example):
restart policy, log rotation, least privilege, the PD transfer settings, the
tokenizer-worker start-up timeout, the allocator, container names, and the
flags the deployment shapes rely on. No sglang import: plain compose data."""

from __future__ import annotations

import shutil

import pytest

from conftest import REPO_ROOT

from sglang_dsv41.tools.plan.compose import load_services
from sglang_dsv41.tools.plan.checks import mooncake_master_args, router_args, sglang_serve_args

DEPLOY = REPO_ROOT / "deploy" / "b300-ds41"
TOPOLOGIES = sorted(p.name for p in DEPLOY.glob("*.yml"))
ENV = {
    "IMAGE": "registry.invalid/sglang-dsv41:test",
    "MODEL_PATH": "/data/models/DeepSeek-V4.1-Flash",
    "SGLANG_CACHE_DIR": "/data/cache/sglang",
}


def _services(name: str, environ: dict | None = None):
    services, _ = load_services(DEPLOY / name, {**ENV, **(environ or {})})
    return services


def _servers(name: str, environ: dict | None = None):
    return [(s, sglang_serve_args(s.argv)) for s in _services(name, environ)
            if sglang_serve_args(s.argv) is not None]


def _is_pd(args: list[str]) -> bool:
    return "--disaggregation-mode" in args


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_every_service_restarts_rotates_logs_and_runs_unprivileged(name):
    services = _services(name)
    assert services
    for svc in services:
        raw = svc.raw
        assert raw.get("restart") == "unless-stopped", svc.label
        assert raw.get("logging", {}).get("driver") == "json-file", svc.label
        options = raw["logging"]["options"]
        assert options["max-size"] and int(options["max-file"]) >= 2, svc.label
        assert not raw.get("privileged"), f"{svc.label}: privileged"
        assert "container_name" not in raw, f"{svc.label}: a fixed container_name collides across deployments"


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_servers_get_what_sglang_and_mooncake_need(name):
    for svc, args in _servers(name):
        raw = svc.raw
        assert raw["cap_add"] == ["IPC_LOCK"], svc.label
        assert raw["ulimits"]["memlock"] == -1, svc.label
        assert raw["ipc"] == "host" and raw["shm_size"], svc.label
        assert svc.gpu_reservation.declared and svc.environment.get("CUDA_VISIBLE_DEVICES"), svc.label
        # base/sglang-common.yaml starts 8 tokenizer workers; uvicorn's 10 s default kills slow importers.
        assert int(svc.environment["SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT"]) >= 60, svc.label
        assert "--enable-dp-attention" not in args, f"{svc.label}: deprecated flag"
        assert "--dp-size" not in args, f"{svc.label}: DP attention is --attn-dp-size"
        if _is_pd(args):
            assert raw.get("pid") == "host", svc.label
            assert svc.environment["SGLANG_DISAGGREGATION_QUEUE_SIZE"] == "16", svc.label
            assert svc.environment["SGLANG_DISAGGREGATION_THREAD_POOL_SIZE"] == "32", svc.label
            assert "SGLANG_MOONCAKE_SEND_AUX_TCP" not in svc.environment, svc.label
            assert "MC_INTRANODE_NVLINK" in svc.environment, svc.label
        else:
            assert "pid" not in raw, f"{svc.label}: pid: host only where CUDA IPC crosses containers"


def test_pd_servers_never_take_expandable_segments_from_env():
    """SERVER_ALLOC_CONF reaches single servers only: PD servers share CUDA IPC handles."""
    on = {"SERVER_ALLOC_CONF": "expandable_segments:True"}
    seen_pd = seen_single = 0
    for name in TOPOLOGIES:
        for svc, args in _servers(name, on):
            conf = svc.environment["PYTORCH_CUDA_ALLOC_CONF"]
            if _is_pd(args):
                seen_pd += 1
                assert conf == "expandable_segments:False", svc.label
            else:
                seen_single += 1
                assert conf == "expandable_segments:True", svc.label
    assert seen_pd and seen_single


def test_dp_attention_dspark_servers_leave_replay_to_the_launch_guard():
    """DP-attention + DSpark servers name no replay flag: the launch guard turns sglang's default off.

    Asking for replay there would be refused at launch; a leftover
    --no-enable-decoder-swa-bounded-replay would hide whether the guard works.
    """
    count = 0
    for name in TOPOLOGIES:
        for svc, args in _servers(name):
            if "--attn-dp-size" in args and "DSPARK" in args:
                count += 1
                assert "--enable-decoder-swa-bounded-replay" not in args, svc.label
                assert "--no-enable-decoder-swa-bounded-replay" not in args, svc.label
    assert count >= 6


def test_l3_files_use_the_shared_master_and_start_none():
    masters = {name for name in TOPOLOGIES
               for svc in _services(name) if mooncake_master_args(svc.argv) is not None}
    assert masters == {"mooncake-master.yml"}
    l3 = 0
    for name in TOPOLOGIES:
        for svc, args in _servers(name):
            if "--hicache-storage-backend" in args:
                l3 += 1
                assert svc.environment["MOONCAKE_MASTER"] == "127.0.0.1:50051", svc.label
                assert not svc.depends_on, f"{svc.label}: depends on a service of its own file"
    assert l3 == 8  # cp-dspark-l3 1, cp-instances 4, pd-3p1d 3
    moved = {s.environment["MOONCAKE_MASTER"]
             for s in _services("cp-dspark-l3.yml", {"MOONCAKE_MASTER_HOST": "10.0.0.5", "MOONCAKE_MASTER_PORT": "50061"})}
    assert moved == {"10.0.0.5:50061"}


def test_project_names_differ_and_routers_bind_their_own_ports():
    import yaml

    names = [yaml.safe_load((DEPLOY / n).read_text())["name"] for n in TOPOLOGIES]
    assert len(set(names)) == len(names)
    for name in TOPOLOGIES:
        for svc in _services(name):
            if router_args(svc.argv) is not None:
                assert svc.environment["DSV41_HEALTH_PORT"] in svc.argv, svc.label


def test_new_pd_shapes_carry_their_defining_flags():
    prefill = {svc.name: args for svc, args in _servers("pd-1p1d-tp-prefill.yml")}["prefill"]
    assert prefill[prefill.index("--optimistic-prefill-attempts") + 1] == "4"
    assert "--enable-prefill-cp" not in prefill and "--attn-dp-size" not in prefill
    prefill = {svc.name: args for svc, args in _servers("pd-1p1d-dp-prefill.yml")}["prefill"]
    assert prefill[prefill.index("--load-balance-method") + 1] == "total_tokens"
    assert prefill[prefill.index("--attn-dp-size") + 1] == "4"


def test_extra_args_and_widths_come_from_env(tmp_path):
    _, args = _servers("cp-dspark.yml")[0]
    assert args[args.index("--tp") + 1] == "8"
    _, args = _servers("cp-dspark.yml", {"CP_DSPARK_SIZE": "4", "CP_DSPARK_EXTRA_ARGS": "--language-model-only"})[0]
    assert args[args.index("--tp") + 1] == "4" and args[-1] == "--language-model-only"
    _, args = _servers("tp.yml", {"TP_DSPARK_ARGS": ""})[0]
    assert "--speculative-algorithm" not in args
    _, args = _servers("tp.yml")[0]
    assert args[args.index("--speculative-algorithm") + 1] == "DSPARK"
    # With no .env and no .env.example, the files' own defaults keep DSpark on.
    copy = tmp_path / "b300-ds41"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns(".env", ".env.example"))
    for name, flag in (("tp.yml", "--speculative-algorithm"), ("dp-attention.yml", "--speculative-algorithm")):
        services, env_file = load_services(copy / name, ENV)
        assert env_file is None
        args = sglang_serve_args(services[0].argv)
        assert args[args.index(flag) + 1] == "DSPARK", name
        assert args[-2] == "--port", f"{name}: empty extra args must add nothing: {args[-3:]}"
