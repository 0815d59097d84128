"""Pin: a DeepSeek-V4.1 checkpoint served language-model-only may run as PD prefill
or decode (the vision tower is not built; KV transfer is the text path).

The original fork added this exemption to ``handle_language_model_only``; sglang 0.5.23
has it (and lists DeepseekV4ForCausalLM among the language-model-only
architectures). These run sglang's real `sglang serve` argument resolution on tiny
configs (no weights) with the platform set to CUDA, and fail if it changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sglang_dsv41
from sglang.srt.arg_groups.overrides import resolved_view
from sglang.srt.runtime_context import override_platform
from sglang.srt.server_args import prepare_server_args

TINY = Path(sglang_dsv41.__file__).parent / "data" / "tiny_dsv41"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    v41 = json.loads((TINY / "config.json").read_text())
    out = {"v41": TINY}
    variants = {
        # DeepSeek-V4 (not 4.1): the exemption is V4.1-only.
        "v4": dict(model_type="deepseek_v4", compress_ratios=[4, 128, 4, 0],
                   vision_n_layers=0),
        # An architecture with no language-model-only support.
        "unknown_arch": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                             vision_n_layers=0),
    }
    for name, change in variants.items():
        path = tmp_path_factory.mktemp(name)
        (path / "config.json").write_text(json.dumps({**v41, **change}))
        out[name] = path
    return out


def _resolve(checkpoint, *flags):
    with override_platform(is_cuda=True, is_hip=False):
        args = prepare_server_args(["--model-path", str(checkpoint), "--device", "cuda",
                                    *flags])
        args.resolve_once()
    return resolved_view(args)


@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
def test_v41_language_model_only_resolves_in_every_pd_mode(checkpoints, mode):
    view = _resolve(checkpoints["v41"], "--language-model-only", "--disaggregation-mode", mode)
    assert view.language_model_only is True
    assert view.disaggregation_mode == mode


def test_other_models_still_refuse_language_model_only_with_pd(checkpoints):
    with pytest.raises(ValueError, match="--language-model-only is incompatible with "
                                         "--disaggregation-mode prefill/decode"):
        _resolve(checkpoints["v4"], "--language-model-only", "--disaggregation-mode", "prefill")


@pytest.mark.parametrize("flag", ["--encoder-only", "--language-only",
                                  "--enable-prefix-mm-cache",
                                  "--enable-broadcast-mm-inputs-process",
                                  "--mm-enable-dp-encoder"])
def test_encoder_side_options_are_still_refused(checkpoints, flag):
    with pytest.raises(ValueError, match=f"--language-model-only cannot be combined with {flag}"):
        _resolve(checkpoints["v41"], "--language-model-only", "--disaggregation-mode",
                 "prefill", flag)


def test_architectures_without_support_are_refused(checkpoints):
    with pytest.raises(ValueError, match=r"--language-model-only does not support \['LlamaForCausalLM'\]"):
        _resolve(checkpoints["unknown_arch"], "--language-model-only")
