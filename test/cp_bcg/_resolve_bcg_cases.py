"""Run sglang 0.5.23's real `sglang serve` argument resolution for the CP breakable-graph cases.

Executed as a script in a fresh interpreter (plugins load once per process):
    python _resolve_bcg_cases.py <vision checkpoint> <text checkpoint> [case ...]
prints one JSON line per case with the resolved prefill graph backend and what each
place that asks `supports_prefill_cp_bcg` (or the adapter choice) sees.
"""

import json
import os
import sys

# A scheduler process imports the prefill graph runner while unpickling its target,
# before load_plugins(): import it first here too, so its by-name binding of
# supports_prefill_cp_bcg is one the hook registry has to rewrite. The original is
# kept in a list because the registry rewrites every module global bound to it.
from sglang.srt.model_executor.runner import prefill_cuda_graph_runner  # noqa: E402

UNPATCHED = [prefill_cuda_graph_runner.supports_prefill_cp_bcg]

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402
from sglang.srt.layers.cp import bcg as bcg_package  # noqa: E402
from sglang.srt.layers.cp.base import ContextParallelStrategyKind  # noqa: E402
from sglang.srt.layers.cp.bcg.bcg import filter_prefill_cp_bcg_capture_num_tokens  # noqa: E402
from sglang.srt.runtime_context import override_platform  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

vision_ckpt, text_ckpt = sys.argv[1], sys.argv[2]
CP = ["--device", "cuda", "--tp", "2", "--enable-prefill-cp"]
INTERLEAVE = [*CP, "--cp-strategy", "interleave"]
CASES = {
    "text_interleave": [text_ckpt, *INTERLEAVE],
    "text_interleave_tp4": [text_ckpt, "--device", "cuda", "--tp", "4", "--enable-prefill-cp",
                            "--cp-strategy", "interleave"],
    "text_interleave_ep_tp": [text_ckpt, *INTERLEAVE, "--ep-size", "2"],
    "text_zigzag": [text_ckpt, *CP, "--cp-strategy", "zigzag"],
    "text_decoder_swa_replay": [text_ckpt, *INTERLEAVE, "--enable-decoder-swa-bounded-replay"],
    "text_explicit_disabled": [text_ckpt, *INTERLEAVE, "--cuda-graph-backend-prefill", "disabled"],
    "text_no_cp": [text_ckpt, "--device", "cuda", "--tp", "2"],
    "vision_interleave": [vision_ckpt, *INTERLEAVE],
    "vision_language_model_only": [vision_ckpt, *INTERLEAVE, "--language-model-only"],
}
# The same server resolved in this process with the setting switched off for its
# resolution only, as `plan` does with each service's own environment.
CASES["text_interleave@setting_off"] = CASES["text_interleave"]

only = sys.argv[3:] or list(CASES)
print("BINDING " + json.dumps({
    "runner_is_package_attribute":
        prefill_cuda_graph_runner.supports_prefill_cp_bcg is bcg_package.supports_prefill_cp_bcg,
    "runner_rebound": prefill_cuda_graph_runner.supports_prefill_cp_bcg is not UNPATCHED[0],
}), flush=True)
with override_platform(is_cuda=True, is_hip=False):
    for name in only:
        out = {"case": name, "ok": False, "error": None}
        saved_setting = os.environ.get("SGLANG_DSV41_CP_BCG")
        if name.endswith("@setting_off"):
            os.environ["SGLANG_DSV41_CP_BCG"] = "0"
        try:
            args = prepare_server_args(["--model-path", *CASES[name]])
            args.resolve_once()
            view = resolved_view(args)
            out.update(
                ok=True,
                attn_cp=view.attn_cp_size,
                prefill_backend=str(view.cuda_graph_config.prefill.backend),
                # the two bindings sglang calls: the package attribute (looked up
                # lazily by the resolution steps) and the runner's by-name import
                supports_package=bcg_package.supports_prefill_cp_bcg(args),
                supports_runner_binding=prefill_cuda_graph_runner.supports_prefill_cp_bcg(args),
                supports_unpatched=UNPATCHED[0](args),
                interleave_adapter=bcg_package.get_cp_bcg_input_type(
                    ContextParallelStrategyKind.INTERLEAVE).__name__,
            )
            if view.attn_cp_size > 1:
                try:
                    out["capture_buckets"] = filter_prefill_cp_bcg_capture_num_tokens(
                        [1, 2, 3, 4, 8, 16], args)
                except ValueError as exc:
                    out["capture_buckets"] = f"ValueError: {exc}"
        except Exception as exc:  # the verdict under test
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if saved_setting is None:
                os.environ.pop("SGLANG_DSV41_CP_BCG", None)
            else:
                os.environ["SGLANG_DSV41_CP_BCG"] = saved_setting
        print("CASE " + json.dumps(out), flush=True)
