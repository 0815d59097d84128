"""Token-embedding overrides must never meet multimodal placeholder rows.

The three layers that keep them apart (admission, scheduler batching, the model
runner's last check), as plain logic; why in docs/design/embed_overrides.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

ADMISSION_ERROR = (
    "embedding overrides cannot be combined with image, video, or audio inputs: "
    "the base embedding lookup for overrides cannot index multimodal placeholder "
    "tokens; send the multimodal input and the overrides as separate requests"
)

BATCH_ERROR = (
    "token embedding overrides cannot share an extend batch with multimodal "
    "placeholder rows (batch row {row}): the base embedding lookup would index "
    "placeholder hash ids outside the vocabulary"
)

OVERRIDE_FORM_ERROR = (
    "positional_embed_overrides must be a PositionalEmbeds object, got {kind}: sglang "
    "builds none from a JSON request body, so only the in-process Engine API can pass "
    "one (for an embedding model, /v1/embeddings takes embed_overrides with "
    "embed_override_token_id)"
)

SELF_CONFLICT_ERROR = (
    "request {rid} carries both embedding overrides and multimodal inputs; "
    "this combination is not supported and the request is aborted"
)


def has_embed_overrides(
    positional_embed_overrides: object,
    *,
    embed_overrides: object = None,
    embed_override_token_id: Optional[int] = None,
    unresolved_form: bool = False,
) -> bool:
    """Does the request carry token-embedding overrides?

    ``unresolved_form`` is True for embedding requests, whose
    ``embed_overrides`` + ``embed_override_token_id`` pair is turned into
    positional overrides only after request validation; sglang resolves the
    pair only when both halves are set, so only then does it count.
    """
    if positional_embed_overrides is not None:
        return True
    return bool(
        unresolved_form
        and embed_overrides is not None
        and embed_override_token_id is not None
    )


def check_override_form(positional_embed_overrides: object, positional_embeds_type: type) -> None:
    """Raise ValueError unless one request's overrides are absent or a ``positional_embeds_type``.

    The scheduler calls a method of that type on whatever arrives (a JSON object
    arrives as a dict), before any per-request error handling: anything else stops
    the scheduler, and the server with it, for every client.
    """
    if positional_embed_overrides is None:
        return
    if isinstance(positional_embed_overrides, positional_embeds_type):
        return
    raise ValueError(OVERRIDE_FORM_ERROR.format(kind=type(positional_embed_overrides).__name__))


BATCH_OVERRIDE_FORM_ERROR = (
    "positional_embed_overrides of a batch request takes one entry per prompt (a list, "
    "null for a prompt without overrides); prompt {index} has none in a {kind}"
)


def check_batch_override_entry(overrides: object, index: int, positional_embeds_type: type) -> None:
    """Raise ValueError unless prompt ``index`` of a batch request has an entry in ``overrides``.

    sglang indexes the field per prompt when it splits a batch; a field posted as
    one JSON object (or a list shorter than the batch) fails that indexing with a
    KeyError or IndexError, which the HTTP server answers with a 500. Absent or
    one shared ``positional_embeds_type`` is sglang's own form for every prompt.
    """
    if overrides is None or isinstance(overrides, positional_embeds_type):
        return
    if isinstance(overrides, (list, tuple)) and 0 <= index < len(overrides):
        return
    kind = f"list of {len(overrides)}" if isinstance(overrides, (list, tuple)) else type(overrides).__name__
    raise ValueError(BATCH_OVERRIDE_FORM_ERROR.format(index=index, kind=kind))


def check_request_admission(*, has_overrides: bool, has_multimodal_input: bool) -> None:
    """Raise ValueError for a request that asks for overrides and media together."""
    if has_overrides and has_multimodal_input:
        raise ValueError(ADMISSION_ERROR)


@dataclass(frozen=True)
class RowKind:
    """What the scheduler needs to know about a request, or about the union of
    the requests already admitted to an extend batch."""

    has_overrides: bool
    has_multimodal: bool

    @property
    def self_conflicting(self) -> bool:
        return self.has_overrides and self.has_multimodal

    @staticmethod
    def union(kinds: Iterable["RowKind"]) -> "RowKind":
        overrides = media = False
        for kind in kinds:
            overrides = overrides or kind.has_overrides
            media = media or kind.has_multimodal
        return RowKind(has_overrides=overrides, has_multimodal=media)


def can_share_extend_batch(candidate: RowKind, admitted: RowKind) -> bool:
    """May ``candidate`` join an extend batch whose admitted rows add up to ``admitted``?

    Conservative on purpose: a multimodal request counts as having placeholder
    rows for every chunk, even a chunk past its media. Decode rows mixed into
    an extend step are not admitted rows; the model-runner check covers them
    exactly. A request that carries both kinds (the scheduler intake aborts
    those) shares with neither kind; alone it would reach the model-runner
    check, which stops it loudly rather than hanging the queue.
    """
    if candidate.has_overrides and admitted.has_multimodal:
        return False
    if candidate.has_multimodal and admitted.has_overrides:
        return False
    return True


@dataclass(frozen=True)
class ExtendRowMedia:
    """One row of an assembled extend batch, as far as placeholders go.

    ``spans`` are the row's placeholder spans as inclusive ``(start, end)``
    positions in the request's full token sequence. ``None`` means the row has
    media whose placement is not recorded; the caller then has to look at the
    token ids themselves.
    """

    prefix_len: int
    extend_len: int
    spans: Optional[tuple[tuple[int, int], ...]]


def chunk_touches_span(prefix_len: int, extend_len: int, start: int, end: int) -> bool:
    """Does the chunk ``[prefix_len, prefix_len + extend_len)`` hold any of ``[start, end]``?"""
    if extend_len <= 0:
        return False
    return start < prefix_len + extend_len and end >= prefix_len


def rows_needing_id_scan(rows: Sequence[Optional[ExtendRowMedia]]) -> list[int]:
    """Check every row with known spans; return the rows that must be scanned.

    Raises ValueError naming the first row whose chunk covers a placeholder
    span. Rows that are ``None`` (no media) are skipped.
    """
    unknown = []
    for index, row in enumerate(rows):
        if row is None:
            continue
        if row.spans is None:
            unknown.append(index)
            continue
        for start, end in row.spans:
            if chunk_touches_span(row.prefix_len, row.extend_len, start, end):
                raise ValueError(BATCH_ERROR.format(row=index))
    return unknown


def batch_error(row: Optional[int]) -> ValueError:
    return ValueError(BATCH_ERROR.format(row="unknown" if row is None else row))
