"""Why a decode aborted a request it retracted. Plain: imports nothing of sglang.

sglang 0.5.23's retraction aborts a request instead of retracting it when it
cannot come back: a beam group, the last request that still does not fit, a
request whose KV has no backup. A DeepSeek-V4 pool keeps no backup at all and has
the prefill recompute the prefix from token ids, so a request with images cannot
come back either (the recompute would run without them); stock gives that abort
the same words as a missing backup.
"""

from __future__ import annotations

REASONS = ("vision_inputs", "no_backup", "host_pool_exhausted", "beam_group", "out_of_memory")
VISION_MESSAGE = (
    "Retracted under decode memory pressure: a DeepSeek-V4 PD decode recomputes a retracted "
    "request from its token ids only, so a request with images cannot resume. Retry later."
)


def abort_reason(*, beam_group: bool, out_of_memory: bool, recompute_pool: bool,
                 has_images: bool, backup: str) -> str:
    """The reason, one of ``REASONS``, for one request the retraction aborted.

    ``recompute_pool``: the decode's pool has the prefill recompute retracted KV;
    ``backup``: ``--disaggregation-decode-retraction-backup``.
    """
    if beam_group:
        return "beam_group"
    if out_of_memory:
        return "out_of_memory"
    if recompute_pool and has_images and backup != "none":
        return "vision_inputs"
    if backup == "host_pool":
        return "host_pool_exhausted"
    return "no_backup"
