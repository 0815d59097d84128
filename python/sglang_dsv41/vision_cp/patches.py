"""The vision_cp feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="vision_cp",
    summary='DeepSeek-V4.1 vision with prefill context parallelism',
    upstream='sgl-project/sglang#40219 (open: DeepSeek-V4.1 vision under prefill CP)',
    remove_when='upstream serves DeepSeek-V4.1 vision under prefill CP itself (sgl-project/sglang#40219); each entry says which part it covers',
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="VCP-ARGS",
        group="vision_cp",
        target="sglang.srt.arg_groups.deepseek_v4_hook.validate_deepseek_v41_features",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.vision_cp.hooks_args:before_validate_v41_features",
        roles=roles(Role.LAUNCHER),
        reason="V4.1 vision + prefill CP: interleave strategy required, prefill CUDA graph "
        "resolved to disabled (error when explicit), DSpark with decoder SWA bounded replay "
        "refused; encoder SWA bounded replay refused under prefill CP, which upstream "
        "misses because attention CP is declared only after this validator.",
        source="the original fork's arg_groups/deepseek_v4_hook.py (_validate_deepseek_v41_vision_prefill_cp, "
        "'context parallelism' incompatibility)",
        signature="(server_args: ServerArgs)",
        ast_sha="f5c2fb7f887b62b2",
        remove_when="upstream validates V4.1 vision with prefill CP itself (interleave only, no "
        "prefill CUDA graph, no DSpark decoder or encoder SWA bounded replay) and "
        "declares attention CP before this validator runs",
    ),
    Patch(
        id="VCP-BUILD",
        group="vision_cp",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.__init__",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.vision_cp.hooks_model:around_deepseek_v4_init",
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
        remove_when="upstream DeepseekV4ForCausalLM builds its vision tower with attention CP > 1 "
        "(the open prefill-CP work still refuses multimodal requests under CP)",
    ),
    Patch(
        id="VCP-PREPARE",
        group="vision_cp",
        target="sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.prepare_model_inputs",
        kind=HookKind.NEW_ATTRIBUTE,
        hook="sglang_dsv41.vision_cp.hooks_model:prepare_model_inputs",
        roles=roles(Role.SCHEDULER),
        reason="The name the eager CP runner (VCP-RUNNER) calls to prepare model inputs on the "
        "full extend layout; delegates to upstream prepare_language_model_inputs (image merge, "
        "placeholder-hash remap), so hooks on that method also cover the CP path.",
        source="the original fork's models/deepseek_v4.py (prepare_model_inputs)",
        signature="class DeepseekV4ForCausalLM(nn.Module)",
        ast_sha="e35290e4c19dc21b",
        relies_on=("prepare_language_model_inputs",),
        remove_when="upstream's CP runner prepares multimodal inputs on the full extend layout "
        "(then VCP-RUNNER goes too, and nothing calls this name)",
    ),
    Patch(
        id="VCP-RUNNER",
        group="vision_cp",
        target="sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend_cp",
        kind=HookKind.REPLACE,
        hook="sglang_dsv41.vision_cp.hooks_model:execute_extend_cp",
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
        remove_when="upstream EagerRunner._execute_extend_cp merges images before it shards, and "
        "feeds the merged ids to the embedding, routing and logits",
    ),
)
