"""`sglang-dsv41 plan` on the shipped topologies and on known-bad ones.

Every case goes through sglang 0.5.23's real `sglang serve` parser and
resolution pipeline with this plugin loaded, in ONE interpreter (importing
sglang is the slow part), and the module's tests read its results.
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run_python

DEPLOY = REPO_ROOT / "deploy" / "b300-ds41"
HERE = Path(__file__).resolve().parent
BAD = HERE / "bad"

# Each shipped topology and facts its resolved layout must show.
SHIPPED = {
    "tp.yml": ["tp.yml/sglang [host local] port 30000, GPUs 0,1,2,3",
               "TP 4, EP 4, DP 1, attention TP 4, attention DP 1, attention CP 1; no PD; DSpark on",
               "vision on"],
    "dp-attention.yml": ["GPUs 0,1,2,3,4,5,6,7", "attention DP 8, attention CP 1; no PD; DSpark on",
                         "decoder SWA replay off"],
    "cp.yml": ["attention CP 4 (interleave); no PD; DSpark off", "vision on"],
    "cp-dspark.yml": ["TP 8, EP 8", "attention CP 8 (interleave); no PD; DSpark on", "decoder SWA replay off"],
    "cp-dspark-l3.yml": ["attention CP 4 (interleave)",
                         "hierarchical cache L2 + L3 mooncake (master 127.0.0.1:50051)",
                         "mooncake-master.yml/mooncake-master [host local] Mooncake master on port 50051"],
    "cp-instances.yml": ["cp-instances.yml/cp2-a [host local] port 30010, GPUs 0,1",
                         "cp-instances.yml/cp2-d [host local] port 30040, GPUs 6,7",
                         "router on port 30000 -> http://127.0.0.1:30010, http://127.0.0.1:30020, "
                         "http://127.0.0.1:30030, http://127.0.0.1:30040",
                         "(4 sglang servers, 1 routers, 1 Mooncake masters)"],
    "pd-1p1d.yml": ["attention CP 4 (interleave); PD prefill (bootstrap 8998)",
                    "attention DP 4, attention CP 1; PD decode", "vision off"],
    "pd-1p1d-vision.yml": ["PD prefill (bootstrap 8998)", "PD decode", "vision on"],
    "pd-3p1d.yml": ["PD prefill (bootstrap 8998)", "PD prefill (bootstrap 8999)", "PD prefill (bootstrap 9000)",
                    "pd-3p1d.yml/decode [host local] port 30040, GPUs 6,7",
                    "(4 sglang servers, 1 routers, 1 Mooncake masters)"],
    "pd-1p1d-tp-prefill.yml": ["attention TP 4, attention DP 1, attention CP 1; PD prefill (bootstrap 8998)",
                               "attention DP 4, attention CP 1; PD decode", "vision off"],
    "pd-1p1d-dp-prefill.yml": ["attention DP 4, attention CP 1; PD prefill (bootstrap 8998)", "PD decode"],
    "pd-1p1d-4gpu.yml": ["pd-1p1d-4gpu.yml/prefill [host local] port 30050, GPUs 4,5",
                         "attention CP 2 (interleave); PD prefill (bootstrap 8997)",
                         "pd-1p1d-4gpu.yml/decode [host local] port 30060, GPUs 6,7",
                         "router on port 30004"],
}
# The node's shared Mooncake master: planned beside every topology, as CI does.
MASTER = "mooncake-master.yml"

# Known-bad topology -> (label of the service blamed, fragments of the reason, number of problems).
BAD_CASES = {
    "crash-cp-dspark-replay.yml": ("crash-cp-dspark-replay.yml/sglang",
                                   ["cp4 + dspark + replay always crashes",
                                    "remove --enable-decoder-swa-bounded-replay"], 1),
    "crash-dp-dspark-replay.yml": ("crash-dp-dspark-replay.yml/sglang",
                                   ["dp + dspark cannot use --enable-decoder-swa-bounded-replay",
                                    "--no-enable-decoder-swa-bounded-replay"], 1),
    "pd-shape-mismatch.yml": ("pd-shape-mismatch.yml/prefill -> pd-shape-mismatch.yml/decode",
                              ["PD handshake would reject", "attn_tp_size: prefill=1, decode=4",
                               "attn_cp_size: prefill=2, decode=1"], 1),
    "pd-block-size-mismatch.yml": ("pd-block-size-mismatch.yml/prefill -> pd-block-size-mismatch.yml/decode",
                                   ["layout mismatch", "spec_layout.num_draft_tokens: prefill=6, decode=4"], 1),
    "gpu-overlap.yml": ("gpu-overlap.yml/b", ["GPU 1 is also used by gpu-overlap.yml/a"], 1),
    "zigzag-vision.yml": ("zigzag-vision.yml/sglang",
                          ["vision with prefill CP requires --cp-strategy interleave", "zigzag"], 1),
    "missing-mooncake-master.yml": ("missing-mooncake-master.yml/sglang",
                                    ["master 127.0.0.1:50051", "no mooncake_master service"], 1),
    "bootstrap-port-collision.yml": ("bootstrap-port-collision.yml/prefill-2",
                                     ["port 8998 (PD bootstrap) is also bound by bootstrap-port-collision.yml/prefill-1"], 1),
    "no-router.yml": ("no-router.yml/a", ["no router in the plan sends it traffic"], 2),
    "health-port-mismatch.yml": ("health-port-mismatch.yml/sglang",
                                 ["healthcheck does not probe its port 30000"], 1),
    "kv-staging-mismatch.yml": ("kv-staging-mismatch.yml/prefill -> kv-staging-mismatch.yml/decode",
                                ["SGLANG_DSV41_KV_STAGING=peer on the prefill only",
                                 "would send every block directly"], 2),
    "kv-staging-removed.yml": ("kv-staging-removed.yml/decode",
                               ["SGLANG_DSV41_KV_STAGING=1 (slot staging) was removed",
                                "set SGLANG_DSV41_KV_STAGING=peer"], 1),
    "gpu-count-mismatch.yml": ("gpu-count-mismatch.yml/sglang", ["needs 4 GPUs", "sees 2: 0,1"], 1),
    "pd-vision-one-side.yml": ("pd-vision-one-side.yml/prefill -> pd-vision-one-side.yml/decode",
                               ["vision is on for one side only"], 1),
    "router-bootstrap-mismatch.yml": ("router-bootstrap-mismatch.yml/router",
                                      ["gives bootstrap port 8999", "serves bootstrap on 8998"], 1),
    "pd-dspark-dynamic-verify.yml": ("pd-dspark-dynamic-verify.yml/prefill",
                                     ["sglang refuses these arguments", "requires static verify"], 1),
    "port-out-of-range.yml": ("port-out-of-range.yml/sglang",
                              ["port 99999 (HTTP (--port)) is not a TCP port (1 to 65535)"], 1),
    "negative-base-gpu.yml": ("negative-base-gpu.yml/sglang", ["--base-gpu-id must not be negative"], 1),
    "pp-size-zero.yml": ("pp-size-zero.yml/sglang", ["--pp-size 0: must be at least 1"], 1),
    "mooncake-master-bad-port.yml": ("mooncake-master-bad-port.yml/sglang",
                                     ["Mooncake master '127.0.0.1:abc': the port is not a TCP port"], 1),
    "router-odd-arguments.yml": ("router-odd-arguments.yml/router",
                                 ["http://127.0.0.1:99999: not a server URL (Port out of range"], 2),
}

ENV = {
    "IMAGE": "registry.invalid/sglang-dsv41:test",
    "MODEL_PATH": "/data/models/DeepSeek-V4.1-Flash",
    "SGLANG_CACHE_DIR": "/data/cache/sglang",
    # The operator's shell filters the plugin out: plan must run its validators anyway
    # (zigzag-vision.yml is refused only by them).
    "SGLANG_PLUGINS": "__none__",
    "SGLANG_PLATFORM": "some_other_platform",
}


def _errors(output: str) -> list[str]:
    return [line.strip()[len("ERROR "):] for line in output.splitlines() if line.strip().startswith("ERROR ")]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    # A copy without any .env a developer keeps there: the shipped defaults are checked.
    deploy = tmp_path_factory.mktemp("deploy") / "b300-ds41"
    shutil.copytree(DEPLOY, deploy, ignore=shutil.ignore_patterns(".env"))
    cases = {f"shipped:{name}": [str(deploy / MASTER), str(deploy / name)] for name in SHIPPED}
    cases.update({f"bad:{name}": [str(BAD / name)] for name in BAD_CASES})
    # Two topologies meant as alternatives, planned together on one host.
    cases["together:tp+cp"] = [str(deploy / "tp.yml"), str(deploy / "cp.yml")]
    # A PD deployment split over two files, no router: both halves and their pair are checked.
    cases["split-pd"] = [str(BAD / "split" / "prefill.yml"), str(BAD / "split" / "decode.yml")]
    # A compose file that does not parse the way compose reads it.
    cases["unreadable"] = [str(BAD / "does-not-exist.yml")]
    # Holes where plan used to pass what it did not check (see the fail-closed tests below).
    for name in ("shell-wrapped-overlap.yml", "nvlink-separate-pid.yml", "nvlink-expandable-segments.yml",
                 "profile-overlap.yml"):
        cases[f"hole:{name}"] = [str(BAD / name)]
    cases["hole:profile-active"] = {"files": [str(BAD / "profile-overlap.yml")], "profiles": ["debug"]}
    cases["hole:host-memory"] = {"files": [str(BAD / "host-memory.yml")], "host_memory_gb": 200}
    cases["hole:host-memory-unchecked"] = [str(BAD / "host-memory.yml")]
    cases["hole:host-memory-ratio"] = {"files": [str(deploy / "pd-1p1d.yml")], "host_memory_gb": 2000}
    cases["hole:gpus-per-node"] = {"files": [str(deploy / "pd-1p1d.yml")], "gpus_per_node": 4}
    # .env values that refer to other variables, as compose expands them.
    chained = tmp_path_factory.mktemp("chained") / "b300-ds41"
    shutil.copytree(DEPLOY, chained, ignore=shutil.ignore_patterns(".env"))
    (chained / ".env").write_text("PORT_BASE=310\nTP_PORT=${PORT_BASE}00\nTP_GPUS=\"${FIRST_GPU:-4},5,6,7\"\n")
    cases["hole:env-chain"] = [str(chained / "tp.yml")]
    # The shipped PD router with sglang_router's fault defaults back: a dead decode would hang its clients.
    defaults = tmp_path_factory.mktemp("router-defaults") / "b300-ds41"
    shutil.copytree(DEPLOY, defaults, ignore=shutil.ignore_patterns(".env"))
    pd = defaults / "pd-1p1d.yml"
    pd.write_text(re.sub(r"\n\s*--(cb|health)-[a-z-]+ \S+( --(cb|health)-[a-z-]+ \S+)?", "", pd.read_text()))
    cases["warn:router-defaults"] = [str(pd)]
    # tp.yml twice (same GPUs and ports): labelled for two hosts; both on this host, as one
    # project name or as two (the second copy's .env renames its project).
    for case, labels, rename in (("hosts:two", ["node-a", "node-b"], False), ("hosts:one-name", [None, None], False),
                                 ("hosts:one", [None, None], True)):
        cases[case] = []
        for label in labels:
            copy = tmp_path_factory.mktemp("host") / "b300-ds41"
            shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns(".env"))
            if label:
                text = (copy / "tp.yml").read_text().replace(
                    "sglang-mooncake-store}\n", f"sglang-mooncake-store}}\n    labels: {{sglang-dsv41.host: {label}}}\n", 1)
                (copy / "tp.yml").write_text(text)
            if rename and cases[case]:
                (copy / ".env").write_text((copy / ".env.example").read_text() + "COMPOSE_PROJECT_NAME=ds41-tp-b\n")
            cases[case].append(str(copy / "tp.yml"))
    # The normalized output of `docker compose config`, read instead of the source file.
    config = tmp_path_factory.mktemp("config") / "tp.config.yml"
    config.write_text((HERE / "compose-config" / "tp.yml").read_text().replace("__DEPLOY__", str(deploy)))
    cases["compose-config:tp"] = {"configs": [str(config)]}
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


def test_shipped_topologies_are_exactly_the_documented_ones():
    on_disk = {p.name for p in DEPLOY.glob("*.yml")}
    assert on_disk == set(SHIPPED) | {MASTER}
    readme = (DEPLOY / "README.md").read_text()
    for name in SHIPPED:
        assert f"`{name}`" in readme, f"{name} missing from deploy/b300-ds41/README.md"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_topology_passes_plan(results, name):
    result = results[f"shipped:{name}"]
    assert result["rc"] == 0, result["output"]
    assert "plan: OK" in result["output"]
    for fact in SHIPPED[name]:
        assert fact in result["output"], f"{fact!r} not in:\n{result['output']}"


@pytest.mark.parametrize("name", sorted(n for n in SHIPPED if n.startswith("pd-")))
def test_shipped_pd_routers_fail_fast_when_a_server_dies(results, name):
    assert "WARNING" not in "".join(
        line for line in results[f"shipped:{name}"]["output"].splitlines() if "/router:" in line)


def test_pd_router_with_the_fault_defaults_is_warned_about(results):
    result = results["warn:router-defaults"]
    assert result["rc"] == 0 and "plan: OK" in result["output"], result["output"]
    warning = [line for line in result["output"].splitlines() if line.startswith("plan: WARNING pd-1p1d.yml/router:")]
    assert len(warning) == 1, result["output"]
    assert "would wait about 300 s" in warning[0] and "--cb-failure-threshold 1" in warning[0], warning


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_topology_is_rejected_naming_service_and_reason(results, name):
    blamed, reasons, count = BAD_CASES[name]
    result = results[f"bad:{name}"]
    assert result["rc"] == 1, result["output"]
    errors = _errors(result["output"])
    assert len(errors) == count, result["output"]
    mine = [e for e in errors if e.startswith(blamed + ": ")]
    assert mine, f"no error blames {blamed}:\n{result['output']}"
    for reason in reasons:
        assert any(reason in e for e in mine), f"{reason!r} not in {mine}"


def test_router_arguments_no_router_reads_are_problems_not_crashes(results):
    output = results["bad:router-odd-arguments.yml"]["output"]
    assert ("router-odd-arguments.yml/router-b: cannot read the router arguments: ambiguous option: --p could "
            "match --port, --pd-disaggregation, --prefill, --prometheus-port") in _errors(output)
    assert ("WARNING router-odd-arguments.yml/router: a prefill's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT is "
            "not a whole number of seconds") in output
    assert "Traceback" not in output and "usage:" not in output


def test_alternative_topologies_together_collide_on_gpus_and_port(results):
    result = results["together:tp+cp"]
    assert result["rc"] == 1
    errors = _errors(result["output"])
    assert any(re.match(r"cp\.yml/sglang: GPUs 0,1,2,3 are also used by tp\.yml/sglang", e) for e in errors), errors
    assert any("port 30000 (HTTP (--port)) is also bound by tp.yml/sglang" in e for e in errors), errors


def test_files_of_different_hosts_are_judged_apart(results):
    two = results["hosts:two"]
    assert two["rc"] == 0 and "plan: OK (2 sglang servers" in two["output"], two["output"]
    assert "tp.yml/sglang [host node-a]" in two["output"] and "tp.yml/sglang [host node-b]" in two["output"]
    errors = _errors(results["hosts:one-name"]["output"])
    assert results["hosts:one-name"]["rc"] == 1 and len(errors) == 1, errors
    assert "project name 'ds41-tp' is also the project of tp.yml (host local)" in errors[0], errors
    errors = _errors(results["hosts:one"]["output"])
    assert results["hosts:one"]["rc"] == 1 and len(errors) == 2, errors
    assert any(re.match(r"tp\.yml/sglang: GPUs 0,1,2,3 are also used by tp\.yml/sglang", e) for e in errors), errors
    assert any("port 30000 (HTTP (--port)) is also bound by tp.yml/sglang" in e for e in errors), errors


def test_pd_halves_in_separate_files_are_paired_even_without_router(results):
    errors = _errors(results["split-pd"]["output"])
    assert len(errors) == 3, errors
    assert any(e.startswith("prefill.yml/prefill -> decode.yml/decode: the PD handshake would reject") for e in errors)
    assert any(e.startswith("prefill.yml/prefill: is a PD server but no router") for e in errors)
    assert any(e.startswith("decode.yml/decode: is a PD server but no router") for e in errors)


def test_unreadable_file_is_reported_with_status_2(results):
    result = results["unreadable"]
    assert result["rc"] == 2
    assert "does-not-exist.yml" in result["output"] and "no such compose file" in result["output"]


# --------------------------------------------------------------------------- fail closed
# Each test below is a way `plan` used to say OK (or skip a service) without
# having checked it; now it fails closed.


def test_plugin_validators_run_whatever_the_calling_shell_filters(results):
    # The harness runs with SGLANG_PLUGINS=__none__ and another SGLANG_PLATFORM set;
    # only the plugin's own validator refuses zigzag CP with vision.
    assert "SGLANG_PLUGINS" in ENV and "SGLANG_PLATFORM" in ENV
    result = results["bad:zigzag-vision.yml"]
    assert result["rc"] == 1 and "requires --cp-strategy interleave" in result["output"], result["output"]


def test_shell_wrapped_server_is_followed_and_checked(results):
    result = results["hole:shell-wrapped-overlap.yml"]
    assert result["rc"] == 1, result["output"]
    assert "shell-wrapped-overlap.yml/wrapped [host local] port 30020, GPUs 0,1" in result["output"]
    assert _errors(result["output"]) == [
        "shell-wrapped-overlap.yml/wrapped: GPUs 0,1 are also used by shell-wrapped-overlap.yml/plain (host local)",
    ]


def test_nvlink_intra_pd_needs_one_pid_namespace(results):
    errors = _errors(results["hole:nvlink-separate-pid.yml"]["output"])
    assert len(errors) == 1, errors
    assert errors[0].startswith("nvlink-separate-pid.yml/prefill -> nvlink-separate-pid.yml/decode: the KV transfer "
                                "uses Mooncake's intra-node NVLink transport (MC_INTRANODE_NVLINK is set)")
    assert "separate PID namespaces" in errors[0] and "pid: host" in errors[0]


def test_nvlink_intra_refuses_expandable_segments(results):
    errors = _errors(results["hole:nvlink-expandable-segments.yml"]["output"])
    assert len(errors) == 1, errors
    assert errors[0].startswith("nvlink-expandable-segments.yml/decode: PYTORCH_CUDA_ALLOC_CONF turns on "
                                "expandable_segments")
    assert "cudaIpcGetMemHandle" in errors[0]


def test_inactive_profiles_are_skipped_and_active_ones_checked(results):
    skipped = results["hole:profile-overlap.yml"]
    assert skipped["rc"] == 0, skipped["output"]
    assert "skipping services of inactive profiles: debug (debug)" in skipped["output"]
    active = results["hole:profile-active"]
    assert active["rc"] == 1
    errors = _errors(active["output"])  # reported on whichever of the two the reader lists second
    assert ("profile-overlap.yml/debug: GPUs 0,1 are also used by profile-overlap.yml/sglang (host local)" in errors
            or "profile-overlap.yml/sglang: GPUs 0,1 are also used by profile-overlap.yml/debug (host local)" in errors), \
        errors


def test_host_memory_is_checked_when_given(results):
    assert results["hole:host-memory-unchecked"]["rc"] == 0, results["hole:host-memory-unchecked"]["output"]
    errors = _errors(results["hole:host-memory"]["output"])
    assert errors == ["host local: the servers pin 240 GB of host memory (host-memory.yml/sglang hicache 60 GB x 4 "
                      "ranks 240 GB), more than --host-memory-gb 200"], errors
    # A host pool sized relative to GPU memory cannot be checked offline: said, not passed.
    errors = _errors(results["hole:host-memory-ratio"]["output"])
    assert any(e.startswith("pd-1p1d.yml/prefill: its hierarchical cache's host pool is sized by --hicache-ratio 2.5")
               for e in errors), errors


def test_gpu_ids_beyond_the_node_are_refused(results):
    result = results["hole:gpus-per-node"]
    assert result["rc"] == 1
    assert "pd-1p1d.yml/decode: names GPU 4, 5, 6, 7, but a node has GPUs 0-3 (--gpus-per-node 4)" in \
        _errors(result["output"]), result["output"]


def test_env_values_that_refer_to_other_variables(results):
    result = results["hole:env-chain"]
    assert result["rc"] == 0, result["output"]
    assert "tp.yml/sglang [host local] port 31000, GPUs 4,5,6,7" in result["output"]


def test_compose_config_output_plans_like_the_source_file(results):
    config, source = results["compose-config:tp"], results["shipped:tp.yml"]
    assert config["rc"] == 0, config["output"]
    layout = [ln for ln in source["output"].splitlines() if ln.startswith(("tp.yml/", "    TP "))]
    assert layout
    for line in layout:
        assert line.replace("tp.yml/", "tp.config.yml/") in config["output"], line


def test_kv_staging_values_a_server_would_refuse_are_reported(results):
    errors = _errors(results["bad:kv-staging-mismatch.yml"]["output"])
    refused = [e for e in errors if e.startswith("kv-staging-mismatch.yml/decode-2: ")]
    assert len(refused) == 1, errors
    assert "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS='lots' is not an integer" in refused[0]
    # decode-2 is left out of the pair check: its setting is already an error
    assert not any(e.startswith("kv-staging-mismatch.yml/prefill -> kv-staging-mismatch.yml/decode-2") for e in errors)
