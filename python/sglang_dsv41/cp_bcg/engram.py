"""The engram hash of a CP prefill inside the breakable prefill CUDA graph.

Under CP every rank hashes the whole prompt (an n-gram hash needs each token's
predecessors) and keeps its interleaved rows. The hasher builds its
request-to-token indices from host values (request lengths, the live token
count), so a captured copy would replay the hash ids of the capture batch:
wrong output, no error. It therefore runs as an eager break, writing the live
prompt's hashes into the fixed-size output the captured rest of the graph reads.
"""

from __future__ import annotations

import torch


def write_live_hash_rows(out: torch.Tensor, live: torch.Tensor) -> None:
    """Copy the live prompt's hash rows into the captured output; zero its unused tail.

    ``out`` holds one row per token of the captured bucket; a replayed batch has
    at most that many. Rows past the live prompt belong to padding tokens.
    """
    if live.shape[1:] != out.shape[1:] or live.shape[0] > out.shape[0]:
        raise RuntimeError(
            f"engram hash ids of shape {tuple(live.shape)} do not fit the captured "
            f"output of shape {tuple(out.shape)}"
        )
    rows = live.shape[0]
    out[:rows].copy_(live)
    out[rows:].zero_()
