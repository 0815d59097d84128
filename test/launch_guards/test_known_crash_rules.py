"""The known-crash rule set on its own (launch_guards/rules.py, no sglang import),
and the place in sglang's resolution pipeline the guard relies on."""

from __future__ import annotations

import ast
import itertools
from importlib.metadata import distribution

import pytest

from sglang_dsv41.cp_bcg.setting import CP_BCG_ENV
from sglang_dsv41.launch_guards.rules import (
    REPLAY_UNDER_CP,
    REPLAY_UNDER_DP_ATTENTION,
    UNREPLAYED_CP_PREFILL_GRAPH,
    CrashFeatures,
    GuardAction,
    known_crash,
    launch_verdict,
)
from sglang_dsv41.plugin.table import by_id


def _features(**over) -> CrashFeatures:
    base = dict(dspark=True, decoder_swa_bounded_replay=True, enable_prefill_cp=False, attn_cp_size=1,
                attn_dp_size=1, replay_requested=False, deepseek_v4=True, prefill_graph_backend="disabled",
                prefill_graph_requested=False, cp_graph_supported=False, cp_graph_opt_in=False)
    base.update(over)
    return CrashFeatures(**base)


@pytest.mark.parametrize("over, action, rule", [
    # DP attention + DSpark + replay: sglang's default -> off; asked for -> refused.
    (dict(attn_dp_size=8), GuardAction.TURN_OFF_REPLAY, REPLAY_UNDER_DP_ATTENTION),
    (dict(attn_dp_size=8, replay_requested=True), GuardAction.REFUSE, REPLAY_UNDER_DP_ATTENTION),
    # Prefill CP + DSpark + replay (sglang never defaults replay on under CP; the rule does not care).
    (dict(enable_prefill_cp=True, attn_cp_size=4), GuardAction.TURN_OFF_REPLAY, REPLAY_UNDER_CP),
    (dict(enable_prefill_cp=True, attn_cp_size=4, replay_requested=True), GuardAction.REFUSE, REPLAY_UNDER_CP),
    (dict(attn_cp_size=2, replay_requested=True), GuardAction.REFUSE, REPLAY_UNDER_CP),
    # Neighbours: no DSpark, no replay, plain TP.
    (dict(attn_dp_size=8, dspark=False), GuardAction.NONE, None),
    (dict(attn_dp_size=8, decoder_swa_bounded_replay=False), GuardAction.NONE, None),
    (dict(enable_prefill_cp=True, attn_cp_size=4, decoder_swa_bounded_replay=False), GuardAction.NONE, None),
    (dict(replay_requested=True), GuardAction.NONE, None),
    # Explicit prefill graphs under DeepSeek-V4 prefill CP.
    (dict(decoder_swa_bounded_replay=False, enable_prefill_cp=True, attn_cp_size=4,
          prefill_graph_backend="breakable", prefill_graph_requested=True),
     GuardAction.REFUSE, UNREPLAYED_CP_PREFILL_GRAPH),
    (dict(decoder_swa_bounded_replay=False, enable_prefill_cp=True, attn_cp_size=4,
          prefill_graph_backend="full", prefill_graph_requested=True, cp_graph_opt_in=True),
     GuardAction.REFUSE, UNREPLAYED_CP_PREFILL_GRAPH),
    (dict(decoder_swa_bounded_replay=False, enable_prefill_cp=True, attn_cp_size=4,
          prefill_graph_backend="breakable", prefill_graph_requested=True, cp_graph_opt_in=True),
     GuardAction.NONE, None),
    (dict(decoder_swa_bounded_replay=False, enable_prefill_cp=True, attn_cp_size=4,
          prefill_graph_backend="breakable", prefill_graph_requested=True, cp_graph_supported=True),
     GuardAction.NONE, None),
    # Chosen by sglang (not requested), not DeepSeek-V4, no CP, or disabled: not ours to judge.
    (dict(decoder_swa_bounded_replay=False, enable_prefill_cp=True, attn_cp_size=4,
          prefill_graph_backend="breakable"), GuardAction.NONE, None),
    (dict(decoder_swa_bounded_replay=False, enable_prefill_cp=True, attn_cp_size=4, deepseek_v4=False,
          prefill_graph_backend="breakable", prefill_graph_requested=True), GuardAction.NONE, None),
    (dict(decoder_swa_bounded_replay=False, prefill_graph_backend="breakable", prefill_graph_requested=True),
     GuardAction.NONE, None),
    (dict(decoder_swa_bounded_replay=False, enable_prefill_cp=True, attn_cp_size=4,
          prefill_graph_backend="disabled", prefill_graph_requested=True), GuardAction.NONE, None),
])
def test_launch_verdicts(over, action, rule):
    verdict = launch_verdict(_features(**over))
    assert (verdict.action, verdict.rule) == (action, rule)
    assert verdict.features == _features(**over)
    if action is GuardAction.NONE:
        assert verdict.message is None
    else:
        assert verdict.message.startswith("[sglang-dsv41] ") and "\n" not in verdict.message


def test_messages_name_the_flags_and_the_way_out():
    refused = launch_verdict(_features(attn_dp_size=4, replay_requested=True)).message
    assert "refusing to start" in refused
    assert "remove --enable-decoder-swa-bounded-replay" in refused
    turned_off = launch_verdict(_features(attn_dp_size=4)).message
    assert "turned off" in turned_off and "--no-enable-decoder-swa-bounded-replay" in turned_off
    graph = launch_verdict(_features(decoder_swa_bounded_replay=False, attn_cp_size=4,
                                     prefill_graph_backend="breakable", prefill_graph_requested=True)).message
    assert "--cuda-graph-backend-prefill breakable" in graph and f"{CP_BCG_ENV}=1" in graph
    assert CP_BCG_ENV == "SGLANG_DSV41_CP_BCG"


def test_plan_check_and_launch_guard_are_one_rule_set():
    # Over every combination: the plan's crash check fires exactly where the guard
    # acts on replay, with the same rule.
    flags = ("dspark", "decoder_swa_bounded_replay", "enable_prefill_cp", "replay_requested")
    for values in itertools.product((False, True), repeat=len(flags)):
        for cp, dp in ((1, 1), (4, 1), (1, 8)):
            features = _features(**dict(zip(flags, values)), attn_cp_size=cp, attn_dp_size=dp)
            verdict = launch_verdict(features)
            crash = known_crash(features)
            acts_on_replay = verdict.rule in (REPLAY_UNDER_CP, REPLAY_UNDER_DP_ATTENTION)
            assert (crash is not None) == acts_on_replay, features
            if crash:
                assert verdict.action is (GuardAction.REFUSE if features.replay_requested
                                          else GuardAction.TURN_OFF_REPLAY)


def test_the_guard_step_runs_after_everything_the_rules_read():
    """Pin the order of sglang's resolution pipeline the guard depends on: its step
    runs once, after the steps that resolve replay (DeepSeek-V4's validation inside
    the model-specific step), DP/CP widths, the prefill graph and speculative decoding."""
    step = by_id()["GUARD-LAUNCH"].resolution_step
    source = distribution("sglang").locate_file("sglang/srt/arg_groups/pipeline.py").read_text()
    pipeline = next(node for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.FunctionDef) and node.name == "run_resolution_pipeline")
    # ast.walk is breadth-first: order the run_hook calls by source position.
    calls = sorted((node.lineno, node.args[0].id) for node in ast.walk(pipeline)
                   if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_hook"
                   and node.args and isinstance(node.args[0], ast.Name))
    order = [name for _, name in calls]
    assert order.count(step) == 1
    for before in ("handle_model_specific_adjustments", "handle_cuda_graph_config", "handle_data_parallelism",
                   "handle_context_parallelism", "apply_prefill_cp_cuda_graph_default",
                   "handle_speculative_decoding"):
        assert before in order and order.index(before) < order.index(step), before
