"""Helpers for the DeepSeek-V4.1 CP runtime tests (this package's own version of the
original fork's ``dsv41_cp_test_utils``; it lives with the tests, not in sglang's namespace).

Everything runs sglang 0.5.23's real CP code: ``InterleaveCPStrategy`` bound with
``init_cp_strategy``, the real ``ForwardBatch``, ``cp_shard_model_inputs`` /
``cp_gather_after_forward`` and the attention-CP all-gather through
``get_parallel().attn_cp_group``. Two kinds of attention-CP group are provided:

- ``PeerShardsGroup``: one process stands for one rank; the all-gather returns the
  shards the other ranks would contribute (computed from the expected full tensor)
  and checks that this rank contributed exactly its own shard.
- ``run_gloo_ranks``: forked processes with a real gloo world and real sglang
  ``GroupCoordinator`` groups, so the all-gather is a real collective.

``installed(*ids)`` puts just the named patches of our table on the real sglang
objects the way sglang's HookRegistry wraps them, and restores the originals.
"""

from __future__ import annotations

import multiprocessing
import socket
import traceback
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable, Sequence
from unittest.mock import patch

import torch

from sglang_dsv41.plugin.testing import patches_installed


# --- patches ----------------------------------------------------------------------------

# Install chosen table patches in-process, undone on exit.
installed = patches_installed


RUNTIME_PATCHES = ("VCP-PREPARE", "VCP-RUNNER")


# --- batches ----------------------------------------------------------------------------

def extend_batch(lengths: Sequence[int], prefixes: Sequence[int], input_ids=None,
                 mm_inputs=None):
    """A real ForwardBatch for one extend step of len(lengths) requests."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    total = sum(lengths)
    if input_ids is None:
        input_ids = torch.arange(1, total + 1)
    seq_lens = [p + n for p, n in zip(prefixes, lengths)]
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(lengths),
        input_ids=input_ids,
        req_pool_indices=torch.arange(len(lengths)),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.arange(total),
        seq_lens_sum=sum(seq_lens),
    )
    batch.positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, lengths)])
    batch.extend_seq_lens_cpu = list(lengths)
    batch.extend_prefix_lens_cpu = list(prefixes)
    batch.seq_lens_cpu = torch.tensor(seq_lens)
    batch.mm_inputs = mm_inputs
    return batch


def interleave_rows(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows of ``full`` that the interleave strategy gives ``rank`` (before padding)."""
    return full[rank::size]


def physical_rows(total: int, size: int) -> int:
    """Padded per-rank row count: ceil(total/size) rounded up to the CP alignment."""
    per_rank = -(-total // size)
    return -(-per_rank // size) * size


def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def rank_major(ids: torch.Tensor, size: int) -> torch.Tensor:
    """The MoE routing id order of cp_interleave_input_ids: rank 0's rows, then rank 1's..."""
    rows = physical_rows(ids.shape[0], size)
    flat = ids.new_zeros(rows * size)
    flat[: ids.shape[0]] = ids
    return flat.view(-1, size).T.flatten()


# --- CP scope ---------------------------------------------------------------------------

@contextmanager
def cp_scope(size: int, rank: int, group, *, strategy: str = "interleave"):
    """Bind prefill CP of ``size`` ranks (this process = ``rank``) around a block."""
    from sglang.srt.layers.cp.base import init_cp_strategy
    from sglang.srt.runtime_context import get_parallel

    values = dict(
        tp_size=size, tp_rank=rank, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1,
        attn_dp_rank=0, attn_cp_size=size, attn_cp_rank=rank, attn_cp_group=group,
        enable_prefill_cp=True, cp_strategy=strategy, enable_cp_tp_group_sharing=False,
    )
    # No CUDA device here: the runner asks for the current stream, which the
    # interleave gather does not use.
    with get_parallel().override(**values), \
            patch("torch.cuda.current_stream", return_value=None):
        init_cp_strategy(enable_prefill_cp=True, cp_size=size, cp_strategy=strategy)
        try:
            yield
        finally:
            init_cp_strategy(enable_prefill_cp=False, cp_size=1, cp_strategy=strategy)


class PeerShardsGroup:
    """Attention-CP group of one process standing for ``rank`` of ``size``.

    ``expected`` lists, gather by gather, what the gathered tensor must become;
    peers contribute their interleave shards of it, and this rank's contribution
    is checked to be exactly its own shard.
    """

    def __init__(self, size: int, rank: int, expected: Sequence[torch.Tensor] = ()):
        self.world_size = size
        self.rank_in_group = rank
        self.expected = list(expected)
        self.gathers = 0

    def all_gather_into_tensor(self, output: torch.Tensor, local: torch.Tensor) -> None:
        assert self.gathers < len(self.expected), "more all-gathers than expected"
        full = self.expected[self.gathers]
        rows = local.shape[0]
        shards = [padded(interleave_rows(full, r, self.world_size), rows)
                  for r in range(self.world_size)]
        torch.testing.assert_close(local, shards[self.rank_in_group].to(local.dtype),
                                   rtol=0, atol=0)
        output.copy_(torch.cat(shards).to(output.dtype))
        self.gathers += 1


# --- real gloo ranks --------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank_main(rank, world, port, layouts, body, results):
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        import sglang.srt.distributed.parallel_state as parallel_state
        from sglang.srt.distributed.parallel_state import GroupCoordinator

        # This machine is a CPU: let sglang's group use torch.distributed directly
        # (its CUDA/NPU path goes through a device-only custom op).
        parallel_state._is_cpu = True
        groups = {}
        for name, ranks_list in layouts.items():
            groups[name] = GroupCoordinator(
                ranks_list, rank, "gloo", use_pynccl=False, use_mscclpp=False,
                use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                use_hpu_communicator=False, use_xpu_communicator=False,
                group_name=f"attn_cp_{name}",
            )
        results.put((rank, "ok", body(rank, groups)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report it; the parent stops the other ranks
        # Return normally (no os._exit) so the queue's feeder thread delivers this.
        results.put((rank, "error", traceback.format_exc()))


def run_gloo_ranks(world: int, layouts: dict, body: Callable, timeout: float = 150):
    """Fork ``world`` processes in one gloo world; each builds the sglang groups in
    ``layouts`` ({name: [[ranks of group 0], [ranks of group 1], ...]}) and runs
    ``body(rank, {name: GroupCoordinator})``. Returns {rank: body's result}; raises
    with every failing rank's traceback."""
    # Import what the ranks run before forking, so no rank pays for the import.
    import sglang.srt.distributed.parallel_state  # noqa: F401
    import sglang.srt.layers.cp.utils  # noqa: F401
    import sglang.srt.model_executor.runner.eager_runner  # noqa: F401
    import sglang.srt.models.deepseek_v4  # noqa: F401

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_rank_main,
                         args=(r, world, port, layouts, body, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, payload = results.get(timeout=timeout)
            if status == "ok":
                outcomes[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("gloo rank failed\n" + "\n".join(errors))
    return outcomes


# --- a V4.1 model with stand-in vision encoder and transformer body ----------------------

POSITION_MARK = 1e-3  # the body adds position * POSITION_MARK, so row order is checkable


def span_for(item, hidden: int) -> torch.Tensor:
    """The complete embedding span the vision stand-in returns for one image item."""
    start, end = item.offsets[0]
    rows = end - start + 1
    base = 1000.0 * (1 + int(item.hash % 7))
    return base + torch.arange(rows * hidden, dtype=torch.float32).view(rows, hidden)


class StandInBody:
    """Transformer-body stand-in: records what it receives and returns DSv4's
    ``(hidden_states, hidden_states_before_norm)``, where hidden = embeds +
    position * POSITION_MARK and pre-norm = hidden + 0.5 (so a gather that mixes
    rows, or mixes the two tensors, shows)."""

    def __init__(self, embed):
        self.embed = embed
        self.calls = []

    def get_input_embeddings(self):
        return self.embed

    def __call__(self, input_ids, positions, forward_batch, input_embeds=None, **kwargs):
        self.calls.append(SimpleNamespace(
            input_ids=input_ids.clone(), positions=positions.clone(),
            input_embeds=input_embeds.clone(), kwargs=kwargs,
            input_ids_global=getattr(forward_batch, "input_ids_global", None),
        ))
        hidden = input_embeds + positions.to(input_embeds.dtype)[:, None] * POSITION_MARK
        return hidden, hidden + 0.5


def expected_hidden(full_embeds: torch.Tensor, positions: torch.Tensor):
    hidden = full_embeds + positions.to(full_embeds.dtype)[:, None] * POSITION_MARK
    return hidden, hidden + 0.5


def make_v4_model(embed, *, vision: bool, image_token_id: int):
    """sglang's DeepseekV4ForCausalLM methods on stand-in vision and body modules
    (the real constructor needs CUDA; test_deepseek_v41_vision_cp_build.py runs it)."""
    from torch import nn

    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    class StandInV4Model(DeepseekV4ForCausalLM):
        def __init__(self):
            nn.Module.__init__(self)
            self.config = SimpleNamespace(image_token_id=image_token_id,
                                          hidden_size=embed.embedding_dim,
                                          vision_downsample_ratio=2)
            # sglang reads the image parameters' device and dtype for the spans.
            self.image_start = nn.Parameter(torch.zeros(embed.embedding_dim))
            # A vision model's marker; the encoder itself is get_image_feature.
            self.vision = object() if vision else None
            self.mm_owner_group = None
            self.model = StandInBody(embed)
            self.pp_group = SimpleNamespace(is_last_rank=True)
            self.lm_head = object()
            self.capture_aux_hidden_states = False
            self.encoded = []
            self.logits_calls = []

        def get_image_feature(self, items):
            self.encoded.extend(item.hash for item in items)
            return [span_for(item, embed.embedding_dim) for item in items]

        def logits_processor(self, input_ids, hidden_states, lm_head, logits_metadata,
                             aux_hidden_states=None, hidden_states_before_norm=None):
            self.logits_calls.append(SimpleNamespace(
                input_ids=input_ids, hidden_states=hidden_states,
                logits_metadata=logits_metadata, aux_hidden_states=aux_hidden_states,
                hidden_states_before_norm=hidden_states_before_norm,
            ))
            return "logits"

    return StandInV4Model()


def image_item(hash_value: int, offsets, vit_grid=None):
    """An image item; ``vit_grid`` (ViT rows, cols) is the processor's grid, which
    must yield the span length at downsample ratio 2 when it is given."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(1),
                              offsets=[tuple(offsets)])
    item.set_hash(hash_value)
    if vit_grid is not None:
        item.n_vit_h, item.n_vit_w = vit_grid
    return item


def image_step(requests, images, *, image_token_id: int, vocab: int):
    """One extend step of ``requests`` [(prefix, length)] whose request i carries the
    image items ``images[i]`` (a list, or None for a request without multimodal
    inputs). Returns (batch, model_ids, merged) where model_ids are the ids the
    language model must see and merged(embed) the expected merged embeddings."""
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    scheduler_ids, image_rows = [], {}
    for index, (prefix, length) in enumerate(requests):
        ids = [(7 + index * 13 + pos) % vocab for pos in range(prefix, prefix + length)]
        for item in images[index] or ():
            start, end = item.offsets[0]
            span_ids = item.padding_sequence(end - start + 1)
            for pos in range(max(start, prefix), min(end, prefix + length - 1) + 1):
                ids[pos - prefix] = span_ids[pos - start]
                image_rows[len(scheduler_ids) + pos - prefix] = (item, pos - start)
        scheduler_ids.extend(ids)
    ids_tensor = torch.tensor(scheduler_ids, dtype=torch.long)
    mm_inputs = [
        None if items is None else MultimodalInputs(mm_items=list(items),
                                                    im_token_id=image_token_id)
        for items in images
    ]
    if all(m is None for m in mm_inputs):
        mm_inputs = None
    batch = extend_batch([n for _, n in requests], [p for p, _ in requests],
                         input_ids=ids_tensor, mm_inputs=mm_inputs)
    model_ids = ids_tensor.clone()
    for row in image_rows:
        model_ids[row] = image_token_id

    def merged(embed) -> torch.Tensor:
        with torch.no_grad():
            full = embed(model_ids).clone()
            for row, (item, span_row) in image_rows.items():
                full[row] = span_for(item, embed.embedding_dim)[span_row]
        return full

    return batch, model_ids, merged


# --- one eager CP extend step ----------------------------------------------------------

def run_extend_cp(model, batch, size: int, rank: int, group, kwargs=None):
    """Build the CP metadata and run EagerRunner._execute_extend_cp as rank ``rank``."""
    from sglang.srt.layers.cp.utils import is_cp_active, prepare_cp_forward
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    runner = EagerRunner.__new__(EagerRunner)
    runner.model_runner = SimpleNamespace(model=model)
    with cp_scope(size, rank, group), torch.no_grad():
        assert is_cp_active(batch)
        prepare_cp_forward(batch)
        return runner._execute_extend_cp(batch, dict(kwargs or {}))


def gloo_group_for(size: int, rank: int, groups: dict):
    """The attention-CP group of ``size`` containing world ``rank`` (see CP_LAYOUTS)."""
    return groups["pairs"] if size == 2 else groups["quad"]


# A 4-process world holds two independent CP-2 groups and one CP-4 group.
CP_LAYOUTS = {"pairs": [[0, 1], [2, 3]], "quad": [[0, 1, 2, 3]]}
