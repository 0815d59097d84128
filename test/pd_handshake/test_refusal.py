"""PDH-REFUSAL: a refused PD pairing fails the requests bound to that prefill, not the decode.

Real sglang 0.5.23 all the way: ``DecodePreallocQueue._ensure_prefill_info`` and
``_resolve_pending_reqs`` (the decode scheduler's own calls), a decode
``CommonKVManager`` fetching each prefill's info over HTTP from sglang's
bootstrap servers on 127.0.0.1, prefill ranks registered through their real
``__init__``, real ``Req`` / ``CommonKVReceiver`` objects. Only the GPU is absent:
the queue is built without its pools and the KV pool is described by hand
(``_pd_harness``). Each case runs once stock (the refusal raises out of the
method, which is what takes a decode server down) and once with the patch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from array import array
from dataclasses import dataclass

import pytest

import _pd_harness as H
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver, KVTransferError
from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang_dsv41 import metrics
from sglang_dsv41.pd_handshake.pairing import PairingRejected
from sglang_dsv41.plugin.testing import patches_installed

REFUSAL_LINE = "[sglang-dsv41] pd-handshake: refused to pair with the prefill at"
STOCK_PAGE_SIZE_ERROR = "Page size mismatch: prefill server has page_size=16"
_rooms = itertools.count(7000)


def refused_count() -> float:
    return metrics.totals()["pd_pairings_refused"].get("", 0)


@contextlib.contextmanager
def two_prefills():
    """A prefill the decode pairs with and one with another page size, each behind
    its own bootstrap server, and one decode rank (TP 1, no DSpark: sglang's own checks)."""
    with H.BootstrapServer() as paired, H.BootstrapServer() as refused, \
            H.prefill_server(H.PrefillShape(1), dspark=False, pool="mla", server=paired), \
            H.prefill_server(H.PrefillShape(1), dspark=False, pool="mla", server=refused,
                             kv_args_changes={"page_size": 16}):
        decode = H.decode_managers(H.DecodeShape(1), dspark=False, pool="mla")
        try:
            yield paired.addr, refused.addr, decode[0]
        finally:
            H.close_managers(decode)


def prealloc_queue(manager) -> DecodePreallocQueue:
    """The decode's preallocation queue, holding what its handshake steps read."""
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    queue.kv_manager = manager
    queue.pending_reqs = []
    queue._prefill_dp_rank_queries = {}
    queue._ensure_retry_count, queue._ensure_last_attempt_time = {}, {}
    # __init__'s values: a not-ready prefill is retried each second, 15 times.
    queue._max_ensure_retries, queue._ensure_retry_interval = 15, 1.0
    return queue


def decode_request(manager, addr: str) -> DecodeRequest:
    host, port = addr.rsplit(":", 1)
    room = next(_rooms)
    req = Req(rid=f"req-{room}", origin_input_text="", origin_input_ids=array("q", [1, 2, 3]),
              sampling_params=SamplingParams(max_new_tokens=4),
              bootstrap_host=host, bootstrap_port=int(port), bootstrap_room=room)
    return DecodeRequest(req=req, kv_receiver=CommonKVReceiver(manager, addr, room))


def assert_failed_with_refusal(decode_req: DecodeRequest, addr: str,
                               refusal: str = STOCK_PAGE_SIZE_ERROR) -> None:
    """The receiver reports Failed, and the reason the client gets names the refusal."""
    receiver = decode_req.kv_receiver
    assert receiver.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError) as failure:
        receiver.failure_exception()
    reason = failure.value.failure_reason
    assert f"{REFUSAL_LINE} {addr}: {refusal}" in reason, reason
    assert "the decode keeps serving" in reason


def test_stock_refusal_raises_out_of_the_method_and_loses_the_paired_prefill():
    """Without the patch sglang's page size check raises out of the decode's
    handshake step, even for a batch whose other prefill was just accepted."""
    with two_prefills() as (paired, refused, manager):
        queue = prealloc_queue(manager)
        reqs = {paired: [decode_request(manager, paired)], refused: [decode_request(manager, refused)]}
        with pytest.raises(RuntimeError, match=STOCK_PAGE_SIZE_ERROR):
            queue._ensure_prefill_info(reqs)
        assert paired in manager.prefill_info_table  # accepted, but its requests never came back
        assert refused not in manager.prefill_info_table
        # The refused request is left bootstrapping, with nothing that will fail it.
        assert reqs[refused][0].kv_receiver.poll() == KVPoll.Bootstrapping


def only_refused_requests_fail(manager, paired: str, refused: str, caplog,
                               refusal: str = STOCK_PAGE_SIZE_ERROR) -> str:
    """Two requests to ``refused`` and one to ``paired`` through the prealloc queue: only the
    two fail, naming ``refusal``, counted once, logged in one line (returned)."""
    queue = prealloc_queue(manager)
    kept = decode_request(manager, paired)
    failed = [decode_request(manager, refused), decode_request(manager, refused)]
    before = refused_count()
    with caplog.at_level(logging.ERROR, logger="sglang_dsv41.pd_handshake.hooks"):
        ready, remaining = queue._ensure_prefill_info({refused: failed, paired: [kept]})
    assert ready == {paired: [kept]} and remaining == []
    assert kept.kv_receiver.poll() == KVPoll.Bootstrapping
    for decode_req in failed:
        assert_failed_with_refusal(decode_req, refused, refusal)
    lines = [r.getMessage() for r in caplog.records if REFUSAL_LINE in r.getMessage()]
    assert len(lines) == 1 and "2 request(s) failed" in lines[0], lines
    assert refused_count() - before == 1
    assert refused not in manager.prefill_info_table and paired in manager.prefill_info_table
    return lines[0]


def test_refusal_fails_only_the_requests_of_the_refused_prefill(caplog):
    with two_prefills() as (paired, refused, manager), patches_installed("PDH-REFUSAL"):
        line = only_refused_requests_fail(manager, paired, refused, caplog)
        assert "page_size=16" in line, line


def test_the_scheduler_step_drops_refused_requests_from_its_pending_queue():
    """``_resolve_pending_reqs`` (what the decode scheduler calls each step) stays
    up; the refused requests leave the pending queue failed, naming the refusal."""
    with two_prefills() as (_, refused, manager):
        stock_queue = prealloc_queue(manager)
        stock_queue.pending_reqs = [decode_request(manager, refused)]
        with pytest.raises(RuntimeError, match=STOCK_PAGE_SIZE_ERROR):
            stock_queue._resolve_pending_reqs()

        with patches_installed("PDH-REFUSAL"):
            queue = prealloc_queue(manager)
            queue.pending_reqs = [decode_request(manager, refused)]
            failed = queue.pending_reqs[0]
            queue._resolve_pending_reqs()
            assert queue.pending_reqs == []
            assert_failed_with_refusal(failed, refused)


def test_a_prefill_not_yet_registered_is_retried_as_upstream_does():
    """Nothing registered at the bootstrap yet: not a refusal. The requests stay
    pending and nothing is counted."""
    with H.BootstrapServer() as empty, patches_installed("PDH-REFUSAL"):
        managers = H.decode_managers(H.DecodeShape(1), dspark=False, pool="mla")
        manager = managers[0]
        try:
            queue = prealloc_queue(manager)
            waiting = decode_request(manager, empty.addr)
            before = refused_count()
            ready, remaining = queue._ensure_prefill_info({empty.addr: [waiting]})
            assert ready == {} and remaining == [waiting]
            assert queue._ensure_retry_count == {empty.addr: 1}
            assert waiting.kv_receiver.poll() == KVPoll.Bootstrapping
            assert refused_count() == before
        finally:
            H.close_managers(managers)


def test_a_dspark_rule_refusal_is_counted_once():
    """PDH-PAIRING counts the rule's own refusal; this hook must not count it again."""
    with H.BootstrapServer() as server, \
            H.prefill_server(H.PrefillShape(4), dspark=True, pool="mla", server=server), \
            patches_installed("PDH-PAIRING", "PDH-REFUSAL"):
        managers = H.decode_managers(H.DecodeShape(4), dspark=False, pool="mla")
        manager = managers[0]
        try:
            queue = prealloc_queue(manager)
            failed = decode_request(manager, server.addr)
            before = refused_count()
            assert queue._ensure_prefill_info({server.addr: [failed]}) == ({}, [])
            assert refused_count() - before == 1
            reason = manager.failure_records[failed.req.bootstrap_room]
            assert "dspark: prefill=True, decode=False" in reason, reason
        finally:
            H.close_managers(managers)


# ------------------------------------------------ refusals that are not a RuntimeError
@dataclass(frozen=True)
class Unpairable:
    """A prefill the handshake cannot pair with, failing with something other than
    a RuntimeError. ``published`` is what it registers (``H.publish_prefill``);
    "DECODE_LAYOUT" stands for the decode's own DSpark layout."""

    published: dict
    dspark: bool          # the decode's --speculative-algorithm DSPARK
    decode_pp: int        # the decode's --pp-size
    escapes: type         # what leaves _ensure_prefill_info without PDH-REFUSAL
    refusal: str          # what the failed requests' reason says after the prefix


UNPAIRABLE = {
    # sglang's rank mapping asserts decode PP is 1 or the prefill's.
    "pp-4-to-pp-2": Unpairable(
        {"pp_size": 4}, dspark=False, decode_pp=2, escapes=AssertionError,
        refusal="AssertionError: ('Decode pp size (2) should be equal to prefill pp size (4)"),
    # sglang's rank mapping would divide by the published attention TP, or map no CP
    # rank at all: PDH-PAIRING checks the published sizes of every pair first.
    "attn-tp-0": Unpairable(
        {"attn_tp_size": 0}, dspark=False, decode_pp=1, escapes=PairingRejected,
        refusal="PD pairing rejected: attn_tp_size: prefill=0, decode=1 "
        "(the prefill published an invalid value: must be a positive int)"),
    "attn-cp-0-without-dspark": Unpairable(
        {"attn_cp_size": 0}, dspark=False, decode_pp=1, escapes=PairingRejected,
        refusal="PD pairing rejected: attn_cp_size: prefill=0, decode=1 "
        "(the prefill published an invalid value: must be a positive int)"),
    # The rule's side of the prefill cannot hold these: PDH-PAIRING names the field.
    "attn-cp-0": Unpairable(
        {"attn_cp_size": 0, "dsv41_spec_layout": "DECODE_LAYOUT"}, dspark=True, decode_pp=1,
        escapes=PairingRejected,
        refusal="DeepSeek-V4.1 DSpark PD pairing rejected: attn_cp_size: prefill=0, decode=1 "
        "(the prefill published an invalid value: must be a positive int)"),
    "layout-is-a-list": Unpairable(
        {"dsv41_spec_layout": [1]}, dspark=True, decode_pp=1, escapes=PairingRejected,
        refusal="DeepSeek-V4.1 DSpark PD pairing rejected: dsv41_spec_layout: prefill=[1]"),
}


@contextlib.contextmanager
def unpairable_and_paired(case: Unpairable):
    """The unpairable prefill, one the same decode pairs with, and that decode (TP 1)."""
    managers = H.decode_managers(H.DecodeShape(1), dspark=case.dspark, pool="mla",
                                 pp=case.decode_pp)
    manager = managers[0]
    layout = manager.dsv41_spec_layout
    published = {k: layout if v == "DECODE_LAYOUT" else v for k, v in case.published.items()}
    try:
        with H.BootstrapServer() as bad, H.BootstrapServer() as paired:
            H.publish_prefill(bad, **published)
            if layout is None:
                H.publish_prefill(paired, pp_size=case.decode_pp)
            else:
                H.publish_prefill(paired, pp_size=case.decode_pp, dsv41_spec_layout=layout)
            yield bad.addr, paired.addr, manager
    finally:
        H.close_managers(managers)


@pytest.mark.parametrize("name", UNPAIRABLE)
def test_without_the_refusal_patch_the_error_leaves_the_scheduler_step(name):
    """What takes the decode down without PDH-REFUSAL: sglang's assert or division
    (stock code), or PDH-PAIRING's rejection naming the published field."""
    case = UNPAIRABLE[name]
    with unpairable_and_paired(case) as (bad, paired, manager), patches_installed("PDH-PAIRING"):
        reqs = {paired: [decode_request(manager, paired)], bad: [decode_request(manager, bad)]}
        with pytest.raises(case.escapes) as escaped:
            prealloc_queue(manager)._ensure_prefill_info(reqs)
        assert paired in manager.prefill_info_table and bad not in manager.prefill_info_table
        assert reqs[bad][0].kv_receiver.poll() == KVPoll.Bootstrapping
        if case.escapes is PairingRejected:
            assert case.refusal.split(": ", 1)[1] in str(escaped.value)


@pytest.mark.parametrize("name", UNPAIRABLE)
def test_any_error_fails_only_that_prefills_requests(name, caplog):
    case = UNPAIRABLE[name]
    with unpairable_and_paired(case) as (bad, paired, manager), \
            patches_installed("PDH-PAIRING", "PDH-REFUSAL"):
        only_refused_requests_fail(manager, paired, bad, caplog, case.refusal)
