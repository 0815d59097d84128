"""Adapter: Mooncake intra-node NVLink host-block routing inside sglang's MooncakeKVManager.

Design: docs/design/mooncake_nvlink.md.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang_dsv41 import metrics
from sglang_dsv41.mooncake_nvlink.kv_staging import held
from sglang_dsv41.mooncake_nvlink.kv_staging import hooks as kv_staging
from sglang_dsv41.mooncake_nvlink.memory import HostMemory, cuda_memory_access
from sglang_dsv41.mooncake_nvlink.state import RoutingState, routing_state, set_routing_state
from sglang_dsv41.mooncake_nvlink.routing import (
    HostBlockReceiver,
    KindTable,
    MemoryAccess,
    MemoryAccessError,
    NoSideChannel,
    host_block_message_size,
    RegionTable,
    SideChannel,
    TransferRouter,
    is_host_block_message,
    nvlink_intra_reason,
    plan_registration,
)

logger = logging.getLogger("sglang_dsv41.mooncake")

_RECEIVER_ATTR = "_dsv41_host_block_receiver"

# Tests on machines without a GPU inject a classification here; None = CUDA.
_injected_memory: Optional[MemoryAccess] = None


def set_memory_access(memory: Optional[MemoryAccess]) -> None:
    """Use ``memory`` for classification and raw copies in managers built from now on."""
    global _injected_memory
    _injected_memory = memory


def _gpu_id(manager) -> Optional[int]:
    gpu_id = getattr(getattr(manager, "kv_args", None), "gpu_id", None)
    return gpu_id if isinstance(gpu_id, int) and gpu_id >= 0 else None


def _memory_for(manager, *, strict: bool) -> MemoryAccess:
    if _injected_memory is not None:
        return _injected_memory
    try:
        return cuda_memory_access(device=_gpu_id(manager))
    except MemoryAccessError:
        if strict:
            raise
        # No usable CUDA runtime in this process means no device memory in it either.
        logger.warning("no CUDA runtime usable; host-block writes use plain host copies")
        return HostMemory()


def after_registerable_regions(result, self):
    """AFTER MooncakeKVManager._registerable_regions: leave host regions out under NVLink-intra."""
    reason = nvlink_intra_reason()
    if reason is None:
        kv_staging.warn_without_nvlink_intra()
        return None  # keep upstream's list
    state = routing_state(self)
    try:
        memory = state.memory if state is not None else _memory_for(self, strict=True)
        plan = plan_registration(list(result), memory.kind_of)
    except MemoryAccessError as exc:
        raise RuntimeError(
            f"[sglang-dsv41] Mooncake intra-node NVLink transport is active ({reason}) but "
            f"device and host memory cannot be told apart: {exc}. Registering a host "
            "region would fail the whole registration."
        ) from exc
    kv_staging.set_up(self, plan.register)
    kinds = KindTable(plan.classified, memory.kind_of)
    set_routing_state(self, RoutingState(reason, memory, TransferRouter(kinds, memory), kinds))
    (logger.info if state is None else logger.debug)(
        "[sglang-dsv41] Mooncake intra-node NVLink transport active (%s): registering %d "
        "device regions; %s",
        reason, len(plan.register), plan.describe_left_out(),
    )
    return plan.register


def _side_channel(manager, session_id: str) -> SideChannel:
    """The decode endpoint of ``session_id``, from the transfer infos upstream already keeps.

    The status of the same transfer goes to this endpoint through the same
    cached push socket, which is what orders host blocks before it.
    """
    rooms = None
    for _ in range(3):  # the bootstrap thread may resize the dict meanwhile
        try:
            rooms = list(getattr(manager, "transfer_infos", {}).items())
            break
        except RuntimeError:
            continue
    match = None
    for room, infos in rooms or []:
        info = infos.get(session_id) if isinstance(infos, dict) else None
        if info is not None and not getattr(info, "is_dummy", False):
            match = (room, info)  # later rooms are newer: keep the last
    if match is None:
        raise NoSideChannel(f"no transfer info holds mooncake session {session_id}")
    from sglang.srt.utils.network import NetworkAddress

    room, info = match
    address = NetworkAddress(info.endpoint, info.dst_port)
    endpoint = address.to_tcp()

    def send(frames: list[bytes]) -> None:
        manager._send_multipart_locked(endpoint, frames, is_ipv6=address.is_ipv6)
        metrics.count_side_channel("sent", *host_block_message_size(frames))

    return SideChannel(room=int(room), send=send)


def _peer_on_this_host(state: RoutingState, session_id: str) -> bool:
    here, decided = state.place_peer(session_id)
    if decided and not here:
        metrics.count_cross_host_peer()
        logger.warning(
            "[sglang-dsv41] decode session %s runs on another host: Mooncake's intra-node NVLink "
            "transport (%s) cannot reach it, so its transfers skip the host-block routing and KV "
            "peer writes; between hosts use MOONCAKE_PROTOCOL=rdma with --disaggregation-ib-device",
            session_id, state.reason,
        )
    return here


def around_transfer_data(original, self, mooncake_session_id, transfer_blocks):
    """AROUND MooncakeKVManager._transfer_data: device blocks to the engine, host blocks beside it."""
    if kv_staging.captured(transfer_blocks):  # a dry run that only learns a call's layout
        return 0
    if held.room_failed():  # a peer write of this request failed: nothing more goes to the decode
        return 0
    state = routing_state(self)
    if state is None or not transfer_blocks or not _peer_on_this_host(state, mooncake_session_id):
        return original(self, mooncake_session_id, transfer_blocks)
    if not isinstance(transfer_blocks, list):
        transfer_blocks = list(transfer_blocks)
    opened = []  # the router asks for the side channel only when it has host blocks to send

    def open_side_channel() -> SideChannel:
        opened.append(True)
        return _side_channel(self, mooncake_session_id)

    def send_device(device_blocks):
        kv_staging.count_device_batch(self, device_blocks)
        return original(self, mooncake_session_id, device_blocks)

    rc = state.router.route(transfer_blocks, send_device, open_side_channel)
    if rc != 0 and opened:  # after the device blocks went through: host blocks not delivered
        metrics.count_side_channel_drop("send")
    return rc


def _published_regions(manager) -> RegionTable:
    """Every region this side published as a transfer target (KV, aux, state)."""
    args = manager.kv_args
    regions = list(zip(args.kv_data_ptrs or [], args.kv_data_lens or []))
    regions += list(zip(args.aux_data_ptrs or [], args.aux_data_lens or []))
    for ptrs, lens in zip(args.state_data_ptrs or [], args.state_data_lens or []):
        regions += list(zip(ptrs or [], lens or []))
    return RegionTable(regions)


def _room_awaits_kv(manager, room: int) -> bool:
    from sglang.srt.disaggregation.base.conn import KVPoll

    status = manager.request_status.get(room)  # one read: the decode may clear it meanwhile
    return status is not None and status not in (KVPoll.Success, KVPoll.Failed)


def _fail_waiting_room(manager, room: Optional[int], reason: str) -> None:
    """A dropped message of a room still waiting fails its request: it would otherwise wait
    for an aux row that never comes, or decode from stale aux or state."""
    if room is None or not _room_awaits_kv(manager, room):
        return
    from sglang.srt.disaggregation.base.conn import KVPoll

    manager.record_failure(room, f"[sglang-dsv41] a host-block message of this request was dropped: {reason}")
    manager.update_status(room, KVPoll.Failed)


def _receiver_for(manager) -> HostBlockReceiver:
    receiver = manager.__dict__.get(_RECEIVER_ATTR)
    if receiver is None:
        state = routing_state(manager)
        memory = state.memory if state is not None else _memory_for(manager, strict=False)
        receiver = HostBlockReceiver(_published_regions(manager), memory, logger,
                                     room_awaits_kv=lambda room: _room_awaits_kv(manager, room))
        manager.__dict__[_RECEIVER_ATTR] = receiver
    return receiver


def around_handle_aux_data(original, self, msg):
    """AROUND MooncakeKVManager._handle_aux_data: take host-block frames, pass the rest on."""
    if not is_host_block_message(msg):
        return original(self, msg)
    try:
        verdict = _receiver_for(self).handle(msg)
    except Exception:  # the decode thread must keep serving
        logger.exception("[sglang-dsv41] host-block message dropped")
        metrics.count_side_channel_drop("receive")
        return None
    if verdict.written:
        metrics.count_side_channel("written", verdict.blocks, verdict.nbytes)
        return None
    metrics.count_side_channel_drop("receive")
    try:
        _fail_waiting_room(self, verdict.room, verdict.reason)
    except Exception:  # the decode thread must keep serving
        logger.exception("[sglang-dsv41] could not fail room %s after dropping its host-block message",
                         verdict.room)
    return None
