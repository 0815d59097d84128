"""The pd_handshake feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="pd_handshake",
    summary='DSpark PD pairing rule for CP and DP-attention layouts',
    upstream='sgl-project/sglang#40161 (open: DeepSeek-V4.1 prefill CP; accepts PD pairs of equal total attention width)',
    design_note="docs/design/pd_handshake.md",
    remove_when='the pinned sglang accepts every pairing pd_handshake.pairing accepts and rejects the rest naming the fields; keep the pairing table as an upstream pin then',
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="PDH-PAIRING",
        group="pd_handshake",
        target="sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.pd_handshake.hooks:around_try_ensure_parallel_info",
        roles=roles(Role.SCHEDULER),
        reason="Decode side of the PD handshake: apply pd_handshake.pairing (DSpark on both, "
        "identical layouts, MLA/hybrid-MLA pool: accept equal shapes and cases a/b/c, "
        "reject the rest naming fields and both values; every pair: refuse a published "
        "parallel size below 1, which sglang would divide by or map no rank for) before any "
        "peer info is cached or rank mapping resolved. AROUND with a scoped, per-thread PrefillServerInfo "
        "rebinding and a manager view instead of a REPLACE of the whole method; the "
        "fingerprint covers the body those substitutions rely on.",
        source="the original fork's disaggregation/common/conn.py (try_ensure_parallel_info TP/CP "
        "relaxation), narrowed to the pairing rule of pd_handshake.pairing",
        signature="(self, bootstrap_addr: str)",
        ast_sha="4ba2b8ed17654460",
    ),
    Patch(
        id="PDH-REFUSAL",
        group="pd_handshake",
        target="sglang.srt.disaggregation.decode.DecodePreallocQueue._ensure_prefill_info",
        kind=HookKind.AROUND,
        hook="sglang_dsv41.pd_handshake.hooks:around_ensure_prefill_info",
        roles=roles(Role.SCHEDULER),
        reason="A refused pairing (PDH-PAIRING's rule, sglang's own page size, KV dtype, "
        "layout or TP checks in try_ensure_parallel_info, its rank-mapping asserts, or a size "
        "the prefill published as 0) raises out of the decode scheduler's "
        "loop and takes the whole decode server down at the first request from that prefill. "
        "AROUND that resolves each prefill address on its own (upstream's loop treats them "
        "independently) and, for a refused one, aborts the requests bound to it with the "
        "refusal as their failure reason, the way upstream's own give-up path aborts them; "
        "counted in pd_pairings_refused.",
        source="this package (a refused pair fails its requests, not the decode)",
        remove_when="sglang fails the requests of a refused pairing instead of raising out of the "
        "decode scheduler loop",
        signature="(self, addr_to_reqs: Dict[str, List[DecodeRequest]])",
        ast_sha="0fddcba7b52353bc",
    ),
)
