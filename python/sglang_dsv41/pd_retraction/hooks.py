"""Adapters: a PD retraction's recompute names the bound prefill DP rank; its aborts say why.

Design: docs/design/pd_retraction.md.
"""

from __future__ import annotations

import logging

from sglang_dsv41 import metrics
from sglang_dsv41.pd_retraction.aborts import VISION_MESSAGE, abort_reason
from sglang_dsv41.pd_retraction.recompute import recompute_rank

logger = logging.getLogger(__name__)


def before_submit_prefill_recompute(self, decode_req):
    """BEFORE ``DecodePreallocQueue._submit_prefill_recompute``: both policies send from there.

    The payload names ``req.disagg_prefill_dp_rank``; setting it to the bound rank
    also lets a later retraction of the same request take the decode's fast path.
    """
    receiver = decode_req.kv_receiver
    info = getattr(receiver, "prefill_info", None)  # absent on a receiver whose init failed
    rank = recompute_rank(getattr(receiver, "prefill_dp_rank", None), getattr(info, "dp_size", None))
    if rank is None:
        return None
    req = decode_req.req
    if req.disagg_prefill_dp_rank not in (None, rank):
        logger.warning("[sglang-dsv41] rid=%s names prefill DP rank %s but its receiver is bound to %s; "
                       "the recompute goes to %s", req.rid, req.disagg_prefill_dp_rank, rank, rank)
    req.disagg_prefill_dp_rank = rank
    return None


def after_retract_decode(result, self):
    """AFTER ``ScheduleBatch.retract_decode``: count, name and explain each request it aborts.

    Runs once per retraction, never on a decode step. The abort is streamed after
    this returns, so a vision request's message can still say why.
    """
    aborted = result[2]
    if not aborted:
        return None
    from sglang.srt.mem_cache.common import dsv4_needs_rebootstrap
    from sglang.srt.runtime_context import get_disagg

    backup = get_disagg().disaggregation_decode_retraction_backup
    recompute_pool = get_disagg().disaggregation_mode == "decode" and \
        dsv4_needs_rebootstrap(self.token_to_kv_pool_allocator)
    for req in aborted:
        finish = req.to_finish
        message = getattr(finish, "message", "") or ""
        reason = abort_reason(
            beam_group=req.beam_group is not None, out_of_memory=message.startswith("Out of memory"),
            recompute_pool=recompute_pool, has_images=req.multimodal_inputs is not None, backup=backup)
        metrics.count_retraction_abort(reason)
        if reason == "vision_inputs":
            finish.message = VISION_MESSAGE
            items = len(getattr(req.multimodal_inputs, "mm_items", None) or ())
            logger.warning(
                "[sglang-dsv41] retraction aborted rid=%s reason=%s: a DeepSeek-V4 PD decode cannot "
                "carry images in the prefill recompute (bootstrap_room=%s, %d input tokens, "
                "%d image items)", req.rid, reason, req.bootstrap_room, len(req.origin_input_ids), items)
    return None
