"""Adapter: a PD retraction's prefill recompute names the DP rank its receiver is bound to.

Design: docs/design/pd_retraction.md.
"""

from __future__ import annotations

import logging

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
