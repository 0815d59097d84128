"""The GPU test's processes, dry-run on this CPU machine.

Same worker as test/mooncake_nvlink/test_mooncake_nvlink_gpu.py, with host tensors playing
the device buffers (classification injected) and Mooncake's tcp protocol, so
the logic the lead runs on the H200 is exercised here too: registration plan,
router, socket side channel, host block into a "device" region, byte checks.
"""

from __future__ import annotations

import pytest

from _gpu_pair import check_routed, run_pair

DRY = {"gpu": 0, "device": "cpu", "protocol": "tcp", "routing": True, "nvlink_env": True}


@pytest.mark.timeout(240)
def test_gpu_worker_dry_run_routes_and_is_byte_exact():
    receiver, sender = run_pair(DRY, DRY)
    check_routed(receiver, sender)
    assert sender["memory_backend"] == receiver["memory_backend"] == "InjectedKinds"
    assert sender["registered"] == 5  # 4 KV buffers + state0
    assert receiver["registered"] == 6  # + state2, device memory on the receiving side

