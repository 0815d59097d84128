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
        ast_sha="451e6fc7ed80c78c",
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
        ast_sha="9194cd9ba33f0fac",
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
        ast_sha="8d460203f1750357",
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
        ast_sha="cac29a0cbd6a263d",
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
        ast_sha="3456bfad1061e316",
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
        ast_sha="fccf5d654a07b01e",
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
        ast_sha="9c712b92a1f77ca5",
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
        source="seed arg_groups/deepseek_v4_hook.py (_validate_deepseek_v41_vision_prefill_cp, "
        "'context parallelism' incompatibility); UPSTREAM-0.5.23 rows B1, B2",
        signature="(server_args: ServerArgs)",
        ast_sha="4194690793d556cd",
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
        source="seed models/deepseek_v4.py (DeepseekV4ForCausalLM.__init__ vision guard); "
        "UPSTREAM-0.5.23 row B4 option (b)",
        signature="(self, config: DeepSeekV4Config, quant_config: Optional[QuantizationConfig]=None, prefix: str='')",
        ast_sha="1f322574a840203c",
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
        source="seed models/deepseek_v4.py (prepare_model_inputs); UPSTREAM-0.5.23 row B6",
        signature="class DeepseekV4ForCausalLM(nn.Module)",
        ast_sha="5485385d04d4a650",
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
        source="seed model_executor/runner/eager_runner.py; UPSTREAM-0.5.23 row B5",
        signature="(self, forward_batch: ForwardBatch, kwargs: dict)",
        ast_sha="07f87b7e9b6875da",
    ),
    # === vision-cp runtime (issue 5) entries above this line ===
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
        source="seed models/deepseek_v4.py (mm_owner_group in __init__), "
        "managers/mm_owner_embedding.py (select_owner_group); UPSTREAM-0.5.23 row C4",
        signature="(self, config: DeepSeekV4Config, quant_config: Optional[QuantizationConfig]=None, prefix: str='')",
        ast_sha="1f322574a840203c",
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
        "share, run stock code with no collective (with SGLANG_DSV41_OWNER_BROADCAST=guarded the "
        "latter in a status-only session); the others open an owner session. Sessions fence the "
        "whole input preparation, so a failure on any rank becomes the same error on every rank "
        "instead of a hang.",
        source="seed models/deepseek_v4.py (prepare_model_inputs fence, _mm_owner_session); "
        "UPSTREAM-0.5.23 rows C4, B6",
        signature="(self, input_ids: torch.Tensor, forward_batch: ForwardBatch, input_embeds: Optional[torch.Tensor]=None)",
        ast_sha="873f6b875451f57e",
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
        source="this package (the chunk routing is ours; the seed has none)",
        signature="(self, image_inputs)",
        ast_sha="b35d1ec6843c0e97",
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
        source="seed managers/mm_utils.py (features_ready, uncaptured text embedding); "
        "UPSTREAM-0.5.23 row C3",
        signature="(self, input_ids, forward_batch)",
        ast_sha="2f73f3618d0677b4",
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
        source="seed managers/mm_schedule.py (_collect_image_span_requests, "
        "_owner_span_encoder); UPSTREAM-0.5.23 rows C1, C2",
        signature="(data_embedding_func: DataEmbeddingFunc, per_image_requests: List[PerImageRequestInfo], device: torch.device)",
        ast_sha="fbbc8fa72fee0535",
    ),
    # === owner-broadcast (issue 3) entries above this line ===
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
        source="seed disaggregation/mooncake/conn.py (_registerable_regions NVLink filter, "
        "_nvlink_intra_transport_active, _is_device_pointer); UPSTREAM-0.5.23 rows E1, E2",
        signature="(self)",
        ast_sha="6ec9479b86d8c37c",
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
        source="seed disaggregation/mooncake/conn.py (_transfer_data split, _send_host_blocks_tcp, "
        "send_aux TCP routing); UPSTREAM-0.5.23 rows E3, E4, E6",
        signature="(self, mooncake_session_id, transfer_blocks)",
        ast_sha="2864acc7a8b8889a",
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
        source="seed disaggregation/mooncake/conn.py (STATE_DATA_HEADER, _handle_state_data, "
        "_host_transfer_regions); UPSTREAM-0.5.23 row E5",
        signature="(self, msg: List[bytes])",
        ast_sha="fe1cc6da028906c9",
    ),
    # === mooncake-nvlink (issue 4) entries above this line ===
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
        source="seed disaggregation/common/conn.py (try_ensure_parallel_info TP/CP "
        "relaxation); UPSTREAM-0.5.23 row D2; issue 6 decision",
        signature="(self, bootstrap_addr: str)",
        ast_sha="b642fd15fc5d3f71",
    ),
    # === pd-handshake (issue 6) entries above this line ===
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
        source="seed managers/tokenizer_manager.py (_validate_one_request); UPSTREAM-0.5.23 row G1",
        signature="(self, obj: Union[GenerateReqInput, EmbeddingReqInput], input_ids: List[int])",
        ast_sha="b07f3e2b9e53a92d",
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
        source="seed managers/schedule_policy.py (PrefillAdder.can_share_extend_batch); "
        "UPSTREAM-0.5.23 row G2",
        signature="class PrefillAdder()",
        ast_sha="42d4c52dc48b4702",
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
        "(no starvation). Chosen over the seed's exact placement (a check before the loop's "
        "prefix match) because that needs a REPLACE of the 336-line admission method or an "
        "iterator trick on waiting_queue, both far more fragile across upgrades. The only "
        "difference is that the prefix match, hicache prefetch pop and staging run for the "
        "refused request first: exactly what happens today whenever add_one_req refuses a "
        "request because the pass is full, a path upstream already handles. The one costly "
        "side effect, priority preemption, is closed by EMB-PREEMPT.",
        source="seed managers/scheduler.py (admission loop break on can_share_extend_batch); "
        "UPSTREAM-0.5.23 row G3",
        signature="(self, req: Req, has_chunked_req: bool, truncation_align_size: Optional[int])",
        ast_sha="52fe90559106142a",
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
        "which is where the seed's check stopped it.",
        source="this package (keeps the seed's ordering for the one costly side effect); "
        "UPSTREAM-0.5.23 row G3 caveat",
        signature="(self, req: Req)",
        ast_sha="5dad39caf67060ec",
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
        source="this package (fail closed for the case the seed leaves to the runner check)",
        signature="(self, req: Req, is_retracted: bool=False)",
        ast_sha="05c1c713a904540e",
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
        source="seed model_executor/model_runner.py + misc_utils.validate_replace_embeds_batch; "
        "UPSTREAM-0.5.23 row G4",
        signature="(self, forward_batch: ForwardBatch, pp_proxy_tensors)",
        ast_sha="ed9bf58fa646d48f",
    ),
    # === embed-overrides (issue 5) entries above this line ===
)


def by_id() -> dict[str, Patch]:
    return {p.id: p for p in PATCHES}


def owed_to(role: Role) -> tuple[Patch, ...]:
    return tuple(p for p in PATCHES if role in p.roles)
