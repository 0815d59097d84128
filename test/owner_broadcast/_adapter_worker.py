"""One of two ranks running the real sglang 0.5.23 input preparation with our hooks.

Run as ``python _adapter_worker.py RANK STORE_FILE OUT_FILE`` in two processes.
Only this package's owner-broadcast patches are registered (through sglang's
own HookRegistry). The model is a DeepseekV4ForCausalLM whose heavy parts are
left out: a real vocab-parallel text embedding split over the two ranks, a
counting stand-in for the vision tower, and real MultimodalDataItems. Every
call goes through the real ``prepare_language_model_inputs``,
``embed_mm_inputs``, ``get_embedding_and_mask`` and
``_get_chunked_prefill_embedding`` of sglang 0.5.23, over a real
GroupCoordinator on gloo.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from sglang_dsv41 import metrics as plugin_metrics

OWN_IDS = ("OWN-GROUP", "OWN-FENCE", "OWN-TEXT-EMBED", "OWN-ENCODE")
WIDTH = 8
VOCAB = 32
IMAGE_TOKEN_ID = 31


def image_span(content_hash: int, span_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(content_hash % 100_003)
    return torch.randn(span_len, WIDTH, generator=generator)


def full_text_table() -> torch.Tensor:
    return torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(3))


def metric_changes(before, after):
    """What the plugin's counters of this process gained between two ``totals()``."""
    changes = {}
    for name, per in after.items():
        for label, value in per.items():
            gained = value - before.get(name, {}).get(label, 0)
            if gained:
                changes.setdefault(name, {})[label] = gained
    return changes


def main():
    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("sglang_dsv41").setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=90))

    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dsv41 import loader
    from sglang_dsv41.plugin.table import by_id

    for patch_id in OWN_IDS:
        loader.register_patch(by_id()[patch_id])
    HookRegistry.apply_hooks()

    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel

    coordinator = GroupCoordinator(
        [[0, 1]], local_rank=rank, torch_distributed_backend="gloo", use_pynccl=False,
        use_mscclpp=False, use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False, use_xpu_communicator=False, group_name="owner_adapter_test",
    )
    counts = {"all_gather_object": 0, "broadcast": 0, "all_reduce_max": 0}
    real_gather, real_broadcast = coordinator.all_gather_object, coordinator.broadcast

    def counted_gather(obj):
        counts["all_gather_object"] += 1
        return real_gather(obj)

    def counted_broadcast(tensor, src=0):
        counts["broadcast"] += 1
        return real_broadcast(tensor, src=src)

    coordinator.all_gather_object = counted_gather
    coordinator.broadcast = counted_broadcast

    # Status rounds: our adapter's MAX all-reduce over the coordinator's
    # device group (gloo here), counted around the real method.
    from sglang_dsv41.owner_broadcast import hooks as owner_broadcast

    real_reduce = owner_broadcast.CoordinatorGroup.all_reduce_max

    def counted_reduce(self, values):
        counts["all_reduce_max"] += 1
        return real_reduce(self, values)

    owner_broadcast.CoordinatorGroup.all_reduce_max = counted_reduce

    with get_parallel().override(
        tp_size=2, tp_rank=rank, attn_dp_size=1, attn_cp_size=1, attn_tp_size=2,
        attn_tp_rank=rank, tp_group=coordinator, attn_tp_group=coordinator,
        pp_group=SimpleNamespace(world_size=1, is_last_rank=True),
    ):
        results = run_all(rank, coordinator, counts)
    with open(out_path, "w") as handle:
        json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()


def run_all(rank, coordinator, counts):
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.managers import mm_schedule
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    from sglang_dsv41.owner_broadcast.protocol import OwnerProtocolError
    from sglang_dsv41.owner_broadcast.routing import ENV_MIN_SAVING
    from sglang_dsv41.owner_broadcast import hooks as owner_broadcast

    embed = VocabParallelEmbedding(VOCAB, WIDTH)
    table = full_text_table()
    shard = embed.shard_indices
    with torch.no_grad():
        embed.weight.zero_()
        rows = shard.org_vocab_end_index - shard.org_vocab_start_index
        embed.weight[:rows] = table[shard.org_vocab_start_index : shard.org_vocab_end_index]
    # How DeepSeek-V4 builds it under attention DP: one shard, no collective.
    single_shard = VocabParallelEmbedding(VOCAB, WIDTH, enable_tp=False)
    with torch.no_grad():
        single_shard.weight.zero_()
        single_shard.weight[:VOCAB] = table

    class Body(nn.Module):
        def __init__(self, text_embedding):
            super().__init__()
            self.embed_tokens = text_embedding

        def get_input_embeddings(self):
            return self.embed_tokens

    class VisionModel(DeepseekV4ForCausalLM):
        """The real class; only what input preparation reads is built."""

        def __init__(self, fail_hash=None, text_embedding=embed):
            nn.Module.__init__(self)
            self.config = SimpleNamespace(hidden_size=WIDTH, image_token_id=IMAGE_TOKEN_ID,
                                          vision_downsample_ratio=3)
            self.vision = object()
            self.image_start = nn.Parameter(torch.zeros(WIDTH))
            self.model = Body(text_embedding)
            self.encoded = []
            self.fail_hash = fail_hash

        def get_image_feature(self, items):
            for item in items:
                if item.hash == self.fail_hash:
                    raise RuntimeError(f"vision tower failed on {item.hash}")
            self.encoded.extend(item.hash for item in items)
            return [image_span(item.hash, tokens_of((item.n_vit_h, item.n_vit_w)))
                    for item in items]

    def image(content_hash, start, grid):
        n_vit_h, n_vit_w = grid
        item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(3, 4),
                                  offsets=[(start, start + tokens_of(grid) - 1)])
        item.set_hash(content_hash)
        item.model_specific_data.update(n_vit_h=n_vit_h, n_vit_w=n_vit_w)
        return item

    def tokens_of(grid):
        n_h, n_w = (-(-grid[0] // 3), -(-grid[1] // 3))
        return 2 + n_h * (n_w + 1)

    def request(length, images):
        """Token ids of one prompt: text ids around the images' placeholder runs."""
        ids = [(7 * i + 1) % (VOCAB - 1) for i in range(length)]
        for item in images:
            start, end = item.offsets[0]
            ids[start : end + 1] = item.padding_sequence(end - start + 1)
        return ids, MultimodalInputs(mm_items=images, im_token_id=IMAGE_TOKEN_ID)

    def expected_embeds(prompt_ids, images, prefix, extend):
        rows = []
        for position in range(prefix, prefix + extend):
            owner = next((i for i in images if i.offsets[0][0] <= position <= i.offsets[0][1]), None)
            if owner is None:
                rows.append(table[prompt_ids[position]])
            else:
                start, end = owner.offsets[0]
                rows.append(image_span(owner.hash, end - start + 1)[position - start])
        return torch.stack(rows)

    models = {}

    def run(name, requests, *, mode=ForwardMode.EXTEND, env="always", fail_hash=None,
            keep_cache=False, lookup_fails_on=None, text_embedding=embed, min_saving=None,
            model_key=None, drop_cache_on=None, encode_fails_on=None):
        """requests: list of (prompt_ids, mm_inputs or None, images, prefix, extend).
        env "always" sends every image chunk through the protocol; "auto" routes
        it. ``model_key`` reuses the model (and its router) of an earlier run."""
        if env is None:  # the variable unset: the default mode
            os.environ.pop(owner_broadcast.ENV_SWITCH, None)
        else:
            os.environ[owner_broadcast.ENV_SWITCH] = env
        os.environ.pop(ENV_MIN_SAVING, None)
        if min_saving is not None:
            os.environ[ENV_MIN_SAVING] = str(min_saving)
        if encode_fails_on is not None and encode_fails_on != rank:
            fail_hash = None  # only that rank's vision tower fails
        model = models.get(model_key)
        if model is None:
            model = VisionModel(fail_hash=fail_hash, text_embedding=text_embedding)
            owner_broadcast.after_model_init(None, model)  # what OWN-GROUP runs after __init__
            if model_key is not None:
                models[model_key] = model
        if not keep_cache:
            mm_schedule.init_mm_embedding_cache(1 << 26)
        if drop_cache_on == rank:
            mm_schedule.embedding_cache.clear()
        if lookup_fails_on == rank:

            def failing_lookup(_ids):
                raise RuntimeError("text lookup failed")

            text_embedding.__dict__["_embed_local_shard"] = failing_lookup
        counts.update(all_gather_object=0, broadcast=0, all_reduce_max=0)
        metrics_before = plugin_metrics.totals()
        router = model.mm_owner_router
        routes_before = dict(router.routes) if router is not None else {}
        input_ids = torch.tensor(
            [t for prompt, _mm, _im, prefix, extend in requests for t in prompt[prefix : prefix + extend]],
            dtype=torch.long,
        )
        batch = SimpleNamespace(
            forward_mode=mode,
            mm_inputs=[mm for _p, mm, _im, _pre, _ext in requests],
            extend_prefix_lens_cpu=[pre for *_x, pre, _ext in requests],
            extend_seq_lens_cpu=[ext for *_x, ext in requests],
            rids=[f"{name}-{i}" for i in range(len(requests))],
            mm_input_embeds=None,
        )
        out = {"name": name, "rank": rank, "group": repr(model.mm_owner_group)}
        try:
            ids, embeds = model.prepare_language_model_inputs(input_ids, batch, None)
            out["status"] = "ok"
            if embeds is not None:
                expected = torch.cat([expected_embeds(p, im, pre, ext)
                                      for p, _mm, im, pre, ext in requests])
                out["embeds_match"] = bool(torch.equal(embeds, expected))
                out["digest"] = hashlib.sha256(embeds.detach().numpy().tobytes()).hexdigest()
            out["ids_in_vocab"] = bool((ids < VOCAB).all())
            out["image_ids"] = ids.tolist().count(IMAGE_TOKEN_ID)
        except OwnerProtocolError as exc:
            out.update(status="agreed-error", error=str(exc))
        except Exception as exc:
            out.update(status="local-error", error=f"{type(exc).__name__}: {exc}")
        finally:
            text_embedding.__dict__.pop("_embed_local_shard", None)
        out.update(encoded=sorted(model.encoded), **counts)
        model.encoded.clear()
        out["metrics"] = metric_changes(metrics_before, plugin_metrics.totals())
        if router is not None:
            out["routes_this_run"] = {route.value: n - routes_before.get(route, 0)
                                      for route, n in router.routes.items()
                                      if n != routes_before.get(route, 0)}
            out["routes"] = {route.value: n for route, n in router.routes.items() if n}
            out["directory"] = router.directory.digest()
            out["directory_spans"] = len(router.directory)
        cache = mm_schedule.embedding_cache
        out["cached"] = sorted(cache.mm_cache)
        return out

    # Two prompts; image 101 occurs in both (one span, encoded once).
    a_images = [image(101, 2, (6, 6)), image(202, 14, (3, 3))]  # 8 and 4 tokens
    b_images = [image(101, 1, (6, 6)), image(303, 11, (6, 3))]  # 8 and 6 tokens
    a_ids, a_mm = request(20, a_images)
    b_ids, b_mm = request(19, b_images)
    text_ids, _ = request(6, [])
    c_images = [image(404, 2, (6, 6))]  # 8 tokens
    c_ids, c_mm = request(12, c_images)

    results = [
        run("owner", [(a_ids, a_mm, a_images, 0, 20), (b_ids, b_mm, b_images, 0, 19)]),
        # A chunk that starts inside image 101 and stops inside image 202.
        # The same chunk again: every span is cached on both ranks.
        run("warm", [(a_ids, a_mm, a_images, 0, 20), (b_ids, b_mm, b_images, 0, 19)],
            keep_cache=True),
        # The same again with a one-shard text embedding (attention DP).
        run("warm-single-shard", [(a_ids, a_mm, a_images, 0, 20), (b_ids, b_mm, b_images, 0, 19)],
            keep_cache=True, text_embedding=single_shard),
        run("partial", [(a_ids, a_mm, a_images, 5, 11)]),
        # The chunk holds only text of an image prompt: no session engaged.
        run("text-chunk", [(a_ids, a_mm, a_images, 18, 2)]),
        # Images in the batch but not in this request's chunk, next to a text prompt.
        run("mixed", [(text_ids, None, [], 0, 6), (b_ids, b_mm, b_images, 0, 19)]),
        run("decode", [(a_ids, a_mm, a_images, 0, 20)], mode=ForwardMode.DECODE),
        run("disabled", [(a_ids, a_mm, a_images, 0, 20), (b_ids, b_mm, b_images, 0, 19)], env="0"),
        run("encode-fails", [(a_ids, a_mm, a_images, 0, 20), (b_ids, b_mm, b_images, 0, 19)],
            fail_hash=303),
        run("lookup-fails", [(b_ids, b_mm, b_images, 0, 19)], lookup_fails_on=0),
        run("single-shard-lookup-fails", [(b_ids, b_mm, b_images, 0, 19)], lookup_fails_on=1,
            text_embedding=single_shard),
        run("after-failure", [(b_ids, b_mm, b_images, 0, 19)]),
        # Routing (env auto). A threshold of one patch: the first chunk takes
        # the protocol and the group records its spans.
        run("auto-cold", [(a_ids, a_mm, a_images, 0, 20), (b_ids, b_mm, b_images, 0, 19)],
            env="auto", min_saving=1, model_key="auto"),
        # The same chunk again: every span known, local lookups only.
        run("auto-known", [(a_ids, a_mm, a_images, 0, 20), (b_ids, b_mm, b_images, 0, 19)],
            env="auto", keep_cache=True, model_key="auto"),
        # Known to the group, but rank 1 lost its cache: it encodes locally.
        run("auto-known-cache-lost-on-1",
            [(a_ids, a_mm, a_images, 0, 20), (b_ids, b_mm, b_images, 0, 19)],
            env="auto", keep_cache=True, model_key="auto", drop_cache_on=1),
        # One image with the default costs: the owner path cannot be faster.
        run("auto-one-image", [(c_ids, c_mm, c_images, 0, 12)], env="auto", model_key="auto-default"),
        # Mode guarded: the same chunk encodes in a status-only session.
        run("guarded-one-image", [(c_ids, c_mm, c_images, 0, 12)], env="guarded"),
        # With a one-shard text embedding the features agreement rides on
        # the fence-end round.
        run("guarded-one-image-single-shard", [(c_ids, c_mm, c_images, 0, 12)], env="guarded",
            text_embedding=single_shard),
        # Only rank 1's vision tower fails on the one image: unguarded, rank 0
        # would go on into the text embedding's all-reduce alone; guarded, it
        # is the same error on both.
        run("guarded-one-image-fails-on-1", [(c_ids, c_mm, c_images, 0, 12)], env="guarded",
            fail_hash=404, encode_fails_on=1),
        run("guarded-after-failure", [(c_ids, c_mm, c_images, 0, 12)], env="guarded"),
        # The variable unset: the default mode must be guarded, failure included.
        run("default-one-image", [(c_ids, c_mm, c_images, 0, 12)], env=None),
        run("default-one-image-fails-on-1", [(c_ids, c_mm, c_images, 0, 12)], env=None,
            fail_hash=404, encode_fails_on=1),
    ]
    # AgreedTextEmbedding relies on VocabParallelEmbedding.forward taking its
    # local lookup from _embed_local_shard and then all-reducing it, and on a
    # one-shard embedding making no collective at all.
    ids = torch.tensor([1, 2, 3])
    embed.__dict__["_embed_local_shard"] = lambda _ids: torch.ones(3, WIDTH)
    try:
        forward_uses_local_shard = bool(torch.equal(embed(ids), torch.full((3, WIDTH), 2.0)))
    finally:
        del embed.__dict__["_embed_local_shard"]
    from sglang.srt.layers import vocab_parallel_embedding as vpe

    reduces = []
    saved = {name: getattr(vpe, name) for name in ("tensor_model_parallel_all_reduce",
                                                  "attn_tp_all_reduce")}
    for name, real in saved.items():
        setattr(vpe, name, lambda tensor, _real=real, _name=name: (reduces.append(_name),
                                                                  _real(tensor))[1])
    try:
        single_shard(ids)
        single_shard_reduces = list(reduces)
        embed(ids)
        sharded_reduces = reduces[len(single_shard_reduces):]
    finally:
        for name, real in saved.items():
            setattr(vpe, name, real)
    # A bad routing setting stops the model build, naming the variable.
    bad_env = {"name": "bad-env", "rank": rank}
    for key, variable, value in (("mode", owner_broadcast.ENV_SWITCH, "sometimes"),
                                 ("saving", ENV_MIN_SAVING, "lots")):
        os.environ[owner_broadcast.ENV_SWITCH] = "auto"
        os.environ[variable] = value
        try:
            owner_broadcast.after_model_init(None, VisionModel())
            bad_env[key] = "built"
        except ValueError as exc:
            bad_env[key] = str(exc)
        finally:
            os.environ.pop(ENV_MIN_SAVING, None)
    results.append(bad_env)
    results.append({
        "name": "installed",
        "forward_uses_local_shard": forward_uses_local_shard,
        "single_shard_tp_size": single_shard.tp_size,
        "single_shard_reduces": single_shard_reduces,
        "sharded_reduces": sharded_reduces,
        "rank": rank,
        "init_wrapped": hasattr(DeepseekV4ForCausalLM.__init__, "__wrapped__"),
        "fence_wrapped": hasattr(DeepseekV4ForCausalLM.prepare_language_model_inputs, "__wrapped__"),
        "mm_replaced": hasattr(DeepseekV4ForCausalLM._prepare_mm_embeddings, "__wrapped__"),
        "encode_wrapped": hasattr(mm_schedule._batch_encode_per_image_misses, "__wrapped__"),
    })
    return results


if __name__ == "__main__":
    main()
