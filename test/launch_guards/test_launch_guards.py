"""The launch guard through sglang 0.5.23's real argument resolution.

`sglang serve` argv -> prepare_server_args -> resolve_once, with this package
loaded through its entry point, on a tiny DeepSeek-V4.1 config (no weights) on
the CPU with the platform overridden to CUDA; then the same commands with the
plugin filtered out (SGLANG_PLUGINS) to show stock behaviour; then `plan` and
`sglang serve`'s resolution side by side on every shipped compose file and on
every crash case as a compose file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import sglang_dsv41
from conftest import REPO_ROOT, run_python

HERE = Path(__file__).resolve().parent
TINY = Path(sglang_dsv41.__file__).parent / "data" / "tiny_dsv41"
# Every shipped topology; the node's shared Mooncake master (no sglang server of
# its own) is planned together with each of them instead.
SHIPPED = sorted(p for p in (REPO_ROOT / "deploy" / "b300-ds41").glob("*.yml") if p.name != "mooncake-master.yml")
CRASH_COMPOSE = sorted((HERE / "compose").glob("*.yml"))
COMPOSE_ENV = {
    "IMAGE": "registry.invalid/sglang-dsv41:test",
    "MODEL_PATH": "/data/models/DeepSeek-V4.1-Flash",
    "SGLANG_CACHE_DIR": "/data/cache/sglang",
}

REFUSAL = "[sglang-dsv41] refusing to start: "
TURNED_OFF_LOG = "[sglang-dsv41] decoder SWA bounded replay turned off: "
TURNED_OFF = "turned decoder SWA bounded replay off"
NOTHING = "no known-crash rule applies"
DP_RULE = "DP attention + DSpark + decoder SWA bounded replay"
CP_RULE = "prefill CP + DSpark + decoder SWA bounded replay"

IMPLICIT_DP_REPLAY = ["dp_dspark_implicit", "pd_decode_dp_dspark_implicit", "dp_dspark_implicit_kwargs"]
EXPLICIT_REPLAY = {
    "dp_dspark_explicit": "dp + dspark cannot use --enable-decoder-swa-bounded-replay",
    "dp_dspark_explicit_kwargs": "dp + dspark cannot use --enable-decoder-swa-bounded-replay",
    "cp_dspark_text_explicit": "cp4 + dspark + replay always crashes",
}
UNREPLAYED_PREFILL_GRAPH = {
    "cp_text_breakable": "breakable",
    "cp_text_breakable_json": "breakable",
    "cp_text_full": "full",
    "cp_text_full_opt_in": "full",
}
KNOWN_GOOD = ["dp_no_dspark", "tp_dspark", "cp_dspark_text", "cp_text", "tp_breakable",
              "dp_dspark_replay_off", "cp_text_breakable_opt_in"]
DSPARK_UNVERIFIED = {
    "cp_dspark_text_opt_in": "(SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED is not set)",
    "cp_dspark_text_opt_in_lower_acceptance": "records an acceptance length of 2.1 under the graph against 3.4 eager",
}
# Resolved under the opt-in with DSpark: the graph once verified; eager with a vision tower.
DSPARK_OPT_IN_RESOLVED = {"cp_dspark_text_opt_in_verified": "breakable", "cp_dspark_vision_opt_in": "disabled"}
# Every shipped topology with the opt-in and text-only CP servers (the .env knobs).
OPT_IN_ENV = {"SGLANG_DSV41_CP_BCG": "1", **{knob: "--language-model-only" for knob in (
    "CP_EXTRA_ARGS", "CP_DSPARK_EXTRA_ARGS", "CP_L3_EXTRA_ARGS", "CP2_EXTRA_ARGS")}}
VERIFIED_VALUE = "0.5.23:3.400:3.390"
# The text-only CP + DSpark servers (the PD prefill of pd-1p1d.yml is one already).
CP_DSPARK_SERVERS = {"cp-dspark.yml": 1, "cp-dspark-l3.yml": 1, "cp-instances.yml": 4, "pd-1p1d.yml": 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """The packaged tiny config with the bundled-DSpark-draft marker merged in
    (as `plan` does), with vision and text-only."""
    config = json.loads((TINY / "config.json").read_text())
    marker = json.loads((TINY / "dspark_draft_marker.json").read_text())
    config.update({k: v for k, v in marker.items() if not k.startswith("_")})
    out = {}
    for name, vision_layers in (("vision_checkpoint", None), ("text_checkpoint", 0)):
        target = tmp_path_factory.mktemp(name)
        cfg = dict(config) if vision_layers is None else {**config, "vision_n_layers": vision_layers}
        (target / "config.json").write_text(json.dumps(cfg))
        out[name] = str(target)
    return out


def _run_cases(request: dict, plugins: str | None, extra_env: dict | None = None) -> dict:
    env = {**COMPOSE_ENV, **(extra_env or {})}
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    script = str(HERE / "_guard_cases.py")
    code = (f"import runpy, sys\nsys.argv = [{script!r}, {json.dumps(request)!r}]\n"
            f"runpy.run_path({script!r}, run_name='__main__')\n")
    proc = run_python(code, env=env, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            case = json.loads(line[len("CASE "):])
            results[case["case"]] = case
        elif line.startswith("COMPOSE "):
            compose = json.loads(line[len("COMPOSE "):])
            results["compose:" + Path(compose["file"]).name] = compose
    return results


@pytest.fixture(scope="module")
def with_plugin(checkpoints) -> dict:
    request = {**checkpoints, "compose": [str(p) for p in CRASH_COMPOSE + SHIPPED]}
    return _run_cases(request, None)


@pytest.fixture(scope="module")
def stock(checkpoints) -> dict:
    return _run_cases(dict(checkpoints), "not_dsv41")


def _shipped_with(checkpoints, extra_env: dict) -> dict:
    request = {**checkpoints, "argv_cases": [], "kwarg_cases": False, "compose": [str(p) for p in SHIPPED]}
    return _run_cases(request, None, extra_env)


@pytest.fixture(scope="module")
def shipped_opt_in(checkpoints) -> dict:
    return _shipped_with(checkpoints, OPT_IN_ENV)


@pytest.fixture(scope="module")
def shipped_opt_in_verified(checkpoints) -> dict:
    return _shipped_with(checkpoints, {**OPT_IN_ENV, "SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED": VERIFIED_VALUE})


# --------------------------------------------------------------------------- replay


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", IMPLICIT_DP_REPLAY)
def test_replay_sglang_chose_is_turned_off_with_one_log_line(with_plugin, stock, name):
    ours, theirs = with_plugin[name], stock[name]
    # Stock 0.5.23 resolves replay on for DP attention + DSpark without being asked.
    assert theirs["ok"] and theirs["replay"] is True and theirs["raw_replay"] is None, theirs
    assert ours["ok"], ours
    assert ours["raw_replay"] is None and ours["replay"] is False, ours
    assert ours["guard"] == f"{TURNED_OFF} ({DP_RULE})"
    assert len(ours["guard_log"]) == 1, ours["guard_log"]
    line = ours["guard_log"][0]
    assert line.startswith(TURNED_OFF_LOG) and "\n" not in line
    assert "dp + dspark cannot use" in line and "--no-enable-decoder-swa-bounded-replay" in line
    # ... and the verdict reaches the schedulers with the pickled record; they
    # publish it (sglang_dsv41_launch_guard_active), the launcher cannot.
    assert ours["guard_in_scheduler"] == ours["guard"], ours
    assert theirs["guard_in_scheduler"] is None, theirs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(EXPLICIT_REPLAY))
def test_replay_asked_for_explicitly_is_refused(with_plugin, stock, name):
    ours, theirs = with_plugin[name], stock[name]
    assert theirs["ok"] and theirs["replay"] is True and theirs["raw_replay"] is True, theirs
    assert not ours["ok"] and ours["error"] is None, ours
    refusal = ours["refusal"]
    assert refusal.startswith(REFUSAL) and "\n" not in refusal, refusal
    assert EXPLICIT_REPLAY[name] in refusal
    assert "--enable-decoder-swa-bounded-replay was given" in refusal
    assert "remove --enable-decoder-swa-bounded-replay" in refusal
    assert ours["guard_log"] == []


# --------------------------------------------------------------------------- prefill graph under CP


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(UNREPLAYED_PREFILL_GRAPH))
def test_explicit_prefill_graph_under_deepseek_v4_cp_is_refused(with_plugin, stock, name):
    backend = UNREPLAYED_PREFILL_GRAPH[name]
    theirs = stock[name]
    # Stock resolves it and captures graphs that CP batches never replay.
    assert theirs["ok"] and theirs["prefill_backend"] == backend and theirs["attn_cp"] == 4, theirs
    ours = with_plugin[name]
    assert not ours["ok"] and ours["error"] is None, ours
    refusal = ours["refusal"]
    assert refusal.startswith(REFUSAL) and "\n" not in refusal, refusal
    assert f"--cuda-graph-backend-prefill {backend}" in refusal
    assert "never replayed" in refusal
    # The opt-in is offered only where it helps.
    assert ("SGLANG_DSV41_CP_BCG=1" in refusal) == (backend == "breakable")


@pytest.mark.timeout(600)
def test_breakable_under_cp_passes_with_the_opt_in(with_plugin):
    ours = with_plugin["cp_text_breakable_opt_in"]
    assert ours["ok"], ours
    assert ours["prefill_backend"] == "breakable" and ours["attn_cp"] == 4
    assert ours["guard"] == NOTHING


# --------------------------------------------------------------------------- DSpark under the CP graph


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(DSPARK_UNVERIFIED))
def test_dspark_under_the_cp_graph_opt_in_is_refused_until_its_acceptance_is_verified(with_plugin, stock, name):
    ours = with_plugin[name]
    assert not ours["ok"] and ours["error"] is None, ours
    refusal = ours["refusal"]
    assert refusal.startswith(REFUSAL + "SGLANG_DSV41_CP_BCG=1 puts DeepSeek-V4 prefill CP with DSpark")
    assert "\n" not in refusal and DSPARK_UNVERIFIED[name] in refusal
    # The way out: the verification, or eager CP prefill.
    assert "run deploy/b300-build/verify-cp-bcg.sh" in refusal and refusal.endswith(
        "or unset SGLANG_DSV41_CP_BCG (eager CP prefill)")
    assert stock[name]["ok"] and stock[name]["prefill_backend"] == "disabled"  # stock: eager, no opt-in


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(DSPARK_OPT_IN_RESOLVED))
def test_dspark_under_the_opt_in_resolves_where_verified_or_eager(with_plugin, name):
    ours = with_plugin[name]
    assert ours["ok"] and ours["guard"] == NOTHING, ours
    assert ours["prefill_backend"] == DSPARK_OPT_IN_RESOLVED[name] and ours["attn_cp"] == 4


def _agreeing_verdicts(result) -> dict[str, str]:
    serve, plan = result["serve"], _plan_verdicts(result["plan_output"])
    assert serve and plan == serve, result["plan_output"]
    return serve


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_plan_and_serve_agree_on_dspark_under_the_cp_graph_opt_in(shipped_opt_in, path):
    result = shipped_opt_in["compose:" + path.name]
    verdicts = _agreeing_verdicts(result)
    refused = [v for v in verdicts.values() if v.startswith("refused")]
    assert len(refused) == CP_DSPARK_SERVERS.get(path.name, 0), verdicts
    assert all("SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED is not set" in v for v in refused), refused
    assert result["plan_rc"] == (1 if refused else 0), result["plan_output"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_plan_and_serve_agree_once_the_acceptance_is_verified(shipped_opt_in_verified, path):
    result = shipped_opt_in_verified["compose:" + path.name]
    verdicts = _agreeing_verdicts(result)
    assert not any(v.startswith("refused") for v in verdicts.values()), verdicts
    assert result["plan_rc"] == 0, result["plan_output"]


# --------------------------------------------------------------------------- neighbours and stock


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", KNOWN_GOOD)
def test_known_good_neighbours_resolve_as_stock_does(with_plugin, stock, name):
    ours, theirs = with_plugin[name], stock[name]
    assert ours["ok"] and theirs["ok"], (ours, theirs)
    assert ours["guard"] == NOTHING and ours["guard_log"] == []
    for key in ("replay", "prefill_backend", "attn_cp"):
        assert ours[key] == theirs[key], (key, ours, theirs)


@pytest.mark.timeout(600)
def test_cp_dspark_without_replay_is_what_sglang_resolves_by_itself(stock):
    # The known-good CP + DSpark layout needs no flag: replay resolves off under CP.
    case = stock["cp_dspark_text"]
    assert case["ok"] and case["replay"] is False and case["attn_cp"] == 4, case


@pytest.mark.timeout(600)
def test_stock_runs_without_the_guard(stock):
    assert stock, "no cases ran"
    for name, case in stock.items():
        assert case.get("guard") is None and case["guard_log"] == [], (name, case)
        assert case["refusal"] is None, (name, case)


@pytest.mark.timeout(600)
def test_guard_judges_the_final_resolved_values(with_plugin):
    # Nothing after the guard's resolution step changes what the rules read;
    # replay differs only where the guard itself turned it off.
    judged = 0
    for name, case in with_plugin.items():
        if not name.startswith("compose:") and case.get("final_features"):
            at_guard, final = dict(case["guard_features"]), dict(case["final_features"])
            if case["guard"].startswith(TURNED_OFF):
                assert at_guard.pop("decoder_swa_bounded_replay") is True
                assert final.pop("decoder_swa_bounded_replay") is False
            assert at_guard == final, name
            judged += 1
    # Every argv case that resolved: the neighbours, the two implicit-replay argv cases
    # and DSpark under the opt-in where it resolves.
    assert judged == len(KNOWN_GOOD) + 2 + len(DSPARK_OPT_IN_RESOLVED)


# --------------------------------------------------------------------------- plan == serve


def _plan_verdicts(output: str) -> dict[str, str]:
    """Per sglang service, what `plan` printed: the guard's decision under its
    layout, or the refusal among the errors."""
    verdicts = {}
    lines = output.splitlines()
    for n, line in enumerate(lines):
        header = re.match(r"^(\S+) \[host [^\]]+\] port ", line)
        if header:
            guard = next((ln.strip() for ln in lines[n + 1:n + 4] if ln.strip().startswith("launch guard: ")),
                         None)
            verdicts[header.group(1)] = guard[len("launch guard: "):] if guard else None
        refused = re.match(r"^\s+ERROR (\S+): sglang serve refuses to start: (.*)$", line)
        if refused:
            verdicts[refused.group(1)] = "refused: " + refused.group(2)
    return verdicts


EXPECTED_COMPOSE = {
    "dp-dspark-implicit.yml": (0, f"{TURNED_OFF} ({DP_RULE})"),
    "dp-dspark-explicit.yml": (1, REFUSAL + "--enable-decoder-swa-bounded-replay was given"),
    "cp-dspark-explicit.yml": (1, REFUSAL + "--enable-decoder-swa-bounded-replay was given, but prefill"),
    "cp-breakable.yml": (1, REFUSAL + "an explicit breakable prefill CUDA graph"),
    "cp-breakable-opt-in.yml": (0, NOTHING),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", CRASH_COMPOSE + SHIPPED, ids=lambda p: p.name)
def test_plan_and_serve_give_the_same_verdict(with_plugin, path):
    result = with_plugin["compose:" + path.name]
    serve, plan = result["serve"], _plan_verdicts(result["plan_output"])
    assert serve, f"no sglang service in {path.name}"
    assert plan == serve, result["plan_output"]
    if path in SHIPPED:
        # Every shipped topology starts as written.
        assert result["plan_rc"] == 0, result["plan_output"]
        assert all(not v.startswith("refused") for v in serve.values()), serve
    else:
        rc, verdict = EXPECTED_COMPOSE[path.name]
        assert result["plan_rc"] == rc, result["plan_output"]
        (only,) = serve.values()
        assert only.removeprefix("refused: ").startswith(verdict) or only == verdict, only


def test_every_crash_compose_case_has_an_expectation():
    assert {p.name for p in CRASH_COMPOSE} == set(EXPECTED_COMPOSE)
