"""Which prefill DP rank a retraction's recompute must name. Plain: imports nothing of sglang.

A DeepSeek-V4 decode keeps no copy of a retracted request's KV; it binds a new
receiver to the room's prefill DP rank and asks the prefill to recompute the
prefix. The prefill's DP controller obeys a named rank under every balancing
method and balances an unnamed one, so the recompute must name the rank the
receiver waits on, or the KV is produced on a rank nobody listens to.
"""

from __future__ import annotations


def recompute_rank(bound_rank: int | None, prefill_dp_size: int | None) -> int | None:
    """The rank to name in the recompute, or None where naming one changes nothing.

    ``bound_rank`` is the receiver's prefill DP rank (None before it is bound);
    a prefill with one DP rank has nothing to choose.
    """
    if bound_rank is None or not prefill_dp_size or prefill_dp_size <= 1:
        return None
    return bound_rank
