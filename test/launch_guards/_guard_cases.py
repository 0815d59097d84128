"""Resolve `sglang serve` command lines through sglang 0.5.23's real argument resolution.

Run as a script in a fresh interpreter (sglang loads plugins once per process):

    python _guard_cases.py <request json>

The request names a tiny DeepSeek-V4.1 checkpoint with vision, a text-only one,
and optionally compose files. Plugins load through sglang's entry points, so
SGLANG_PLUGINS decides whether this package takes part. The platform is
overridden to CUDA (the hardware is the only thing mocked). Prints one
``CASE <json>`` line per argv case and, with compose files, one
``COMPOSE <json>`` line per file: what `plan` printed and what each service's
`sglang serve` resolution did.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import sys

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402
from sglang.srt.runtime_context import override_platform  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402

GUARD_ATTRIBUTE = "_sglang_dsv41_launch_guard"
GUARD_LOG_PREFIX = "[sglang-dsv41]"

REQUEST = json.loads(sys.argv[1])
VISION, TEXT = REQUEST["vision_checkpoint"], REQUEST["text_checkpoint"]

DP8 = ["--tp", "8", "--ep-size", "8", "--dp-size", "8", "--enable-dp-attention", "--enable-dp-lm-head"]
DSPARK = ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "5"]
CP4 = ["--tp", "4", "--ep-size", "4", "--enable-prefill-cp", "--cp-strategy", "interleave"]
REPLAY = ["--enable-decoder-swa-bounded-replay"]
BREAKABLE = ["--cuda-graph-backend-prefill", "breakable"]
OPT_IN = {"SGLANG_DSV41_CP_BCG": "1"}
# What verify-cp-bcg.sh prints for a passing acceptance comparison, and a failing one.
VERIFIED = {**OPT_IN, "SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED": "0.5.23:3.400:3.390"}
VERIFIED_LOWER = {**OPT_IN, "SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED": "0.5.23:3.400:2.100"}

# name -> (argv after --model-path, extra environment)
ARGV_CASES = {
    # DP attention + DSpark: sglang turns replay on by itself.
    "dp_dspark_implicit": ([VISION, *DP8, *DSPARK], {}),
    "dp_dspark_explicit": ([VISION, *DP8, *DSPARK, *REPLAY], {}),
    "dp_dspark_replay_off": ([VISION, *DP8, *DSPARK, "--no-enable-decoder-swa-bounded-replay"], {}),
    "pd_decode_dp_dspark_implicit": ([VISION, "--tp", "4", "--ep-size", "4", "--dp-size", "4",
                                      "--enable-dp-attention", "--enable-dp-lm-head", *DSPARK,
                                      "--disaggregation-mode", "decode",
                                      "--disaggregation-transfer-backend", "mooncake"], {}),
    # Known-good neighbours.
    "dp_no_dspark": ([VISION, *DP8], {}),
    "tp_dspark": ([VISION, "--tp", "4", *DSPARK], {}),
    "cp_dspark_text": ([TEXT, *CP4, *DSPARK], {}),
    "cp_text": ([TEXT, *CP4], {}),
    "tp_breakable": ([TEXT, "--tp", "4", *BREAKABLE], {}),
    # Text-only prefill CP + DSpark with replay asked for.
    "cp_dspark_text_explicit": ([TEXT, *CP4, *DSPARK, *REPLAY], {}),
    # Explicit prefill graphs under DeepSeek-V4 prefill CP.
    "cp_text_breakable": ([TEXT, *CP4, *BREAKABLE], {}),
    "cp_text_breakable_opt_in": ([TEXT, *CP4, *BREAKABLE], OPT_IN),
    "cp_text_breakable_json": ([TEXT, *CP4, "--cuda-graph-config",
                                '{"prefill": {"backend": "breakable"}}'], {}),
    "cp_text_full": ([TEXT, *CP4, "--cuda-graph-backend-prefill", "full"], {}),
    "cp_text_full_opt_in": ([TEXT, *CP4, "--cuda-graph-backend-prefill", "full"], OPT_IN),
    # DSpark under the opt-in's CP breakable graph: only after its acceptance comparison.
    "cp_dspark_text_opt_in": ([TEXT, *CP4, *DSPARK], OPT_IN),
    "cp_dspark_text_opt_in_verified": ([TEXT, *CP4, *DSPARK], VERIFIED),
    "cp_dspark_text_opt_in_lower_acceptance": ([TEXT, *CP4, *DSPARK], VERIFIED_LOWER),
    "cp_dspark_vision_opt_in": ([VISION, *CP4, *DSPARK], OPT_IN),
}

# The Engine API path: keyword arguments straight into ServerArgs.
KWARG_CASES = {
    "dp_dspark_explicit_kwargs": dict(
        tp_size=8, ep_size=8, dp_size=8, enable_dp_attention=True, enable_dp_lm_head=True,
        speculative_algorithm="DSPARK", speculative_dspark_block_size=5,
        enable_decoder_swa_bounded_replay=True),
    "dp_dspark_implicit_kwargs": dict(
        tp_size=8, ep_size=8, dp_size=8, enable_dp_attention=True, enable_dp_lm_head=True,
        speculative_algorithm="DSPARK", speculative_dspark_block_size=5),
}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _environment(extra: dict):
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _summary(verdict) -> str | None:
    return None if verdict is None else verdict.summary()


def _resolve(build) -> dict:
    records = _Records()
    out = {"ok": False, "refusal": None, "error": None}
    try:
        server_args = build()
        # After parsing: sglang's logging setup there replaces the root handlers.
        # The plugin's logger has its own handler and does not propagate, so
        # listen there too (what a user sees on stderr).
        logging.getLogger().addHandler(records)
        logging.getLogger("sglang_dsv41").addHandler(records)
        server_args.resolve_once()
        view = resolved_view(server_args)
        verdict = getattr(server_args, GUARD_ATTRIBUTE, None)
        out.update(
            ok=True,
            replay=view.enable_decoder_swa_bounded_replay,
            raw_replay=server_args.enable_decoder_swa_bounded_replay,
            prefill_backend=str(view.cuda_graph_config.prefill.backend),
            attn_cp=view.attn_cp_size,
            guard=_summary(verdict),
            # What a scheduler receives: the record pickled, as sglang hands it over.
            guard_in_scheduler=_summary(getattr(pickle.loads(pickle.dumps(server_args)),
                                                GUARD_ATTRIBUTE, None)),
            guard_features=None if verdict is None or verdict.features is None
            else verdict.features.__dict__,
        )
    except SystemExit as exc:
        out["refusal"] = exc.code if isinstance(exc.code, str) else f"exit status {exc.code}"
    except Exception as exc:  # sglang's own refusals, reported as the verdict
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        logging.getLogger().removeHandler(records)
        logging.getLogger("sglang_dsv41").removeHandler(records)
    out["guard_log"] = [line for line in records.lines if line.startswith(GUARD_LOG_PREFIX)]
    return out


def _final_features(server_args):
    from sglang_dsv41.launch_guards.hooks import crash_features

    return crash_features(server_args).__dict__


def run_argv_cases(names):
    for name in names:
        argv, env = ARGV_CASES[name]
        holder = {}

        def build(argv=argv):
            holder["args"] = prepare_server_args(["--model-path", *argv, "--device", "cuda"])
            return holder["args"]

        with _environment(env), override_platform(is_cuda=True, is_hip=False):
            out = _resolve(build)
            if out["ok"] and out["guard_features"] is not None:
                # What the rules would read on the finished record.
                out["final_features"] = _final_features(holder["args"])
        print("CASE " + json.dumps({"case": name, **out}), flush=True)


def run_kwarg_cases():
    for name, kwargs in KWARG_CASES.items():
        with override_platform(is_cuda=True, is_hip=False):
            out = _resolve(lambda: ServerArgs(model_path=VISION, device="cuda", **kwargs))
        print("CASE " + json.dumps({"case": name, **out}), flush=True)


# --------------------------------------------------------------------------- compose: plan vs serve


def _plan_output(path: str) -> tuple[int, str]:
    from sglang_dsv41.tools.plan.cli import main

    # A topology is planned with the node's shared Mooncake master beside it,
    # as it is deployed.
    master = os.path.join(os.path.dirname(path), "mooncake-master.yml")
    files = [master, path] if os.path.exists(master) else [path]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = main(files)
    return rc, buffer.getvalue()


def _serve_verdicts(path: str) -> dict[str, str]:
    """What `sglang serve` does with each service's command: the refusal it
    exits with, or what the guard decided when resolution went through."""
    from sglang_dsv41.tools.plan import cli
    from sglang_dsv41.tools.plan.compose import load_services
    from sglang_dsv41.tools.plan.checks import sglang_serve_args

    services, _ = load_services(path)
    verdicts = {}
    with cli.tiny_checkpoint() as checkpoint:
        for service in services:
            args = sglang_serve_args(service.argv)
            if args is None:
                continue
            argv, _ = cli.server_argv(service, args, checkpoint)
            with cli.container_environment(service), \
                    override_platform(is_cuda=True, is_hip=False):
                out = _resolve(lambda: prepare_server_args(argv))
            if out["refusal"] is not None:
                verdicts[service.label] = "refused: " + out["refusal"]
            elif out["error"] is not None:
                verdicts[service.label] = "sglang error: " + out["error"]
            else:
                verdicts[service.label] = out["guard"]
    return verdicts


def run_compose(paths):
    for path in paths:
        rc, output = _plan_output(path)
        print("COMPOSE " + json.dumps({"file": path, "plan_rc": rc, "plan_output": output,
                                       "serve": _serve_verdicts(path)}), flush=True)


run_argv_cases(REQUEST.get("argv_cases", list(ARGV_CASES)))
if REQUEST.get("kwarg_cases", True):
    run_kwarg_cases()
run_compose(REQUEST.get("compose", []))
