"""A decode's peer map is its word, checked against what opening its handles really maps (CPU).

The prefill opens each CUDA IPC handle a decode sent and then writes at the
offsets the decode declared. ``CudaIpcTransport`` runs here against a stand-in
CUDA runtime and driver (the hardware is the only thing mocked): it records
what was opened and closed and reports, as ``cuMemGetAddressRange`` does, how
large each mapped allocation is. A region that reaches past its mapping, a
handle that maps into the middle of an allocation, or a handle that does not
open, refuses the whole map and leaves nothing open; hostile frames never get
that far.
"""

from __future__ import annotations

import ctypes
import struct

import pytest

from sglang_dsv41.mooncake_nvlink.kv_staging.peer import (
    HANDLE_BYTES,
    MAX_PEER_REGIONS,
    PEER_MAP_TAG,
    CudaIpcTransport,
    PeerMap,
    PeerMapError,
    PeerRegion,
    encode_peer_map,
    find_peer_map,
    host_identity,
)

from _cuda_stand_in import StandInCuda, handle as _handle

MiB = 1 << 20
ENTRY = struct.Struct(f"<QQQ{HANDLE_BYTES}s")


def _transport(allocations):
    cuda = StandInCuda(allocations)
    return CudaIpcTransport(None, 0, runtime=cuda, driver=cuda), cuda


def _map(*regions) -> PeerMap:
    return PeerMap("cuda-ipc", host_identity(), tuple(PeerRegion(*r) for r in regions))


def test_regions_inside_their_mappings_open_and_translate_into_them():
    transport, cuda = _transport({_handle(1): (64 * MiB, 0), _handle(2): (8 * MiB, 0)})
    peer = _map((0x1000_0000, 16 * MiB, 4 * MiB, _handle(1)), (0x2000_0000, 8 * MiB, 0, _handle(2)))
    target = transport.open(peer)
    assert transport.open_mappings == 2
    local, size = target.locate(0x1000_0000 + 5)
    (base1, _), = [v for k, v in cuda.open.items() if v[1] == 64 * MiB]
    assert local == base1 + 4 * MiB + 5 and size == 16 * MiB - 5
    target.retire()
    assert transport.open_mappings == 0 and len(cuda.closed) == 2


@pytest.mark.parametrize("offset, length, why", [
    (60 * MiB, 8 * MiB, "reaches past its mapped allocation of 67108864 bytes"),  # runs off the end
    (64 * MiB, 1, "reaches past"),  # starts at the end
    (0, 64 * MiB + 1, "reaches past"),  # one byte too long
    ((1 << 62) - 1, 2, "reaches past"),  # far outside, the kind a version skew would send
])
def test_a_region_past_its_mapping_refuses_the_map_and_leaves_nothing_open(offset, length, why):
    transport, cuda = _transport({_handle(1): (64 * MiB, 0)})
    peer = _map((0x1000_0000, 4 * MiB, 0, _handle(1)), (0x3000_0000, length, offset, _handle(1)))
    with pytest.raises(PeerMapError, match=why):
        transport.open(peer)
    assert transport.open_mappings == 0 and cuda.open == {}


def test_a_handle_that_maps_inside_an_allocation_is_refused():
    transport, cuda = _transport({_handle(1): (64 * MiB, 2 * MiB)})
    with pytest.raises(PeerMapError, match="inside an allocation"):
        transport.open(_map((0x1000_0000, MiB, 0, _handle(1))))
    assert transport.open_mappings == 0 and cuda.open == {}


def test_a_handle_no_process_here_exported_is_refused_and_the_opened_ones_closed():
    transport, cuda = _transport({_handle(1): (64 * MiB, 0)})
    peer = _map((0x1000_0000, MiB, 0, _handle(1)), (0x2000_0000, MiB, 0, _handle(9)))
    with pytest.raises(PeerMapError, match="cudaIpcOpenMemHandle failed"):
        transport.open(peer)
    assert transport.open_mappings == 0 and cuda.open == {} and len(cuda.closed) == 1


def test_two_decodes_sharing_a_handle_keep_it_open_until_both_retire():
    transport, cuda = _transport({_handle(1): (64 * MiB, 0)})
    a = transport.open(_map((0x1000_0000, MiB, 0, _handle(1))))
    b = transport.open(_map((0x1000_0000, 2 * MiB, MiB, _handle(1))))
    assert transport.open_mappings == 1
    a.retire()
    assert transport.open_mappings == 1 and cuda.closed == []
    b.retire()
    assert transport.open_mappings == 0 and len(cuda.closed) == 1


def _table(*rows) -> bytes:
    return b"".join(ENTRY.pack(*row) for row in rows)


@pytest.mark.parametrize("frames, needle", [
    ([b"cuda-ipc", b"boot", _table((0x1000, MiB, 0, _handle(1)))[:-1]], r"not n\*88"),  # truncated
    ([b"cuda-ipc", b"boot", _table((0x1000, 0, 0, _handle(1)))], "empty or wraps"),  # zero size
    ([b"cuda-ipc", b"boot", _table((0, MiB, 0, _handle(1)))], "empty or wraps"),  # null pointer
    ([b"cuda-ipc", b"boot", _table((2**64 - 16, 32, 0, _handle(1)))], "wraps"),
    ([b"cuda-ipc", b"boot", _table((0x1000, MiB, 1 << 62, _handle(1)))], "wraps"),  # absurd offset
    ([b"cuda-ipc", b"boot", _table((0x1000_0000, 2 * MiB, 0, _handle(1)),
                                   (0x1010_0000, MiB, 0, _handle(2)))], "overlap"),
    ([b"cuda-ipc", b"boot", _table(*[(0x1000 * (k + 1), 16, 0, _handle(1))
                                     for k in range(MAX_PEER_REGIONS + 1)])], "exceeds"),  # oversized
    ([b"cuda-ipc", b"boot"], "frames"),  # the table frame missing
    ([b"cuda-ipc", "boot", _table((0x1000, MiB, 0, _handle(1)))], "bytes"),  # wrong type
])
def test_hostile_registration_frames_are_refused_before_anything_opens(frames, needle):
    with pytest.raises(PeerMapError, match=needle):
        find_peer_map([b"registration", PEER_MAP_TAG, *frames])


def test_a_map_of_another_host_is_refused_before_any_handle_opens():
    transport, cuda = _transport({_handle(1): (64 * MiB, 0)})
    peer = PeerMap("cuda-ipc", "another-boot-id", (PeerRegion(0x1000_0000, MiB, 0, _handle(1)),))
    with pytest.raises(PeerMapError, match="another host"):
        transport.open(find_peer_map(encode_peer_map(peer)))
    assert cuda.open == {} and cuda.closed == []


def test_the_stand_in_reports_sizes_as_the_driver_does():
    # The range check reads the size through this call; a stand-in that lied would prove nothing.
    cuda = StandInCuda({_handle(1): (3 * MiB, 0)})
    ptr = ctypes.c_void_p()
    assert cuda.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), _handle(1), 1) == 0
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    assert cuda._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr.value + 5)) == 0
    assert (base.value, size.value) == (ptr.value, 3 * MiB)


# --- rows narrower than the GPU copy's width


def test_dspark_8_byte_rows_bind_like_wide_pages():
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import PagedLayout, PeerTarget, bind_layout

    target = PeerTarget(_map((0x1000_0000, MiB, 0, _handle(1))), [0x7000_0000], None, [])
    device = lambda addr: MiB  # noqa: E731  every source counts as device memory
    row, why = bind_layout(PagedLayout.of([(0x2000_0008, 0x1000_0008, 8)]), target, device)  # DSpark's request row
    assert why is None and (row.entries, row.page_bytes) == (((0x2000_0008, 0x7000_0008, 8),), 8)
