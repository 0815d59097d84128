"""Every prefill x decode shape up to 8 GPUs each: the pairing verdict, and for
accepted pairs the rank mapping that sglang 0.5.23's own code computes with the hook.

Prefill shapes: (TP, attention CP, attention DP); decode shapes: (TP, attention DP);
with and without DSpark; MLA (DeepSeek-V4's pool), hybrid-MLA and a non-MLA pool.

* ``test_pure_rule_*``: ``pd_handshake.pairing`` against the decision, restated here as a
  few lines of its own (``decision``), on sides built the way the deployment tool
  builds them (``side_from_args``).
* ``test_runtime_*``: per prefill shape, a real bootstrap server on 127.0.0.1, the
  prefill's ranks registering through ``CommonKVManager.__init__``, every decode rank
  of every decode shape running the hooked ``try_ensure_parallel_info``. Rejections
  must raise before caching or mapping; accepted pairs must give a mapping that
  delivers: checked on sglang's receiver (``CommonKVReceiver.init`` asks the bootstrap
  server for each target rank and marks dummy links) against what each prefill rank
  really does (``is_dummy_cp_rank``, ``filter_kv_indices_for_cp_rank``,
  ``_should_skip_cp_replicated_state_transfer``). sglang's unhooked method runs on
  the same managers to show where the decision changes upstream and nowhere else.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os

import pytest

import _pd_harness as H
from sglang.srt.runtime_context import get_context
from sglang_dsv41.pd_handshake.pairing import (
    PairingRejected,
    Rule,
    evaluate_pairing,
    side_from_args,
)

PREFILLS = H.prefill_shapes()
DECODES = H.decode_shapes()
# A decode rank's side of the handshake depends on its attention TP only (decode.py
# sets engine_rank = tp_rank % attn_tp_size; attention CP is 1), so the runtime runs
# one decode shape per attention TP, DP-attention ones where they exist, and
# test_runtime_decode_shapes_share_handshake_state_by_attention_tp shows the others
# build identical handshake state.
RUNTIME_DECODES = [H.DecodeShape(4, 4), H.DecodeShape(4, 2), H.DecodeShape(4), H.DecodeShape(8)]
assert sorted(d.attn_tp for d in RUNTIME_DECODES) == sorted({d.attn_tp for d in DECODES})
ALL_CP_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
STAND_IN_LAYOUT = {"model": "deepseek-v4.1", "num_draft_tokens": 6, "kv_cache_dtype": H.KV_DTYPE}


def decision(p: H.PrefillShape, d: H.DecodeShape, dspark: bool, pool: str):
    """The PD pairing rule's decision, written out independently of the implementation."""
    if not dspark:
        return Rule.NOT_DSPARK
    if p.cp == 1 and p.attn_tp == d.attn_tp:
        return Rule.UPSTREAM_EQUAL
    if pool not in ("mla", "hybrid_mla"):
        return None
    if p.cp > 1 and p.attn_tp * p.cp == d.attn_tp:
        return Rule.PREFILL_CP_SPANS_DECODE_TP
    if p.cp > 1 and p.attn_tp == d.attn_tp:
        return Rule.PREFILL_CP_EQUAL_TP
    if p.cp == 1:
        return Rule.DIFFERENT_TP_NO_CP
    return None


def upstream_accepts(p: H.PrefillShape, d: H.DecodeShape, dspark: bool, pool: str) -> bool:
    """What sglang 0.5.23's own check accepts for these shapes (pinned below)."""
    if not dspark or p.attn_tp == d.attn_tp:
        return True
    return p.cp > 1 and pool in ("mla", "hybrid_mla") and p.attn_tp * p.cp == d.attn_tp


def tool_sides(p, d, dspark, pool):
    algo = "DSPARK" if dspark else None
    prefill = side_from_args(tp_size=p.tp, attn_cp_size=p.cp, dp_size=p.dp,
                             enable_dp_attention=p.dp > 1, speculative_algorithm=algo,
                             spec_layout=STAND_IN_LAYOUT, kv_pool=pool,
                             page_size=H.PAGE_SIZE, kv_cache_dtype=H.KV_DTYPE)
    decode = side_from_args(tp_size=d.tp, dp_size=d.dp, enable_dp_attention=d.dp > 1,
                            speculative_algorithm=algo, spec_layout=STAND_IN_LAYOUT,
                            kv_pool=pool, page_size=H.PAGE_SIZE, kv_cache_dtype=H.KV_DTYPE)
    return prefill, decode


# ------------------------------------------------------------------ the pure rule
def test_pure_rule_matches_the_decision_for_every_shape():
    counts = collections.Counter()
    for p in PREFILLS:
        for d in DECODES:
            for dspark in (False, True):
                for pool in H.POOLS:
                    verdict = evaluate_pairing(*tool_sides(p, d, dspark, pool))
                    want = decision(p, d, dspark, pool)
                    where = f"{p} {d} dspark={dspark} pool={pool}"
                    assert verdict.rule == want, f"{where}: {verdict}"
                    assert verdict.accepted == (want is not None), where
                    counts[verdict.rule] += 1
                    if want is None:
                        msg = verdict.message
                        assert msg.startswith("DeepSeek-V4.1 DSpark PD pairing rejected"), msg
                        assert f"attn_tp_size: prefill={p.attn_tp}, decode={d.attn_tp}" in msg \
                            or f"attn_cp_size: prefill={p.cp}, decode=1" in msg, msg
    # Every rule occurs, so no branch of the decision goes untested.
    assert set(counts) == set(Rule) | {None}, counts


def test_pure_rule_on_the_deployments_the_issue_names():
    cases = [
        # CP prefill TP4 x attention CP4 against a DP-attention decode (TP4, DP4): (b)
        (H.PrefillShape(4, 4), H.DecodeShape(4, 4), Rule.PREFILL_CP_EQUAL_TP),
        # the same prefill against a plain TP4 decode: (a)
        (H.PrefillShape(4, 4), H.DecodeShape(4), Rule.PREFILL_CP_SPANS_DECODE_TP),
        # CP2 prefills with one DP2 decode: (b)
        (H.PrefillShape(2, 2), H.DecodeShape(2, 2), Rule.PREFILL_CP_EQUAL_TP),
        # TP prefill with a DP-attention decode: (c)
        (H.PrefillShape(4), H.DecodeShape(4, 4), Rule.DIFFERENT_TP_NO_CP),
        (H.PrefillShape(4), H.DecodeShape(8, 4), Rule.DIFFERENT_TP_NO_CP),
        # CP prefill against a decode whose attention TP is neither: rejected
        (H.PrefillShape(4, 4), H.DecodeShape(2), None),
        (H.PrefillShape(8, 2), H.DecodeShape(2), None),
        (H.PrefillShape(8, 2), H.DecodeShape(8, 4), None),
    ]
    for p, d, rule in cases:
        assert evaluate_pairing(*tool_sides(p, d, True, "mla")).rule == rule, (p, d)


def test_pure_rule_rejects_layout_and_flag_differences_naming_both_values():
    p, d = tool_sides(H.PrefillShape(4), H.DecodeShape(4, 4), True, "mla")
    other = side_from_args(tp_size=4, dp_size=4, enable_dp_attention=True,
                           speculative_algorithm="DSPARK", kv_pool="mla",
                           spec_layout={**STAND_IN_LAYOUT, "num_draft_tokens": 5},
                           page_size=H.PAGE_SIZE, kv_cache_dtype=H.KV_DTYPE)
    with pytest.raises(PairingRejected) as err:
        from sglang_dsv41.pd_handshake.pairing import check_pairing
        check_pairing(p, other)
    assert "spec_layout.num_draft_tokens: prefill=6, decode=5" in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)
    assert [m.field for m in err.value.verdict.mismatches] == ["spec_layout.num_draft_tokens"]

    plain = side_from_args(tp_size=4, dp_size=4, enable_dp_attention=True, kv_pool="mla",
                           page_size=H.PAGE_SIZE, kv_cache_dtype=H.KV_DTYPE)
    verdict = evaluate_pairing(p, plain)
    assert not verdict.accepted
    assert "dspark: prefill=True, decode=False" in verdict.message

    cp_prefill = side_from_args(tp_size=4, attn_cp_size=4, speculative_algorithm="DSPARK",
                                spec_layout=STAND_IN_LAYOUT, all_cp_ranks_transfer=True)
    dp_decode = side_from_args(tp_size=4, dp_size=4, enable_dp_attention=True,
                               speculative_algorithm="DSPARK", spec_layout=STAND_IN_LAYOUT,
                               all_cp_ranks_transfer=False)
    verdict = evaluate_pairing(cp_prefill, dp_decode)
    assert "all_cp_ranks_transfer: prefill=True, decode=False" in verdict.message

    small_pages = side_from_args(tp_size=4, speculative_algorithm="DSPARK",
                                 spec_layout=STAND_IN_LAYOUT, page_size=64,
                                 kv_cache_dtype=H.KV_DTYPE)
    assert "page_size: prefill=256, decode=64" in evaluate_pairing(p, small_pages).message


def test_pd_side_refuses_inconsistent_input():
    from sglang_dsv41.pd_handshake.pairing import PDSide

    with pytest.raises(ValueError, match="needs spec_layout"):
        PDSide(attn_tp_size=4, dspark=True)
    with pytest.raises(ValueError, match="inconsistent"):
        PDSide(attn_tp_size=4, tp_size=8, enable_dp_attention=False)
    with pytest.raises(ValueError, match="positive int"):
        PDSide(attn_tp_size=0)
    with pytest.raises(ValueError, match="not divisible"):
        side_from_args(tp_size=6, attn_cp_size=4)
    side = PDSide(attn_tp_size=1, dspark=True, spec_layout={"kv_item_lens": [512, 1024]})
    assert hash(side) == hash(PDSide(attn_tp_size=1, dspark=True,
                                     spec_layout={"kv_item_lens": (512, 1024)}))



def test_published_values_no_server_can_have_are_a_rejection_naming_the_field():
    """A prefill's published sizes and layout come from the network: a value PDSide
    cannot hold is the remote's fault, rejected like any other mismatch."""
    from sglang_dsv41.pd_handshake.pairing import published_side

    decode = side_from_args(tp_size=2, speculative_algorithm="DSPARK",
                            spec_layout={"num_draft_tokens": 6})
    sizes = dict(attn_tp_size=2, attn_cp_size=1, dp_size=1, pp_size=1)
    side = published_side(decode, spec_layout={"num_draft_tokens": 6}, **sizes)
    assert side.dspark and evaluate_pairing(side, decode).accepted
    assert not published_side(decode, **sizes).dspark

    with pytest.raises(PairingRejected) as zero:
        published_side(decode, spec_layout={"num_draft_tokens": 6},
                       **{**sizes, "attn_cp_size": 0, "pp_size": -1})
    assert [m.field for m in zero.value.verdict.mismatches] == ["attn_cp_size", "pp_size"]
    assert "attn_cp_size: prefill=0, decode=1 (the prefill published an invalid value" in str(
        zero.value)
    with pytest.raises(PairingRejected) as listed:
        published_side(decode, spec_layout=[1], **sizes)
    assert [m.field for m in listed.value.verdict.mismatches] == ["dsv41_spec_layout"]
    assert "dsv41_spec_layout: prefill=[1], decode={'num_draft_tokens': 6}" in str(listed.value)


# ------------------------------------------------------------------ the runtime
VARIANTS = [  # (dspark, pool, SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER on both servers)
    (True, "mla", False), (True, "hybrid_mla", False), (True, "other", False),
    (True, "mla", True),
    # Without DSpark the hook must change nothing: MLA and non-MLA pools.
    (False, "mla", False), (False, "other", False),
]
RUNTIME_CASES = [
    pytest.param(dspark, pool, env, p, id=f"{'dspark' if dspark else 'plain'}-{pool}"
                 f"{'-allcp' if env else ''}-{p}")
    for dspark, pool, env in VARIANTS
    for p in PREFILLS
    # all-CP transfer matters with prefill CP only; for the non-MLA pool (never a
    # DSpark pool in practice) prefill attention DP adds nothing the rule reads.
    if (not env or p.cp > 1) and (pool != "other" or p.dp == 1)
]


@contextlib.contextmanager
def all_cp_env(on: bool):
    old = os.environ.get(ALL_CP_ENV)
    if on:
        os.environ[ALL_CP_ENV] = "1"
    else:
        os.environ.pop(ALL_CP_ENV, None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ALL_CP_ENV, None)
        else:
            os.environ[ALL_CP_ENV] = old


@pytest.fixture(scope="module")
def hooked():
    published = get_context().override_server_args()
    published.install()  # receiver.init reads the decode allocation policy
    try:
        with H.plugin_hook_installed() as original:
            yield original
    finally:
        published.restore()


class DecodeCache:
    """Decode managers of the current variant only (each holds a zmq context)."""

    def __init__(self):
        self.variant = None
        self.groups = {}

    def get(self, d, dspark, pool, env):
        if self.variant != (dspark, pool, env):
            self.clear()
            self.variant = (dspark, pool, env)
        if d not in self.groups:
            with all_cp_env(env):
                self.groups[d] = H.decode_managers(d, dspark=dspark, pool=pool)
        return self.groups[d]

    def clear(self):
        for managers in self.groups.values():
            H.close_managers(managers)
        self.groups = {}


@pytest.fixture(scope="module")
def decode_cache():
    cache = DecodeCache()
    yield cache
    cache.clear()


def _head_units(rank: int, size: int, units: int) -> range:
    width = units // size
    return range(rank * width, (rank + 1) * width)


def check_mapping_delivers(managers, ranks, p, d, pool, addr, group):
    """One request through prefill DP group ``group``: what the mapping promises
    (targets, dummy links, responses) against what the prefill ranks really send."""
    units = math.lcm(p.attn_tp, d.attn_tp)
    head_sharded_kv = pool == "other"
    head_sharded_state = pool != "mla"
    links_into = collections.defaultdict(list)  # prefill (cp, tp) -> [(decode rank, dummy, R)]
    for r, manager in enumerate(managers):
        receiver = H.receiver_links(manager, addr, group)
        where = f"{p} {d} pool={pool} decode rank {r} prefill dp {group}"
        assert receiver.conclude_state is None, (where, manager.failure_records)
        real = []
        for link in receiver.bootstrap_infos:
            prefill_rank = ranks[link["rank_port"]]
            assert prefill_rank.dp == group, where
            links_into[(prefill_rank.cp, prefill_rank.tp)].append(
                (r, link["is_dummy"], receiver.required_dst_info_num))
            if not link["is_dummy"]:
                real.append(prefill_rank)
        # Every rank it expects data from sends, and it waits for exactly those.
        assert real and all(pr.sends_kv for pr in real), where
        assert receiver.required_prefill_response_num == len(real), where
        # KV: every page (and every head this decode rank holds) arrives; MLA
        # KV arrives once.
        wanted = {(page, u) for page in range(H.TOTAL_PAGES)
                  for u in (_head_units(r, d.attn_tp, units) if head_sharded_kv else [0])}
        arriving = collections.Counter(
            (page, u) for pr in real for page in pr.kv_pages
            for u in (_head_units(pr.tp, p.attn_tp, units) if head_sharded_kv else [0]))
        assert wanted <= set(arriving), where
        if pool == "mla":
            assert set(arriving) == wanted and max(arriving.values()) == 1, where
        # CP-replicated state: one CP rank (rank 0) per prefill TP slice sends it.
        state_senders = [pr for pr in real if pr.sends_state]
        assert all(pr.cp == 0 for pr in state_senders), where
        assert sorted(pr.tp for pr in state_senders) == sorted({pr.tp for pr in real}), where
        if not head_sharded_state:
            assert len(state_senders) == 1, where
        receiver.clear()
    for prefill_rank in ranks.values():
        if prefill_rank.dp != group:
            continue
        links = links_into.get((prefill_rank.cp, prefill_rank.tp), [])
        where = f"{p} {d} pool={pool} prefill dp {group} cp {prefill_rank.cp} tp {prefill_rank.tp}"
        if not links:
            # Nobody bootstraps it: only a dummy CP rank may be left out.
            assert not prefill_rank.sends_kv, where
            continue
        required = {R for _, _, R in links}
        assert len(required) == 1, where
        required = required.pop()
        # The prefill rank starts once it holds `required` transfer infos ...
        assert len(links) == required, where
        # ... and concludes once that many real destinations got their data.
        real_links = sum(1 for _, dummy, _ in links if not dummy)
        assert real_links in (0, required), where


HANDSHAKE_STATE = ("attn_tp_size", "attn_cp_size", "pp_size", "is_mla_backend",
                   "is_hybrid_mla_backend", "enable_all_cp_ranks_for_transfer",
                   "dsv41_spec_layout", "kv_cache_dtype_str", "kv_layout", "dcp_size")


@pytest.mark.parametrize("dspark,pool,env", VARIANTS)
def test_runtime_decode_shapes_share_handshake_state_by_attention_tp(dspark, pool, env):
    with all_cp_env(env):
        built = {d: H.decode_managers(d, dspark=dspark, pool=pool) for d in DECODES}
    try:
        for d, managers in built.items():
            twin = next(r for r in RUNTIME_DECODES if r.attn_tp == d.attn_tp)
            assert len(managers) == len(built[twin]) == d.attn_tp
            for mine, theirs in zip(managers, built[twin]):
                for name in HANDSHAKE_STATE:
                    assert getattr(mine, name) == getattr(theirs, name), (d, twin, name)
                assert mine.kv_args.engine_rank == theirs.kv_args.engine_rank
                assert mine.kv_args.page_size == theirs.kv_args.page_size
    finally:
        for managers in built.values():
            H.close_managers(managers)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dspark,pool,env,p", RUNTIME_CASES)
def test_runtime_handshake_and_mapping(hooked, decode_cache, dspark, pool, env, p):
    original = hooked
    with all_cp_env(env), H.BootstrapServer() as server, \
            H.prefill_server(p, dspark=dspark, pool=pool, server=server) as ranks:
        for d in RUNTIME_DECODES:
            managers = decode_cache.get(d, dspark, pool, env)
            want = decision(p, d, dspark, pool)
            pure = evaluate_pairing(*tool_sides(p, d, dspark, pool))
            where = f"{p} {d} dspark={dspark} pool={pool} all_cp={env}"
            try:
                for manager in managers:
                    calls = len(manager.mapping_calls)
                    if want is None:
                        with pytest.raises(PairingRejected) as err:
                            manager.try_ensure_parallel_info(server.addr)
                        assert server.addr not in manager.prefill_info_table, where
                        assert len(manager.mapping_calls) == calls, where
                        got = err.value.verdict.mismatches
                        assert [m.field for m in got] == [m.field for m in pure.mismatches], where
                        for runtime, tool in zip(got, pure.mismatches):
                            assert str(runtime) in str(err.value), where
                            # A prefill does not publish its pool kind; the rest must agree.
                            if runtime.field != "kv_pool":
                                assert (runtime.prefill, runtime.decode) == \
                                    (tool.prefill, tool.decode), (where, runtime, tool)
                    else:
                        assert manager.try_ensure_parallel_info(server.addr) is True, where
                        info = manager.prefill_info_table[server.addr]
                        assert len(manager.mapping_calls) == calls + 1, where
                        assert info.dsv41_spec_layout == manager.dsv41_spec_layout, where
                if want is not None:
                    # The last prefill DP group (the others map the same way).
                    check_mapping_delivers(managers, ranks, p, d, pool, server.addr, p.dp - 1)
                # sglang's own method on the same managers: unchanged where the
                # decision does not speak, and the differences are exactly (c) and
                # non-MLA CP pairs.
                for manager in {id(m): m for m in (managers[0], managers[-1])}.values():
                    hooked_info = manager.prefill_info_table.pop(server.addr, None)
                    try:
                        upstream_ok = original(manager, server.addr)
                    except RuntimeError as exc:
                        assert "DeepSeek-V4.1 DSpark PD" in str(exc), where
                        upstream_ok = False
                    assert upstream_ok == upstream_accepts(p, d, dspark, pool), where
                    if upstream_ok and hooked_info is not None:
                        upstream_info = manager.prefill_info_table[server.addr]
                        for field in ("target_tp_rank", "target_tp_ranks", "target_cp_ranks",
                                      "target_pp_ranks", "required_dst_info_num",
                                      "required_prefill_response_num", "dsv41_spec_layout",
                                      "attn_tp_size", "attn_cp_size", "dp_size"):
                            assert getattr(upstream_info, field) == getattr(hooked_info, field), \
                                (where, field)
                    if (want is not None) != upstream_ok:
                        assert (want is Rule.DIFFERENT_TP_NO_CP) or (
                            pool == "other" and p.cp > 1 and p.attn_tp == d.attn_tp), where
            finally:
                for manager in managers:
                    manager.prefill_info_table.pop(server.addr, None)


def test_mapping_check_catches_a_one_sided_all_cp_ranks_setting(hooked):
    """The delivery check has teeth: with SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER
    on the prefill only, every CP rank sends a slice but the decode pulls CP rank 0
    alone. A prefill does not publish that setting, so the runtime cannot see it; the
    pure rule rejects it when a tool knows both sides."""
    p, d = H.PrefillShape(4, 4), H.DecodeShape(4)
    managers = H.decode_managers(d, dspark=True, pool="mla")
    try:
        with all_cp_env(True), H.BootstrapServer() as server, \
                H.prefill_server(p, dspark=True, pool="mla", server=server) as ranks:
            for manager in managers:
                assert manager.try_ensure_parallel_info(server.addr) is True
            with pytest.raises(AssertionError):
                check_mapping_delivers(managers, ranks, p, d, "mla", server.addr, 0)
    finally:
        H.close_managers(managers)
    prefill = side_from_args(tp_size=4, attn_cp_size=4, speculative_algorithm="DSPARK",
                             spec_layout=STAND_IN_LAYOUT, all_cp_ranks_transfer=True)
    decode = side_from_args(tp_size=4, speculative_algorithm="DSPARK",
                            spec_layout=STAND_IN_LAYOUT, all_cp_ranks_transfer=False)
    assert not evaluate_pairing(prefill, decode).accepted
