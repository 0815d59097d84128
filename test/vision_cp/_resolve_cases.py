"""Run sglang 0.5.23's real `sglang serve` argument resolution for named cases.

Executed as a script in a fresh interpreter (plugins load once per process):
    python _resolve_cases.py <tiny checkpoint> <text-only checkpoint>
prints one JSON line per case: {"case", "ok", "error", "attn_cp", "prefill_backend"}.
"""

import json
import sys

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402
from sglang.srt.runtime_context import override_platform  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

vision_ckpt, text_ckpt = sys.argv[1], sys.argv[2]
CP = ["--device", "cuda", "--tp", "2", "--enable-prefill-cp"]
CASES = {
    "vision_interleave": [vision_ckpt, *CP, "--cp-strategy", "interleave"],
    "vision_zigzag": [vision_ckpt, *CP, "--cp-strategy", "zigzag"],
    "vision_explicit_breakable": [vision_ckpt, *CP, "--cp-strategy", "interleave",
                                  "--cuda-graph-backend-prefill", "breakable"],
    "vision_dspark_decoder_replay": [vision_ckpt, *CP, "--cp-strategy", "interleave",
                                     "--speculative-algorithm", "DSPARK",
                                     "--speculative-draft-model-path", vision_ckpt,
                                     "--enable-decoder-swa-bounded-replay"],
    "vision_encoder_replay": [vision_ckpt, *CP, "--cp-strategy", "interleave",
                              "--enable-encoder-swa-bounded-replay"],
    "text_explicit_breakable": [text_ckpt, *CP, "--cp-strategy", "interleave",
                                "--cuda-graph-backend-prefill", "breakable"],
    "vision_language_model_only_breakable": [vision_ckpt, *CP, "--cp-strategy", "interleave",
                                             "--language-model-only",
                                             "--cuda-graph-backend-prefill", "breakable"],
    "vision_no_cp": [vision_ckpt, "--device", "cuda", "--tp", "2"],
}

only = sys.argv[3:] or list(CASES)
with override_platform(is_cuda=True, is_hip=False):
    for name in only:
        out = {"case": name, "ok": False, "error": None}
        try:
            args = prepare_server_args(["--model-path", *CASES[name]])
            args.resolve_once()
            view = resolved_view(args)
            out.update(ok=True, attn_cp=view.attn_cp_size,
                       prefill_backend=str(view.cuda_graph_config.prefill.backend))
        except (Exception, SystemExit) as exc:  # the verdict under test (the launch guard exits)
            out["error"] = f"{type(exc).__name__}: {exc}"
        print("CASE " + json.dumps(out), flush=True)
