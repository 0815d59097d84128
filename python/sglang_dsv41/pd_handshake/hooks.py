"""Adapter: the DSpark PD pairing rule inside sglang's decode-side handshake.

Design: docs/design/pd_handshake.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from contextlib import contextmanager

from sglang_dsv41 import metrics
from sglang_dsv41.pd_handshake.pairing import (
    PairingRejected,
    PDSide,
    Rule,
    check_pairing,
    published_side,
)

logger = logging.getLogger(__name__)

_LAYOUT_FIELD = "dsv41_spec_layout"
_UNSET = object()

# Threads inside a handshake -> their _Handshake; the module global is rebound while
# any is active (one scheduler thread in production, several in tests).
_active: dict[int, "_Handshake"] = {}
_active_lock = threading.Lock()
_real_info_class = None


def decode_side(manager) -> PDSide:
    """The decode manager's own parallel info and layouts."""
    if manager.is_mla_backend:
        kv_pool = "mla"
    elif manager.is_hybrid_mla_backend:
        kv_pool = "hybrid_mla"
    else:
        kv_pool = "other"
    layout = manager.dsv41_spec_layout
    return PDSide(
        attn_tp_size=manager.attn_tp_size,
        attn_cp_size=manager.attn_cp_size,
        dp_size=getattr(manager, "attn_dp_size", 1) or 1,
        pp_size=manager.pp_size,
        dspark=layout is not None,
        spec_layout=layout,
        kv_pool=kv_pool,
        page_size=manager.kv_args.page_size,
        kv_cache_dtype=manager.kv_cache_dtype_str,
        kv_layout=manager.kv_layout,
        all_cp_ranks_transfer=bool(manager.enable_all_cp_ranks_for_transfer),
    )


def prefill_side(info, published_layout, decode: PDSide) -> PDSide:
    """A prefill as its bootstrap server published it (pool kind is not published).

    Raises ``PairingRejected`` for a published value no server can have.
    """
    return published_side(
        decode,
        attn_tp_size=info.attn_tp_size,
        attn_cp_size=info.attn_cp_size,
        dp_size=info.dp_size,
        pp_size=info.pp_size,
        spec_layout=published_layout,
        page_size=info.page_size,
        kv_cache_dtype=info.kv_cache_dtype,
        kv_layout=info.kv_layout,
    )


class _ManagerView:
    """Stands in for the decode manager inside one upstream handshake call."""

    __slots__ = ("_manager", "_handshake")

    # Upstream's DSpark block runs when either side has a layout; the rule replaces it.
    dsv41_spec_layout = None

    def __init__(self, manager, handshake: "_Handshake"):
        object.__setattr__(self, "_manager", manager)
        object.__setattr__(self, "_handshake", handshake)

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def __setattr__(self, name, value):
        setattr(self._manager, name, value)

    def _resolve_rank_mapping(self, info):
        self._handshake.check(info)
        return self._manager._resolve_rank_mapping(info)


class _Handshake:
    def __init__(self, manager, bootstrap_addr: str):
        self.manager = manager
        self.bootstrap_addr = bootstrap_addr
        self.thread = threading.get_ident()
        self.info = None
        self.published_layout = _UNSET
        self.checked = False
        self.view = _ManagerView(manager, self)

    def build_info(self, real_class, **fields):
        layout = fields.pop(_LAYOUT_FIELD, None)
        info = real_class(**fields)
        self.info, self.published_layout = info, layout
        return info

    def check(self, info) -> None:
        if info is not self.info:
            raise RuntimeError(
                "[sglang-dsv41] pd-handshake: the prefill info being mapped is not the "
                "one fetched in this handshake; refusing to pair"
            )
        setattr(info, _LAYOUT_FIELD, self.published_layout)
        local = decode_side(self.manager)
        try:  # the published sizes are checked for every pair: sglang maps ranks with them
            prefill = prefill_side(info, self.published_layout, local)
            verdict = check_pairing(prefill, local) if prefill.dspark or local.dspark else None
        except PairingRejected:
            metrics.count_pairing_refused()
            raise
        if verdict is not None and verdict.rule is not Rule.UPSTREAM_EQUAL:
            logger.info(
                "[sglang-dsv41] DSpark PD pairing with %s accepted by rule %s: prefill "
                "attention TP %d CP %d, decode attention TP %d",
                self.bootstrap_addr, verdict.rule.value, info.attn_tp_size,
                info.attn_cp_size, local.attn_tp_size,
            )
        self.checked = True


def _dispatching_info(*args, **kwargs):
    handshake = _active.get(threading.get_ident())
    if handshake is None or args:
        return _real_info_class(*args, **kwargs)
    return handshake.build_info(_real_info_class, **kwargs)


@contextmanager
def _scoped_info_class(conn_module, handshake: _Handshake):
    global _real_info_class
    with _active_lock:
        if not _active:
            _real_info_class = conn_module.PrefillServerInfo
            conn_module.PrefillServerInfo = _dispatching_info
        _active[handshake.thread] = handshake
    try:
        yield
    finally:
        with _active_lock:
            del _active[handshake.thread]
            if not _active:
                conn_module.PrefillServerInfo = _real_info_class


def _require_layout_field(info_class) -> None:
    names = {f.name for f in dataclasses.fields(info_class)}
    if _LAYOUT_FIELD not in names:
        raise RuntimeError(
            f"[sglang-dsv41] pd-handshake: PrefillServerInfo has no {_LAYOUT_FIELD!r} "
            "field; this sglang is not the one the hook was written for"
        )


def around_try_ensure_parallel_info(original, self, *args, **kwargs):
    """AROUND CommonKVManager.try_ensure_parallel_info(self, bootstrap_addr) (decode side)."""
    bootstrap_addr = args[0] if args else kwargs["bootstrap_addr"]
    if bootstrap_addr in self.prefill_info_table:
        return original(self, *args, **kwargs)
    from sglang.srt.disaggregation.common import conn

    _require_layout_field(
        _real_info_class if conn.PrefillServerInfo is _dispatching_info else conn.PrefillServerInfo
    )
    handshake = _Handshake(self, bootstrap_addr)
    with _scoped_info_class(conn, handshake):
        ready = original(handshake.view, *args, **kwargs)
    if bootstrap_addr in self.prefill_info_table and not handshake.checked:
        # Upstream cached peer info without passing our check: its flow changed.
        self.prefill_info_table.pop(bootstrap_addr, None)
        raise RuntimeError(
            "[sglang-dsv41] pd-handshake: sglang cached prefill info for "
            f"{bootstrap_addr} without the DSpark pairing check; refusing to pair"
        )
    return ready


def around_ensure_prefill_info(original, self, addr_to_reqs):
    """AROUND DecodePreallocQueue._ensure_prefill_info(self, addr_to_reqs) (decode side).

    A prefill the decode must not pair with (the pairing rule's refusal, one of
    sglang's own page size / KV dtype / layout / TP checks, its rank-mapping
    asserts, or a division by a size the prefill published as 0) raises out of
    the scheduler loop, and the decode server goes down with it. Each prefill
    address is resolved on its own (upstream's loop handles them independently);
    any exception for one is a refusal of that prefill: it fails only the
    requests bound to it, naming the error, and the decode keeps serving every
    other prefill.
    """
    ready, remaining = {}, []
    for bootstrap_addr, reqs in addr_to_reqs.items():
        try:
            addr_ready, addr_remaining = original(self, {bootstrap_addr: reqs})
        except Exception as exc:  # not only RuntimeError: asserts and bad published sizes too
            _fail_refused(self.kv_manager, bootstrap_addr, reqs, exc)
            continue
        ready.update(addr_ready)
        remaining.extend(addr_remaining)
    return ready, remaining


def _fail_refused(kv_manager, bootstrap_addr: str, reqs, exc: Exception) -> None:
    if not isinstance(exc, PairingRejected):  # the rule counted its own refusal
        metrics.count_pairing_refused()
    # RuntimeError is how sglang and the rule word a refusal; anything else needs its type.
    unexpected = not isinstance(exc, RuntimeError)
    reason = str(exc)
    if unexpected:
        reason = f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__
    message = (
        f"[sglang-dsv41] pd-handshake: refused to pair with the prefill at {bootstrap_addr}: "
        f"{reason} ({len(reqs)} request(s) failed; the decode keeps serving)"
    )
    logger.error(message, exc_info=exc if unexpected else None)
    for decode_req in reqs:
        if decode_req.kv_receiver is None:
            continue
        decode_req.kv_receiver.abort()
        # The client reads the refusal, not abort()'s generic reason.
        kv_manager.record_failure(decode_req.req.bootstrap_room, message)
