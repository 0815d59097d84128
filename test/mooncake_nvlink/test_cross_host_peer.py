"""A PD pair on two hosts never engages the intra-node pieces (host-block routing, KV peer writes).

The prefill decides where a decode runs from the address in its Mooncake
session id: an address this machine's kernel will not bind is another host.
Shown with two host ids (this machine's loopback and a TEST-NET-2 address), and
with two network namespaces of this machine (a fresh one, made with
``unshare``, has none of the first one's addresses): in both, the remote
decode's blocks go to Mooncake as they came, it is logged once and counted
once, while a decode on this host keeps the routing.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from _cross_host import BLOCKS, REMOTE_HOST_ID, active_manager, cross_host_count, send
from sglang_dsv41.mooncake_nvlink import hooks as hook
from sglang_dsv41.mooncake_nvlink.routing import address_is_here, session_host

@pytest.fixture(autouse=True)
def _reset_memory():
    yield
    hook.set_memory_access(None)


def test_session_hosts_and_addresses():
    assert session_host("10.1.2.3:15000") == "10.1.2.3"
    assert session_host("[fd00::5]:15000") == "fd00::5"
    assert address_is_here("127.0.0.1") is True
    assert address_is_here(REMOTE_HOST_ID) is False
    assert address_is_here("no-such-host.invalid") is None  # cannot tell: intra-node pieces stay on
    assert address_is_here("") is None


def test_a_decode_on_another_host_bypasses_routing_once_logged_and_counted(monkeypatch, caplog):
    manager = active_manager(monkeypatch)
    before = cross_host_count()
    # This host's decode: routed; its host block finds no side channel, so the transfer fails
    # after the device block went to the engine alone.
    assert send(manager, "127.0.0.1:15001") == (-1, [[BLOCKS[0]]])
    remote = f"{REMOTE_HOST_ID}:15001"
    with caplog.at_level(logging.WARNING, logger="sglang_dsv41.mooncake"):
        for _ in range(3):
            # Another host's decode: every block to Mooncake as it came, nothing routed.
            assert send(manager, remote) == (0, [BLOCKS])
    warnings = [r for r in caplog.records if "runs on another host" in r.getMessage()]
    assert len(warnings) == 1 and remote in warnings[0].getMessage()
    assert "MOONCAKE_PROTOCOL=nvlink_intra" in warnings[0].getMessage()
    assert cross_host_count() - before == 1
    # The local decode is still routed after the remote one was seen.
    assert send(manager, "127.0.0.1:15001") == (-1, [[BLOCKS[0]]])
    assert cross_host_count() - before == 1


def test_a_decode_whose_host_cannot_be_told_keeps_the_routing(monkeypatch):
    manager = active_manager(monkeypatch)
    before = cross_host_count()
    assert send(manager, "no-such-host.invalid:15001") == (-1, [[BLOCKS[0]]])
    assert cross_host_count() == before


def _this_machines_address() -> str | None:
    """A non-loopback address of this network namespace, or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("198.51.100.1", 9))  # no packet is sent: the kernel picks the source address
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


CHILD = textwrap.dedent("""
    import json, logging, os, sys
    sys.path[:0] = [sys.argv[2]]
    from _cross_host import active_manager, send, cross_host_count
    class Env:
        def setenv(self, k, v): os.environ[k] = v
        def delenv(self, k, raising=True): os.environ.pop(k, None)
    manager = active_manager(Env())
    results = [send(manager, sys.argv[1]) for _ in range(2)]
    print(json.dumps({"results": results, "counted": cross_host_count()}))
""")


def test_two_network_namespaces_of_one_machine(monkeypatch, tmp_path):
    """The decode's address is this namespace's; the prefill runs in a new one."""
    unshare = shutil.which("unshare")
    address = _this_machines_address()
    if unshare is None or address is None:
        pytest.skip("needs unshare and a non-loopback address")
    probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged network namespace here: {probe.stderr.decode()[-200:]}")
    session = f"{address}:15001"
    manager = active_manager(monkeypatch)
    assert send(manager, session) == (-1, [[BLOCKS[0]]])  # same namespace: routed
    import pathlib

    here = str(pathlib.Path(__file__).resolve().parent)
    child = subprocess.run([unshare, "-rn", sys.executable, "-c", CHILD, session, here],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["results"] == [[0, [[list(b) for b in BLOCKS]]]] * 2
    assert report["counted"] == 1
    assert "runs on another host" in child.stderr
