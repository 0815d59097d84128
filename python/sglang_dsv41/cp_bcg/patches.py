"""The cp_bcg feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="cp_bcg",
    summary='DeepSeek-V4 interleave prefill CP in the breakable prefill CUDA graph, opt-in with SGLANG_DSV41_CP_BCG=1 (every hook is a pass-through without it)',
    upstream='sgl-project/sglang#38603 (open: the breakable prefill graph under prefill CP)',
    remove_when='sglang runs DeepSeek-V4 interleave prefill CP in the breakable prefill graph itself (sgl-project/sglang#38603); each entry says which part it covers',
    design_note="docs/design/cp_bcg.md",
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="CPBCG-GATE",
        group="cp_bcg",
        target="sglang.srt.layers.cp.bcg.supports_prefill_cp_bcg",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.cp_bcg.hooks:around_supports_prefill_cp_bcg",
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
        remove_when="sglang's own combination table accepts (interleave, dsv4) for the breakable prefill graph",
    ),
    Patch(
        id="CPBCG-INPUT",
        group="cp_bcg",
        target="sglang.srt.layers.cp.bcg.get_cp_bcg_input_type",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.cp_bcg.hooks:around_get_cp_bcg_input_type",
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
        remove_when="sglang's interleave graph input adapter supports DeepSeek-V4 (not only GLM)",
    ),
    Patch(
        id="CPBCG-ENGRAM",
        group="cp_bcg",
        target="sglang.srt.layers.engram.EngramHasher.forward",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.cp_bcg.hooks_engram:around_engram_hasher_forward",
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
        remove_when="sglang's DeepSeek-V4 CP branch hashes engram ids at an eager break of the breakable graph",
    ),
)
