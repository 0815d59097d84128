"""The real bootstrap path with the plugin loaded by sglang's ``load_plugins()``.

One fresh interpreter (plugins load once per process) runs every scenario of
``_bootstrap_scenarios.py``: sglang's Python bootstrap server on 127.0.0.1, prefill
ranks registering over HTTP through their real ``CommonKVManager.__init__``, decode
managers fetching and validating through the plugin-installed hook.

The interpreter is started when this module is collected, so its ~1 minute of
import and plugin loading overlaps the in-process tests of this directory.

Restart and re-registration, as upstream intends them (pinned here):
* a bootstrap server keeps the first registration's DSpark layout and answers 400
  to a rank that registers another one, so decode keeps validating against the
  first layout until the prefill (and its bootstrap server) restarts;
* decode caches a prefill's info per bootstrap address until its heartbeat checker
  declares that address failed (``_handle_node_failure``); the next request then
  fetches and validates again, so a restarted prefill with another layout is
  rejected. A restart quicker than the heartbeat leaves the cached info in place
  (upstream's behaviour; the hook does not add a re-check).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

HERE = Path(__file__).resolve().parent
SCRIPT = f"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
sys.path.insert(0, {str(HERE)!r})
from sglang.srt.plugins import load_plugins
load_plugins()
import _bootstrap_scenarios as scenarios
print("RESULT" + json.dumps(scenarios.run_all()), flush=True)
"""
TIMEOUT_S = 420


def _start():
    env = dict(os.environ)
    env.pop("SGLANG_PLUGINS", None)
    env.pop("SGLANG_DSV41_ALLOW_DRIFT", None)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    atexit.register(lambda: proc.poll() is None and proc.kill())
    return proc


_PROC = _start()


@pytest.fixture(scope="module")
def scenarios():
    try:
        out, err = _PROC.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _PROC.kill()
        out, err = _PROC.communicate()
        pytest.fail(f"bootstrap scenarios did not finish in {TIMEOUT_S} s:\n{err[-4000:]}")
    lines = [l for l in out.splitlines() if l.startswith("RESULT")]
    assert _PROC.returncode == 0 and lines, err[-6000:]
    return json.loads(lines[-1][len("RESULT"):])


def _value(scenarios, name):
    result = scenarios[name]
    assert result["ok"], result["value"]
    return result["value"]


def _accepted(obs, mapping=None):
    assert obs["ready"] is True and obs["error"] is None and obs["cached"], obs
    assert obs["mapping_calls"] == 1, obs
    if mapping is not None:
        for key, value in mapping.items():
            assert obs["mapping"][key] == value, (key, obs)


def _rejected(obs, *phrases):
    assert obs["ready"] is None and obs["error"].startswith("PairingRejected: "), obs
    assert not obs["cached"] and obs["mapping_calls"] == 0, obs
    for phrase in phrases:
        assert phrase in obs["error"], (phrase, obs["error"])


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_load_plugins_installs_the_handshake_hook(scenarios):
    value = _value(scenarios, "plugin_installed")
    assert value == {"installed": True, "wrapped": True}


def test_cp_prefill_pairs_by_rule_a_and_b_and_rejects_other_shapes(scenarios):
    value = _value(scenarios, "cp_prefill")
    # (a) TP4 x CP4 prefill (attention TP 1) with a TP4 decode: every decode rank pulls
    # from prefill TP rank 0, CP rank 0 (DeepSeek-V4's MLA pool: CP rank 0 holds and
    # sends everything), which waits for all four decode ranks.
    assert [o["rank"] for o in value["tp4_decode"]] == [0, 1, 2, 3]
    for obs in value["tp4_decode"]:
        _accepted(obs, {"target_tp_ranks": [0], "target_cp_ranks": [0],
                        "required_dst_info_num": 4, "required_prefill_response_num": 1})
        assert obs["published_layout"]["num_draft_tokens"] == 6
    # (b) the same prefill with a DP-attention decode (TP4, DP4): attention TP 1 each.
    for obs in value["dp4_decode"]:
        _accepted(obs, {"target_tp_ranks": [0], "target_cp_ranks": [0],
                        "required_dst_info_num": 1, "required_prefill_response_num": 1})
    for obs in value["tp2_decode"]:
        _rejected(obs, "attn_tp_size: prefill=1, decode=2", "attn_cp_size: prefill=4, decode=1")


def test_tp_prefill_with_dp_attention_decode_is_rule_c_for_mla_pools_only(scenarios):
    value = _value(scenarios, "tp_prefill_with_dp_decode")
    (mla,) = value["dp4_decode"]
    # MLA: one real source (TP rank 0), dummy links to TP ranks 1-3, one response.
    _accepted(mla, {"target_tp_rank": 0, "target_tp_ranks": [0, 1, 2, 3],
                    "required_dst_info_num": 1, "required_prefill_response_num": 1})
    (hybrid,) = value["dp4_decode_hybrid"]
    # Hybrid MLA: its head-sharded state needs all four TP ranks, four responses.
    _accepted(hybrid, {"target_tp_ranks": [0, 1, 2, 3], "target_cp_ranks": [0],
                       "required_prefill_response_num": 4})
    (other,) = value["dp4_decode_non_mla"]
    _rejected(other, "kv_pool: prefill=None, decode='other'",
              "attn_tp_size: prefill=4, decode=1")


def test_decode_waits_until_every_prefill_rank_registered(scenarios):
    value = _value(scenarios, "not_ready_then_ready")
    early = value["early"]
    # The bootstrap server answers 503 until all ranks registered: not ready, no error.
    assert early["ready"] is False and early["error"] is None, early
    assert not early["cached"] and early["mapping_calls"] == 0
    _accepted(value["late"], {"target_cp_ranks": [0], "required_dst_info_num": 4})


def test_reregistration_with_another_layout_is_refused_by_the_bootstrap_server(scenarios):
    value = _value(scenarios, "reregister_with_different_layout")
    assert value["put_status"] == 400
    assert "layout differs across prefill ranks" in value["put_text"]
    assert value["published_draft_tokens"] == 6
    assert value["registered_count"] == 2
    for obs in value["decode_same_layout"]:
        _accepted(obs)
    for obs in value["decode_new_layout"]:
        _rejected(obs, "layout mismatch", "spec_layout.num_draft_tokens: prefill=6, decode=5")


def test_restart_revalidates_after_the_heartbeat_drops_the_peer(scenarios):
    value = _value(scenarios, "restart")
    _accepted(value["watcher_first"])
    _accepted(value["idle_first"])
    assert value["watcher_dropped_peer"] is True
    # The restarted prefill publishes another layout: fetched again and rejected.
    _rejected(value["watcher_after_restart"],
              "spec_layout.num_draft_tokens: prefill=5, decode=6")
    # Without a heartbeat failure, upstream keeps serving the cached info ...
    idle = value["idle_after_restart"]
    assert idle["ready"] is True and idle["mapping_calls"] == 0, idle
    assert idle["published_layout"]["num_draft_tokens"] == 6
    # ... until the node-failure path drops it; then the new layout is rejected too.
    _rejected(value["idle_after_node_failure"], "spec_layout.num_draft_tokens")
    # A prefill restarted as TP4 (no CP) pairs with the DP-attention decode by (c).
    _accepted(value["watcher_after_reshape"], {"target_tp_ranks": [0, 1, 2, 3]})
    assert value["watcher_after_reshape"]["prefill_attn"] == [4, 1]
    assert value["heartbeat_stopped"] is True
