"""The plain rules, without sglang: who may share an extend batch, which chunks
touch placeholder spans."""

from __future__ import annotations

import itertools

import pytest

from sglang_dsv41.embed_overrides import rules

TEXT = rules.RowKind(has_overrides=False, has_multimodal=False)
OVERRIDE = rules.RowKind(has_overrides=True, has_multimodal=False)
MEDIA = rules.RowKind(has_overrides=False, has_multimodal=True)
BOTH = rules.RowKind(has_overrides=True, has_multimodal=True)


def _share(candidate, admitted):
    return rules.can_share_extend_batch(candidate, rules.RowKind.union(admitted))


def test_override_and_media_never_share_in_either_order():
    assert not _share(OVERRIDE, [MEDIA])
    assert not _share(MEDIA, [OVERRIDE])
    assert not _share(OVERRIDE, [TEXT, MEDIA, TEXT])
    assert not _share(MEDIA, [TEXT, OVERRIDE])


def test_everything_else_shares():
    for candidate, admitted in [
        (TEXT, [OVERRIDE, MEDIA]),  # text joins any batch
        (OVERRIDE, [OVERRIDE, TEXT]),
        (MEDIA, [MEDIA, TEXT]),
        (OVERRIDE, []),
        (MEDIA, []),
    ]:
        assert _share(candidate, admitted), (candidate, admitted)


def test_a_request_with_both_shares_with_neither_kind():
    assert BOTH.self_conflicting and not OVERRIDE.self_conflicting
    assert not _share(BOTH, [MEDIA])
    assert not _share(BOTH, [OVERRIDE])
    assert _share(BOTH, [TEXT])  # alone it reaches the runner check, loudly
    assert rules.RowKind.union([]) == TEXT
    assert rules.RowKind.union([OVERRIDE, MEDIA]) == BOTH


def test_no_admitted_batch_ever_mixes_the_two_kinds():
    """Admitting greedily under the rule, in any arrival order, never mixes."""
    kinds = [TEXT, OVERRIDE, MEDIA]
    for arrival in itertools.product(kinds, repeat=5):
        admitted = []
        for kind in arrival:
            if not _share(kind, admitted):
                break
            admitted.append(kind)
        assert not (
            any(k.has_overrides for k in admitted) and any(k.has_multimodal for k in admitted)
        ), arrival


@pytest.mark.parametrize(
    "prefix,extend,span,touches",
    [
        (0, 4, (0, 1), True),  # chunk starts on the span
        (0, 2, (2, 5), False),  # chunk ends right before it
        (0, 3, (2, 5), True),  # last chunk token is the span's first
        (6, 2, (2, 5), False),  # chunk starts right after it
        (5, 2, (2, 5), True),  # first chunk token is the span's last (inclusive)
        (3, 1, (2, 5), True),  # inside
        (5, 0, (2, 5), False),  # empty chunk
        (5, 1, (0, 1), False),  # decode row well past the media
    ],
)
def test_chunk_touches_inclusive_span(prefix, extend, span, touches):
    assert rules.chunk_touches_span(prefix, extend, *span) is touches


def test_rows_with_spans_are_checked_and_unknown_rows_are_returned():
    rows = [
        None,
        rules.ExtendRowMedia(prefix_len=5, extend_len=1, spans=((0, 1),)),
        rules.ExtendRowMedia(prefix_len=0, extend_len=3, spans=None),
    ]
    assert rules.rows_needing_id_scan(rows) == [2]
    rows.append(rules.ExtendRowMedia(prefix_len=0, extend_len=3, spans=((9, 9), (2, 4))))
    with pytest.raises(ValueError, match=r"cannot share an extend batch.*row 3"):
        rules.rows_needing_id_scan(rows)


def test_override_detection_follows_sglang_resolution():
    assert rules.has_embed_overrides(object())
    assert not rules.has_embed_overrides(None)
    # the unresolved pair counts only for embedding requests, and only whole
    pair = dict(embed_overrides=[0.0], embed_override_token_id=50)
    assert rules.has_embed_overrides(None, unresolved_form=True, **pair)
    assert not rules.has_embed_overrides(None, unresolved_form=False, **pair)
    assert not rules.has_embed_overrides(
        None, unresolved_form=True, embed_overrides=[0.0], embed_override_token_id=None
    )
    assert not rules.has_embed_overrides(
        None, unresolved_form=True, embed_overrides=None, embed_override_token_id=50
    )


def test_admission_refuses_only_the_combination():
    with pytest.raises(ValueError, match="overrides cannot be combined"):
        rules.check_request_admission(has_overrides=True, has_multimodal_input=True)
    for flags in [(True, False), (False, True), (False, False)]:
        rules.check_request_admission(has_overrides=flags[0], has_multimodal_input=flags[1])


class _Resolved:
    """Plays PositionalEmbeds: the rule is given the type, so it needs no sglang."""


@pytest.mark.parametrize(
    "sent",
    [{"embeds": [[0.5]], "positions": [1]}, [[[0.5]], [1]], [{"embeds": [[0.5]], "positions": [1]}]],
    ids=["object", "array", "list-of-objects"],
)
def test_override_form_refuses_what_a_json_body_carries(sent):
    with pytest.raises(ValueError) as refused:
        rules.check_override_form(sent, _Resolved)
    assert str(refused.value).startswith("positional_embed_overrides must be a PositionalEmbeds")
    assert f"got {type(sent).__name__}:" in str(refused.value)


def test_override_form_admits_no_overrides_and_the_resolved_type():
    rules.check_override_form(None, _Resolved)
    rules.check_override_form(_Resolved(), _Resolved)
