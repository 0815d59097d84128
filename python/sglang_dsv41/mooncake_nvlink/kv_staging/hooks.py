"""Adapter: KV peer writes (opt-in) inside sglang's Mooncake PD managers.

Design: docs/design/kv_staging.md.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sglang_dsv41 import metrics
from sglang_dsv41.mooncake_nvlink.kv_staging import held
from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import BatchCopyError
from sglang_dsv41.mooncake_nvlink.kv_staging.mappings import (
    PROBE_INTERVAL_S,
    REGISTERED_AGAIN,
    SESSION_FAILED,
    TEARDOWN,
    SessionMappings,
)
from sglang_dsv41.mooncake_nvlink.kv_staging.peer import (
    FALLBACK_NO_PEER_MAP,
    FEW_BLOCKS,
    BoundLayout,
    PagedLayout,
    PeerMap,
    PeerMapError,
    PeerTarget,
    PeerTransport,
    PeerWrites,
    bind_layout,
    encode_peer_map,
    find_peer_map,
)
from sglang_dsv41.mooncake_nvlink.kv_staging.setting import (
    STAGING_ENV,
    StagingConfig,
    StagingConfigError,
    staging_config,
)
from sglang_dsv41.mooncake_nvlink.state import routing_state

logger = logging.getLogger("sglang_dsv41.mooncake")

PEER_MAP_ATTR = "_dsv41_peer_map"
_STATE_ATTR = "_dsv41_kv_staging"
# Per thread: a layout capture's sink, and why the page path left a send to upstream's blocks.
_capture = threading.local()

# Tests on machines without a GPU inject a peer transport here; None = CUDA on the manager's GPU.
_injected_transport: Optional[PeerTransport] = None

# A batch sglang built itself (the page path does not cover its send) goes the direct way.
BLOCK_PATH = "block_path"


def set_peer_transport(transport: Optional[PeerTransport]) -> None:
    """Use ``transport`` for peer maps and peer writes in managers built from now on."""
    global _injected_transport
    _injected_transport = transport


@dataclass
class StagingState:
    config: StagingConfig
    transport: PeerTransport
    exported: Optional[PeerMap] = None  # decode
    mappings: Optional[SessionMappings] = None  # prefill
    layouts: dict = field(default_factory=dict)  # prefill: kind of send call -> _LearntCall
    lock: threading.Lock = field(default_factory=threading.Lock)
    prober: Optional[threading.Thread] = None  # prefill: probes the decodes it maps
    stopped: threading.Event = field(default_factory=threading.Event)


def state_of(manager) -> Optional[StagingState]:
    state = manager.__dict__.get(_STATE_ATTR)
    return state if isinstance(state, StagingState) else None


def _role(manager) -> str:
    mode = getattr(manager, "disaggregation_mode", None)
    return str(getattr(mode, "value", mode) or "")


def _gpu_id(manager) -> int:
    gpu_id = getattr(getattr(manager, "kv_args", None), "gpu_id", None)
    return gpu_id if isinstance(gpu_id, int) and gpu_id >= 0 else 0


def _transport_for(manager, role: str) -> PeerTransport:
    """The injected transport, else CUDA IPC; only a prefill builds a copier (and its kernel)."""
    if _injected_transport is not None:
        return _injected_transport
    from sglang_dsv41.mooncake_nvlink.kv_staging.peer import CudaIpcTransport

    if role == "decode":
        return CudaIpcTransport(None, _gpu_id(manager))
    from sglang_dsv41.mooncake_nvlink.kv_staging.batch_copy import CudaBatchCopy

    return CudaIpcTransport(CudaBatchCopy(_gpu_id(manager)), _gpu_id(manager))


def _peer_maps_released(reason: str) -> None:
    metrics.count_kv_staging("kv_staging_peer_maps", reason)


def set_up(manager, device_regions=()) -> None:
    """Set up this manager's peer writes once, when they are on.

    The decode side exports ``device_regions`` (the regions registered with the
    engine) and builds nothing else; the prefill side builds its copier. Fails
    closed: peer writes asked for but impossible stop the manager's construction
    with a message naming the setting.
    """
    if state_of(manager) is not None:
        return
    try:
        config = staging_config()
    except StagingConfigError as exc:
        raise RuntimeError(f"[sglang-dsv41] KV staging: {exc}") from exc
    role = _role(manager)
    if config is None or role not in ("prefill", "decode"):
        return
    try:
        if role == "prefill" and not callable(getattr(manager, "_send_probe", None)):
            raise RuntimeError("this sglang's transfer manager has no _send_probe: a decode that "
                               "stops could not be told from one that runs")
        state = StagingState(config, _transport_for(manager, role))
        if role == "decode":
            regions = [(int(p), int(n)) for p, n in device_regions if int(n) > 0]
            state.exported = state.transport.export(regions)
        else:
            state.mappings = SessionMappings(state.transport, on_release=_peer_maps_released)
    except (BatchCopyError, PeerMapError, RuntimeError, OSError) as exc:
        raise RuntimeError(
            f"[sglang-dsv41] {STAGING_ENV}=peer but the {role} side cannot set up peer "
            f"writes: {exc}. Unset {STAGING_ENV} or fix the cause."
        ) from exc
    manager.__dict__[_STATE_ATTR] = state
    if state.mappings is not None:  # a write never fails when its decode dies: probe it
        state.prober = threading.Thread(target=_probe_loop, args=(manager, state), daemon=True,
                                        name="dsv41-kv-peer-probe")
        state.prober.start()
    if state.exported is not None:
        logger.info("[sglang-dsv41] KV peer writes on (decode side, %s): %d regions in %d allocations "
                    "exported", state.transport.kind, len(state.exported.regions), len(state.exported.handles))
        return
    logger.info(
        "[sglang-dsv41] KV peer writes on (prefill side, %s): sends of %d+ blocks written "
        "straight into the decode's KV", state.transport.kind, config.min_blocks,
    )


_warned_without_nvlink = False


def warn_without_nvlink_intra() -> None:
    """Peer writes asked for on a transport they do not apply to: say so once per process."""
    global _warned_without_nvlink
    if _warned_without_nvlink or (os.environ.get(STAGING_ENV) or "").strip() in ("", "0"):
        return
    _warned_without_nvlink = True
    logger.warning(
        "[sglang-dsv41] %s is set but Mooncake's intra-node NVLink transport is not active "
        "(MC_INTRANODE_NVLINK / MOONCAKE_PROTOCOL=nvlink_intra): KV peer writes have no effect",
        STAGING_ENV,
    )


# --- registration: the decode's peer map ---------------------------------------------


def around_send_bootstrap_message(original, self, *, bootstrap_info, message, operation):
    """AROUND CommonKVReceiver._send_bootstrap_message: the registration carries the peer map."""
    state = state_of(getattr(self, "kv_mgr", None)) if operation == "_register_kv_args" else None
    if state is not None and state.exported is not None and not bootstrap_info.get("is_dummy"):
        metrics.count_kv_staging("kv_staging_peer_maps", "sent")
        message = list(message) + encode_peer_map(state.exported)
    return original(self, bootstrap_info=bootstrap_info, message=message, operation=operation)


def around_register_info_from_zmq(original, cls, msg):
    """AROUND KVArgsRegisterInfo.from_zmq: keep a decode peer's map on its registration info."""
    info = original(cls, msg)
    try:
        peer = find_peer_map(msg)
    except PeerMapError as exc:
        logger.error("[sglang-dsv41] KV peer writes: ignoring a malformed peer map: %s", exc)
        peer = None
    if peer is not None:
        info.__dict__[PEER_MAP_ATTR] = peer
    return info


def after_teardown(result, self):
    """AFTER MooncakeKVManager.teardown: a role switch closes every decode mapping."""
    state = state_of(self)
    if state is not None and state.mappings is not None:
        state.stopped.set()
        state.mappings.close_all(TEARDOWN)
    return None


# --- prefill: a decode session's map, and the batches that go the direct way ----------------


def _peer_target(manager, state: StagingState, session_id: str) -> tuple[Optional[PeerTarget], Optional[str]]:
    """The opened peer map of ``session_id``'s latest registration, or (None, why not)."""
    info = (getattr(manager, "decode_kv_args_table", None) or {}).get(session_id)
    peer = getattr(info, PEER_MAP_ATTR, None)
    if peer is None:  # a registration without a (usable) map: any older mapping of it goes
        state.mappings.drop((session_id,), REGISTERED_AGAIN)
        return None, FALLBACK_NO_PEER_MAP
    return state.mappings.target(session_id, peer)


# --- prefill: a mapped decode that stops (why: docs/design/kv_staging.md, mappings) ---------


def _probe_loop(manager, state: StagingState) -> None:
    while not state.stopped.wait(PROBE_INTERVAL_S):
        try:
            probe_mapped_decodes(manager, state)
        except Exception:  # a probe pass must never end the probing
            logger.exception("[sglang-dsv41] KV peer writes: probing mapped decodes failed")


def probe_mapped_decodes(manager, state: StagingState) -> list[str]:
    """One pass: the mappings of sessions sglang counts failed go; every other mapped decode is
    probed, and those that stopped answering are let go and counted failed with sglang (returned)."""
    try:  # sglang's threads change the set while it is copied
        failed = list(getattr(manager, "failed_sessions", ()) or ())
    except RuntimeError:
        failed = []
    if failed:
        state.mappings.drop(failed, SESSION_FAILED)

    def answers(session: str) -> bool:
        try:
            return manager._send_probe(session) == 0
        except Exception:  # upstream's probe catches the engine's errors; anything else is a miss
            return False

    gone = state.mappings.probe(answers)
    for session in gone:
        lock = getattr(manager, "session_lock", None)
        if lock is not None:
            with lock:
                manager.session_failures[session] += 1
                manager.failed_sessions.add(session)
        logger.error("[sglang-dsv41] KV peer writes: decode session %s stopped answering probes: its "
                     "mapping is released and sglang counts the session failed", session)
    return gone


def count_device_batch(manager, blocks) -> None:
    """In peer mode, count a batch of device blocks going the direct way, with why.

    Every send the page path covers is written from its page lists before
    sglang builds blocks; a batch that reaches the engine is one it left
    alone, for the reason the page path gave or as ``block_path``.
    """
    state = state_of(manager)
    if state is None or state.mappings is None:
        return
    why = FEW_BLOCKS if len(blocks) < state.config.min_blocks else getattr(_capture, "why", None) or BLOCK_PATH
    metrics.count_kv_staging("kv_staging_batches", why)


# --- prefill: one transfer call from page lists (peer mode) --------------------------------

_ONE_PAGE = np.zeros(1, dtype=np.int32)


def captured(transfer_blocks) -> bool:
    """During a layout capture on this thread: keep the blocks, send nothing (True)."""
    sink = getattr(_capture, "sink", None)
    if sink is None:
        return False
    sink.extend(transfer_blocks)
    _capture.calls += 1
    return True


def capture_layout(original, manager, call: dict) -> tuple[int, Optional[list]]:
    """Run upstream's call for page 0 to page 0 with the engine left out: its (rc, blocks).

    Upstream pairs the buffers (pipeline stages, layer ids, elided entries, its
    checks); each block it builds for one page is a pair's (page-0 source, page-0
    destination, bytes per page). Blocks None: not the one batch this relies on.
    """
    sink: list = []
    _capture.sink, _capture.calls = sink, 0
    try:
        rc = original(manager, **{**call, "prefill_data_indices": _ONE_PAGE, "dst_data_indices": _ONE_PAGE})
        calls = _capture.calls
    finally:
        _capture.sink = None
    return rc, (sink if calls == 1 else None)


_MAX_LAYOUTS = 1024  # kinds of call remembered (sessions x state types); past it, start over


@dataclass
class _LearntCall:
    layout: PagedLayout
    # (the peer map it was last checked against, the bound layout or None when it cannot
    # take the page path, why not): replaced as one value, transfer threads share it
    checked: Optional[tuple[PeerTarget, Optional[BoundLayout], Optional[str]]] = None


def _layout_key(session_id, state_type, force_flat, *lists) -> tuple:
    """What a call's pairing depends on: the session, the state type, flat or not, and the
    pointer, length and layer-id lists (as tuples: sglang may change a list in place)."""
    return (session_id, state_type, force_flat, *[None if v is None else tuple(v) for v in lists])


def _paged_layout(original, manager, state: StagingState, key: tuple, call_as_given) -> tuple[int, Optional[_LearntCall]]:
    """(rc, the call's learnt layout), learnt once per ``_layout_key`` (never per page list):
    a decode that registers again with other buffers is learnt anew. ``call_as_given()``:
    upstream's keyword arguments, built only to learn. rc != 0: upstream refused the call."""
    known = state.layouts.get(key)
    if known is not None:
        return 0, known
    rc, entries = capture_layout(original, manager, call_as_given())
    if rc != 0 or not entries:
        return rc, None
    learnt = _LearntCall(PagedLayout.of(entries))
    with state.lock:
        if len(state.layouts) >= _MAX_LAYOUTS:
            state.layouts.clear()
        state.layouts[key] = learnt
    return 0, learnt


def _layers_on_executor(manager) -> bool:
    # Upstream sends layer by layer on its thread pool then: a capture on this thread would not see them.
    return bool(getattr(manager, "enable_custom_mem_pool", False)) and (
        getattr(manager, "custom_mem_pool_type", None) != "INTRA_NODE_NVLINK")


def around_send_kvcache_generic(original, self, mooncake_session_id, src_data_ptrs, dst_data_ptrs, item_lens,
                                prefill_data_indices, dst_data_indices, executor, state_type=None,
                                force_flat=False, src_layer_ids=None, dst_layer_ids=None,
                                dst_device_data_indices=None, dst_device_data_ptrs=None, dst_item_lens=None,
                                bootstrap_room=None):
    """AROUND MooncakeKVManager._send_kvcache_generic: in peer mode, one peer write from the page lists.

    Not upstream's block per page run and buffer: the call's layout is learnt
    from upstream itself (a dry run for one page) and its pages go as one
    write, held on a last chunk. What the page path does not cover goes the
    direct way, counted (design note, "How a user meets it", items 3 to 7).
    """
    if held.room_failed():  # a peer write of this request failed: nothing more goes to its pages
        return 0

    def call_as_given() -> dict:  # built only where upstream's own code runs: a send path hot per request
        return dict(mooncake_session_id=mooncake_session_id, src_data_ptrs=src_data_ptrs,
                    dst_data_ptrs=dst_data_ptrs, item_lens=item_lens, prefill_data_indices=prefill_data_indices,
                    dst_data_indices=dst_data_indices, executor=executor, state_type=state_type,
                    force_flat=force_flat, src_layer_ids=src_layer_ids, dst_layer_ids=dst_layer_ids,
                    dst_device_data_indices=dst_device_data_indices, dst_device_data_ptrs=dst_device_data_ptrs,
                    dst_item_lens=dst_item_lens, bootstrap_room=bootstrap_room)

    def direct(why: Optional[str] = None) -> int:
        """Upstream's call as it was; its device batches are counted with ``why`` (``count_device_batch``)."""
        _capture.why = why
        try:
            return original(self, **call_as_given())
        finally:
            _capture.why = None

    state = state_of(self)
    if state is None or state.mappings is None:
        return original(self, **call_as_given())
    if dst_device_data_indices is not None or _layers_on_executor(self):
        return direct()
    routing = routing_state(self)
    target, why_not = _peer_target(self, state, mooncake_session_id) if routing is not None else (None, None)
    if target is None:
        return direct(why_not)
    key = _layout_key(mooncake_session_id, state_type, force_flat, src_data_ptrs, dst_data_ptrs, item_lens,
                      src_layer_ids, dst_layer_ids, dst_item_lens)
    rc, learnt = _paged_layout(original, self, state, key, call_as_given)
    if rc != 0:  # upstream refused this call (its layout checks) and has concluded it
        return rc
    if learnt is None:  # every entry elided, or not upstream's one-batch path: as it was
        return direct()
    checked = learnt.checked
    if checked is None or checked[0] is not target:  # first use, or the decode registered again
        bound, why_not = bind_layout(learnt.layout, target, routing.kinds.device_bytes_from)
        learnt.checked = checked = (target, bound, why_not)
        if why_not is not None:
            logger.info("[sglang-dsv41] KV peer writes: sends of %d buffers to %s (state %s) go the "
                        "direct way: %s", len(learnt.layout), mooncake_session_id, state_type, why_not)
    bound = checked[1]
    if bound is None:
        return direct(checked[2])
    writes = held.holding()
    if writes is None:
        # Written at once: not worth a launch when upstream's blocks (one per buffer and
        # page at most) are under the threshold.
        if len(learnt.layout) * len(prefill_data_indices) < state.config.min_blocks:
            return direct(FEW_BLOCKS)
        writes = PeerWrites()
    why_not = writes.add_pages(bound, prefill_data_indices, dst_data_indices)
    if why_not is not None:
        return direct(why_not)
    metrics.count_kv_staging("kv_staging_batches", "peer_pages")
    if writes is held.holding():
        return 0
    try:
        writes.flush()
    except Exception as exc:  # a failed copy or a page outside its buffers: this request fails
        metrics.count_kv_staging("kv_staging_batches", "failed")
        logger.error("[sglang-dsv41] KV peer write to %s failed: %s: %s",
                     mooncake_session_id, type(exc).__name__, exc)
        return held.fail_room(self, f"KV peer write failed: {type(exc).__name__}: {exc}")
    return 0


# --- prefill: a request's last sends held for one write (peer mode) ------------------------
#
# Why and until when: docs/design/kv_staging.md ("How a user meets it", item 4). The
# barriers: the state sends returning (MC-KVS-STATE), the transfer's conclusion on this
# thread (MC-KVS-CONCLUDE), the worker's next chunk (held.ChunkAwareQueue: dropped).


def _room_gone(manager, room) -> bool:
    """Whether sglang already counts ``room`` failed (an abort included) or cleared it."""
    if room is None:
        return False
    from sglang.srt.disaggregation.base.conn import KVPoll

    # one read: sglang's sender may clear the room between two
    status = manager.request_status.get(room)
    return status is None or status == KVPoll.Failed


def around_transfer_worker(original, self, queue, *args, **kwargs):
    """AROUND MooncakeKVManager.transfer_worker: in peer mode, hold a last chunk's sends for one write."""
    state = state_of(self)
    if state is None or state.mappings is None:
        return original(self, queue, *args, **kwargs)
    try:
        return original(self, held.ChunkAwareQueue(queue), *args, **kwargs)
    finally:  # a worker that stops (or dies) writes nothing it held, and lets go of its maps
        held.drop_held("the transfer worker stopped")


def around_maybe_send_extra(original, self, *args, **kwargs):
    """AROUND MooncakeKVManager.maybe_send_extra: the held KV and state sends land before it returns."""
    if held.holding() is None:
        return original(self, *args, **kwargs)
    try:
        rc = original(self, *args, **kwargs)
    except BaseException:
        held.drop_held("the state sends raised")
        raise
    if rc != 0:  # upstream fails the request: nothing more goes into its pages
        held.drop_held("a state send failed")
        return rc
    if _room_gone(self, held.current_room()):  # aborted while its sends were held: write nothing
        held.drop_held("its room failed or was aborted meanwhile")
        return 0
    failed = held.flush_held("state sends")
    return 0 if failed is None else held.fail_room(self, failed)


def around_conclude_transfer(original, self, *, bootstrap_room, status, targets=None, failure_reason=None):
    """AROUND CommonKVManager.conclude_transfer: this thread's held writes land before the status."""
    if held.holding() is not None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        if status == KVPoll.Success and _room_gone(self, bootstrap_room):
            held.drop_held("its room failed or was aborted meanwhile")
        elif status == KVPoll.Success:
            failed = held.flush_held("conclusion")
            if failed is not None:
                status, failure_reason = KVPoll.Failed, failed
        else:  # the request failed: its pages are about to be released, write nothing more
            held.drop_held("the transfer failed")
    return original(self, bootstrap_room=bootstrap_room, status=status, targets=targets,
                    failure_reason=failure_reason)
