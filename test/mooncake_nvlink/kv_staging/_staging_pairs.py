"""Run several real PD pairs with KV staging options at once, and read what they report."""

from __future__ import annotations

import subprocess

from mooncake_pd_pairs import collect, free_port, start_pair, tiny_llama_config


def start_staging_pair(staging: dict, model: str, room: int) -> subprocess.Popen:
    """One PD pair (prefill and decode processes) with these staging options."""
    cfg = {"model": model, "bootstrap_port": free_port(), "room": room, "timeout": 400,
           "staging": staging}
    return start_pair("full", cfg)


def run_pairs(runs: dict, model_dir, first_room: int) -> dict:
    """Every run's pair in parallel; their results by name."""
    model = tiny_llama_config(model_dir)
    procs = {name: start_staging_pair(opts, model, first_room + 1000 * i)
             for i, (name, opts) in enumerate(runs.items())}
    return {name: collect(p) for name, p in procs.items()}


def batches(res, role):
    return res[role]["plugin_metrics"].get("kv_staging_batches", {})



def assert_exact_and_in_place_at_status(r):
    """Both rooms succeed byte-exact, and every KV byte is in place at the Success status."""
    for room in ("A", "B"):
        assert r["prefill"][f"status_{room}"] == "success"
        assert r["decode"][f"status_{room}"] == "success"
    assert r["decode"]["mismatch_A"] == r["decode"]["mismatch_at_status_A"] == []
    # Room B is the harness's negative control: its host-block frames are held
    # back until after the status; the snapshot sees exactly those missing, and
    # the decode drops them when they come (the room is finished by then).
    assert r["decode"]["mismatch_at_status_B"] == r["decode"]["mismatch_B"] == ["aux0", "aux1", "state1"]
    assert r["decode"]["stray_writes"] == []
