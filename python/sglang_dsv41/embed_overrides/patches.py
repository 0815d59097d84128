"""The embed_overrides feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="embed_overrides",
    summary='token-embedding overrides never meet multimodal placeholder rows',
    remove_when='upstream refuses embedding overrides together with multimodal input; every entry goes with it',
    design_note="docs/design/embed_overrides.md",
)

_BATCH_ENTRY_REASON = (
    "Refuse, with a 400 naming the field, a batch request whose positional_embed_overrides has "
    "no entry for one of its prompts (one JSON object for the whole batch, or a list shorter "
    "than it). sglang indexes the field per prompt when it splits the batch, and the KeyError "
    "or IndexError becomes a 500 (the server keeps serving). Each entry is then checked per "
    "request by EMB-ADMIT."
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="EMB-ADMIT",
        group="embed_overrides",
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.embed_overrides.hooks:before_validate_one_request",
        roles=roles(Role.LAUNCHER, Role.TOKENIZER_WORKER),
        reason="Refuse, with a clear error to the client, a request that carries embedding "
        "overrides (positional_embed_overrides, or an embedding request's unresolved "
        "embed_overrides + embed_override_token_id pair) together with image, video or audio "
        "input: the base embedding lookup of overrides cannot index placeholder hash ids. "
        "Also refuse, with or without media, overrides that are not a PositionalEmbeds: sglang "
        "keeps a JSON positional_embed_overrides as posted (a dict or list), and the scheduler's "
        "intake calls PositionalEmbeds.reconstruct on it outside any per-request error handling, "
        "which stops the scheduler and the server. "
        "TokenizerWorker inherits the method, so multi-tokenizer workers refuse it too.",
        source="the original fork's managers/tokenizer_manager.py (_validate_one_request)",
        signature="(self, obj: Union[GenerateReqInput, EmbeddingReqInput], input_ids: List[int])",
        ast_sha="4a56b6b27107f54a",
    ),
    Patch(
        id="EMB-BATCH-GEN",
        group="embed_overrides",
        target="sglang.srt.managers.io_struct.GenerateReqInput._get_positional_embed_overrides_item",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.embed_overrides.hooks:before_get_positional_embed_overrides_item",
        roles=roles(Role.LAUNCHER, Role.TOKENIZER_WORKER),
        reason=_BATCH_ENTRY_REASON,
        source="this package (a client's malformed batch gets a client error)",
        signature="(self, i: int)",
        ast_sha="bbc62392db07e88e",
    ),
    Patch(
        id="EMB-BATCH-EMB",
        group="embed_overrides",
        target="sglang.srt.managers.io_struct.EmbeddingReqInput._get_positional_embed_overrides_item",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.embed_overrides.hooks:before_get_positional_embed_overrides_item",
        roles=roles(Role.LAUNCHER, Role.TOKENIZER_WORKER),
        reason=_BATCH_ENTRY_REASON,
        source="this package (a client's malformed batch gets a client error)",
        signature="(self, i: int)",
        ast_sha="bbc62392db07e88e",
    ),
    Patch(
        id="EMB-CAN-SHARE",
        group="embed_overrides",
        target="sglang.srt.managers.schedule_policy.PrefillAdder.can_share_extend_batch",
        kind=HookKind.NEW_ATTRIBUTE,
        hook="sglang_dsv41.embed_overrides.hooks:can_share_extend_batch",
        roles=roles(Role.SCHEDULER),
        reason="The sharing rule as a PrefillAdder method: an override request may not join "
        "admitted multimodal requests and vice versa (the continuing chunk counts, since "
        "add_chunked_req puts it in can_run_list first).",
        source="the original fork's managers/schedule_policy.py (PrefillAdder.can_share_extend_batch)",
        signature="class PrefillAdder()",
        ast_sha="a848c37a6dcd1b37",
        relies_on=("add_chunked_req", "add_one_req"),
    ),
    Patch(
        id="EMB-ADD-ONE",
        group="embed_overrides",
        target="sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.embed_overrides.hooks:around_add_one_req",
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
    ),
    Patch(
        id="EMB-PREEMPT",
        group="embed_overrides",
        target="sglang.srt.managers.schedule_policy.PrefillAdder.preempt_to_schedule",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.embed_overrides.hooks:around_preempt_to_schedule",
        roles=roles(Role.SCHEDULER),
        reason="With priority preemption and a full batch, the loop preempts running requests "
        "before add_one_req runs; for a request EMB-ADD-ONE will refuse that would evict "
        "running work for nothing. Returning False (nothing preempted) makes the loop stop, "
        "which is where the original fork's check stopped it.",
        source="this package (keeps the original fork's ordering for the one costly side effect)",
        signature="(self, req: Req)",
        ast_sha="680b2994670e25ec",
    ),
    Patch(
        id="EMB-INTAKE",
        group="embed_overrides",
        target="sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.embed_overrides.hooks:before_add_request_to_queue",
        roles=roles(Role.SCHEDULER),
        reason="A request that reaches the scheduler with both overrides and multimodal inputs "
        "(a path that skipped EMB-ADMIT) could share a batch with nothing, itself included: it "
        "would block the queue head forever or stop the scheduler at EMB-LOOKUP. It is aborted "
        "through sglang's ordinary early-abort path instead, so only that request fails.",
        source="this package (fail closed for the case the original fork leaves to the runner check)",
        signature="(self, req: Req, is_retracted: bool=False)",
        ast_sha="981a631aee56405e",
    ),
    Patch(
        id="EMB-LOOKUP",
        group="embed_overrides",
        target="sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.embed_overrides.hooks:before_extend_forward_kwargs",
        roles=roles(Role.SCHEDULER),
        reason="Last check before the base embedding lookup of an override batch (shared by "
        "the eager and prefill-graph paths): a ValueError naming the row when a chunk in the "
        "batch covers multimodal placeholder rows, instead of indexing hash ids outside the "
        "vocabulary. Recorded spans are checked on the host; media without recorded spans is "
        "checked on the token ids.",
        source="the original fork's model_executor/model_runner.py + misc_utils.validate_replace_embeds_batch",
        signature="(self, forward_batch: ForwardBatch, pp_proxy_tensors)",
        ast_sha="3c075edbad9e2365",
    ),
)
