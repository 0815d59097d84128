"""One CP rank's image extend step through the real eager CP path (VCP-RUNNER, VCP-PREPARE).

Shared by the inputs test and the build test's child interpreter, which runs the
same step through the classes as the whole plugin left them.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from dsv41_cp_harness import (
    PeerShardsGroup,
    expected_hidden,
    image_item,
    image_step,
    make_v4_model,
    run_extend_cp,
)
from sglang.srt.managers import mm_schedule

HIDDEN = 8
VOCAB = 64
IMAGE_TOKEN_ID = 5
HASH_A, HASH_B = 0xA11CE, 0xB0B

# Three requests in one extend step, as (prefix_len, extend_len):
#  0: text only (empty multimodal inputs);
#  1: image A at request positions [2, 7] starts inside the cached prefix (only
#     positions 4..7 are in this chunk), then text, image B at [10, 12], text;
#  2: no multimodal inputs at all (None).
REQUESTS = [(0, 6), (4, 10), (0, 5)]


def extend_step():
    images = [[], [image_item(HASH_A, (2, 7)), image_item(HASH_B, (10, 12))], None]
    return image_step(REQUESTS, images, image_token_id=IMAGE_TOKEN_ID, vocab=VOCAB)


def fresh_rank_state():
    """Each CP rank is its own process with its own multimodal embedding cache."""
    mm_schedule.init_mm_embedding_cache(1 << 20)
    torch.manual_seed(0)


def vision_model():
    return make_v4_model(nn.Embedding(VOCAB, HIDDEN), vision=True, image_token_id=IMAGE_TOKEN_ID)


def run_rank(size: int, rank: int):
    fresh_rank_state()
    model = vision_model()
    batch, model_ids, merged = extend_step()
    full = merged(model.model.embed)
    hidden, pre_norm = expected_hidden(full, batch.positions)
    scheduler_ids = batch.input_ids
    scheduler_copy = scheduler_ids.clone()
    group = PeerShardsGroup(size, rank, [hidden, pre_norm])
    result = run_extend_cp(model, batch, size, rank, group)
    return SimpleNamespace(model=model, batch=batch, full=full, hidden=hidden,
                           pre_norm=pre_norm, model_ids=model_ids, result=result,
                           scheduler_ids=scheduler_ids, scheduler_copy=scheduler_copy,
                           group=group)
