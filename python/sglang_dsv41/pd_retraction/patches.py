"""The pd_retraction feature's patch-table entries: what each hook changes and why there.

Plain data; ``plugin.table`` assembles every feature's entries in one order.
"""

from __future__ import annotations

from sglang_dsv41.plugin.spec import Feature, HookKind, Patch, Role, roles

FEATURE = Feature(
    name="pd_retraction",
    summary="PD retraction on a DeepSeek-V4 decode: the recompute reaches the bound prefill DP rank",
    upstream="sgl-project/sglang#40730 (report), sgl-project/sglang#40731 (open: pin a retract "
    "rebootstrap to the prefill DP rank the receiver is bound to)",
    design_note="docs/design/pd_retraction.md",
    remove_when="the pinned sglang's rebootstrap payload names the receiver's bound prefill DP rank "
    "under every decode allocation policy (the fix of sgl-project/sglang#40731 landed)",
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        id="PDR-RECOMPUTE-RANK",
        group="pd_retraction",
        target="sglang.srt.disaggregation.decode.DecodePreallocQueue._submit_prefill_recompute",
        kind=HookKind.BEFORE,
        hook="sglang_dsv41.pd_retraction.hooks:before_submit_prefill_recompute",
        roles=roles(Role.SCHEDULER),
        reason="A retracted request's recompute payload names a prefill DP rank only when the "
        "client named one or under the prefill_complete policy; under early allocation with a "
        "DP-attention prefill balanced by load or round robin the prefill's controller picks "
        "another rank than the one the decode's new receiver is bound to, both sides wait out "
        "their timeouts and the request fails (and the misrouted prefill re-records the room's "
        "rank). Before the payload is built, the request takes the receiver's bound rank; "
        "BEFORE on the one method both allocation policies send from.",
        source="sgl-project/sglang#40731 (description: pin the rebootstrap to the receiver's rank)",
        signature="(self, decode_req: DecodeRequest)",
        ast_sha="f00a075bdf8035fc",
    ),
    Patch(
        id="PDR-ABORT-REASON",
        group="pd_retraction",
        target="sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",
        kind=HookKind.AFTER,
        hook="sglang_dsv41.pd_retraction.hooks:after_retract_decode",
        roles=roles(Role.SCHEDULER),
        reason="A DeepSeek-V4 PD decode aborts every request with images it retracts (the "
        "recompute carries token ids only) with the words of a missing KV backup, and nothing "
        "counts it. After the retraction picks its aborts and before the scheduler streams "
        "them, each is counted by reason (retraction_aborts), and a vision request gets one "
        "log line and an abort message that names the cause. AFTER on the method that decides, "
        "once per retraction; backup_kv_cache is imported by name into schedule_batch.",
        source="this package (sglang 0.5.23's retraction path read against its multimodal TODO)",
        remove_when="the pinned sglang recomputes retracted multimodal requests with their images, "
        "or names the cause of the abort and counts it",
        signature="(self)",
        ast_sha="ab0ae73db2feb4b5",
    ),
)
