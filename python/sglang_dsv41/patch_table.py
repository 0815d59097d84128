"""THE patch table: every change this package makes to sglang, and nothing else.

The loader registers exactly these entries, the activation check verifies
exactly these entries per process role, ``docs/PATCHES.md`` is generated from
them, and a test fails when a module under ``hooks/`` is not named here.

Fingerprints are taken from sglang 0.5.23's installed sources by
``sglang-dsv41 fingerprint``; see AGENTS.md before changing one.
"""

from __future__ import annotations

from sglang_dsv41.patch_spec import HookKind, Patch, Role, roles

_ACT = "sglang_dsv41.hooks.activation"

PATCHES: tuple[Patch, ...] = (
    # --- activation: prove in every process role that its patches are installed
    Patch(
        id="ACT-SCHED",
        group="activation",
        target="sglang.srt.managers.scheduler.Scheduler.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_scheduler",
        roles=roles(Role.SCHEDULER),
        reason="First object a scheduler process builds after load_plugins(); verifies "
        "that every patch owed to the scheduler role is installed and logs the status line.",
        source="this package (sglang's loader swallows hook failures)",
        signature="(self, server_args: ServerArgs, port_args: PortArgs)",
        ast_sha="7c245dffa1126dfe",
        depends_on="signature",
        upstream=None,
        remove_when="sglang's plugin loader stops a process whose hooks failed to apply and "
        "reports, in every process role, which hooks are installed; until then this "
        "check is the only proof that a process runs patched code",
    ),
    Patch(
        id="ACT-TOKENIZER",
        group="activation",
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_tokenizer_manager",
        roles=roles(Role.LAUNCHER, Role.TOKENIZER_WORKER),
        reason="Built in the launcher (single tokenizer) and, through TokenizerWorker, in "
        "every multi-tokenizer HTTP worker; verifies the patches owed to that role.",
        source="this package",
        signature="(self, server_args: ServerArgs, port_args: PortArgs, *, start_pd_bootstrap_service: bool=True)",
        ast_sha="a8c4b0ed14e9ffd9",
        depends_on="signature",
        upstream=None,
        remove_when="sglang's plugin loader stops a process whose hooks failed to apply and "
        "reports, in every process role, which hooks are installed; until then this "
        "check is the only proof that a process runs patched code",
    ),
    Patch(
        id="ACT-ROUTER",
        group="activation",
        target="sglang.srt.managers.multi_tokenizer_mixin.MultiTokenizerRouter.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_launcher_router",
        roles=roles(Role.LAUNCHER),
        reason="With --tokenizer-worker-num > 1 the launcher builds this router instead of a "
        "TokenizerManager; verifies the launcher's patches there.",
        source="this package",
        signature="(self, server_args: ServerArgs, port_args: PortArgs)",
        ast_sha="7c245dffa1126dfe",
        depends_on="signature",
        upstream=None,
        remove_when="sglang's plugin loader stops a process whose hooks failed to apply and "
        "reports, in every process role, which hooks are installed; until then this "
        "check is the only proof that a process runs patched code",
    ),
    Patch(
        id="ACT-DETOK",
        group="activation",
        target="sglang.srt.managers.detokenizer_manager.DetokenizerManager.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_detokenizer",
        roles=roles(Role.DETOKENIZER),
        reason="First object the detokenizer process builds after load_plugins().",
        source="this package",
        signature="(self, server_args: ServerArgs, port_args: PortArgs)",
        ast_sha="7c245dffa1126dfe",
        depends_on="signature",
        upstream=None,
        remove_when="sglang's plugin loader stops a process whose hooks failed to apply and "
        "reports, in every process role, which hooks are installed; until then this "
        "check is the only proof that a process runs patched code",
    ),
    Patch(
        id="ACT-DPC",
        group="activation",
        target="sglang.srt.managers.data_parallel_controller.DataParallelController.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_dp_controller",
        roles=roles(Role.DP_CONTROLLER),
        reason="First object the DP controller process builds after load_plugins().",
        source="this package",
        signature="(self, server_args: ServerArgs, port_args: PortArgs, run_scheduler_process_func: Callable, prelaunched_schedulers: dict[tuple[int, int], tuple[int, Connection]] | None=None)",
        ast_sha="a7f0af3afa1d32f7",
        depends_on="signature",
        upstream=None,
        remove_when="sglang's plugin loader stops a process whose hooks failed to apply and "
        "reports, in every process role, which hooks are installed; until then this "
        "check is the only proof that a process runs patched code",
    ),
    Patch(
        id="ACT-DTR-VERIFY",
        group="activation",
        target="sglang.srt.managers.multi_tokenizer_mixin.MultiDetokenizerRouter.__init__",
        kind=HookKind.BEFORE,
        hook=f"{_ACT}:verify_detokenizer_router",
        roles=roles(Role.DETOKENIZER_ROUTER),
        reason="With --detokenizer-worker-num > 1 a router process fans scheduler output out "
        "to the detokenizers; the first object it builds verifies its patches.",
        source="this package",
        signature="(self, ipc_name_list: List[str], port_args: PortArgs)",
        ast_sha="1cc7ee711839c251",
        depends_on="signature",
        upstream=None,
        remove_when="sglang's plugin loader stops a process whose hooks failed to apply and "
        "reports, in every process role, which hooks are installed",
    ),
    Patch(
        id="ACT-DTR-START",
        group="activation",
        target="sglang.srt.entrypoints.engine.Engine._launch_detokenizer_subprocesses",
        kind=HookKind.AROUND,
        hook=f"{_ACT}:around_launch_detokenizers",
        roles=roles(Role.LAUNCHER),
        reason="The detokenizer router process never calls load_plugins() in sglang 0.5.23. "
        "While the launcher starts the detokenizers, the engine module's name for the router "
        "process body points at a module-level function of ours that loads plugins first and "
        "then runs upstream's; the fingerprint pins the launch body that reads that name.",
        source="this package",
        signature="(cls, server_args: ServerArgs, port_args: PortArgs, run_detokenizer_process_func: Callable)",
        ast_sha="139308172d1b8ef9",
        upstream=None,
        remove_when="sglang's detokenizer router process calls load_plugins() itself",
    ),
    # --- vision-cp: DeepSeek-V4.1 vision with prefill context parallelism
    Patch(
        id="VCP-ARGS",
        group="vision-cp",
        target="sglang.srt.arg_groups.deepseek_v4_hook.validate_deepseek_v41_features",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.hooks.vision_cp_args:before_validate_v41_features",
        roles=roles(Role.LAUNCHER),
        reason="V4.1 vision + prefill CP: interleave strategy required, prefill CUDA graph "
        "resolved to disabled (error when explicit), DSpark with decoder SWA bounded replay "
        "refused; encoder SWA bounded replay refused under prefill CP, which upstream "
        "misses because attention CP is declared only after this validator.",
        source="the original fork's arg_groups/deepseek_v4_hook.py (_validate_deepseek_v41_vision_prefill_cp, "
        "'context parallelism' incompatibility)",
        signature="(server_args: ServerArgs)",
        ast_sha="f5c2fb7f887b62b2",
        upstream=None,
        remove_when="upstream validates V4.1 vision with prefill CP itself (interleave only, no "
        "prefill CUDA graph, no DSpark decoder or encoder SWA bounded replay) and "
        "declares attention CP before this validator runs",
    ),
    Patch(
        id="VCP-BUILD",
        group="vision-cp",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.__init__",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.vision_cp_runtime:around_deepseek_v4_init",
        roles=roles(Role.SCHEDULER),
        reason="Upstream refuses to build the V4.1 vision tower when attention CP > 1. With "
        "vision and CP, the constructor runs with its module-level get_parallel reading one "
        "CP rank until the vision tower class is called (so its PP and MoE A2A checks stay), "
        "then CUDA + interleave is required (NPU, zigzag refused) and the tower and the "
        "language body see the real CP. Only the model module's binding is scoped: a "
        "get_parallel().override(attn_cp_size=1) fails sglang's topology validation. An "
        "AROUND instead of a REPLACE of the 99-line constructor; the fingerprint pins the "
        "statement order it relies on, and a constructor that never builds the tower fails.",
        source="the original fork's models/deepseek_v4.py (DeepseekV4ForCausalLM.__init__ vision guard)",
        signature="(self, config: DeepSeekV4Config, quant_config: Optional[QuantizationConfig]=None, prefix: str='')",
        ast_sha="ae3cc1b161320387",
        upstream=None,
        remove_when="upstream DeepseekV4ForCausalLM builds its vision tower with attention CP > 1 "
        "(the open prefill-CP work still refuses multimodal requests under CP)",
    ),
    Patch(
        id="VCP-PREPARE",
        group="vision-cp",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.prepare_model_inputs",
        kind=HookKind.NEW_ATTRIBUTE,
        hook="sglang_dsv41.hooks.vision_cp_runtime:prepare_model_inputs",
        roles=roles(Role.SCHEDULER),
        reason="The name the eager CP runner (VCP-RUNNER) calls to prepare model inputs on the "
        "full extend layout; delegates to upstream prepare_language_model_inputs (image merge, "
        "placeholder-hash remap), so hooks on that method also cover the CP path.",
        source="the original fork's models/deepseek_v4.py (prepare_model_inputs)",
        signature="class DeepseekV4ForCausalLM(nn.Module)",
        ast_sha="e35290e4c19dc21b",
        relies_on=("prepare_language_model_inputs",),
        upstream=None,
        remove_when="upstream's CP runner prepares multimodal inputs on the full extend layout "
        "(then VCP-RUNNER goes too, and nothing calls this name)",
    ),
    Patch(
        id="VCP-RUNNER",
        group="vision-cp",
        target="sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend_cp",
        kind=HookKind.REPLACE,
        hook="sglang_dsv41.hooks.vision_cp_runtime:execute_extend_cp",
        roles=roles(Role.SCHEDULER),
        reason="Upstream embeds and shards forward_batch.input_ids (image placeholder hashes) "
        "before any image merge, so hash ids reach the text embedding, the hash-layer and "
        "vision MoE routing ids and the logits. The replacement prepares inputs on the full "
        "layout first (VCP-PREPARE) and feeds the normalized ids to all four, never writing "
        "the scheduler's ids. REPLACE of the 75-line method: passing embeddings through "
        "kwargs leaves the routing and logits ids raw, and an AROUND could only swap "
        "forward_batch.input_ids for the whole forward, mutating state the scheduler owns.",
        source="the original fork's model_executor/runner/eager_runner.py (_execute_extend_cp)",
        signature="(self, forward_batch: ForwardBatch, kwargs: dict)",
        ast_sha="39e3d4f7ff07d48e",
        upstream=None,
        remove_when="upstream EagerRunner._execute_extend_cp merges images before it shards, and "
        "feeds the merged ids to the embedding, routing and logits",
    ),
    # === vision-cp runtime entries above this line ===
    # --- owner-broadcast: one rank encodes each image span, the group agrees
    Patch(
        id="OWN-GROUP",
        group="owner-broadcast",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.__init__",
        kind=HookKind.AFTER,
        hook="sglang_dsv41.hooks.owner_broadcast:after_model_init",
        roles=roles(Role.SCHEDULER),
        reason="Sets model.mm_owner_group once the model (and its vision tower) exists: the "
        "attention-TP group, or the attention-CP group when attn_cp == tp, when that group "
        "replicates the image work; None otherwise or with SGLANG_DSV41_OWNER_BROADCAST=0. "
        "Gives it a chunk router (routing policy from the environment; a bad value stops the "
        "build naming the variable). Logs the decision once per process.",
        source="the original fork's models/deepseek_v4.py (mm_owner_group in __init__), "
        "managers/mm_owner_embedding.py (select_owner_group)",
        signature="(self, config: DeepSeekV4Config, quant_config: Optional[QuantizationConfig]=None, prefix: str='')",
        ast_sha="ae3cc1b161320387",
        upstream=None,
        remove_when="upstream encodes each image once per TP/CP group and shares the embedding "
        "(the whole owner-broadcast group goes together)",
    ),
    Patch(
        id="OWN-FENCE",
        group="owner-broadcast",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.prepare_language_model_inputs",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.owner_broadcast:around_prepare_language_model_inputs",
        roles=roles(Role.SCHEDULER),
        reason="Routes each image chunk from what every rank holds alike (batch metadata, "
        "settings, the group's span directory), so all ranks decide without communicating: "
        "spans the group already holds, and chunks whose encoder work the owners cannot usefully "
        "share, run stock code (the latter in a status-only session in the default mode guarded; "
        "SGLANG_DSV41_OWNER_BROADCAST=auto runs them with no collective); the others open an "
        "owner session. Sessions fence the "
        "whole input preparation, so a failure on any rank becomes the same error on every rank "
        "instead of a hang.",
        source="the original fork's models/deepseek_v4.py (prepare_model_inputs fence, _mm_owner_session)",
        signature="(self, input_ids: torch.Tensor, forward_batch: ForwardBatch, input_embeds: Optional[torch.Tensor]=None)",
        ast_sha="34bbfa53a7e0eb4e",
        upstream=None,
        remove_when="the owner-broadcast group goes (see OWN-GROUP)",
    ),
    Patch(
        id="OWN-ADMIT",
        group="owner-broadcast",
        target="sglang.srt.managers.schedule_batch.Req.extend_image_inputs",
        kind=HookKind.AFTER,
        hook="sglang_dsv41.hooks.owner_broadcast:after_extend_image_inputs",
        roles=roles(Role.SCHEDULER),
        reason="Builds a request's image table for the chunk routing when the scheduler admits "
        "its media (offsets are final there and admission reads every item anyway), so the "
        "first image chunk on the forward path finds it instead of reading every item. Only in "
        "a process with a chunk router and not on a PD decode server (it embeds no images); "
        "the chunk still checks that the table is of the request's current item list and "
        "rebuilds it otherwise.",
        source="this package (the chunk routing is ours; the original fork has none)",
        signature="(self, image_inputs)",
        ast_sha="6cd0c8ac21227118",
        upstream=None,
        remove_when="the owner-broadcast group goes (see OWN-GROUP)",
    ),
    Patch(
        id="OWN-TEXT-EMBED",
        group="owner-broadcast",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM._prepare_mm_embeddings",
        kind=HookKind.REPLACE,
        hook="sglang_dsv41.hooks.owner_broadcast:replace_prepare_mm_embeddings",
        roles=roles(Role.SCHEDULER),
        reason="Same embed_mm_inputs call, but with an engaged session the text embedding is a "
        "wrapper that agrees features_ready (together with its own local lookup) before the "
        "embedding's TP all-reduce. The agreement point sits in the middle of embed_mm_inputs "
        "(145 lines); replacing this 15-line caller avoids copying that function.",
        source="the original fork's managers/mm_utils.py (features_ready, uncaptured text embedding)",
        signature="(self, input_ids, forward_batch)",
        ast_sha="eff592bf5f5a4dcd",
        upstream=None,
        remove_when="the owner-broadcast group goes (see OWN-GROUP)",
    ),
    Patch(
        id="OWN-ENCODE",
        group="owner-broadcast",
        target="sglang.srt.managers.mm_schedule._batch_encode_per_image_misses",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.owner_broadcast:around_batch_encode_per_image_misses",
        roles=roles(Role.SCHEDULER),
        reason="Where 0.5.23 encodes a chunk's per-image cache misses on every rank: with an "
        "engaged session, fill each request's overlapping list (0.5.23 3-tuple format) and "
        "resolve the spans through the owner protocol (one encode per span in the group, "
        "broadcast to the rest); otherwise (no session, or a status-only one) the stock encode.",
        source="the original fork's managers/mm_schedule.py (_collect_image_span_requests, "
        "_owner_span_encoder)",
        signature="(data_embedding_func: DataEmbeddingFunc, per_image_requests: List[PerImageRequestInfo], device: torch.device)",
        ast_sha="f73aa2cb968e7fcf",
        upstream=None,
        remove_when="the owner-broadcast group goes (see OWN-GROUP)",
    ),
    # === owner-broadcast entries above this line ===
    # --- mooncake-nvlink: keep intra-node NVLink for device memory, host blocks beside it
    Patch(
        id="MC-NVL-REGIONS",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._registerable_regions",
        kind=HookKind.AFTER,
        hook="sglang_dsv41.hooks.mooncake_nvlink:after_registerable_regions",
        roles=roles(Role.SCHEDULER),
        reason="Under Mooncake's intra-node NVLink transport one host region fails the whole "
        "batch registration and every later transfer; register device regions only and log "
        "what was left out. Also builds the per-manager routing state used by MC-NVL-TRANSFER.",
        source="the original fork's disaggregation/mooncake/conn.py (_registerable_regions NVLink filter, "
        "_nvlink_intra_transport_active, _is_device_pointer)",
        signature="(self)",
        ast_sha="ae8f174a1cd8a137",
        upstream=None,
        remove_when="Mooncake's intra-node NVLink transport accepts host memory regions, or "
        "sglang stops registering host regions under it (the mooncake-nvlink group "
        "goes together)",
    ),
    Patch(
        id="MC-NVL-TRANSFER",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._transfer_data",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.mooncake_nvlink:around_transfer_data",
        roles=roles(Role.SCHEDULER),
        reason="The funnel of KV, state and aux sends: device-sourced blocks go to the engine, "
        "host-sourced ones as host-block frames on the decode endpoint's ordered zmq socket "
        "(found in transfer_infos), ahead of the completion status. Aux takes this path too, "
        "so send_aux needs no hook.",
        source="the original fork's disaggregation/mooncake/conn.py (_transfer_data split, _send_host_blocks_tcp, "
        "send_aux TCP routing)",
        signature="(self, mooncake_session_id, transfer_blocks)",
        ast_sha="1dfbc019c800fbb0",
        upstream=None,
        remove_when="the mooncake-nvlink group goes (see MC-NVL-REGIONS)",
    ),
    Patch(
        id="MC-NVL-AUX-RECV",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._handle_aux_data",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.mooncake_nvlink:around_handle_aux_data",
        roles=roles(Role.SCHEDULER),
        reason="Decode thread: host-block frames travel as AUX_DATA with a tag; write them only "
        "inside published regions with the exact declared length, drop and log anything else, "
        "never let a bad frame stop the thread. Avoids replacing the start_decode_thread closure.",
        source="the original fork's disaggregation/mooncake/conn.py (STATE_DATA_HEADER, _handle_state_data, "
        "_host_transfer_regions)",
        signature="(self, msg: List[bytes])",
        ast_sha="be999ecf897db34a",
        upstream=None,
        remove_when="the mooncake-nvlink group goes (see MC-NVL-REGIONS)",
    ),
    Patch(
        id="MC-KVS-GRANT-SEND",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.common.conn.CommonKVReceiver._send_bootstrap_message",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.kv_staging:around_send_bootstrap_message",
        roles=roles(Role.SCHEDULER),
        reason="KV staging (opt-in, SGLANG_DSV41_KV_STAGING=1 or peer), decode side: the "
        "registration message to each prefill peer is the only per-peer message sent once; it "
        "carries that peer's lease of one slot of the decode's staging pool (1), or the decode's "
        "exported KV regions (peer), as trailing frames, which a prefill without the plugin "
        "ignores. A no-op when staging is off.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, *, bootstrap_info: dict, message: List[bytes], operation: Literal['_register_kv_args', 'send_metadata'])",
        ast_sha="f352c53590625ae8",
        upstream=None,
        remove_when="sglang moves MLA/DeepSeek-V4 KV in few large writes itself (its staging "
        "path covers non-MLA pools only), or Mooncake's per-block cost disappears",
    ),
    Patch(
        id="MC-KVS-GRANT-READ",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo.from_zmq",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.kv_staging:around_register_info_from_zmq",
        roles=roles(Role.SCHEDULER),
        reason="KV staging, prefill side: read a decode peer's slot grant or peer map from the "
        "trailing frames of its registration message and keep it on the parsed registration info, "
        "which the transfer funnel (MC-NVL-TRANSFER) looks up per session.",
        source="none: added here (the original fork sends every block directly)",
        signature="(cls, msg: List[bytes])",
        ast_sha="e3ae6829911ff4f1",
        upstream=None,
        remove_when="with MC-KVS-GRANT-SEND",
    ),
    Patch(
        id="MC-KVS-PAGES",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._send_kvcache_generic",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.kv_staging:around_send_kvcache_generic",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes (SGLANG_DSV41_KV_STAGING=peer), prefill side: the KV and "
        "generic state sends of a request arrive here as page lists, before upstream turns "
        "them into one block per page run and buffer. The call's buffer pairing is learnt "
        "from upstream itself (a dry run for one page, which MC-NVL-TRANSFER keeps from the "
        "engine) and the pages go as one peer write built from the lists, with no block list. "
        "Calls it does not cover run upstream's code unchanged. A no-op in other modes.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, mooncake_session_id: str, src_data_ptrs: list[int], dst_data_ptrs: list[int], item_lens: list[int], prefill_data_indices: npt.NDArray[np.int32], dst_data_indices: npt.NDArray[np.int32], executor: concurrent.futures.ThreadPoolExecutor, state_type: Optional[StateType]=None, force_flat: bool=False, src_layer_ids: Optional[List[int]]=None, dst_layer_ids: Optional[List[int]]=None, dst_device_data_indices: Optional[npt.NDArray[np.int32]]=None, dst_device_data_ptrs: Optional[set[int]]=None, dst_item_lens: list[int] | None=None, bootstrap_room: Optional[int]=None)",
        ast_sha="2ab0979787864fc9",
        upstream=None,
        remove_when="with MC-KVS-GRANT-SEND",
    ),
    Patch(
        id="MC-KVS-WORKER",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.transfer_worker",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.kv_staging:around_transfer_worker",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes (SGLANG_DSV41_KV_STAGING=peer), prefill side: the worker's queue "
        "is wrapped so the plugin knows when the worker sends a request's last chunk; its "
        "page-list sends (KV, state) are held and written as one batch before the request is "
        "concluded (MC-KVS-STATE, MC-KVS-CONCLUDE). Anything still held when the worker takes "
        "its next chunk is dropped, never written late. A no-op in other modes.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, queue: FastQueue, executor: concurrent.futures.ThreadPoolExecutor, staging_buffer=None, worker_index=0)",
        ast_sha="c864a7361584eb02",
        upstream=None,
        remove_when="with MC-KVS-GRANT-SEND",
    ),
    Patch(
        id="MC-KVS-STATE",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.maybe_send_extra",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.kv_staging:around_maybe_send_extra",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes, prefill side: the held sends of a last chunk land when the state "
        "sends return, before upstream checks the room for an abort and counts the chunk as "
        "drained (the abort acknowledgement waits for that count); a failed write is returned "
        "as a failed state send, which upstream turns into the request's failure.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, req: TransferInfo, prefill_state_indices: List, executor: concurrent.futures.ThreadPoolExecutor, target_rank_registration_info: Optional[KVArgsRegisterInfo]=None)",
        ast_sha="aeb90c387e6d2288",
        upstream=None,
        remove_when="with MC-KVS-GRANT-SEND",
    ),
    Patch(
        id="MC-KVS-CONCLUDE",
        group="mooncake-nvlink",
        target="sglang.srt.disaggregation.common.conn.CommonKVManager.conclude_transfer",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.kv_staging:around_conclude_transfer",
        roles=roles(Role.SCHEDULER),
        reason="KV peer writes, prefill side: writes this thread still holds land before a "
        "success status leaves (a failed write concludes the request as failed instead) and are "
        "dropped before a failure status. Threads holding nothing pass straight through.",
        source="none: added here (the original fork sends every block directly)",
        signature="(self, *, bootstrap_room: int, status: KVPoll, targets: Optional[List[Tuple[str, int]]]=None, failure_reason: Optional[str]=None)",
        ast_sha="4f077067128c20a2",
        upstream=None,
        remove_when="with MC-KVS-GRANT-SEND",
    ),
    # === mooncake-nvlink entries above this line ===
    # --- pd-handshake: DSpark PD pairing rule for CP and DP-attention layouts
    Patch(
        id="PDH-PAIRING",
        group="pd-handshake",
        target="sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.pd_handshake:around_try_ensure_parallel_info",
        roles=roles(Role.SCHEDULER),
        reason="Decode side of the PD handshake: apply core.pd_pairing (DSpark on both, "
        "identical layouts, MLA/hybrid-MLA pool: accept equal shapes and cases a/b/c, "
        "reject the rest naming fields and both values) before any peer info is cached "
        "or rank mapping resolved. AROUND with a scoped, per-thread PrefillServerInfo "
        "rebinding and a manager view instead of a REPLACE of the whole method; the "
        "fingerprint covers the body those substitutions rely on.",
        source="the original fork's disaggregation/common/conn.py (try_ensure_parallel_info TP/CP "
        "relaxation), narrowed to the pairing rule of core.pd_pairing",
        signature="(self, bootstrap_addr: str)",
        ast_sha="4ba2b8ed17654460",
        upstream="sgl-project/sglang#40161 (open: DeepSeek-V4.1 prefill CP; accepts PD pairs "
        "of equal total attention width)",
        remove_when="the pinned sglang accepts every pairing core.pd_pairing accepts and rejects "
        "the rest naming the fields; keep the pairing table as an upstream pin then",
    ),
    # === pd-handshake entries above this line ===
    # --- embed-overrides: token-embedding overrides never meet multimodal placeholder rows
    Patch(
        id="EMB-ADMIT",
        group="embed-overrides",
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.hooks.embed_overrides:before_validate_one_request",
        roles=roles(Role.LAUNCHER, Role.TOKENIZER_WORKER),
        reason="Refuse, with a clear error to the client, a request that carries embedding "
        "overrides (positional_embed_overrides, or an embedding request's unresolved "
        "embed_overrides + embed_override_token_id pair) together with image, video or audio "
        "input: the base embedding lookup of overrides cannot index placeholder hash ids. "
        "TokenizerWorker inherits the method, so multi-tokenizer workers refuse it too.",
        source="the original fork's managers/tokenizer_manager.py (_validate_one_request)",
        signature="(self, obj: Union[GenerateReqInput, EmbeddingReqInput], input_ids: List[int])",
        ast_sha="4a56b6b27107f54a",
        upstream=None,
        remove_when="upstream refuses embedding overrides together with multimodal input (the "
        "embed-overrides group goes together)",
    ),
    Patch(
        id="EMB-CAN-SHARE",
        group="embed-overrides",
        target="sglang.srt.managers.schedule_policy.PrefillAdder.can_share_extend_batch",
        kind=HookKind.NEW_ATTRIBUTE,
        hook="sglang_dsv41.hooks.embed_overrides:can_share_extend_batch",
        roles=roles(Role.SCHEDULER),
        reason="The sharing rule as a PrefillAdder method: an override request may not join "
        "admitted multimodal requests and vice versa (the continuing chunk counts, since "
        "add_chunked_req puts it in can_run_list first).",
        source="the original fork's managers/schedule_policy.py (PrefillAdder.can_share_extend_batch)",
        signature="class PrefillAdder()",
        ast_sha="a848c37a6dcd1b37",
        relies_on=("add_chunked_req", "add_one_req"),
        upstream=None,
        remove_when="the embed-overrides group goes (see EMB-ADMIT)",
    ),
    Patch(
        id="EMB-ADD-ONE",
        group="embed-overrides",
        target="sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.embed_overrides:around_add_one_req",
        roles=roles(Role.SCHEDULER),
        reason="Return AddReqResult.OTHER for a request that cannot share the batch. That is "
        "add_one_req's own 'pass is full' verdict, so the admission loop (plain and DLLM) undoes "
        "the request's per-pass state and stops: first come, first served, the refused request "
        "stays at the queue head and is admitted once the multimodal chunk ahead of it drains "
        "(no starvation). Chosen over the original fork's exact placement (a check before the loop's "
        "prefix match) because that needs a REPLACE of the 336-line admission method or an "
        "iterator trick on waiting_queue, both far more fragile across upgrades. The only "
        "difference is that the prefix match, hicache prefetch pop and staging run for the "
        "refused request first: exactly what happens today whenever add_one_req refuses a "
        "request because the pass is full, a path upstream already handles. The one costly "
        "side effect, priority preemption, is closed by EMB-PREEMPT.",
        source="the original fork's managers/scheduler.py (admission loop break on can_share_extend_batch)",
        signature="(self, req: Req, has_chunked_req: bool, truncation_align_size: Optional[int])",
        ast_sha="ea070524dac3f43c",
        upstream=None,
        remove_when="the embed-overrides group goes (see EMB-ADMIT)",
    ),
    Patch(
        id="EMB-PREEMPT",
        group="embed-overrides",
        target="sglang.srt.managers.schedule_policy.PrefillAdder.preempt_to_schedule",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.embed_overrides:around_preempt_to_schedule",
        roles=roles(Role.SCHEDULER),
        reason="With priority preemption and a full batch, the loop preempts running requests "
        "before add_one_req runs; for a request EMB-ADD-ONE will refuse that would evict "
        "running work for nothing. Returning False (nothing preempted) makes the loop stop, "
        "which is where the original fork's check stopped it.",
        source="this package (keeps the original fork's ordering for the one costly side effect)",
        signature="(self, req: Req)",
        ast_sha="680b2994670e25ec",
        upstream=None,
        remove_when="the embed-overrides group goes (see EMB-ADMIT)",
    ),
    Patch(
        id="EMB-INTAKE",
        group="embed-overrides",
        target="sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.hooks.embed_overrides:before_add_request_to_queue",
        roles=roles(Role.SCHEDULER),
        reason="A request that reaches the scheduler with both overrides and multimodal inputs "
        "(a path that skipped EMB-ADMIT) could share a batch with nothing, itself included: it "
        "would block the queue head forever or stop the scheduler at EMB-LOOKUP. It is aborted "
        "through sglang's ordinary early-abort path instead, so only that request fails.",
        source="this package (fail closed for the case the original fork leaves to the runner check)",
        signature="(self, req: Req, is_retracted: bool=False)",
        ast_sha="981a631aee56405e",
        upstream=None,
        remove_when="the embed-overrides group goes (see EMB-ADMIT)",
    ),
    Patch(
        id="EMB-LOOKUP",
        group="embed-overrides",
        target="sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.hooks.embed_overrides:before_extend_forward_kwargs",
        roles=roles(Role.SCHEDULER),
        reason="Last check before the base embedding lookup of an override batch (shared by "
        "the eager and prefill-graph paths): a ValueError naming the row when a chunk in the "
        "batch covers multimodal placeholder rows, instead of indexing hash ids outside the "
        "vocabulary. Recorded spans are checked on the host; media without recorded spans is "
        "checked on the token ids.",
        source="the original fork's model_executor/model_runner.py + misc_utils.validate_replace_embeds_batch",
        signature="(self, forward_batch: ForwardBatch, pp_proxy_tensors)",
        ast_sha="3c075edbad9e2365",
        upstream=None,
        remove_when="the embed-overrides group goes (see EMB-ADMIT)",
    ),
    # === embed-overrides entries above this line ===
    # --- launch-guards: `sglang serve` never lands in a known-crash layout
    Patch(
        id="GUARD-LAUNCH",
        group="launch-guards",
        target="sglang.srt.arg_groups.model_hook.handle_model_capability_adjustments",
        kind=HookKind.RESOLUTION,
        hook="sglang_dsv41.hooks.launch_guards:guard_resolved_layout",
        roles=roles(Role.LAUNCHER),
        reason="The known-crash rules of core/known_crashes.py (the same rules `plan` "
        "reports) applied in the launcher's argument resolution, before any process starts. "
        "Decoder SWA bounded replay that sglang turned on by default for DSpark with DP "
        "attention or prefill CP is turned off with one log line; the same layout with "
        "--enable-decoder-swa-bounded-replay given explicitly, and an explicit prefill CUDA "
        "graph under DeepSeek-V4 prefill CP that would be captured and never replayed (unless "
        "SGLANG_DSV41_CP_BCG=1), stop the launcher with one line naming the flags. A wrapper "
        "of this resolution step, the model-capability step: it runs after every step that "
        "decides what the rules read, and sglang's replay default has no step of its own.",
        source="the original fork's compose field notes (cp4 + dspark + replay; dp + dspark + "
        "replay); upstream model_runner._prefill_cuda_graph_allows_context_parallel",
        signature="(server_args: Any)",
        ast_sha="2e15e28db8c51606",
        upstream=None,
        remove_when="sglang's own validation refuses these layouts, or a GPU re-test on the "
        "pinned release shows they no longer crash",
    ),
    # === launch-guards entries above this line ===
    # --- cp-bcg: DeepSeek-V4 interleave prefill CP in the breakable prefill CUDA graph,
    # opt-in with SGLANG_DSV41_CP_BCG=1 (every hook below is a pass-through without it)
    Patch(
        id="CPBCG-GATE",
        group="cp-bcg",
        target="sglang.srt.layers.cp.bcg.supports_prefill_cp_bcg",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.cp_bcg:around_supports_prefill_cp_bcg",
        roles=roles(Role.LAUNCHER, Role.SCHEDULER),
        reason="Upstream's combination table has no (interleave, dsv4) entry, so every "
        "DeepSeek-V4 prefill under CP runs eagerly and the breakable prefill graph is "
        "resolved off for it. With the opt-in, the supported text-only DeepSeek-V4 shape "
        "(dsv4 backend, interleave, attention CP == TP, PP 1, no DP attention, EP 1 or TP, "
        "no decoder SWA bounded replay, no vision tower unless --language-model-only) "
        "answers yes; every other answer stays upstream's. The predicate is wrapped rather "
        "than the table mutated: the launcher's resolution steps import it lazily and the "
        "prefill graph runner's by-name binding is rewritten by the hook registry.",
        source="the original fork's layers/cp/bcg.py (supports_prefill_cp_bcg)",
        signature="(server_args: ServerArgs)",
        ast_sha="4d74b0a1455a3281",
        upstream=None,
        remove_when="sglang's own combination table accepts (interleave, dsv4) for the breakable prefill graph",
    ),
    Patch(
        id="CPBCG-INPUT",
        group="cp-bcg",
        target="sglang.srt.layers.cp.bcg.get_cp_bcg_input_type",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.cp_bcg:around_get_cp_bcg_input_type",
        roles=roles(Role.SCHEDULER),
        reason="Upstream's interleave adapter is GLM-only (its support test names the GLM "
        "architecture and it sets GLM's KDA reorder capacity). With the opt-in the "
        "interleave strategy gets a subclass that keeps the fixed-address rank-major "
        "routing ids, the fixed-address MoE local token count, global positions for the "
        "compressor writes and local positions for the captured body, drops the KDA field, "
        "and allows EP == TP; for a non-DeepSeek-V4 model it builds upstream's adapter.",
        source="the original fork's layers/cp/bcg.py (its prefill CP graph input fields and "
        "their preparation)",
        signature="(strategy: ContextParallelStrategyKind)",
        ast_sha="d75fa977a7f6847b",
        upstream=None,
        remove_when="sglang's interleave graph input adapter supports DeepSeek-V4 (not only GLM)",
    ),
    Patch(
        id="CPBCG-ENGRAM",
        group="cp-bcg",
        target="sglang.srt.layers.engram.EngramHasher.forward",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.hooks.cp_bcg_engram:around_engram_hasher_forward",
        roles=roles(Role.SCHEDULER),
        reason="The CP branch of the DeepSeek-V4 body hashes the whole prompt by calling "
        "the hasher directly; inside the breakable graph that call would be captured with "
        "the capture batch's host-built request indices and replay its hash ids (silently "
        "wrong output). With the opt-in, a CP extend inside the breakable graph hashes the "
        "live prompt at an eager break (sglang's eager_on_graph) into the captured output, "
        "zero past the live rows. The hasher method is wrapped because the model's own "
        "break wrapper was bound at import and serves the non-CP branch only.",
        source="the original fork's models/deepseek_v4.py (engram hash under CP in the "
        "breakable graph)",
        signature="(self, input_ids: torch.Tensor, forward_batch: ForwardBatch)",
        ast_sha="ae8bb0b0fb4510b6",
        upstream=None,
        remove_when="sglang's DeepSeek-V4 CP branch hashes engram ids at an eager break of the breakable graph",
    ),
    # === cp-bcg entries above this line ===
)


def by_id() -> dict[str, Patch]:
    return {p.id: p for p in PATCHES}


def owed_to(role: Role) -> tuple[Patch, ...]:
    return tuple(p for p in PATCHES if role in p.roles)
