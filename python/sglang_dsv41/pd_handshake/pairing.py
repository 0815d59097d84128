"""Which prefill and decode servers may pair for DeepSeek-V4.1 DSpark PD (no sglang import).

Design: docs/design/pd_handshake.md.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

MLA_POOLS = frozenset({"mla", "hybrid_mla"})
SIZE_FIELDS = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size")


def is_size(value: Any) -> bool:
    """A parallel size a server can have: an int of at least 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class Rule(str, enum.Enum):
    """Why a pairing was accepted."""

    UPSTREAM_EQUAL = "upstream-equal"
    PREFILL_CP_SPANS_DECODE_TP = "a"
    PREFILL_CP_EQUAL_TP = "b"
    DIFFERENT_TP_NO_CP = "c"
    NOT_DSPARK = "not-dspark"


@dataclass(frozen=True)
class SpecLayout:
    """A DSpark transfer layout, frozen so that ``PDSide`` stays hashable.

    ``items`` is the sorted ``(key, frozen value)`` pairs of a mapping layout; a
    non-mapping stand-in is kept as ``opaque``.
    """

    items: tuple = ()
    opaque: Any = None

    @classmethod
    def of(cls, value: Any) -> "SpecLayout":
        if isinstance(value, SpecLayout):
            return value
        if isinstance(value, Mapping):
            return cls(items=tuple(sorted((str(k), _freeze(v)) for k, v in value.items())))
        hash(value)  # a stand-in must compare by value; refuse unhashable ones early
        return cls(opaque=value)

    def as_dict(self) -> Optional[dict]:
        return None if self.opaque is not None else dict(self.items)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _thaw(value: Any) -> Any:
    """Frozen tuples back to lists, for messages that read like the published JSON."""
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class PDSide:
    """One server's parallel info and layouts, as published for (or known about) PD.

    ``attn_tp_size``/``attn_cp_size``/``dp_size``/``pp_size`` are the values the
    prefill bootstrap server publishes (``dp_size`` is the number of attention-DP
    groups or DP replicas). ``tp_size`` and ``enable_dp_attention`` are not
    published; tools fill them in and they are checked for consistency only.
    ``kv_pool`` is "mla", "hybrid_mla" or any other string; a prefill does not
    publish it, so at runtime the prefill side has ``None``.
    ``spec_layout`` accepts the published layout dict (or any hashable stand-in) and
    is stored frozen, so sides can be hashed and compared.
    ``all_cp_ranks_transfer``: whether every prefill CP rank sends its KV slice
    (prefill) or the decode pulls from every prefill CP rank (decode); sglang does
    not publish it, so it is compared only when both sides state it.
    """

    attn_tp_size: int
    attn_cp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    dspark: bool = False
    spec_layout: Optional[SpecLayout] = None
    kv_pool: Optional[str] = None
    page_size: Optional[int] = None
    kv_cache_dtype: Optional[str] = None
    kv_layout: Optional[str] = None
    tp_size: Optional[int] = None
    enable_dp_attention: Optional[bool] = None
    all_cp_ranks_transfer: Optional[bool] = None

    def __post_init__(self):
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not is_size(value):
                raise ValueError(f"PDSide.{name} must be a positive int, got {value!r}")
        if self.spec_layout is not None and not isinstance(self.spec_layout, SpecLayout):
            object.__setattr__(self, "spec_layout", SpecLayout.of(self.spec_layout))
        if self.dspark and self.spec_layout is None:
            raise ValueError(
                "PDSide(dspark=True) needs spec_layout: the published DSpark layout, or "
                "a stand-in equal exactly when both servers' layouts are"
            )
        if not self.dspark and self.spec_layout is not None:
            raise ValueError("PDSide has a DSpark spec_layout but dspark=False")
        if self.tp_size is not None and self.enable_dp_attention is not None:
            attn_dp = self.dp_size if self.enable_dp_attention else 1
            expected = self.attn_tp_size * self.attn_cp_size * attn_dp
            if self.tp_size != expected:
                raise ValueError(
                    f"PDSide is inconsistent: tp_size={self.tp_size} but attn_tp_size="
                    f"{self.attn_tp_size} x attn_cp_size={self.attn_cp_size} x attention "
                    f"DP {attn_dp} = {expected}"
                )

    @property
    def mla_like(self) -> bool:
        return self.kv_pool in MLA_POOLS


def side_from_args(
    *,
    tp_size: int,
    attn_cp_size: int = 1,
    dp_size: int = 1,
    enable_dp_attention: bool = False,
    pp_size: int = 1,
    speculative_algorithm: Optional[str] = None,
    spec_layout: Any = None,
    kv_pool: Optional[str] = "mla",
    page_size: Optional[int] = None,
    kv_cache_dtype: Optional[str] = None,
    kv_layout: Optional[str] = None,
    all_cp_ranks_transfer: Optional[bool] = None,
) -> PDSide:
    """A ``PDSide`` from plain server-args values (``--tp-size``, ``--dp-size``, ...).

    ``dp_size`` with ``enable_dp_attention`` means attention-DP groups inside the TP
    group (sglang's ``attn_dp_size``); without it, DP replicas that each run the full
    TP. DSpark is on when ``speculative_algorithm`` is "DSPARK" (any case).
    """
    for name, value in (("tp_size", tp_size), ("attn_cp_size", attn_cp_size), ("dp_size", dp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    attn_dp = dp_size if enable_dp_attention else 1
    if tp_size % (attn_dp * attn_cp_size):
        raise ValueError(
            f"tp_size={tp_size} is not divisible by attention DP {attn_dp} x "
            f"attn_cp_size={attn_cp_size}"
        )
    dspark = str(speculative_algorithm or "").upper() == "DSPARK"
    return PDSide(
        attn_tp_size=tp_size // attn_dp // attn_cp_size,
        attn_cp_size=attn_cp_size,
        dp_size=dp_size,
        pp_size=pp_size,
        dspark=dspark,
        spec_layout=spec_layout if dspark else None,
        kv_pool=kv_pool,
        page_size=page_size,
        kv_cache_dtype=kv_cache_dtype,
        kv_layout=kv_layout,
        tp_size=tp_size,
        enable_dp_attention=enable_dp_attention,
        all_cp_ranks_transfer=all_cp_ranks_transfer,
    )


@dataclass(frozen=True)
class Mismatch:
    field: str
    prefill: Any
    decode: Any
    why: str = ""

    def __str__(self) -> str:
        text = f"{self.field}: prefill={self.prefill!r}, decode={self.decode!r}"
        return f"{text} ({self.why})" if self.why else text


@dataclass(frozen=True)
class PairingVerdict:
    accepted: bool
    rule: Optional[Rule]
    mismatches: tuple[Mismatch, ...] = ()
    dspark: bool = False

    @property
    def message(self) -> str:
        if self.accepted:
            return f"accepted ({self.rule.value})"
        subject = "DeepSeek-V4.1 DSpark PD" if self.dspark else "PD"
        kinds = " (layout mismatch)" if any(
            m.field == "dspark" or m.field.startswith("spec_layout") for m in self.mismatches
        ) else ""
        details = "; ".join(str(m) for m in self.mismatches)
        text = f"{subject} pairing rejected{kinds}: {details}."
        if self.dspark:
            text += (
                " With DSpark on both servers, identical target/draft layouts and an MLA or "
                "hybrid-MLA KV pool, the accepted shapes are: equal attention TP with CP 1; "
                "prefill CP > 1 with attention TP x CP equal to decode attention TP (a) or "
                "with equal attention TP (b); both CP 1 with different attention TP (c)."
            )
        return text


class PairingRejected(ValueError, RuntimeError):
    """A prefill/decode pairing that must not be used.

    A ``ValueError`` for tools (bad configuration) and a ``RuntimeError`` like the
    other handshake errors sglang raises on the decode side.
    """

    def __init__(self, verdict: PairingVerdict):
        super().__init__(verdict.message)
        self.verdict = verdict


def _generic_mismatches(prefill: PDSide, decode: PDSide) -> list[Mismatch]:
    """Checks every pair must pass, DSpark or not (sglang 0.5.23 enforces or assumes them)."""
    found = []
    for name in ("page_size", "kv_cache_dtype", "kv_layout"):
        p, d = getattr(prefill, name), getattr(decode, name)
        if p is not None and d is not None and p != d:
            found.append(Mismatch(name, p, d, "both servers must use the same value"))
    if decode.attn_cp_size != 1:
        found.append(
            Mismatch("attn_cp_size", prefill.attn_cp_size, decode.attn_cp_size,
                     "decode attention CP must be 1")
        )
    if decode.pp_size not in (1, prefill.pp_size):
        found.append(
            Mismatch("pp_size", prefill.pp_size, decode.pp_size,
                     "decode PP must equal prefill PP or be 1")
        )
    small, large = sorted((prefill.attn_tp_size, decode.attn_tp_size))
    if large % small:
        found.append(
            Mismatch("attn_tp_size", prefill.attn_tp_size, decode.attn_tp_size,
                     "one attention TP size must divide the other")
        )
    return found


def _layout_mismatches(prefill: PDSide, decode: PDSide) -> list[Mismatch]:
    if prefill.dspark != decode.dspark:
        return [Mismatch("dspark", prefill.dspark, decode.dspark,
                         "both servers must run DSpark, or neither")]
    p, d = prefill.spec_layout, decode.spec_layout
    if p == d:
        return []
    p_dict, d_dict = p.as_dict(), d.as_dict()
    if p_dict is None or d_dict is None:
        return [Mismatch("spec_layout", p.opaque if p_dict is None else p_dict,
                         d.opaque if d_dict is None else d_dict)]
    return [
        Mismatch(f"spec_layout.{key}", _thaw(p_dict.get(key)), _thaw(d_dict.get(key)))
        for key in sorted(p_dict.keys() | d_dict.keys())
        if p_dict.get(key) != d_dict.get(key)
    ]


def _pool_mismatch(prefill: PDSide, decode: PDSide) -> Optional[Mismatch]:
    """The relaxed shapes need an MLA-style pool (replicated across attention TP)."""
    if decode.mla_like and (prefill.kv_pool is None or prefill.kv_pool == decode.kv_pool):
        return None
    return Mismatch("kv_pool", prefill.kv_pool, decode.kv_pool,
                    "different TP/CP shapes need an MLA or hybrid-MLA KV pool on both")


def _dspark_shape(prefill: PDSide, decode: PDSide) -> tuple[Optional[Rule], list[Mismatch]]:
    p_tp, p_cp, d_tp = prefill.attn_tp_size, prefill.attn_cp_size, decode.attn_tp_size
    if p_cp == 1 and p_tp == d_tp:
        return Rule.UPSTREAM_EQUAL, []
    if p_cp > 1 and p_tp * p_cp == d_tp:
        rule = Rule.PREFILL_CP_SPANS_DECODE_TP
    elif p_cp > 1 and p_tp == d_tp:
        rule = Rule.PREFILL_CP_EQUAL_TP
    elif p_cp == 1:
        rule = Rule.DIFFERENT_TP_NO_CP
    else:
        why = ("with prefill CP, decode attention TP must equal prefill attention TP, "
               "or prefill attention TP x CP")
        return None, [
            Mismatch("attn_tp_size", p_tp, d_tp, why),
            Mismatch("attn_cp_size", p_cp, decode.attn_cp_size, why),
        ]
    found = []
    pool = _pool_mismatch(prefill, decode)
    if pool is not None:
        found.append(pool)
        if p_tp != d_tp:
            found.append(Mismatch("attn_tp_size", p_tp, d_tp, "differs"))
        if p_cp != decode.attn_cp_size:
            found.append(Mismatch("attn_cp_size", p_cp, decode.attn_cp_size, "differs"))
    if (
        p_cp > 1
        and prefill.all_cp_ranks_transfer is not None
        and decode.all_cp_ranks_transfer is not None
        and prefill.all_cp_ranks_transfer != decode.all_cp_ranks_transfer
    ):
        found.append(
            Mismatch("all_cp_ranks_transfer", prefill.all_cp_ranks_transfer,
                     decode.all_cp_ranks_transfer,
                     "prefill CP ranks that send and the decode's pulls must agree "
                     "(SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER on both)")
        )
    return (None if found else rule), found


def evaluate_pairing(prefill: PDSide, decode: PDSide) -> PairingVerdict:
    """The verdict for one prefill/decode pair; never raises for a rejection."""
    dspark = prefill.dspark or decode.dspark
    mismatches = _generic_mismatches(prefill, decode)
    if not dspark:
        if mismatches:
            return PairingVerdict(False, None, tuple(mismatches), dspark=False)
        return PairingVerdict(True, Rule.NOT_DSPARK)
    mismatches += _layout_mismatches(prefill, decode)
    structural = any(m.field in ("attn_cp_size", "pp_size", "attn_tp_size") for m in mismatches)
    rule = None
    if not structural:
        rule, shape_mismatches = _dspark_shape(prefill, decode)
        mismatches += shape_mismatches
    if mismatches:
        return PairingVerdict(False, None, _dedupe(mismatches), dspark=True)
    return PairingVerdict(True, rule, dspark=True)


def check_pairing(prefill: PDSide, decode: PDSide) -> PairingVerdict:
    """The accepted verdict, or ``PairingRejected`` naming every mismatched field."""
    verdict = evaluate_pairing(prefill, decode)
    if not verdict.accepted:
        raise PairingRejected(verdict)
    return verdict


def published_side(decode: PDSide, *, spec_layout: Any = None, **published: Any) -> PDSide:
    """The ``PDSide`` of a prefill from the values its bootstrap server published.

    ``published`` holds the other ``PDSide`` fields; DSpark is on when ``spec_layout``
    (the published ``dsv41_spec_layout``) is not None. A value no server can have
    (a size below 1, a layout that is neither a JSON object nor hashable) is the
    remote's fault: ``PairingRejected`` naming the field and both values, not a
    construction error of this module.
    """
    bad = [
        Mismatch(name, published[name], getattr(decode, name),
                 "the prefill published an invalid value: must be a positive int")
        for name in SIZE_FIELDS if name in published and not is_size(published[name])
    ]
    if spec_layout is not None:
        try:
            spec_layout = SpecLayout.of(spec_layout)
        except TypeError as exc:
            bad.append(Mismatch("dsv41_spec_layout", spec_layout, _plain_layout(decode),
                                f"the prefill published an unusable DSpark layout: {exc}"))
    if bad:
        dspark = spec_layout is not None or decode.dspark
        raise PairingRejected(PairingVerdict(False, None, tuple(bad), dspark=dspark))
    return PDSide(dspark=spec_layout is not None, spec_layout=spec_layout, **published)


def _plain_layout(side: PDSide) -> Any:
    layout = side.spec_layout
    if layout is None:
        return None
    as_dict = layout.as_dict()
    return layout.opaque if as_dict is None else {k: _thaw(v) for k, v in as_dict.items()}


def _dedupe(mismatches: list[Mismatch]) -> tuple[Mismatch, ...]:
    seen, out = set(), []
    for m in mismatches:
        key = (m.field, repr(m.prefill), repr(m.decode))
        if key not in seen:
            seen.add(key)
            out.append(m)
    return tuple(out)
