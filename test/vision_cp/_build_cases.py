"""Build DeepseekV4ForCausalLM through sglang 0.5.23's real constructor for named cases.

Executed in a fresh interpreter (argument resolution and the published runtime
context are process-wide): ``python _build_cases.py <checkpoint dir> [plugin]``.
Prints one ``CASE {json}`` line per case. With ``plugin`` the whole package is
loaded through sglang's ``load_plugins()`` first (every patch of the table, not
only VCP-BUILD); without it only VCP-BUILD is installed. The stock case runs
sglang's own constructor (the innermost function of the hook chain) either way.

What is real: `sglang serve` argument resolution (tp 2, prefill CP, interleave),
the published scheduler context, the CP strategy binding, the constructor, the
ViT/Aligner, the LM head and logits processor. What stands in, and why:
- the parallel groups (tp/pp/attn) are rank/size handles, since no process
  groups exist in this single process; construction does not communicate;
- the platform: ``_is_cuda`` / ``_is_npu`` of the model module say which
  accelerator this is (the machine has none);
- the language body ``DeepseekV4Model``: it creates CUDA streams and kernels while
  it is built; the stand-in records which CP width the constructor shows it.
"""

import json
import sys
import traceback
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the runner step runs _image_cp_rank

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.cp.base import init_cp_strategy  # noqa: E402
from sglang.srt.runtime_context import (  # noqa: E402
    SpawnRanks,
    get_parallel,
    override_platform,
    publish,
)
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from dsv41_cp_harness import installed  # noqa: E402

checkpoint = sys.argv[1]
via_plugin = sys.argv[2:] == ["plugin"]
if via_plugin:
    from sglang.srt.plugins import load_plugins

    load_plugins()
with override_platform(is_cuda=True, is_hip=False):
    args = prepare_server_args(["--model-path", checkpoint, "--device", "cuda", "--tp", "2",
                                "--enable-prefill-cp", "--cp-strategy", "interleave"])
    args.resolve_once()
publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
hf_config = ModelConfig.from_server_args(args).hf_config


def group(rank, size):
    return SimpleNamespace(rank_in_group=rank, world_size=size, ranks=list(range(size)),
                           is_first_rank=rank == 0, is_last_rank=rank == size - 1,
                           cpu_group=None, device_group=None)


parallel = get_parallel()
parallel.override_permanently(pp_group=group(0, 1), tp_group=group(0, 2),
                              attn_tp_group=group(0, 1), attn_cp_group=group(0, 2))

import sglang.srt.models.deepseek_v4 as model_module  # noqa: E402

real_get_parallel = model_module.get_parallel


class LanguageBodyStandIn(torch.nn.Module):
    seen = []

    def __init__(self, config, quant_config=None, prefix=""):
        super().__init__()
        LanguageBodyStandIn.seen.append({
            "attn_cp_size": model_module.get_parallel().attn_cp_size,
            "get_parallel_is_real": model_module.get_parallel is real_get_parallel,
        })
        self.start_layer, self.end_layer, self.layers = 0, 0, []
        self.embed_tokens = None


model_module.DeepseekV4Model = LanguageBodyStandIn
model_module._is_cuda, model_module._is_npu = True, False


def build(config=hf_config):
    LanguageBodyStandIn.seen.clear()
    with override_platform(is_cuda=True, is_hip=False):
        model = model_module.DeepseekV4ForCausalLM(config, None)
    return {
        "vision": type(model.vision).__name__ if model.vision is not None else None,
        "aligner": type(getattr(model, "aligner", None)).__name__,
        "image_params": [tuple(getattr(model, n).shape) for n in
                         ("image_start", "image_end", "image_newline") if hasattr(model, n)],
        "lm_head": type(model.lm_head).__name__,
        "owner_group": type(getattr(model, "mm_owner_group", None)).__name__,
        "body": LanguageBodyStandIn.seen[-1],
    }


def case(name, fn):
    out = {"case": name, "ok": False, "error": None}
    try:
        out["result"] = fn()
        out["ok"] = True
    except Exception as exc:  # the verdict under test
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["error_type"] = type(exc).__name__
        out["cause"] = repr(exc.__cause__) if exc.__cause__ is not None else None
        out["trace_tail"] = traceback.format_exc()[-600:]
    # After every case the model module's bindings are sglang's own again.
    out["module_restored"] = (model_module.get_parallel is real_get_parallel
                              and model_module.ViT.__name__ == "ViT")
    print("CASE " + json.dumps(out), flush=True)


def with_strategy(kind, fn):
    init_cp_strategy(enable_prefill_cp=True, cp_size=2, cp_strategy=kind)
    try:
        return fn()
    finally:
        init_cp_strategy(enable_prefill_cp=True, cp_size=2, cp_strategy="interleave")


def on_npu(fn):
    model_module._is_cuda, model_module._is_npu = False, True
    try:
        return fn()
    finally:
        model_module._is_cuda, model_module._is_npu = True, False


def with_parallel(fn, **values):
    with parallel.override(**values):
        return fn()


def with_moe_a2a(backend, fn):
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    from sglang.srt.runtime_context import get_flags

    with get_flags().moe.override(a2a_backend=MoeA2ABackend(backend)):
        return fn()


def language_model_only():
    hf_config.language_model_only = True
    try:
        return build()
    finally:
        hf_config.language_model_only = False


def stock(fn):
    cls = model_module.DeepseekV4ForCausalLM
    hooked = cls.__dict__["__init__"]
    own = hooked
    while hasattr(own, "__wrapped__"):
        own = own.__wrapped__
    cls.__init__ = own
    try:
        return fn()
    finally:
        cls.__init__ = hooked


with nullcontext() if via_plugin else installed("VCP-BUILD"):
    case("stock_interleave", lambda: stock(build))
    case("interleave", build)
    case("zigzag", lambda: with_strategy("zigzag", build))
    case("npu", lambda: on_npu(build))
    case("pipeline_parallel", lambda: with_parallel(build, pp_size=2, pp_group=group(0, 2)))
    case("megamoe", lambda: with_moe_a2a("megamoe", build))
    case("deepep", lambda: with_moe_a2a("deepep", build))
    case("language_model_only", language_model_only)
    case("no_cp", lambda: with_parallel(build, attn_cp_size=1, attn_tp_size=2,
                                        attn_cp_rank=0, attn_tp_rank=0,
                                        attn_cp_group=group(0, 1), attn_tp_group=group(0, 2)))
