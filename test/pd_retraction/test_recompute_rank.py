"""A retraction's prefill recompute lands on the prefill DP rank the decode's receiver is bound to.

``_retraction_scenario.py`` runs sglang's own decode queue, receiver, bootstrap
server, prefill senders and the prefill DP controller's dispatch for every
balancing method, once with the plugin loaded by ``load_plugins()`` and once
stock (``SGLANG_PLUGINS`` naming another plugin), each in a fresh interpreter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_python
from sglang_dsv41.pd_retraction.recompute import recompute_rank

HERE = Path(__file__).resolve().parent
SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(HERE)!r})
from sglang.srt.plugins import load_plugins
load_plugins()
import _retraction_scenario as scenario
print("RESULT" + json.dumps(scenario.run_all()), flush=True)
"""
BALANCED = ("round_robin", "total_requests", "total_tokens")


def scenario(plugin: bool) -> dict:
    env = {} if plugin else {"SGLANG_PLUGINS": "not-dsv41"}
    proc = run_python(SCRIPT, env=env, timeout=420)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT"):])
    assert result["hooked"] is plugin
    runs = {run["method"]: run for run in result["runs"]}
    for run in runs.values():
        # The retraction became a rebootstrap whose receiver bound to the room's original
        # rank, and both of the decode's messages went to that rank only.
        assert run["rebootstrap"] and run["recompute_path"] == "/generate"
        assert run["receiver_rank"] == run["original_rank"]
        bound = str(run["receiver_rank"])
        assert run["decode_messages"] == {r: (["register", "metadata"] if r == bound else [])
                                          for r in run["decode_messages"]}
    return runs


@pytest.mark.parametrize("plugin", [True, False], ids=["plugin", "stock"])
def test_recompute_goes_to_the_bound_prefill_rank(plugin):
    runs = scenario(plugin)
    assert set(runs) == {*BALANCED, "follow_bootstrap_room"}
    for method, run in runs.items():
        if plugin:
            assert run["routed_dp_rank"] == run["receiver_rank"], run
            assert run["recompute_rank"] == run["receiver_rank"], run
            # The recompute's sender keeps the room's entry (none where rooms place by number).
            kept = None if method == "follow_bootstrap_room" else run["receiver_rank"]
            assert run["room_entry"] == kept, run
        elif method == "follow_bootstrap_room":
            # The prefill places by room and the decode resolves the same way: no misroute.
            assert run["routed_dp_rank"] is None and run["recompute_rank"] == run["receiver_rank"]
        else:
            # The misroute: the prefill balances an unnamed recompute onto the other rank,
            # whose sender then records the room there; the receiver waits on the first.
            assert run["routed_dp_rank"] is None, run
            assert run["recompute_rank"] != run["receiver_rank"], run
            assert run["room_entry"] == run["recompute_rank"], run


def test_the_rank_is_named_only_where_the_prefill_has_a_choice():
    assert recompute_rank(1, 2) == 1
    assert recompute_rank(0, 4) == 0
    assert recompute_rank(None, 2) is None  # not bound yet
    assert recompute_rank(0, 1) is None  # one DP rank: nothing to choose
    assert recompute_rank(0, None) is None
