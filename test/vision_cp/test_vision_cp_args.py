"""DeepSeek-V4.1 vision + prefill CP argument rules through sglang's real resolution.

`sglang serve` argv -> prepare_server_args -> resolve_once, on a tiny V4.1
config shipped in the package (no weights), on the CPU with the platform
overridden to CUDA. Run once with the plugin and once with SGLANG_PLUGINS set
so that it is not loaded, to show which verdicts are ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sglang_dsv41
from conftest import run_python
from sglang_dsv41.vision_cp.rules import VisionCPArgs, check_vision_prefill_cp

HERE = Path(__file__).parent
TINY = Path(sglang_dsv41.__file__).parent / "data" / "tiny_dsv41"


def _resolve_all(tmp_path_factory, plugins: str | None) -> dict:
    text = tmp_path_factory.mktemp("tiny_text")
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["vision_n_layers"] = 0
    (text / "config.json").write_text(json.dumps(cfg))
    script = (HERE / "_resolve_cases.py").read_text()
    code = f"import sys\nsys.argv = ['x', {str(TINY)!r}, {str(text)!r}]\n" + script
    env = {"SGLANG_PLUGINS": plugins} if plugins is not None else {}
    proc = run_python(code, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = [json.loads(l[5:]) for l in proc.stdout.splitlines() if l.startswith("CASE ")]
    return {c["case"]: c for c in cases}


@pytest.fixture(scope="module")
def with_plugin(tmp_path_factory):
    return _resolve_all(tmp_path_factory, None)


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return _resolve_all(tmp_path_factory, "not_dsv41")


def test_interleave_resolves_with_prefill_graph_disabled(with_plugin):
    case = with_plugin["vision_interleave"]
    assert case["ok"], case
    assert case["attn_cp"] == 2
    assert case["prefill_backend"] == "disabled"


@pytest.mark.parametrize(
    "name, message",
    [
        ("vision_zigzag", "vision with prefill CP requires --cp-strategy interleave; got 'zigzag'"),
        ("vision_explicit_breakable", "runs eager prefill; remove the explicit --cuda-graph-backend-prefill"),
        ("vision_dspark_decoder_replay", "does not support DSpark together with --enable-decoder-swa-bounded-replay"),
        ("vision_encoder_replay", "--enable-encoder-swa-bounded-replay does not support context parallelism"),
    ],
)
def test_bad_vision_cp_combinations_are_rejected(with_plugin, name, message):
    case = with_plugin[name]
    assert not case["ok"]
    assert message in case["error"], case["error"]


def test_rules_do_not_touch_text_only_or_non_cp_servers(with_plugin, stock):
    # Text-only checkpoint / --language-model-only: the explicit prefill graph is
    # judged by upstream alone, so our verdict equals stock's.
    for name in ("text_explicit_breakable", "vision_language_model_only_breakable", "vision_no_cp"):
        ours, theirs = with_plugin[name], stock[name]
        if not ours["ok"] and theirs["ok"]:
            # The launch guard (test/launch_guards) refuses an explicit prefill graph
            # that DeepSeek-V4 prefill CP would never replay, vision or not.
            assert "never replayed" in ours["error"], (name, ours)
        else:
            assert ours["ok"] == theirs["ok"], (name, ours, theirs)
        if not ours["ok"]:
            assert "vision with prefill CP" not in ours["error"]


def test_stock_sglang_accepts_what_the_plugin_rejects(stock):
    # Without the plugin 0.5.23 lets these through: the rules are really ours.
    assert stock["vision_explicit_breakable"]["ok"], stock["vision_explicit_breakable"]
    assert stock["vision_encoder_replay"]["ok"], stock["vision_encoder_replay"]
    zigzag = stock["vision_zigzag"]
    assert zigzag["error"] is None or "vision with prefill CP" not in zigzag["error"]


def _args(**over):
    base = dict(model_type="deepseek_v41", vision_layers=2, language_model_only=False,
                enable_prefill_cp=True, cp_strategy="interleave", prefill_graph_enabled=False,
                prefill_graph_explicit=False, speculative_algorithm=None,
                decoder_swa_bounded_replay=None, encoder_swa_bounded_replay=False)
    base.update(over)
    return VisionCPArgs(**base)


def test_rule_unit_cases():
    assert check_vision_prefill_cp(_args()).disable_prefill_graph is False
    assert check_vision_prefill_cp(_args(prefill_graph_enabled=True)).disable_prefill_graph
    with pytest.raises(ValueError, match="interleave"):
        check_vision_prefill_cp(_args(cp_strategy="zigzag"))
    # Not V4.1, or no CP, or no vision: nothing to say.
    assert not check_vision_prefill_cp(_args(model_type="deepseek_v4", cp_strategy="zigzag")).disable_prefill_graph
    check_vision_prefill_cp(_args(enable_prefill_cp=False, cp_strategy="zigzag"))
    check_vision_prefill_cp(_args(vision_layers=0, cp_strategy="zigzag"))
    # DSpark alone is fine; decoder replay alone is fine.
    check_vision_prefill_cp(_args(speculative_algorithm="DSPARK"))
    check_vision_prefill_cp(_args(decoder_swa_bounded_replay=True))
    with pytest.raises(ValueError, match="DSpark"):
        check_vision_prefill_cp(_args(speculative_algorithm="dspark", decoder_swa_bounded_replay=True))
    with pytest.raises(ValueError, match="context parallelism"):
        check_vision_prefill_cp(_args(vision_layers=0, encoder_swa_bounded_replay=True))
