"""DeepSeek-V4 interleave prefill CP + breakable prefill graph: argument resolution.

`sglang serve` argv -> prepare_server_args -> resolve_once on the tiny V4.1 config
shipped in the package (no weights), on the CPU with the platform overridden to
CUDA, in fresh interpreters: with the plugin and SGLANG_DSV41_CP_BCG=1, with the
plugin and the setting unset, and without the plugin. Each case also reports what
both bindings of `supports_prefill_cp_bcg` answer (the package attribute the
resolution steps import lazily, and the prefill graph runner's by-name import),
which interleave adapter `get_cp_bcg_input_type` hands out and which capture
buckets survive.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sglang_dsv41
from conftest import run_python
from sglang_dsv41.cp_bcg.rules import CPBCGArgs, cp_bcg_refusal, parse_cp_bcg_setting

HERE = Path(__file__).parent
TINY = Path(sglang_dsv41.__file__).parent / "data" / "tiny_dsv41"
ADAPTER = "DeepseekV4InterleaveCPBCGInput"
UPSTREAM_ADAPTER = "InterleaveCPBCGInput"


def _resolve_all(tmp_path_factory, env: dict) -> dict:
    text = tmp_path_factory.mktemp("tiny_text")
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["vision_n_layers"] = 0
    (text / "config.json").write_text(json.dumps(cfg))
    script = (HERE / "_resolve_bcg_cases.py").read_text()
    code = f"import sys\nsys.argv = ['x', {str(TINY)!r}, {str(text)!r}]\n" + script
    proc = run_python(code, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = [json.loads(l[5:]) for l in proc.stdout.splitlines() if l.startswith("CASE ")]
    (binding,) = [json.loads(l[8:]) for l in proc.stdout.splitlines() if l.startswith("BINDING ")]
    return {"binding": binding, **{c["case"]: c for c in cases}}


@pytest.fixture(scope="module")
def bcg_on(tmp_path_factory):
    return _resolve_all(tmp_path_factory, {"SGLANG_DSV41_CP_BCG": "1"})


@pytest.fixture(scope="module")
def bcg_off(tmp_path_factory):
    return _resolve_all(tmp_path_factory, {"SGLANG_DSV41_CP_BCG": ""})


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return _resolve_all(tmp_path_factory, {"SGLANG_PLUGINS": "not_dsv41", "SGLANG_DSV41_CP_BCG": "1"})


SUPPORTED = ("text_interleave", "text_interleave_tp4", "text_interleave_ep_tp",
             "vision_language_model_only")
UNSUPPORTED = ("text_zigzag", "text_no_cp", "vision_interleave")


@pytest.mark.parametrize("name", SUPPORTED)
def test_bcg_opt_in_resolves_text_interleave_cp_to_the_breakable_prefill_graph(bcg_on, name):
    case = bcg_on[name]
    assert case["ok"], case
    assert case["supports_unpatched"] is False  # stock never captures DeepSeek-V4 under CP
    assert case["attn_cp"] > 1
    assert case["prefill_backend"] == "breakable", case
    # every binding sglang calls sees the same answer
    assert case["supports_package"] is True and case["supports_runner_binding"] is True
    assert case["interleave_adapter"] == ADAPTER


@pytest.mark.parametrize("name", SUPPORTED + UNSUPPORTED)
def test_bcg_off_by_default_matches_stock_sglang(bcg_off, stock, name):
    ours, theirs = bcg_off[name], stock[name]
    assert ours == theirs, (ours, theirs)
    if ours["ok"]:
        assert ours["prefill_backend"] != "breakable" or ours["attn_cp"] == 1
        assert ours["supports_package"] is False and ours["supports_runner_binding"] is False
        assert ours["interleave_adapter"] == UPSTREAM_ADAPTER


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_bcg_opt_in_leaves_unsupported_shapes_eager(bcg_on, stock, name):
    case = bcg_on[name]
    if not case["ok"]:  # upstream refuses the shape itself (zigzag needs NPU for DSv4)
        assert case["error"] == stock[name]["error"]
        return
    assert case["supports_package"] is False and case["supports_runner_binding"] is False
    assert case["prefill_backend"] == stock[name]["prefill_backend"]
    if case["attn_cp"] > 1:
        assert case["prefill_backend"] == "disabled"


def test_bcg_vision_under_cp_stays_eager_but_language_model_only_is_captured(bcg_on):
    assert bcg_on["vision_interleave"]["prefill_backend"] == "disabled"
    assert bcg_on["vision_language_model_only"]["prefill_backend"] == "breakable"


def test_bcg_decoder_swa_replay_is_excluded(bcg_on, stock):
    case = bcg_on["text_decoder_swa_replay"]
    if case["ok"]:
        assert case["supports_package"] is False and case["supports_runner_binding"] is False
        assert case["prefill_backend"] != "breakable"
    else:  # upstream itself refuses the combination: then it must refuse it the same way
        assert case["error"] == stock["text_decoder_swa_replay"]["error"]


def test_bcg_minimum_capture_bucket_is_the_cp_size_for_interleave(bcg_on):
    assert bcg_on["text_interleave"]["capture_buckets"] == [2, 3, 4, 8, 16]
    assert bcg_on["text_interleave_tp4"]["capture_buckets"] == [4, 8, 16]


def test_bcg_runner_binding_imported_before_plugins_is_rewritten(bcg_on, bcg_off):
    for result in (bcg_on, bcg_off):
        assert result["binding"] == {"runner_is_package_attribute": True, "runner_rebound": True}


# --- the gate's rules, one condition at a time -------------------------------------------

def _args(**changes) -> CPBCGArgs:
    base = dict(
        is_deepseek_v4=True, prefill_attention_backend="dsv4", enable_prefill_cp=True,
        cp_strategy="interleave", tp_size=4, attn_cp_size=4, pp_size=1, dp_size=1,
        enable_dp_attention=False, ep_size=1, decoder_swa_bounded_replay=False,
        vision_layers=0, language_model_only=False,
    )
    base.update(changes)
    return CPBCGArgs(**base)


def test_bcg_gate_accepts_the_supported_shape():
    assert cp_bcg_refusal(_args(), enabled=True) is None
    assert cp_bcg_refusal(_args(ep_size=4), enabled=True) is None
    assert cp_bcg_refusal(_args(vision_layers=2, language_model_only=True), enabled=True) is None


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({}, "SGLANG_DSV41_CP_BCG is not 1"),
        ({"is_deepseek_v4": False}, "not a DeepSeek-V4 model"),
        ({"prefill_attention_backend": "fa3"}, "not 'dsv4'"),
        ({"enable_prefill_cp": False}, "prefill CP is off"),
        ({"cp_strategy": "zigzag"}, "not 'interleave'"),
        ({"attn_cp_size": 2}, "must equal TP"),
        ({"tp_size": 1, "attn_cp_size": 1}, "must equal TP"),
        ({"pp_size": 2}, "pipeline parallelism"),
        ({"dp_size": 2}, "data-parallel attention"),
        ({"enable_dp_attention": True}, "data-parallel attention"),
        ({"ep_size": 2}, "neither 1 nor TP"),
        ({"decoder_swa_bounded_replay": True}, "decoder SWA bounded replay"),
        ({"vision_layers": 2}, "vision tower under CP"),
    ],
)
def test_bcg_gate_refuses_each_unsupported_condition(changes, reason):
    enabled = bool(changes)
    refusal = cp_bcg_refusal(_args(**changes), enabled=enabled)
    assert refusal is not None and reason in refusal


@pytest.mark.parametrize("raw, value", [(None, False), ("", False), ("0", False),
                                        (" 1 ", True), ("1", True)])
def test_bcg_setting_values(raw, value):
    assert parse_cp_bcg_setting(raw) is value


@pytest.mark.parametrize("raw", ["yes", "true", "2", "on"])
def test_bcg_setting_refuses_other_values(raw):
    with pytest.raises(ValueError, match="SGLANG_DSV41_CP_BCG must be 0 or 1"):
        parse_cp_bcg_setting(raw)


@pytest.mark.timeout(300)
def test_bcg_bad_setting_stops_plugin_load_naming_the_patch():
    proc = run_python(
        "from sglang.srt.plugins import load_plugins\nload_plugins()\nprint('LOADED')",
        env={"SGLANG_DSV41_CP_BCG": "yes"}, timeout=290,
    )
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert "CPBCG-" in proc.stderr and "SGLANG_DSV41_CP_BCG must be 0 or 1" in proc.stderr


def test_bcg_setting_is_read_per_resolution(bcg_on):
    """One process, the same server, the setting off for its resolution only (how
    `plan` resolves each service under its own environment): stock answer."""
    case = bcg_on["text_interleave@setting_off"]
    assert case["ok"] and case["prefill_backend"] == "disabled"
    assert case["supports_package"] is False and case["interleave_adapter"] == UPSTREAM_ADAPTER
    assert bcg_on["text_interleave"]["prefill_backend"] == "breakable"


def test_bcg_explicit_disabled_prefill_graph_is_respected(bcg_on):
    case = bcg_on["text_explicit_disabled"]
    assert case["supports_package"] is True
    assert case["prefill_backend"] == "disabled"

