"""The owner_broadcast feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="owner_broadcast",
    summary='one rank encodes each image span, the group agrees',
    upstream='sgl-project/sglang#40219 (open: single-owner image encoding under CP)',
    design_note="docs/design/owner_broadcast.md",
    remove_when='upstream encodes each image once per TP/CP group and shares the embedding; every entry goes with it',
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="OWN-GROUP",
        group="owner_broadcast",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.__init__",
        kind=HookKind.AFTER,
        hook="sglang_dsv41.owner_broadcast.hooks:after_model_init",
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
    ),
    Patch(
        id="OWN-FENCE",
        group="owner_broadcast",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.prepare_language_model_inputs",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.owner_broadcast.hooks:around_prepare_language_model_inputs",
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
    ),
    Patch(
        id="OWN-ADMIT",
        group="owner_broadcast",
        target="sglang.srt.managers.schedule_batch.Req.extend_image_inputs",
        kind=HookKind.AFTER,
        hook="sglang_dsv41.owner_broadcast.hooks:after_extend_image_inputs",
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
    ),
    Patch(
        id="OWN-TEXT-EMBED",
        group="owner_broadcast",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM._prepare_mm_embeddings",
        kind=HookKind.REPLACE,
        hook="sglang_dsv41.owner_broadcast.hooks:replace_prepare_mm_embeddings",
        roles=roles(Role.SCHEDULER),
        reason="Same embed_mm_inputs call, but with an engaged session the text embedding is a "
        "wrapper that agrees features_ready (together with its own local lookup) before the "
        "embedding's TP all-reduce. The agreement point sits in the middle of embed_mm_inputs "
        "(145 lines); replacing this 15-line caller avoids copying that function.",
        source="the original fork's managers/mm_utils.py (features_ready, uncaptured text embedding)",
        signature="(self, input_ids, forward_batch)",
        ast_sha="eff592bf5f5a4dcd",
    ),
    Patch(
        id="OWN-ENCODE",
        group="owner_broadcast",
        target="sglang.srt.managers.mm_schedule._batch_encode_per_image_misses",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.owner_broadcast.hooks:around_batch_encode_per_image_misses",
        roles=roles(Role.SCHEDULER),
        reason="Where 0.5.23 encodes a chunk's per-image cache misses on every rank: with an "
        "engaged session, fill each request's overlapping list (0.5.23 3-tuple format) and "
        "resolve the spans through the owner protocol (one encode per span in the group, "
        "broadcast to the rest); otherwise (no session, or a status-only one) the stock encode.",
        source="the original fork's managers/mm_schedule.py (_collect_image_span_requests, "
        "_owner_span_encoder)",
        signature="(data_embedding_func: DataEmbeddingFunc, per_image_requests: List[PerImageRequestInfo], device: torch.device)",
        ast_sha="f73aa2cb968e7fcf",
    ),
)
