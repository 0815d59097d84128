"""route_chunk over sglang 0.5.23's real batch objects, one process.

The routing keeps one table per scheduled request (built on its first chunk)
instead of reading every item on every chunk. These tests pin what that
must not change: the spans and route of each chunk follow the request's
items as sglang holds them, a replaced item list is read afresh, and the
tables leave with their requests. Multi-rank agreement of the routes is in
test_adapters.py and test_gloo_group.py.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("sglang.srt.managers.schedule_batch")

from sglang.srt.managers import mm_schedule  # noqa: E402
from sglang.srt.managers.schedule_batch import (  # noqa: E402
    Modality,
    MultimodalDataItem,
    MultimodalInputs,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sglang_dsv41.owner_broadcast.chunks import build_table  # noqa: E402
from sglang_dsv41.owner_broadcast.routing import (  # noqa: E402
    ChunkSpan,
    ItemMeta,
    OwnerRouter,
    RequestImages,
    Route,
    RoutingPolicy,
    SpanDirectory,
)
from sglang_dsv41.owner_broadcast import hooks as owner_broadcast  # noqa: E402


def image(content_hash, start, length, grid=(4, 4)):
    item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(2, 2),
                              offsets=[(start, start + length - 1)])
    item.set_hash(content_hash)
    item.model_specific_data.update(n_vit_h=grid[0], n_vit_w=grid[1])
    return item


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A real one-rank gloo group: the not-worth route's status rounds run on
    it (the routes themselves are what these tests look at)."""
    import torch.distributed as dist

    from sglang_dsv41.owner_broadcast.protocol import TorchDistributedGroup

    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process (another test leaked it)")
    store = tmp_path_factory.mktemp("one-rank") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield TorchDistributedGroup(dist.group.WORLD)
    dist.destroy_process_group()


@pytest.fixture
def model(one_rank_group):
    mm_schedule.init_mm_embedding_cache(1 << 20)
    # Routing as for a group of two (a saving no chunk here reaches, so cold
    # chunks route not-worth); the sessions run on the one-rank group. Mode
    # auto: its stock encodes open no session (guarded: the last test).
    return SimpleNamespace(
        vision=object(),
        config=SimpleNamespace(hidden_size=4, vision_downsample_ratio=2),
        image_start=torch.zeros(4),
        mm_owner_group=one_rank_group,
        mm_owner_router=OwnerRouter(2, RoutingPolicy(mode="auto", min_saving=10**9), SpanDirectory(0),
                                    row_bytes=4),
    )


def batch(requests, mode=ForwardMode.EXTEND):
    return SimpleNamespace(
        forward_mode=mode,
        mm_inputs=[mm for mm, _prefix, _extend in requests],
        extend_prefix_lens_cpu=[prefix for _mm, prefix, _extend in requests],
        extend_seq_lens_cpu=[extend for _mm, _prefix, extend in requests],
        rids=[f"r{i}" for i in range(len(requests))],
    )


def route(model, *requests):
    """One input preparation through the real OWN-FENCE adapter (routing
    before, the directory updated after), with stock's body stubbed out.
    Returns the chunk's route; checks what the inner hooks see of it."""
    routed, inside = [], []
    real_route_chunk = owner_broadcast.route_chunk

    def capture(model, forward_batch):
        chunk = real_route_chunk(model, forward_batch)
        routed.append(chunk)
        return chunk

    def prepare(model, input_ids, forward_batch, *args):
        chunk = owner_broadcast.active_chunk()
        inside.append(chunk)
        if chunk is not None and chunk.session is not None:
            chunk.session.features_ready()  # what the text-embedding hook does

    owner_broadcast.route_chunk = capture
    try:
        owner_broadcast.around_prepare_language_model_inputs(prepare, model, None, batch(list(requests)))
    finally:
        owner_broadcast.route_chunk = real_route_chunk
    chunk = routed[0]
    if chunk is None or chunk.route is Route.KNOWN:
        # nothing for the inner hooks to do: they see no chunk at all
        assert inside == [None]
    else:
        assert inside == [chunk]
    assert owner_broadcast.active_chunk() is None  # reset after the preparation
    return chunk


def test_chunks_of_one_request_reuse_its_table_and_follow_its_items(model):
    mm = MultimodalInputs(mm_items=[image(11, 2, 10), image(22, 20, 6, (2, 3))], im_token_id=99)
    router = model.mm_owner_router

    first = route(model, (mm, 0, 15))  # tokens 0..14: the first image only
    assert first.route is Route.NOT_WORTH and first.session is None  # cold: stock encode
    assert first.spans == (ChunkSpan(11, 10, (4, 4)),)
    table = mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE]  # kept on the request itself
    assert table.source is mm.mm_items and table.source_len == 2

    second = route(model, (mm, 15, 15))  # tokens 15..29: the second image
    assert second.spans == (ChunkSpan(22, 6, (2, 3)),) and second.route is Route.NOT_WORTH
    assert mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE] is table  # built once for the request

    again = route(model, (mm, 0, 30))  # the whole prompt again: both recorded
    assert again.route is Route.KNOWN and len(again.spans) == 2
    assert again.session is None  # known: no collective at all
    assert table.known_epoch == router.directory.epoch  # next chunks skip the lookups
    assert route(model, (mm, 0, 30)).route is Route.KNOWN
    # the directory shadows the cache's byte budget, read when spans are recorded
    assert router.directory.capacity_bytes == mm_schedule.embedding_cache.max_size


def test_a_replaced_item_list_is_read_afresh(model):
    mm = MultimodalInputs(mm_items=[image(11, 2, 10)], im_token_id=99)
    assert route(model, (mm, 0, 30)).spans == (ChunkSpan(11, 10, (4, 4)),)
    mm.mm_items = [image(33, 2, 10)]
    assert route(model, (mm, 0, 30)).spans == (ChunkSpan(33, 10, (4, 4)),)
    # the same list object grown in place is read afresh too
    mm.mm_items.append(image(44, 14, 4))
    spans = route(model, (mm, 0, 30)).spans
    assert [span.content_hash for span in spans] == [33, 44]


def reference_meta(item):
    """An item's routing fields read one by one, as the core's ItemMeta
    documents them (what the hooks' single reading loop must reproduce)."""
    data = item.model_specific_data
    return ItemMeta(offsets=item.offsets or (), precomputed=item.precomputed_embeddings is not None,
                    content_hash=item.hash, grid=(data.get("n_vit_h"), data.get("n_vit_w")))


def odd_item(draw):
    """A real MultimodalDataItem with the shapes sglang's metadata can take."""
    modality = draw(st.sampled_from([Modality.IMAGE] * 5 + [Modality.VIDEO, Modality.AUDIO]))
    start = draw(st.integers(0, 50))
    length = draw(st.integers(1, 12))
    offsets = draw(st.sampled_from(["one", "one", "one", "one", "none", "empty", "two"]))
    offsets = {
        "one": [(start, start + length - 1)],
        "none": None,
        "empty": [],
        "two": [(start, start + length - 1), (start + 30, start + 30 + length - 1)],
    }[offsets]
    precomputed = draw(st.sampled_from([False] * 6 + [True]))
    item = MultimodalDataItem(
        modality=modality,
        feature=None if precomputed else torch.zeros(1),
        precomputed_embeddings=torch.zeros(1) if precomputed else None,
        offsets=offsets,
    )
    item.set_hash(draw(st.sampled_from([1, 2, 3, 10**18 + 9])))
    grid = draw(st.sampled_from(["ints", "ints", "ints", "missing", "numpy", "text", "junk"]))
    if grid == "ints":
        item.model_specific_data.update(n_vit_h=draw(st.integers(1, 4)), n_vit_w=draw(st.integers(1, 4)))
    elif grid == "numpy":
        item.model_specific_data.update(n_vit_h=np.int64(2), n_vit_w=np.int64(3))
    elif grid == "text":
        item.model_specific_data.update(n_vit_h="2", n_vit_w="4")
    elif grid == "junk":
        item.model_specific_data.update(n_vit_h="x", n_vit_w=None)
    return item


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_hooks_read_items_as_the_core_documents(data):
    items = data.draw(st.lists(st.builds(lambda: None) | st.composite(lambda draw: odd_item(draw))(),
                               max_size=5))
    mm = MultimodalInputs(mm_items=items, im_token_id=99)
    table = build_table(mm, mm.mm_items)
    expected = RequestImages([reference_meta(item) for item in items
                              if item is not None and item.modality is Modality.IMAGE])
    fields = ("precomputed", "items", "spans", "all_keys", "max_start", "min_end", "known_epoch")
    assert [getattr(table, f) for f in fields] == [getattr(expected, f) for f in fields]
    assert table.source is mm.mm_items and table.source_len == len(items)
    assert mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE] is table


def test_text_and_decode_batches_are_not_routed(model):
    mm = MultimodalInputs(mm_items=[image(11, 2, 10)], im_token_id=99)
    assert route(model, (None, 0, 8)) is None
    assert owner_broadcast.route_chunk(model, batch([(mm, 0, 1)], ForwardMode.DECODE)) is None
    # an image request whose chunk holds only text: routed, with no span
    assert route(model, (None, 0, 4), (mm, 12, 6)).route is Route.NO_SPANS


def test_tables_leave_with_their_requests(model):
    requests = [MultimodalInputs(mm_items=[image(100 + i, 0, 8)], im_token_id=99) for i in range(5)]
    route(model, *[(mm, 0, 8) for mm in requests])
    tables = [weakref.ref(mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE]) for mm in requests]
    assert all(ref() is not None for ref in tables)
    del requests
    gc.collect()
    # nothing of the router's (or the hooks') holds a finished request's table
    assert [ref() for ref in tables] == [None] * 5


def test_a_table_known_to_one_router_is_not_known_to_another(model):
    # Two routers (two models over the same requests) never read each
    # other's known epoch as their own.
    mm = MultimodalInputs(mm_items=[image(11, 2, 10)], im_token_id=99)
    route(model, (mm, 0, 15))
    assert route(model, (mm, 0, 15)).route is Route.KNOWN
    table = mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE]
    assert table.known_epoch == model.mm_owner_router.directory.epoch
    model.mm_owner_router = OwnerRouter(2, RoutingPolicy(min_saving=10**9), SpanDirectory(0), row_bytes=4)
    assert route(model, (mm, 0, 15)).route is Route.NOT_WORTH  # the new directory never saw it


def test_a_class_without_an_instance_dict_stops_the_build(monkeypatch):
    # The per-request table lives in the MultimodalInputs instance dict; a
    # release that takes the dict away must stop the model build, not crash
    # the first image chunk. (test/upstream_pins pins that 0.5.23 has one.)
    from sglang.srt.managers import schedule_batch

    owner_broadcast.require_request_tables()  # 0.5.23: fine

    class SlottedInputs:
        __slots__ = ("mm_items",)

    monkeypatch.setattr(schedule_batch, "MultimodalInputs", SlottedInputs)
    with pytest.raises(RuntimeError, match="OWN-FENCE.*no instance dict.*SGLANG_DSV41_OWNER_BROADCAST=0"):
        owner_broadcast.require_request_tables()


def test_pin_merging_media_builds_a_new_item_list():
    # The tables are reused while a request's item list is the same object of
    # the same length; sglang 0.5.23 adds a turn's media with merge(), which
    # must keep building a new list for that check to see it.
    first = MultimodalInputs(mm_items=[image(11, 2, 10)], im_token_id=99)
    items = first.mm_items
    first.merge(MultimodalInputs(mm_items=[image(22, 20, 6)], im_token_id=99))
    assert first.mm_items is not items and len(first.mm_items) == 2


def admitted(*media_turns):
    """A real Req that the scheduler hands each turn's media through the real
    ``Req.extend_image_inputs``, with OWN-ADMIT installed by sglang's own
    wrapper; returns the request and the table each turn left on its inputs."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_dsv41.plugin.testing import patches_installed

    params = SamplingParams(max_new_tokens=1)
    params.normalize(None)
    req = Req("admitted", "", array("q", range(1, 64)), params, vocab_size=1000)
    tables = []
    with patches_installed("OWN-ADMIT"):
        for items in media_turns:
            req.extend_image_inputs(MultimodalInputs(mm_items=items, im_token_id=99))
            tables.append(req.multimodal_inputs.__dict__.get(owner_broadcast.TABLE_ATTRIBUTE))
    return req, tables


def same_table(table, items):
    """Whether ``table`` holds what reading ``items`` afresh gives."""
    expected = RequestImages([reference_meta(item) for item in items])
    fields = ("precomputed", "items", "spans", "all_keys", "max_start", "min_end")
    return [getattr(table, f) for f in fields] == [getattr(expected, f) for f in fields]


def test_admission_builds_the_table_the_first_chunk_routes_with(model, monkeypatch):
    monkeypatch.setattr(owner_broadcast, "routes_in_process", True)  # a router in this process
    req, (table,) = admitted([image(11, 2, 10), image(22, 20, 6, (2, 3))])
    mm = req.multimodal_inputs
    assert table is not None and table.source is mm.mm_items and same_table(table, mm.mm_items)

    first = route(model, (mm, 0, 30))  # the request's first chunk
    assert first.spans == (ChunkSpan(11, 10, (4, 4)), ChunkSpan(22, 6, (2, 3)))
    assert mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE] is table  # used, not rebuilt
    assert route(model, (mm, 0, 30)).route is Route.KNOWN


def test_admission_of_more_media_builds_the_merged_table(model, monkeypatch):
    # A second extend (sglang merges the media into a new item list) leaves a
    # table of the merged list, which the next chunk uses as it is.
    monkeypatch.setattr(owner_broadcast, "routes_in_process", True)
    req, (first, merged) = admitted([image(11, 2, 10)], [image(33, 40, 5)])
    mm = req.multimodal_inputs
    assert merged is not first and merged.source is mm.mm_items and len(mm.mm_items) == 2
    assert same_table(merged, mm.mm_items)
    assert [span.content_hash for span in route(model, (mm, 0, 50)).spans] == [11, 33]
    assert mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE] is merged


def test_admission_builds_nothing_where_no_chunk_is_routed(model, monkeypatch):
    # A scheduler whose model has no router (owner path off, no vision, no
    # replicating group) pays nothing at admission; chunks still route when
    # a router shows up, reading the items themselves.
    monkeypatch.setattr(owner_broadcast, "routes_in_process", False)
    req, (table,) = admitted([image(11, 2, 10)])
    assert table is None and owner_broadcast.TABLE_ATTRIBUTE not in req.multimodal_inputs.__dict__
    assert route(model, (req.multimodal_inputs, 0, 30)).spans == (ChunkSpan(11, 10, (4, 4)),)


def test_the_real_scheduler_admission_builds_the_table(model, monkeypatch):
    # Scheduler.handle_generate_request as a scheduler receives a request from
    # the tokenizer: media prepared, prompt padded, Req built and handed its
    # media (OWN-ADMIT builds the table there), checks, queued.
    from array import array
    from pathlib import Path

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import MultimodalProcessorOutput
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_dsv41.plugin.testing import patches_installed

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "helpers"))
    import embed_harness

    monkeypatch.setattr(owner_broadcast, "routes_in_process", True)
    items = [image(11, 2, 10), image(22, 20, 6, (2, 3))]
    prompt = array("q", [5] * 40)
    params = SamplingParams(max_new_tokens=1)
    params.normalize(None)
    recv = TokenizedGenerateReqInput(
        rid="admitted", input_text="", input_ids=prompt, input_embeds=None,
        mm_inputs=MultimodalProcessorOutput(mm_items=items, input_ids=list(prompt), im_token_id=99),
        token_type_ids=None, sampling_params=params, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False)
    try:
        rig = embed_harness.SchedulerRig()
        # DeepSeek-V4's own padding (its method does not read the model)
        rig.receive_generate_requests(lambda ids, mm: DeepseekV4ForCausalLM.pad_input_ids(None, ids, mm))
        with patches_installed("OWN-ADMIT"):
            rig.scheduler.handle_generate_request(recv)
        (req,) = rig.scheduler.waiting_queue
    finally:
        reset_context()
    assert req.finished_reason is None
    mm = req.multimodal_inputs
    # padded before the hand-over
    assert list(req.origin_input_ids[2:12]) == list(mm.mm_items[0].padding_sequence(10))
    assert list(req.origin_input_ids[:2]) == [5, 5]
    table = mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE]
    assert table.source is mm.mm_items and same_table(table, mm.mm_items)
    assert route(model, (mm, 0, 40)).spans == (ChunkSpan(11, 10, (4, 4)), ChunkSpan(22, 6, (2, 3)))
    assert mm.__dict__[owner_broadcast.TABLE_ATTRIBUTE] is table


def test_a_pd_decode_server_builds_no_tables_at_admission():
    # sglang's own published configuration decides; a bare process (no
    # configuration) builds them, as before OWN-ADMIT's decode rule.
    from sglang.srt.runtime_context import get_disagg, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    assert not owner_broadcast.on_decode_server()
    try:
        publish(ServerArgs(model_path="dummy"), role="scheduler")
        assert not owner_broadcast.on_decode_server()
        with get_disagg().override(disaggregation_mode="decode"):
            assert owner_broadcast.on_decode_server()
        with get_disagg().override(disaggregation_mode="prefill"):
            assert not owner_broadcast.on_decode_server()
    finally:
        reset_context()


def test_pin_the_scheduler_hands_media_over_after_adjusting_offsets():
    # OWN-ADMIT builds the table when the request's media are handed over, so
    # every step that can still change offsets or the item list must come
    # before that call: the session's offset shift and the padding.
    import ast
    import inspect
    import textwrap

    from sglang.srt.managers.scheduler import Scheduler

    for method, before in (
        (Scheduler._handle_generate_request,
         ("adjust_mm_offsets", "_try_apply_padded_mm_input_ids", "duplicate_pad_mm_input_ids")),
        (Scheduler._handle_embedding_request,
         ("_try_apply_padded_mm_input_ids", "duplicate_pad_mm_input_ids")),
    ):
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
        calls = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                calls.setdefault(name, []).append(node.lineno)
        (hand_over,) = calls["extend_image_inputs"]
        for name in before:
            assert name in calls and max(calls[name]) < hand_over, (method.__name__, name)


def test_guarded_mode_gives_stock_encodes_a_status_only_session(model):
    model.mm_owner_router = OwnerRouter(2, RoutingPolicy(mode="guarded", min_saving=10**9),
                                        SpanDirectory(0), row_bytes=4)
    mm = MultimodalInputs(mm_items=[image(11, 2, 10)], im_token_id=99)
    cold = route(model, (mm, 0, 15))
    assert cold.route is Route.NOT_WORTH
    assert cold.session is not None and cold.session.local_encode and cold.session.engaged
    known = route(model, (mm, 0, 15))
    assert known.route is Route.KNOWN and known.session is None
