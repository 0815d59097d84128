"""The kv_staging feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="kv_staging",
    summary="a PD request's many small KV blocks written as few copies straight into the decode's KV (opt-in: SGLANG_DSV41_KV_STAGING=peer)",
    design_note="docs/design/kv_staging.md",
    remove_when="sglang moves MLA/DeepSeek-V4 KV in few large writes itself (its staging path covers non-MLA pools only), or Mooncake's per-block cost disappears",
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="MC-KVS-MAP-SEND",
        group="kv_staging",
        target="sglang.srt.disaggregation.common.conn.CommonKVReceiver._send_bootstrap_message",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.mooncake_nvlink.kv_staging.hooks:around_send_bootstrap_message",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes (opt-in, SGLANG_DSV41_KV_STAGING=peer), decode side: the "
        "registration message to each prefill peer is the only per-peer message sent once; it "
        "carries the decode's exported KV and state regions as trailing frames, which a prefill "
        "without the plugin ignores. A no-op when peer writes are off.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, *, bootstrap_info: dict, message: List[bytes], operation: Literal['_register_kv_args', 'send_metadata'])",
        ast_sha="f352c53590625ae8",
    ),
    Patch(
        id="MC-KVS-MAP-READ",
        group="kv_staging",
        target="sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo.from_zmq",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.mooncake_nvlink.kv_staging.hooks:around_register_info_from_zmq",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes, prefill side: read a decode peer's map from the trailing frames "
        "of its registration message and keep it on the parsed registration info, which the "
        "page path (MC-KVS-PAGES) looks up per session; a malformed map is logged and "
        "ignored (that decode's sends go the direct way).",
        source="none: added here (the original fork sends every block directly)",
        signature="(cls, msg: List[bytes])",
        ast_sha="e3ae6829911ff4f1",
    ),
    Patch(
        id="MC-KVS-PAGES",
        group="kv_staging",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_kvcache_generic",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.mooncake_nvlink.kv_staging.hooks:around_send_kvcache_generic",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes (SGLANG_DSV41_KV_STAGING=peer), prefill side: the KV and "
        "generic state sends of a request arrive here as page lists, before upstream turns "
        "them into one block per page run and buffer. The call's buffer pairing is learnt "
        "from upstream itself (a dry run for one page, which MC-NVL-TRANSFER keeps from the "
        "engine) and the pages go as one peer write built from the lists, with no block list. "
        "Calls it does not cover run upstream's code unchanged (the direct way, counted). "
        "A no-op in other modes.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, mooncake_session_id: str, src_data_ptrs: list[int], dst_data_ptrs: list[int], item_lens: list[int], prefill_data_indices: npt.NDArray[np.int32], dst_data_indices: npt.NDArray[np.int32], executor: concurrent.futures.ThreadPoolExecutor, state_type: Optional[StateType]=None, force_flat: bool=False, src_layer_ids: Optional[List[int]]=None, dst_layer_ids: Optional[List[int]]=None, dst_device_data_indices: Optional[npt.NDArray[np.int32]]=None, dst_device_data_ptrs: Optional[set[int]]=None, dst_item_lens: list[int] | None=None, bootstrap_room: Optional[int]=None)",
        ast_sha="2ab0979787864fc9",
    ),
    Patch(
        id="MC-KVS-WORKER",
        group="kv_staging",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.transfer_worker",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.mooncake_nvlink.kv_staging.hooks:around_transfer_worker",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes (SGLANG_DSV41_KV_STAGING=peer), prefill side: the worker's queue "
        "is wrapped so the plugin knows when the worker sends a request's last chunk; its "
        "page-list sends (KV, state) are held and written as one batch before the request is "
        "concluded (MC-KVS-STATE, MC-KVS-CONCLUDE). Anything still held when the worker takes "
        "its next chunk is dropped, never written late. A no-op in other modes.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, queue: FastQueue, executor: concurrent.futures.ThreadPoolExecutor, staging_buffer=None, worker_index=0)",
        ast_sha="c864a7361584eb02",
    ),
    Patch(
        id="MC-KVS-STATE",
        group="kv_staging",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.maybe_send_extra",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.mooncake_nvlink.kv_staging.hooks:around_maybe_send_extra",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes, prefill side: the held sends of a last chunk land when the state "
        "sends return, before upstream checks the room for an abort and counts the chunk as "
        "drained (the abort acknowledgement waits for that count); a failed write concludes that "
        "request failed here and reports the state send as sent, so upstream fails that request "
        "only, not the decode session.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, req: TransferInfo, prefill_state_indices: List, executor: concurrent.futures.ThreadPoolExecutor, target_rank_registration_info: Optional[KVArgsRegisterInfo]=None)",
        ast_sha="aeb90c387e6d2288",
    ),
    Patch(
        id="MC-KVS-CONCLUDE",
        group="kv_staging",
        target="sglang.srt.disaggregation.common.conn.CommonKVManager.conclude_transfer",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.mooncake_nvlink.kv_staging.hooks:around_conclude_transfer",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes, prefill side: writes this thread still holds land before a "
        "success status leaves (a failed write concludes the request as failed instead) and are "
        "dropped before a failure status. Threads holding nothing pass straight through.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, *, bootstrap_room: int, status: KVPoll, targets: Optional[List[Tuple[str, int]]]=None, failure_reason: Optional[str]=None)",
        ast_sha="4f077067128c20a2",
    ),
    Patch(
        id="MC-KVS-TEARDOWN",
        group="kv_staging",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.teardown",
        kind=HookKind.AFTER,
        hook="sglang_dsv41.mooncake_nvlink.kv_staging.hooks:after_teardown",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes, prefill side: a manager torn down for a role switch closes its "
        "mappings of every decode session (each once no write uses it); an open CUDA IPC "
        "mapping keeps the decode's allocation alive. A no-op in other modes.",
        source="none: added here (the original fork has no peer writes)",
        signature="(self)",
        ast_sha="1b3104b8295de785",
    ),
)
