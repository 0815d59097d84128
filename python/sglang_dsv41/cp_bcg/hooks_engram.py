"""Adapter: the engram hasher as an eager break of the CP breakable prefill graph.

sglang's own eager-break wrapper for the hasher (in the DeepSeek-V4 model
module) serves only the non-CP branch and was bound to the unpatched function
at import, so the CP branch gets a break of its own here, built with the same
``eager_on_graph`` mechanism.
"""

from __future__ import annotations

import functools

from sglang_dsv41.cp_bcg.engram import write_live_hash_rows
from sglang_dsv41.cp_bcg.rules import cp_bcg_enabled


def _hash_live_prompt(original_forward, hasher, input_ids, out) -> None:
    """The break body; at replay it runs with its capture-time arguments.

    ``input_ids`` is the capture-time view and is not read: the live batch comes
    from the forward context the graph runner sets for every capture and replay.
    """
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
        get_tc_piecewise_forward_context,
    )

    forward_batch = get_tc_piecewise_forward_context().forward_batch
    total = int(forward_batch.attn_cp_metadata.total_seq_lens)
    live = original_forward(hasher, forward_batch.input_ids[:total], forward_batch)
    write_live_hash_rows(out, live)


@functools.cache
def engram_cp_break():
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
        eager_on_graph,
    )

    return eager_on_graph(_hash_live_prompt)


def _cp_prefill_in_breakable_graph(forward_batch) -> bool:
    from sglang.srt.layers.cp.utils import is_cp_active
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
        is_in_breakable_cuda_graph,
    )

    return (
        is_in_breakable_cuda_graph()
        and forward_batch.forward_mode.is_extend()
        and is_cp_active(forward_batch)
    )


def around_engram_hasher_forward(original, self, input_ids, forward_batch):
    """AROUND sglang.srt.layers.engram.EngramHasher.forward."""
    # The graph flag first: it is one module-global read on every other forward.
    if not (_cp_prefill_in_breakable_graph(forward_batch) and cp_bcg_enabled()):
        return original(self, input_ids, forward_batch)
    out = self.new_hash_ids(input_ids)
    engram_cp_break()(original, self, input_ids, out)
    return out
