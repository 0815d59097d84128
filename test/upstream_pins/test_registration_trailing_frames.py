"""Pin: a prefill without the plugin ignores the KV peer map a decode appends.

With peer writes on, the decode side appends two frames (a tag and its peer
map) to the registration message it sends each prefill rank. sglang 0.5.23's
``KVArgsRegisterInfo.from_zmq`` reads its frames by position and never past
the kv_item_lens frame, so a stock prefill parses the message exactly as
without the map and sends every block directly. If upstream starts reading
further frames, this fails and the map must move.

Real: the registration message built by sglang's own
``MooncakeKVManager.build_receiver_registration_message`` (on a bare
instance with the fields it reads) and the stock parser.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo, MooncakeKVManager

from sglang_dsv41.mooncake_nvlink.kv_staging.peer import (
    HANDLE_BYTES, PeerMap, PeerRegion, encode_peer_map, find_peer_map, host_identity,
)


def _registration_message() -> list[bytes]:
    manager = MooncakeKVManager.__new__(MooncakeKVManager)
    manager.kv_args = SimpleNamespace(
        kv_data_ptrs=[0x1000, 0x2000], aux_data_ptrs=[0x3000], state_data_ptrs=[[0x4000]],
        state_item_lens=[[64]], state_dim_per_tensor=[[]], state_layer_ids=[[0]],
        kv_layer_ids=[0, 1], engine_rank=3, kv_item_lens=[512, 512],
    )
    manager.attn_tp_size, manager.dcp_size, manager.dcp_rank = 8, 1, 0
    manager.local_ip, manager.rank_port = "10.0.0.7", 17001
    manager.enable_staging = False
    manager.get_session_id = lambda: "10.0.0.7:15001"
    return manager.build_receiver_registration_message()


def test_stock_parser_ignores_an_appended_peer_map():
    message = _registration_message()
    peer = PeerMap("cuda-ipc", host_identity(), (PeerRegion(0x1000, 4096, 0, b"h" * HANDLE_BYTES),))
    plain = KVArgsRegisterInfo.from_zmq(message)
    with_map = KVArgsRegisterInfo.from_zmq(message + encode_peer_map(peer))
    assert dataclasses.asdict(with_map) == dataclasses.asdict(plain)
    assert plain.dst_kv_ptrs == [0x1000, 0x2000] and plain.dst_kv_item_lens == [512, 512]
    assert find_peer_map(message + encode_peer_map(peer)) == peer


def test_the_peer_map_sits_past_every_frame_the_parser_reads():
    # The parser's last positional frame is index 19 (kv_item_lens); the map
    # starts where sglang's own message ends.
    assert len(_registration_message()) == 20
