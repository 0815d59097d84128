"""KV peer writes (``SGLANG_DSV41_KV_STAGING=peer``) over a real sglang 0.5.23 Mooncake PD pair.

The PD pair harness (test/mooncake_nvlink/_pd_pair.py): real managers,
bootstrap server, senders and receivers, real Mooncake engines over tcp,
buffers in host memory whose "device" classification is injected. Without a
GPU the peer writes go through ``HostCmaTransport`` (test/helpers/host_peer.py,
process_vm_writev into the decode process): the same registration, map,
translation and write path the CUDA IPC transport takes. Four runs in parallel:
- peer: each room is one last chunk, so its KV send (from its page lists,
  upstream's call learnt by a dry run that reaches no engine) is held and
  written when the state sends return, byte-exact, and the decode buffers
  already hold every byte when the Success status is applied; nothing lands
  outside the rooms' pages. The harness's state is one block from a state
  kind sglang sends without page lists: it goes the direct way;
  Then the decode process ends: the prefill's probe (sglang's own, through the
  real engine) finds it gone, counts its session failed and unmaps it;
- failing: the second peer write fails (room B's, after room A completed):
  room B fails on both sides, room A stays byte-exact;
- foreign: the decode's map claims another host: the prefill refuses to open
  it and every batch takes the direct path, counted, byte-exact;
- host entry: one KV buffer is host memory, so the page path steps aside and
  upstream's block list is routed: the device blocks to the engine, the host
  ones as frames on the ordered channel, byte-exact.
"""

from __future__ import annotations

import os

import pytest

from _staging_pairs import assert_exact_and_in_place_at_status, run_pairs
from _staging_pairs import batches as _batches

pytestmark = pytest.mark.timeout(600)

PEER = {"SGLANG_DSV41_KV_STAGING": "peer", "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS": "2"}
RUNS = {
    "peer": {"env": PEER, "decode_exits": True},
    # one write per room (its held KV): room A's, then room B's (fails)
    "failing": {"env": PEER, "fail_peer_write_at": 2},
    "foreign": {"env": PEER, "foreign_host": True},
    "host_entry": {"env": PEER, "host_kv_entry": 1},
}


def _cma_usable() -> bool:
    import ctypes

    from host_peer import IoVec

    libc = ctypes.CDLL(None, use_errno=True)
    probe = ctypes.c_char()
    iov = IoVec(ctypes.cast(ctypes.byref(probe), ctypes.c_void_p), 1)
    child = os.fork()
    if child == 0:  # a child writes its parent: what the prefill does to the decode
        os._exit(0 if libc.process_vm_writev(os.getppid(), ctypes.byref(iov), 1, ctypes.byref(iov), 1, 0) == 1 else 1)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) == 0


if not _cma_usable():
    pytest.skip("process_vm_writev between sibling processes is not permitted here", allow_module_level=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_pairs(RUNS, tmp_path_factory.mktemp("model"), 21000)


def test_peer_writes_are_byte_exact_and_land_before_status(runs):
    assert_exact_and_in_place_at_status(runs["peer"])
    r = runs["peer"]
    # Each KV send from its page lists, held, then written before the status; the one-block
    # state batch (no page lists, under MIN_BLOCKS) direct.
    assert _batches(r, "prefill") == {"peer_pages": 2, "few_blocks": 2}
    assert r["prefill"]["plugin_metrics"]["kv_staging_held_writes"] == {"written": 2}
    assert r["prefill"]["peer_writes"] == 2
    assert r["prefill"]["open_peer_maps"] == 1
    assert r["decode"]["plugin_metrics"]["kv_staging_peer_maps"] == {"sent": 1}
    # the decode built no copier (the harness's stand-in fails any use) and copied nothing
    assert r["decode"]["status_A"] == "success"


def test_a_decode_that_ends_is_unmapped_and_counted_failed_within_seconds(runs):
    from sglang_dsv41.mooncake_nvlink.kv_staging.mappings import PROBE_INTERVAL_S, PROBE_MISSES

    p = runs["peer"]["prefill"]
    gone = p["after_decode_exit"]
    assert gone["open_peer_maps"] == 0 and gone["failed_sessions"] == gone["decode_sessions"]
    assert len(gone["decode_sessions"]) == 1
    assert gone["seconds"] <= (PROBE_MISSES + 2) * PROBE_INTERVAL_S + 5  # the process ends 0.5 s after its verdict
    assert p["plugin_metrics"]["kv_staging_peer_maps"] == {"decode_gone": 1}
    assert p["failed_sessions"] == []  # while it ran, it answered every probe


def test_the_decode_exports_exactly_its_engine_registered_regions(runs):
    d = runs["peer"]["decode"]
    assert sorted(map(tuple, d["exported"])) == sorted(map(tuple, d["registered"]))
    assert not {tuple(x) for x in d["host_regions"]} & {tuple(x) for x in d["exported"]}
    # nothing registered beyond the device regions
    assert sorted(map(tuple, d["registered"])) == sorted(map(tuple, d["device_regions"]))


def test_a_failed_peer_write_fails_that_request_only(runs):
    r = dict(runs["failing"], peer=runs["peer"])
    assert r["prefill"]["status_A"] == "success" and r["decode"]["status_A"] == "success"
    assert r["decode"]["mismatch_A"] == [] and r["decode"]["mismatch_at_status_A"] == []
    assert r["prefill"]["status_B"] == "failed"
    assert r["decode"]["status_B"] == "failed"
    # both rooms' KV sends were held (their state blocks direct); room B's write, when its state
    # sends returned, failed and failed its transfer
    assert _batches(r, "prefill") == {"peer_pages": 2, "few_blocks": 2}
    assert r["prefill"]["plugin_metrics"]["kv_staging_held_writes"] == {"written": 1, "failed": 1}
    # the request failed, not the decode: sglang did not give up on its session
    assert r["prefill"]["failed_sessions"] == []
    assert r["peer"]["prefill"]["failed_sessions"] == []


def test_a_map_from_another_host_is_not_opened_and_batches_go_direct(runs):
    r = runs["foreign"]
    for room in ("A", "B"):
        assert r["prefill"][f"status_{room}"] == "success"
    # room B's host frames are the harness's held-back negative control, dropped as late
    assert r["decode"]["mismatch_A"] == [] and r["decode"]["mismatch_B"] == ["aux0", "aux1", "state1"]
    assert _batches(r, "prefill") == {"peer_map_unusable": 2, "few_blocks": 2}
    assert r["prefill"]["peer_writes"] == 0 and r["prefill"]["open_peer_maps"] == 0


def test_a_host_kv_buffer_leaves_the_call_to_the_direct_way(runs):
    r = runs["host_entry"]
    for room in ("A", "B"):
        assert r["prefill"][f"status_{room}"] == "success" and r["decode"][f"status_{room}"] == "success"
    assert r["decode"]["mismatch_A"] == r["decode"]["mismatch_at_status_A"] == []
    # room B's host frames (its kv1 pages among them) are the harness's held-back negative
    # control: missing at the status, and dropped as late when they come
    assert r["decode"]["mismatch_at_status_B"] == r["decode"]["mismatch_B"] == ["aux0", "aux1", "kv1", "state1"]
    assert r["decode"]["stray_writes"] == []
    # the KV call went the direct way (its device blocks to the engine, counted with why);
    # nothing was held or written by peer
    assert _batches(r, "prefill") == {"source_not_device": 2, "few_blocks": 2}
    assert r["prefill"]["peer_writes"] == 0
    assert not r["prefill"]["plugin_metrics"].get("kv_staging_held_writes")
    assert r["decode"]["host_messages_written"] >= 2
