"""Real sglang 0.5.23 Mooncake PD transfers between two processes, with and without the plugin.

Both runs force the intra-node NVLink mode (MC_INTRANODE_NVLINK=1; the CPU
Mooncake wheel has no such transport and keeps tcp, so the engine itself still
works) and inject which buffers count as device memory. With the plugin, host
regions stay out of the engine registration, host blocks (aux, state entry 1)
arrive on the side channel before the completion status, byte-exact, and bad
host-block frames are dropped without writing. Without it (stock 0.5.23), every
region is registered, which is what fails on a GPU with this transport.

One interpreter per run imports sglang once and forks the two sides (see
_pd_pair.py); the two runs go in parallel to keep the wall time down.
"""

from __future__ import annotations

import subprocess

import pytest

from mooncake_pd_pairs import collect, free_port, start_pair, tiny_llama_config

OUR_IDS = {"MC-NVL-REGIONS", "MC-NVL-TRANSFER", "MC-NVL-AUX-RECV"}


def _start(mode: str, model: str, room: int) -> subprocess.Popen:
    cfg = {"model": model, "bootstrap_port": free_port(), "room": room, "timeout": 300}
    return start_pair(mode, cfg, plugin=mode != "none")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = tiny_llama_config(tmp_path_factory.mktemp("model"))
    procs = {"plugin": _start("full", model, 7000), "stock": _start("none", model, 9000)}
    return {name: collect(p) for name, p in procs.items()}


def _as_set(regions):
    return {tuple(r) for r in regions}


@pytest.mark.timeout(480)
def test_plugin_registers_device_regions_only(runs):
    for role in ("prefill", "decode"):
        side = runs["plugin"][role]
        assert OUR_IDS <= set(side["plugin_applied"])
        assert _as_set(side["registered"]) == _as_set(side["device_regions"])
        assert not _as_set(side["registered"]) & _as_set(side["host_regions"])


@pytest.mark.timeout(480)
def test_stock_registers_host_regions_too(runs):
    """Without the plugin the host regions go to the engine: what fails on a GPU."""
    for role in ("prefill", "decode"):
        side = runs["stock"][role]
        assert _as_set(side["registered"]) == _as_set(side["device_regions"]) | _as_set(
            side["host_regions"]
        )
    assert runs["stock"]["decode"]["host_messages_written"] == 0


@pytest.mark.timeout(480)
def test_plugin_transfer_is_byte_exact_and_host_blocks_precede_status(runs):
    dec = runs["plugin"]["decode"]
    for room in ("A", "B"):
        assert runs["plugin"]["prefill"][f"status_{room}"] == "success"
        assert dec[f"status_{room}"] == "success"
    assert dec["stray_writes"] == []
    # Room A: the real path. At the moment the Success status is applied, every
    # buffer (KV over the engine, aux and state entry 1 over the side channel)
    # already holds its bytes.
    assert dec["mismatch_A"] == dec["mismatch_at_status_A"] == []
    # Room B holds host-block frames back until after the status (negative
    # control): the snapshot catches exactly the side-channel buffers, and the
    # late frames are dropped, never written: the room is finished, its slots may
    # be another request's by then.
    assert dec["mismatch_at_status_B"] == dec["mismatch_B"] == ["aux0", "aux1", "state1"]
    # Room A: one message for the aux buffers, one for the host state entry.
    assert dec["host_messages_written"] == 2


@pytest.mark.timeout(480)
def test_bad_host_block_frames_are_dropped_and_the_decode_thread_keeps_serving(runs):
    dec = runs["plugin"]["decode"]
    assert dec["bad_frames_dropped"] == 8
    assert dec["untouched_after_bad_frames"] is True
    assert dec["decode_thread_alive"] is True
    assert dec["status_A"] == "success"  # served after the bad frames


@pytest.mark.timeout(480)
def test_a_dropped_frame_of_a_waiting_room_fails_that_request(runs):
    """Otherwise it would wait for an aux row that never comes, or decode from stale aux."""
    waiting = runs["plugin"]["decode"]["waiting_room_after_bad_frame"]
    assert "Failed" not in waiting["before"]
    assert waiting["status"] == "failed", waiting
    assert "a host-block message of this request was dropped" in waiting["reason"], waiting
    assert "not inside any of the" in waiting["reason"], waiting


@pytest.mark.timeout(480)
def test_stock_transfer_also_completes_on_cpu(runs):
    """Pins the stock baseline: over tcp everything moves through the engine."""
    dec = runs["stock"]["decode"]
    assert dec["status_A"] == dec["status_B"] == "success"
    assert dec["mismatch_A"] == dec["mismatch_B"] == []
    assert dec["mismatch_at_status_A"] == dec["mismatch_at_status_B"] == []


@pytest.mark.timeout(480)
def test_side_channel_counters_match_what_moved(runs):
    """The hooks' counts behind sglang_dsv41_side_channel_*: every host block the
    prefill sent was written on the decode side, byte for byte in number, and
    each injected bad message counts as one receive drop."""
    sent = runs["plugin"]["prefill"]["plugin_metrics"]
    got = runs["plugin"]["decode"]["plugin_metrics"]
    # Per room: aux0 and aux1 (one slot each) and the host state entry.
    blocks_per_room = 3
    bytes_per_room = AUX_ITEM_BYTES + STATE_ENTRY_1_BYTES
    assert sent["side_channel_blocks"] == {"sent": 2 * blocks_per_room}
    assert sent["side_channel_bytes"] == {"sent": 2 * bytes_per_room}
    # Room B's two messages arrive after its status (held back on purpose): dropped; so is
    # the bad frame sent for a waiting room at the end.
    assert got["side_channel_blocks"] == {"written": blocks_per_room}
    assert got["side_channel_bytes"] == {"written": bytes_per_room}
    assert got["side_channel_drops"] == {"receive": runs["plugin"]["decode"]["bad_frames_dropped"] + 3}
    assert sent["side_channel_drops"] == {}


AUX_ITEM_BYTES = 64 + 40  # _pd_pair.AUX_ITEMS: one slot of each aux buffer
STATE_ENTRY_1_BYTES = 160  # _pd_pair.STATE_ITEM[1]: the host-resident state entry
