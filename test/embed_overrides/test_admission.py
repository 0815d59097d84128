"""Request admission: overrides together with image, video or audio, and overrides
in a JSON form sglang never resolves, are refused by the real
TokenizerManager._validate_one_request, in the launcher's TokenizerManager and in
a multi-tokenizer worker's TokenizerWorker."""

from __future__ import annotations

import json
from array import array
from types import SimpleNamespace

import pydantic
import pytest

from conftest import run_python
from embed_harness import hooks_installed, publish_scheduler_context, vec
from sglang.srt.managers.embed_types import PositionalEmbeds
from sglang.srt.managers.io_struct import (
    EmbeddingReqInput,
    GenerateReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.session.session_controller import SessionController
from sglang.srt.runtime_context import publish, reset_context
from sglang.srt.server_args import ServerArgs

REFUSED = "overrides cannot be combined with image, video, or audio"
NOT_RESOLVED = "positional_embed_overrides must be a PositionalEmbeds object"
# What a client can post in the field: a JSON object, the struct's array form,
# or a list of either (the batch form).
JSON_OVERRIDES = {
    "object": {"embeds": [[0.25] * 4], "positions": [1]},
    "array": [[[0.25] * 4], [1]],
    "list-of-objects": [{"embeds": [[0.25] * 4], "positions": [1]}],
}


def _manager(cls=TokenizerManager, *, is_generation=True):
    manager = cls.__new__(cls)
    manager.context_len = 128
    manager.num_reserved_tokens = 0
    manager.allow_auto_truncate = False
    manager.validate_total_tokens = False
    manager.is_generation = is_generation
    # 0.5.23 reads this for decision-layout checkpoints; not one here
    manager.model_config = SimpleNamespace(joint_head_config=None, pointer_head=None)
    return manager


@pytest.fixture
def tokenizer_context():
    reset_context()
    publish(ServerArgs(model_path="dummy"), role="tokenizer")
    yield
    reset_context()


def _generate(**fields):
    return GenerateReqInput(
        input_ids=[10, 50, 20],
        sampling_params={},
        positional_embed_overrides=PositionalEmbeds(embeds=[vec()], positions=[1]),
        **fields,
    )


MEDIA = [
    {"image_data": ["image.png"]},
    {"video_data": ["clip.mp4"]},
    {"audio_data": ["speech.wav"]},
]


@pytest.mark.parametrize("media", MEDIA, ids=lambda m: next(iter(m)))
def test_generate_request_with_overrides_and_media_is_refused(tokenizer_context, media):
    manager = _manager()
    with hooks_installed({"EMB-ADMIT"}):
        req = _generate(**media)
        with pytest.raises(ValueError, match=REFUSED):
            manager._validate_one_request(req, req.input_ids)
        text_only = _generate()
        manager._validate_one_request(text_only, text_only.input_ids)
        media_only = GenerateReqInput(input_ids=[10, 50, 20], sampling_params={}, **media)
        manager._validate_one_request(media_only, media_only.input_ids)


def test_unresolved_embedding_overrides_with_image_are_refused(tokenizer_context):
    """EmbeddingReqInput turns embed_overrides into positional overrides only
    after validation, so the unresolved pair must be caught here too."""
    manager = _manager(is_generation=False)
    req = EmbeddingReqInput(
        input_ids=[10, 50, 20],
        sampling_params={},
        embed_override_token_id=50,
        embed_overrides=[vec()],
        image_data=["image.png"],
    )
    with hooks_installed({"EMB-ADMIT"}):
        with pytest.raises(ValueError, match=REFUSED):
            manager._validate_one_request(req, req.input_ids)
        req.image_data = None
        manager._validate_one_request(req, req.input_ids)
        # half a pair is not an override request (sglang does not resolve it)
        half = EmbeddingReqInput(
            input_ids=[10, 50, 20], sampling_params={}, embed_overrides=[vec()],
            image_data=["image.png"],
        )
        manager._validate_one_request(half, half.input_ids)


def test_refusal_comes_before_upstream_checks(tokenizer_context):
    """The request is refused for the combination even when another check
    would also fail, so the client learns the real reason."""
    manager = _manager()
    manager.context_len = 2  # the 3-token prompt is too long as well
    req = _generate(image_data=["image.png"])
    with pytest.raises(ValueError, match="longer than the model's context length"):
        manager._validate_one_request(req, req.input_ids)  # stock 0.5.23
    with hooks_installed({"EMB-ADMIT"}):
        with pytest.raises(ValueError, match=REFUSED):
            manager._validate_one_request(req, req.input_ids)


def test_stock_sglang_accepts_the_combination(tokenizer_context):
    """Control: without the patch 0.5.23 lets the request through."""
    manager = _manager()
    req = _generate(image_data=["image.png"])
    manager._validate_one_request(req, req.input_ids)


def _from_json(cls, body: dict):
    """The request as the HTTP server builds it from a posted body (FastAPI
    validates a dataclass body with pydantic): the field is typed Any, so the
    JSON value is kept as it came."""
    return pydantic.TypeAdapter(cls).validate_python(body)


@pytest.mark.parametrize("cls", [GenerateReqInput, EmbeddingReqInput])
@pytest.mark.parametrize("sent", JSON_OVERRIDES.values(), ids=JSON_OVERRIDES.keys())
def test_json_overrides_without_media_are_refused(tokenizer_context, cls, sent):
    manager = _manager(is_generation=cls is GenerateReqInput)
    req = _from_json(cls, {"input_ids": [10, 50, 20], "positional_embed_overrides": sent})
    with hooks_installed({"EMB-ADMIT"}):
        with pytest.raises(ValueError, match=NOT_RESOLVED):
            manager._validate_one_request(req, req.input_ids)


def test_stock_hands_json_overrides_to_a_scheduler_intake_that_raises(tokenizer_context):
    """Control: 0.5.23 admits the JSON object, and the scheduler's intake calls
    PositionalEmbeds.reconstruct on it outside any per-request error handling.
    Raised there, the error leaves the scheduler's event loop and the whole
    server goes down (what a real CPU server does)."""
    manager = _manager()
    sent = {
        "input_ids": [10, 50, 20], "sampling_params": {},
        "positional_embed_overrides": JSON_OVERRIDES["object"],
    }
    req = _from_json(GenerateReqInput, sent)
    manager._validate_one_request(req, req.input_ids)

    publish_scheduler_context()
    tokenized = TokenizedGenerateReqInput(
        rid="json-overrides", input_text=None, input_ids=array("i", req.input_ids),
        input_embeds=None, mm_inputs=None, token_type_ids=None,
        sampling_params=SamplingParams(), return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False,
        positional_embed_overrides=req.positional_embed_overrides,
    )
    scheduler = Scheduler.__new__(Scheduler)
    # what the intake reads before it reaches the overrides
    scheduler.session_controller = SessionController(tree_cache=None)
    scheduler.scheduler_stage_metrics = None
    with pytest.raises(AttributeError, match="'dict' object has no attribute 'reconstruct'"):
        scheduler.process_input_requests([tokenized])


WORKER_PROCESS = """
import json
# A multi-tokenizer worker loads the plugins through our worker app (the
# foundation tests that route); the same entry-point discovery here.
from sglang.srt.plugins import load_plugins
load_plugins()
from types import SimpleNamespace
from sglang.srt.managers.embed_types import PositionalEmbeds
from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput
from sglang.srt.managers.multi_tokenizer_mixin import TokenizerWorker
from sglang.srt.runtime_context import publish
from sglang.srt.server_args import ServerArgs
from sglang_dsv41.plugin.verify import role_status
from sglang_dsv41.plugin.spec import Role
import torch

publish(ServerArgs(model_path="dummy"), role="tokenizer")
worker = TokenizerWorker.__new__(TokenizerWorker)
worker.context_len = 128
worker.num_reserved_tokens = 0
worker.allow_auto_truncate = False
worker.validate_total_tokens = False
worker.model_config = SimpleNamespace(joint_head_config=None, pointer_head=None)
out = {}
cases = {
    "generate": (True, GenerateReqInput(
        input_ids=[10, 50, 20], sampling_params={}, image_data=["image.png"],
        positional_embed_overrides=PositionalEmbeds(embeds=[torch.ones(4)], positions=[1]))),
    "embedding": (False, EmbeddingReqInput(
        input_ids=[10, 50, 20], sampling_params={}, image_data=["image.png"],
        embed_override_token_id=50, embed_overrides=[torch.ones(4)])),
    # posted JSON, no media
    "json": (True, GenerateReqInput(
        input_ids=[10, 50, 20], sampling_params={},
        positional_embed_overrides={"embeds": [[1.0] * 4], "positions": [1]})),
}
for name, (is_generation, req) in cases.items():
    worker.is_generation = is_generation
    try:
        worker._validate_one_request(req, req.input_ids)
        out[name] = "accepted"
    except ValueError as exc:
        out[name] = str(exc)
applied, missing = role_status(Role.TOKENIZER_WORKER)
out["applied"] = [p.id for p in applied]
out["missing"] = [p.id for p in missing]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.timeout(240)
def test_multi_tokenizer_worker_refuses_the_combination():
    proc = run_python(WORKER_PROCESS, timeout=230)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    assert REFUSED in out["generate"], out
    assert REFUSED in out["embedding"], out
    assert NOT_RESOLVED in out["json"], out
    assert "EMB-ADMIT" in out["applied"] and out["missing"] == []


BATCH_ENTRY_MISSING = "of a batch request takes one entry per prompt"
ONE_OBJECT = {"embeds": [[0.25] * 4], "positions": [1]}


@pytest.mark.parametrize("cls", [GenerateReqInput, EmbeddingReqInput])
@pytest.mark.parametrize("overrides, prompt, stock_error", [
    (ONE_OBJECT, 0, KeyError),  # one JSON object for the whole batch
    ([ONE_OBJECT], 1, IndexError),  # a list shorter than the batch
    (7, 0, TypeError),
], ids=["one-object", "short-list", "number"])
def test_batch_without_an_entry_per_prompt_is_a_client_error(tokenizer_context, cls, overrides, prompt,
                                                             stock_error):
    """sglang splits a batch by indexing the field per prompt; a missing entry is a
    KeyError or IndexError there (a 500 over HTTP): with the patch, a ValueError (a 400)."""
    req = cls(text=["the lazy dog", "a quick fox"], positional_embed_overrides=overrides)
    req.normalize_batch_and_arguments()
    with pytest.raises(stock_error):
        req[prompt]
    with hooks_installed({"EMB-BATCH-GEN", "EMB-BATCH-EMB"}):
        with pytest.raises(ValueError, match=BATCH_ENTRY_MISSING) as refused:
            req[prompt]
    assert f"prompt {prompt} has none" in str(refused.value)


@pytest.mark.parametrize("cls", [GenerateReqInput, EmbeddingReqInput])
def test_batch_forms_sglang_splits_are_left_alone(tokenizer_context, cls):
    shared = PositionalEmbeds(embeds=[vec()], positions=[1])
    per_prompt = [PositionalEmbeds(embeds=[vec()], positions=[1]), None]
    with hooks_installed({"EMB-BATCH-GEN", "EMB-BATCH-EMB"}):
        for overrides, want in ((None, [None, None]), (shared, [shared, shared]), (per_prompt, per_prompt),
                                ([ONE_OBJECT, ONE_OBJECT], [ONE_OBJECT, ONE_OBJECT])):
            req = cls(text=["the lazy dog", "a quick fox"], positional_embed_overrides=overrides)
            req.normalize_batch_and_arguments()
            # (a JSON entry per prompt is split as sent; EMB-ADMIT refuses each one)
            assert [req[i].positional_embed_overrides for i in range(2)] == want
