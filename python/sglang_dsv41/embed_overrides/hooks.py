"""Adapters: keep token-embedding overrides away from multimodal placeholder rows.

The rules live in ``sglang_dsv41.embed_overrides.rules``; these functions
only read sglang objects and call them.
"""

from __future__ import annotations

import logging

from sglang_dsv41.embed_overrides import rules

logger = logging.getLogger(__name__)


# --- request admission (launcher and multi-tokenizer workers) -------------


def before_validate_one_request(self, obj, input_ids):
    """BEFORE TokenizerManager._validate_one_request: refuse overrides that are not
    a PositionalEmbeds, and overrides + media."""
    from sglang.srt.managers.embed_types import PositionalEmbeds
    from sglang.srt.managers.io_struct import EmbeddingReqInput

    rules.check_override_form(obj.positional_embed_overrides, PositionalEmbeds)
    has_overrides = rules.has_embed_overrides(
        obj.positional_embed_overrides,
        embed_overrides=getattr(obj, "embed_overrides", None),
        embed_override_token_id=getattr(obj, "embed_override_token_id", None),
        unresolved_form=isinstance(obj, EmbeddingReqInput),
    )
    if has_overrides:
        rules.check_request_admission(
            has_overrides=True, has_multimodal_input=obj.contains_mm_input()
        )
    return None


def before_get_positional_embed_overrides_item(self, i):
    """BEFORE {Generate,Embedding}ReqInput._get_positional_embed_overrides_item: a batch
    whose field has no entry for prompt ``i`` is the client's error (400), not a 500."""
    from sglang.srt.managers.embed_types import PositionalEmbeds

    rules.check_batch_override_entry(self.positional_embed_overrides, i, PositionalEmbeds)
    return None


# --- scheduler admission ---------------------------------------------------


def _row_kind(req) -> rules.RowKind:
    return rules.RowKind(
        has_overrides=req.positional_embed_overrides is not None,
        has_multimodal=req.multimodal_inputs is not None,
    )


def can_share_extend_batch(self, req) -> bool:
    """New PrefillAdder method: may ``req`` join the requests admitted so far?

    Runs for every admission candidate, so plain requests return at once and
    the admitted rows are scanned only for the attribute that matters.
    """
    candidate = _row_kind(req)
    if not (candidate.has_overrides or candidate.has_multimodal):
        return True
    rows = self.can_run_list
    admitted = rules.RowKind(
        has_overrides=candidate.has_multimodal
        and any(r.positional_embed_overrides is not None for r in rows),
        has_multimodal=candidate.has_overrides
        and any(r.multimodal_inputs is not None for r in rows),
    )
    return rules.can_share_extend_batch(candidate, admitted)


def around_add_one_req(original, self, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req: refuse a request that cannot share.

    OTHER is the verdict add_one_req itself gives when the pass is full
    (prefill_max_requests): the admission loop skips the request, undoes its
    per-pass state and stops admitting for this pass, so the refused request
    keeps its place at the head of the queue for the next pass.
    """
    if not can_share_extend_batch(self, req):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.OTHER
    return original(self, req, *args, **kwargs)


def around_preempt_to_schedule(original, self, req, *args, **kwargs):
    """AROUND PrefillAdder.preempt_to_schedule: never evict running requests for
    a candidate that add_one_req would refuse anyway. False makes the admission
    loop stop, as when there is nothing worth preempting."""
    if not can_share_extend_batch(self, req):
        return False
    return original(self, req, *args, **kwargs)


def before_add_request_to_queue(self, req, *args, **kwargs):
    """BEFORE Scheduler._add_request_to_queue: abort a request that carries both.

    Admission refuses such requests, so this only fires for a path that skipped
    it. Such a request could share a batch with nothing, itself included:
    queued as is, it would either block the queue head forever or reach the
    model-runner check and stop the scheduler. Aborting it here uses sglang's
    ordinary early-abort path: the client gets the error and nothing else is
    affected.
    """
    if req.finished() or req.to_finish is not None:
        return None
    if not _row_kind(req).self_conflicting:
        return None
    req.set_finish_with_abort(rules.SELF_CONFLICT_ERROR.format(rid=req.rid))
    req.positional_embed_overrides = None
    return None


# --- last check before the embedding lookup (model runner) ----------------


def _row_media(mm_inputs, prefix_len, extend_len):
    if mm_inputs is None or not mm_inputs.mm_items:
        return None
    spans = []
    for item in mm_inputs.mm_items:
        if item.offsets is None:
            return rules.ExtendRowMedia(prefix_len, extend_len, None)
        spans.extend((int(start), int(end)) for start, end in item.offsets)
    return rules.ExtendRowMedia(prefix_len, extend_len, tuple(spans))


def _placeholder_ids(mm_inputs) -> list[int]:
    values = []
    for item in mm_inputs.mm_items:
        if item.pad_values is not None or item.pad_value is not None:
            values.extend(int(v) for v in item.padding_values())
    return values


def _ids_hold_placeholders(ids, mm_inputs) -> bool:
    import torch

    values = _placeholder_ids(mm_inputs)
    if not values or ids.numel() == 0:
        return False
    probe = torch.tensor(values, dtype=ids.dtype, device=ids.device)
    return bool(torch.isin(ids, probe).any().item())


def before_extend_forward_kwargs(self, forward_batch, pp_proxy_tensors):
    """BEFORE ModelRunner._extend_forward_kwargs: refuse an override batch whose
    chunk covers multimodal placeholder rows, before the base lookup runs.

    Placeholder spans recorded on the media items are checked on the host. Rows
    whose placement is unknown (no recorded spans, or no host copy of the chunk
    lengths) are checked on their token ids instead; that costs one device sync
    and happens only for override batches that also carry such media.
    """
    if forward_batch.replace_embeds is None or forward_batch.replace_positions is None:
        return None
    mm_batch = forward_batch.mm_inputs
    if not mm_batch or all(m is None for m in mm_batch):
        return None
    prefix_lens = forward_batch.extend_prefix_lens_cpu
    extend_lens = forward_batch.extend_seq_lens_cpu
    ids = forward_batch.input_ids
    if prefix_lens is None or extend_lens is None or len(extend_lens) != len(mm_batch):
        # Chunk placement unknown: look for any placeholder id in the batch.
        for index, mm_inputs in enumerate(mm_batch):
            if mm_inputs is not None and _ids_hold_placeholders(ids, mm_inputs):
                raise rules.batch_error(index)
        return None
    rows = [
        _row_media(mm_inputs, int(prefix_len), int(extend_len))
        for mm_inputs, prefix_len, extend_len in zip(mm_batch, prefix_lens, extend_lens)
    ]
    unknown = rules.rows_needing_id_scan(rows)
    if unknown:
        starts = [0]
        for extend_len in extend_lens:
            starts.append(starts[-1] + int(extend_len))
        for index in unknown:
            chunk = ids[starts[index] : starts[index + 1]]
            if _ids_hold_placeholders(chunk, mm_batch[index]):
                raise rules.batch_error(index)
    return None
