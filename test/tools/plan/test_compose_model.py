"""How `plan` reads compose files: interpolation, extends, include, ports, GPUs,
router and Mooncake master flags, known crashes (pure code, no sglang import)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from sglang_dsv41.tools.plan.compose import ComposeError, interpolate, load_services, read_env_file
from sglang_dsv41.launch_guards.rules import CrashFeatures, known_crash
from sglang_dsv41.tools.plan.checks import (
    mooncake_master_args,
    parse_master,
    parse_router,
    router_args,
    sglang_serve_args,
)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _lookup(values):
    return values.get


@pytest.mark.parametrize("text, values, expected", [
    ("${A}", {"A": "x"}, "x"),
    ("$A-$B", {"A": "x", "B": "y"}, "x-y"),
    ("${A:-d}", {}, "d"),
    ("${A:-d}", {"A": ""}, "d"),
    ("${A-d}", {"A": ""}, ""),
    ("${A:+alt}", {"A": "x"}, "alt"),
    ("${A:+alt}", {"A": ""}, ""),
    ("${A+alt}", {"A": ""}, "alt"),
    ("${A:-${B:-inner}}", {}, "inner"),
    ("$$A and $${B}", {}, "$A and ${B}"),
    ("cost: 5$", {}, "cost: 5$"),
])
def test_interpolation_follows_compose(text, values, expected):
    assert interpolate(text, _lookup(values), "here") == expected


@pytest.mark.parametrize("text, message", [
    ("${MISSING}", "MISSING is not set"),
    ("$MISSING", "MISSING is not set"),
    ("${A:?give A}", "A: give A"),
    ("${A?}", "A: is required"),
    ("${A", "unterminated"),
])
def test_interpolation_refuses_unset_variables(text, message):
    with pytest.raises(ComposeError, match=message):
        interpolate(text, _lookup({}), "here")


def test_env_file_syntax(tmp_path):
    env = _write(tmp_path / ".env", """\
        # comment
        export A=1
        B="two words"
        C='x#y'
        D=plain # trailing comment
    """)
    assert read_env_file(env) == {"A": "1", "B": "two words", "C": "x#y", "D": "plain"}
    _write(tmp_path / "bad.env", "not a pair\n")
    with pytest.raises(ComposeError, match="not a KEY=VALUE line"):
        read_env_file(tmp_path / "bad.env")


def test_extends_across_files_merges_like_compose(tmp_path):
    _write(tmp_path / "base" / "services.yml", """\
        services:
          server:
            image: img
            network_mode: host
            volumes: ["./conf.yaml:/etc/conf.yaml:ro", "/data:/data"]
            environment: {A: base, B: base}
            command: ["base", "command"]
            healthcheck: {test: ["CMD", "base"], interval: 30s}
            deploy: {resources: {reservations: {devices: [{driver: nvidia, count: all, capabilities: [gpu]}]}}}
            labels: ["sglang-dsv41.host=node-a"]
          derived:
            extends: {service: server}
            environment: [C=derived]
    """)
    top = _write(tmp_path / "top" / "topology.yml", """\
        services:
          one:
            extends: {file: ../base/services.yml, service: derived}
            volumes: ["/other:/data"]
            environment: {B: top, CUDA_VISIBLE_DEVICES: "2,3"}
            command: serve --flag 'a b'
            healthcheck: {test: ["CMD", "top"]}
    """)
    (service,), _ = load_services(top, environ={})
    assert service.argv == ["serve", "--flag", "a b"]
    assert service.environment == {"A": "base", "B": "top", "C": "derived", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert service.healthcheck == {"test": ["CMD", "top"], "interval": "30s"}
    assert service.host == "node-a"
    # Volumes merge by target; relative sources are relative to the file that declared them.
    binds = {b.target: b for b in service.binds}
    assert binds["/etc/conf.yaml"].source == (tmp_path / "base" / "conf.yaml").resolve()
    assert binds["/etc/conf.yaml"].read_only
    assert binds["/data"].source == Path("/other")
    assert service.host_path("/etc/conf.yaml") == (tmp_path / "base" / "conf.yaml").resolve()
    assert service.host_path("/data/models/x") == Path("/other/models/x")
    assert service.host_path("/nowhere") is None
    assert service.gpu_reservation.visible == ("2", "3")


def test_include_anchors_and_extends_cycles(tmp_path):
    _write(tmp_path / "inc.yml", """\
        services:
          master: {image: img, command: mooncake_master --rpc_port=1234}
    """)
    top = _write(tmp_path / "top.yml", """\
        include: [inc.yml]
        x-common: &common {image: img, environment: {X: "1"}}
        services:
          a: {<<: *common, command: a}
    """)
    services, _ = load_services(top, environ={})
    assert {s.name: s.argv for s in services} == {"a": ["a"], "master": ["mooncake_master", "--rpc_port=1234"]}
    assert next(s for s in services if s.name == "a").environment == {"X": "1"}
    cyc = _write(tmp_path / "cycle.yml", """\
        services:
          a: {extends: b}
          b: {extends: a}
    """)
    with pytest.raises(ComposeError, match="extends cycle"):
        load_services(cyc, environ={})
    clash = _write(tmp_path / "clash.yml", """\
        include: [inc.yml]
        services:
          master: {image: other}
    """)
    with pytest.raises(ComposeError, match="defined both here and in inc.yml"):
        load_services(clash, environ={})


def test_variables_come_from_environment_then_env_then_example(tmp_path):
    top = _write(tmp_path / "t.yml", """\
        services:
          a: {image: "${IMAGE}", command: "serve --port ${PORT:-1}"}
    """)
    with pytest.raises(ComposeError, match="IMAGE is not set"):
        load_services(top, environ={})
    _write(tmp_path / ".env.example", "IMAGE=from-example\nPORT=2\n")
    (svc,), used = load_services(top, environ={})
    assert (svc.image, svc.argv[-1], used.name) == ("from-example", "2", ".env.example")
    _write(tmp_path / ".env", "IMAGE=from-env\n")
    (svc,), used = load_services(top, environ={"PORT": "3"})
    assert (svc.image, svc.argv[-1], used.name) == ("from-env", "3", ".env")


def test_ports_and_gpu_reservations(tmp_path):
    top = _write(tmp_path / "t.yml", """\
        services:
          bridge:
            image: img
            ports: ["8080:80", "127.0.0.1:9000-9001:9000-9001/udp", "5000", {target: 81, published: "8081"}]
          ids:
            image: img
            environment: {CUDA_VISIBLE_DEVICES: "1,0"}
            deploy: {resources: {reservations: {devices: [{driver: nvidia, device_ids: ["4", "5"], capabilities: [gpu]}]}}}
          all-no-cvd:
            image: img
            deploy: {resources: {reservations: {devices: [{driver: nvidia, count: all, capabilities: [gpu]}]}}}
          counted:
            image: img
            deploy: {resources: {reservations: {devices: [{driver: nvidia, count: 2, capabilities: [gpu]}]}}}
          none: {image: img}
          wrong-index:
            image: img
            environment: {CUDA_VISIBLE_DEVICES: "3"}
            deploy: {resources: {reservations: {devices: [{driver: nvidia, device_ids: ["4", "5"], capabilities: [gpu]}]}}}
    """)
    with pytest.raises(ComposeError, match="CUDA_VISIBLE_DEVICES=3 names GPU 3"):
        load_services(top, environ={})
    top.write_text(top.read_text().split("  wrong-index:")[0])
    services = {s.name: s for s in load_services(top, environ={})[0]}
    ports = [(p.host_port, p.container_port, p.protocol) for p in services["bridge"].published_ports]
    assert ports == [(8080, 80, "tcp"), (9000, 9000, "udp"), (9001, 9001, "udp"), (8081, 81, "tcp")]
    # CUDA_VISIBLE_DEVICES numbers the container's GPUs, which are host GPUs 4 and 5.
    assert services["ids"].gpu_reservation.visible == ("5", "4")
    assert services["all-no-cvd"].gpu_reservation.visible is None
    assert services["counted"].gpu_reservation.visible is None
    assert not services["none"].gpu_reservation.declared


def test_service_kinds_and_their_flags():
    assert sglang_serve_args(["sglang", "serve", "--tp", "2"]) == ["--tp", "2"]
    assert sglang_serve_args(["/usr/bin/python3", "-m", "sglang.launch_server", "--tp", "2"]) == ["--tp", "2"]
    assert sglang_serve_args(["python3", "-m", "sglang_router.launch_router"]) is None
    assert router_args(["python3", "-m", "sglang_router.launch_router", "--port", "1"]) == ["--port", "1"]
    assert mooncake_master_args(["/usr/local/bin/mooncake_master", "--rpc_port=5"]) == ["--rpc_port=5"]

    svc = None
    router = parse_router(svc, ["--pd-disaggregation", "--prefill", "http://a:1", "8999", "--prefill", "http://b:2",
                                "--decode", "http://c:3", "--policy", "round_robin", "--port", "40000"])
    assert router.pd and router.port == 40000 and router.prometheus_port == 29000
    assert router.prefill == [("http://a:1", 8999), ("http://b:2", None)]
    assert router.decode == ["http://c:3"]
    with pytest.raises(ValueError, match="bootstrap port is not a number"):
        parse_router(svc, ["--pd-disaggregation", "--prefill", "http://a:1", "http://b:2"])

    master = parse_master(svc, ["--rpc_port", "6000", "--enable_http_metadata_server=true",
                                "--http_metadata_server_port=8081", "--metrics_port=9100"])
    assert master.rpc_port == 6000
    assert master.other_ports == [(9100, "Mooncake master metrics"), (8081, "Mooncake HTTP metadata")]
    assert parse_master(svc, []).rpc_port == 50051


@pytest.mark.parametrize("features, fragment", [
    (dict(dspark=True, decoder_swa_bounded_replay=True, enable_prefill_cp=True, attn_cp_size=4, attn_dp_size=1),
     "cp4 + dspark + replay"),
    (dict(dspark=True, decoder_swa_bounded_replay=True, enable_prefill_cp=False, attn_cp_size=1, attn_dp_size=2),
     "--no-enable-decoder-swa-bounded-replay"),
    (dict(dspark=True, decoder_swa_bounded_replay=False, enable_prefill_cp=True, attn_cp_size=4, attn_dp_size=1),
     None),
    (dict(dspark=False, decoder_swa_bounded_replay=True, enable_prefill_cp=True, attn_cp_size=4, attn_dp_size=1),
     None),
    (dict(dspark=True, decoder_swa_bounded_replay=True, enable_prefill_cp=False, attn_cp_size=1, attn_dp_size=1),
     None),
])
def test_known_crashes(features, fragment):
    verdict = known_crash(CrashFeatures(**features))
    assert (verdict is None) if fragment is None else (fragment in verdict)


def _layout(**fields):
    from sglang_dsv41.tools.plan.checks import ServerLayout

    base = dict(tp_size=1, pp_size=1, nnodes=1, ep_size=1, dp_size=1, attn_tp_size=1, attn_dp_size=1,
                attn_cp_size=1, base_gpu_id=0, gpu_id_step=1, port=30000, disaggregation_mode="null",
                bootstrap_port=None, transfer_backend=None, dspark=False, speculative_num_draft_tokens=None,
                decoder_swa_bounded_replay=False, enable_prefill_cp=False, cp_strategy=None,
                hierarchical_cache=False, hicache_storage_backend=None, vision=True,
                kv_cache_dtype="fp8_e4m3", page_size=256, model_type="deepseek_v41")
    return ServerLayout(**{**base, **fields})


@pytest.mark.parametrize("fields, indices", [
    (dict(tp_size=4), [0, 1, 2, 3]),
    (dict(tp_size=8, dp_size=1, attn_dp_size=8), list(range(8))),  # DP attention: one TP group
    (dict(tp_size=2, dp_size=2), [0, 1, 2, 3]),  # DP replicas: a TP block each
    (dict(tp_size=2, base_gpu_id=2), [2, 3]),
    (dict(tp_size=2, gpu_id_step=2), [0, 2]),
    (dict(tp_size=2, pp_size=2), [0, 1, 2, 3]),
    (dict(tp_size=8, nnodes=2), [0, 1, 2, 3]),  # per node
])
def test_gpu_indices_follow_sglangs_assignment(fields, indices):
    assert _layout(**fields).gpu_indices == indices


def test_used_gpus_maps_indices_to_host_gpus():
    from sglang_dsv41.tools.plan.compose import GpuReservation
    from sglang_dsv41.tools.plan.checks import PlannedServer, used_gpus

    class _Svc:
        def __init__(self, visible):
            self.gpu_reservation = GpuReservation(True, visible, "test")

    assert used_gpus(PlannedServer(_Svc(("4", "5", "6", "7")), _layout(tp_size=2, dp_size=2))) == (("4", "5", "6", "7"), None)
    gpus, why = used_gpus(PlannedServer(_Svc(("4", "5")), _layout(tp_size=2, dp_size=2)))
    assert gpus is None and "needs 4 GPUs (TP 2 x PP 1 x DP replicas 2)" in why
    gpus, why = used_gpus(PlannedServer(_Svc(("0", "1", "2")), _layout(tp_size=2)))
    assert gpus is None and "the rest would sit idle" in why


def test_env_file_values_refer_to_other_variables(tmp_path):
    env = _write(tmp_path / ".env", """\
        BASE=/data
        MODELS=${BASE}/models
        LITERAL='${BASE}/kept'
        QUOTED="${MODELS}/x\\ty" # comment
        FROM_SHELL=${HOME_DIR:-/root}
        LATER=${NOT_YET-unset}
        NOT_YET=1
    """)
    values = read_env_file(env, {"HOME_DIR": "/home/me", "BASE": "/shell"})
    # The caller's environment wins over lines above, as compose's dotenv does.
    assert values == {"BASE": "/data", "MODELS": "/shell/models", "LITERAL": "${BASE}/kept",
                      "QUOTED": "/shell/models/x\ty", "FROM_SHELL": "/home/me", "LATER": "unset", "NOT_YET": "1"}
    _write(tmp_path / "bad.env", "A=${MISSING:?set MISSING}\n")
    with pytest.raises(ComposeError, match=r"bad.env:1: variable MISSING: set MISSING"):
        read_env_file(tmp_path / "bad.env", {})


def test_profiles_project_names_and_compose_config(tmp_path):
    from sglang_dsv41.tools.plan.compose import load_compose_config, load_project

    top = _write(tmp_path / "proj" / "t.yml", """\
        services:
          a: {image: x}
          b: {image: x, profiles: [debug]}
          c: {image: x, profiles: [debug, other]}
    """)
    project = load_project(top, environ={})
    assert [s.name for s in project.services] == ["a"] and project.inactive == {"b": ("debug",), "c": ("debug", "other")}
    assert project.name == "proj"  # no top-level name: the directory, as compose names it
    assert [s.name for s in load_project(top, environ={}, profiles=["other"]).services] == ["a", "c"]
    assert [s.name for s in load_project(top, environ={"COMPOSE_PROFILES": "debug"}).services] == ["a", "b", "c"]
    assert load_project(top, environ={"COMPOSE_PROJECT_NAME": "from-env"}).name == "from-env"
    config = _write(tmp_path / "config.yml", """\
        name: normalized
        services:
          s:
            command: [sglang, serve, --port, "30000"]
            environment: {A: "1", PRICE: "5$$"}
            ports: [{mode: ingress, target: 80, published: "8080", protocol: tcp}]
            volumes: [{type: bind, source: /abs/conf, target: /etc/conf, read_only: true, bind: {create_host_path: true}}]
            deploy: {resources: {reservations: {devices: [{driver: nvidia, count: -1, capabilities: [gpu]}]}}}
            depends_on: {m: {condition: service_healthy, required: true}}
    """)
    (svc,) = load_compose_config(str(config)).services
    assert svc.argv == ["sglang", "serve", "--port", "30000"] and svc.environment == {"A": "1", "PRICE": "5$"}
    assert [(p.host_port, p.container_port) for p in svc.published_ports] == [(8080, 80)]
    assert svc.host_path("/etc/conf") == Path("/abs/conf") and svc.depends_on == {"m": "service_healthy"}
    assert svc.gpu_reservation.declared and svc.gpu_reservation.visible is None
