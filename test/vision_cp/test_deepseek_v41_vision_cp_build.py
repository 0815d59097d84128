"""DeepseekV4ForCausalLM construction with V4.1 vision under prefill CP (patch VCP-BUILD).

sglang 0.5.23's real argument resolution and constructor, in a fresh interpreter
(see _build_cases.py for exactly what stands in for hardware). Stock 0.5.23 refuses
vision with CP; with VCP-BUILD, CUDA + interleave builds the vision tower, zigzag
and NPU are refused with our message, and every other constructor check stays.

Where the original fork differs: it allowed vision with a MoE all-to-all backend only
for MegaMoE on a PD decode node. sglang 0.5.23 allows CUDA MegaMoE on any node, and
we ship its rule unchanged (VCP-BUILD lifts the CP guard only; every other check of
the constructor is upstream's). Vision + CP + MegaMoE prefill has not been run on a
GPU here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import sglang_dsv41
from conftest import run_python

HERE = Path(__file__).parent
TINY = Path(sglang_dsv41.__file__).parent / "data" / "tiny_dsv41"


def _checkpoint(tmp_path: Path) -> Path:
    """The package's tiny V4.1 config, completed with every field the model reads
    (a released checkpoint carries them all)."""
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config

    config = {}
    for field in dataclasses.fields(DeepSeekV4Config):
        if field.default is not dataclasses.MISSING:
            config[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            config[field.name] = field.default_factory()
    config.pop("quantization_config", None)
    config.update(json.loads((TINY / "config.json").read_text()))
    config.update(
        vocab_size=1024, image_token_id=1000, vision_rope_theta=10000.0,
        vision_downsample_ratio=2, vision_max_n_token=64, vision_min_pixels=3136,
        rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 16384},
    )
    out = tmp_path / "tiny_v41_vision"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config, default=list))
    return out


def _run_cases(checkpoint: Path, *extra: str, then: str = "") -> dict:
    argv = ["x", str(checkpoint), *extra]
    code = (f"import sys\nsys.argv = {argv!r}\n"
            + (HERE / "_build_cases.py").read_text().replace(
                'Path(__file__).resolve().parents[1] / "helpers"', repr(str(HERE.parent / "helpers"))).replace(
                "Path(__file__).resolve().parent", repr(str(HERE)))
            + then)
    proc = run_python(code, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = [json.loads(l[5:]) for l in proc.stdout.splitlines() if l.startswith("CASE ")]
    return {c["case"]: c for c in found}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("ckpt"))


# The cases run with the whole package loaded by sglang's load_plugins() (every patch
# of the table, the owner-broadcast ones included). After them the same process runs
# one image CP step per rank of a CP-2 group through the classes as the plugin left
# them.
_PLUGIN_RUNNER_STEP = """
from _image_cp_rank import run_rank
for rank in range(2):
    run = run_rank(2, rank)
    (logits,) = run.model.logits_calls
    (body,) = run.model.model.calls
    out = {"case": f"runner_rank{rank}", "ok": True, "module_restored": True, "result": {
        "logits_ids": bool(torch.equal(logits.input_ids, run.model_ids)),
        "logits_hidden": bool(torch.equal(logits.hidden_states, run.hidden)),
        "scheduler_ids_kept": bool(torch.equal(run.scheduler_ids, run.scheduler_copy)),
        "body_ids_normalized": bool((body.input_ids < 1000).all()),
        "gathers": run.group.gathers}}
    print("CASE " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def cases(checkpoint):
    return _run_cases(checkpoint, "plugin", then=_PLUGIN_RUNNER_STEP)


def test_every_case_restores_the_model_module(cases):
    assert set(cases) == {"stock_interleave", "interleave", "zigzag", "npu",
                          "pipeline_parallel", "megamoe", "deepep",
                          "language_model_only", "no_cp", "runner_rank0", "runner_rank1"}
    for case in cases.values():
        assert case["module_restored"], case


def test_stock_constructor_refuses_vision_with_cp(cases):
    case = cases["stock_interleave"]
    assert not case["ok"]
    assert "V4.1 vision supports TP/EP/DP without CP or PP" in case["error"]


def test_cuda_interleave_builds_the_vision_tower_under_cp(cases):
    case = cases["interleave"]
    assert case["ok"], case
    built = case["result"]
    assert built["vision"] == "ViT" and built["aligner"] == "Aligner"
    assert built["image_params"] == [[256], [256], [256]]
    assert built["lm_head"] == "ParallelLMHead"
    # The language body is built with the real CP width and sglang's get_parallel.
    assert built["body"] == {"attn_cp_size": 2, "get_parallel_is_real": True}


@pytest.mark.parametrize("name, platform, strategy", [
    ("zigzag", "cuda", "zigzag"),
    ("npu", "npu", "interleave"),
])
def test_zigzag_and_npu_are_refused_with_our_message(cases, name, platform, strategy):
    case = cases[name]
    assert not case["ok"]
    assert case["error_type"] == "VisionCPBuildRefused"
    assert ("DeepSeek-V4.1 vision with context parallelism requires CUDA and the "
            "interleave CP strategy") in case["error"]
    assert f"platform={platform}, cp strategy={strategy}, attention CP size=2" in case["error"]


def test_pipeline_parallel_is_still_refused_by_upstream(cases):
    case = cases["pipeline_parallel"]
    assert not case["ok"]
    assert case["error_type"] == "ValueError"
    assert "V4.1 vision supports TP/EP/DP without CP or PP" in case["error"]
    assert "the pipeline parallel or MoE A2A setting is what is refused" in case["error"]
    assert case["cause"] is not None  # upstream's own error is chained


def test_moe_all_to_all_rule_is_upstreams(cases):
    assert cases["megamoe"]["ok"], cases["megamoe"]
    assert cases["megamoe"]["result"]["vision"] == "ViT"
    deepep = cases["deepep"]
    assert not deepep["ok"] and deepep["error_type"] == "ValueError"
    assert "MoE A2A requires CUDA MegaMoE" in deepep["error"]


def test_without_vision_or_without_cp_the_stock_constructor_runs(cases):
    text = cases["language_model_only"]
    assert text["ok"], text
    assert text["result"]["vision"] is None and text["result"]["image_params"] == []
    assert text["result"]["body"] == {"attn_cp_size": 2, "get_parallel_is_real": True}
    no_cp = cases["no_cp"]
    assert no_cp["ok"], no_cp
    assert no_cp["result"]["vision"] == "ViT"
    assert no_cp["result"]["body"] == {"attn_cp_size": 1, "get_parallel_is_real": True}


def test_image_cp_step_through_the_plugin(cases):
    """The eager CP runner as the plugin installed it merges images before the shard."""
    for rank in range(2):
        assert cases[f"runner_rank{rank}"]["result"] == {
            "logits_ids": True, "logits_hidden": True, "scheduler_ids_kept": True,
            "body_ids_normalized": True, "gathers": 2}


def test_a_constructor_that_never_builds_the_tower_fails_closed():
    """If sglang's constructor stopped building the tower where VCP-BUILD expects it,
    the lifted guard would outlive the constructor: refuse instead."""
    from types import SimpleNamespace

    from sglang.srt import runtime_context
    from sglang.srt.models import deepseek_v4
    from sglang_dsv41.vision_cp.hooks_model import around_deepseek_v4_init

    seen = []

    def drifted_constructor(model, config):
        seen.append(deepseek_v4.get_parallel().attn_cp_size)

    config = SimpleNamespace(model_type="deepseek_v41", vision_n_layers=2)
    with runtime_context.get_parallel().override(
            tp_size=2, attn_tp_size=1, attn_dp_size=1, attn_cp_size=2):
        with pytest.raises(RuntimeError, match="no longer matches the one VCP-BUILD"):
            around_deepseek_v4_init(drifted_constructor, object(), config)
    assert seen == [1]
    assert deepseek_v4.get_parallel is runtime_context.get_parallel
