"""`sglang-dsv41 verify` without servers: the plan it would run, the comparisons and
verdicts, the dry run, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dsv41.cp_bcg.setting import dspark_verification_problem
from sglang_dsv41.plugin.pin import PINNED_SGLANG_VERSION
from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.table import owed_to
from sglang_dsv41.tools.verify import evaluate
from sglang_dsv41.tools.verify.plan import GRAPH_LINE, Options, build_plan

CLI = str(Path(sys.executable).parent / "sglang-dsv41")
pytestmark = pytest.mark.timeout(120)
OWED = {role.value: len(owed_to(role)) for role in Role}


@pytest.fixture
def model(tmp_path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vision_config": {"depth": 2}}))
    return tmp_path / "model"


def run_verify(*args, env=None, timeout=100):
    full = {k: v for k, v in os.environ.items()}
    full.update(env or {})
    return subprocess.run([CLI, "verify", *args], capture_output=True, text=True, env=full,
                          timeout=timeout)


def prompts(*outputs, spec=None):
    return [{"prompt": f"text-{i}w", "output_ids": ids, "text": "t", "completion_tokens": 30,
             "spec_verify_ct": spec, "ttft_s": 0.1, "latency_s": 1.0} for i, ids in enumerate(outputs)]


def side(label, outputs, *, log="", metrics=None, spec=None, argv=("sglang", "serve")):
    return {"label": label, "url": "http://x", "error": None, "prompts": prompts(*outputs, spec=spec),
            "procs": [{"name": label, "argv": list(argv), "plugin": True, "log": log,
                       "metrics": metrics}]}


# ---------------------------------------------------------------- comparisons


def test_equal_greedy_tokens_have_no_mismatch():
    assert evaluate.compare_tokens(prompts([1, 2, 3], [4]), prompts([1, 2, 3], [4])) == []


def test_a_mismatch_names_the_prompt_and_the_first_differing_position():
    (line,) = evaluate.compare_tokens(prompts([1, 2, 3], [4]), prompts([1, 2, 3], [4, 5]))
    assert line == "text-1w: tokens differ from position 1 (1 vs 2 tokens)"
    (line,) = evaluate.compare_tokens(prompts([1, 2, 3]), prompts([1, 9, 3]))
    assert line.startswith("text-0w: tokens differ from position 1")
    (line,) = evaluate.compare_tokens(prompts([1]), prompts(None))
    assert line == "text-0w: no output token ids to compare"
    (line,) = evaluate.compare_tokens(prompts(None), prompts(None))  # nothing on either side is no match
    assert line == "text-0w: no output token ids to compare"


def test_acceptance_length_is_tokens_per_verify_step_and_none_without_speculation():
    assert evaluate.acceptance_length(prompts([1], [2], spec=10)) == 3.0
    assert evaluate.acceptance_length(prompts([1], spec=None)) is None


def graph_side(label, outputs, spec, *, captured):
    return side(label, outputs, spec=spec, log=GRAPH_LINE if captured else "")


def test_cp_bcg_passes_and_yields_the_value_the_launch_guard_accepts():
    verdict = evaluate.evaluate_cp_bcg(graph_side("eager", [[1, 2]], 10, captured=False),
                                       graph_side("graph", [[1, 2]], 10, captured=True),
                                       PINNED_SGLANG_VERSION)
    assert verdict["status"] == "pass", verdict
    value = verdict["figures"]["dspark_verified"]
    assert value == f"{PINNED_SGLANG_VERSION}:3.000:3.000"
    assert dspark_verification_problem(value, PINNED_SGLANG_VERSION) is None


@pytest.mark.parametrize("graph_spec, captured, words", [
    (15, True, "more than 2% below"),            # corrupted draft input: same tokens, fewer accepted
    (None, True, "only one server reports"),
    (10, False, f"did not log '{GRAPH_LINE}'"),  # the opt-in never captured its graph
])
def test_cp_bcg_fails_on_acceptance_or_a_graph_never_captured(graph_spec, captured, words):
    verdict = evaluate.evaluate_cp_bcg(graph_side("eager", [[1, 2]], 10, captured=False),
                                       graph_side("graph", [[1, 2]], graph_spec, captured=captured),
                                       PINNED_SGLANG_VERSION)
    assert verdict["status"] == "fail" and words in verdict["detail"], verdict
    assert verdict["figures"]["dspark_verified"] is None


def plugin_log_and_metrics(scheduler_applied=None):
    owed_s, owed_l = OWED["scheduler"], OWED["launcher"]
    applied = owed_s if scheduler_applied is None else scheduler_applied
    log = "\n".join(f"[sglang-dsv41] role={role} pid={pid} patches applied={n}/{OWED[role]} owed"
                    for role, pid, n in (("launcher", 1, owed_l), ("scheduler", 2, applied),
                                         ("detokenizer", 3, OWED["detokenizer"])))
    metrics = "\n".join([
        f'sglang_dsv41_patches_applied{{role="scheduler"}} {applied}.0',
        f'sglang_dsv41_patches_owed{{role="scheduler"}} {owed_s}.0',
        f'sglang_dsv41_patches_applied{{role="launcher"}} {owed_l}.0',
        f'sglang_dsv41_patches_owed{{role="launcher"}} {owed_l}.0',
        'sglang_dsv41_launch_guard_active{rule="none"} 1.0'])
    return log, metrics


def test_status_passes_with_every_role_and_the_metrics_and_fails_on_a_missing_patch():
    log, metrics = plugin_log_and_metrics()
    assert evaluate.evaluate_status(side("plugin", [], log=log, metrics=metrics), OWED)["status"] == "pass"
    log, metrics = plugin_log_and_metrics(scheduler_applied=OWED["scheduler"] - 1)
    verdict = evaluate.evaluate_status(side("plugin", [], log=log, metrics=metrics), OWED)
    assert verdict["status"] == "fail" and "patches missing (scheduler" in verdict["detail"], verdict
    verdict = evaluate.evaluate_status(side("plugin", [], log="", metrics=None), OWED)
    assert "no status line of launcher, scheduler, detokenizer" in verdict["detail"]


def test_stock_fails_when_the_stock_side_ran_the_plugin():
    log, _ = plugin_log_and_metrics()
    verdict = evaluate.evaluate_stock(side("plugin", [[1]]), side("stock", [[1]], log=log))
    assert verdict["status"] == "fail" and "it was not stock" in verdict["detail"]


def test_launch_guards_is_skipped_without_a_dspark_server_and_reads_every_one_that_ran():
    assert evaluate.evaluate_launch_guards([side("plugin", [])])["status"] == "skip"
    dspark = ("sglang", "serve", "--speculative-algorithm", "DSPARK")
    _, metrics = plugin_log_and_metrics()
    verdict = evaluate.evaluate_launch_guards([side("graph", [], metrics=metrics, argv=dspark)])
    assert verdict["status"] == "pass" and verdict["figures"]["verdicts"] == {"graph": ["none"]}
    verdict = evaluate.evaluate_launch_guards([side("graph", [], metrics="", argv=dspark)])
    assert verdict["status"] == "fail" and "no launch guard verdict" in verdict["detail"]


def test_owner_broadcast_fails_when_no_encode_was_saved():
    on = side("broadcast", [[1]], metrics='sglang_dsv41_owner_encodes_saved_total 0.0')
    verdict = evaluate.evaluate_owner_broadcast(on, side("no-broadcast", [[1]], metrics=""))
    assert verdict["status"] == "fail" and "every rank encoded every image" in verdict["detail"]
    on["procs"][0]["metrics"] = "sglang_dsv41_owner_encodes_saved_total 21.0"
    assert evaluate.evaluate_owner_broadcast(on, side("no-broadcast", [[1]], metrics=""))["status"] == "pass"


def test_pd_needs_batches_that_went_as_peer_writes():
    peer = side("peer", [[1]], metrics='sglang_dsv41_kv_staging_batches_total{path="few_blocks"} 4.0')
    verdict = evaluate.evaluate_pd(peer, side("direct", [[1]]))
    assert verdict["status"] == "fail" and "no transfer batch went as a peer write" in verdict["detail"]
    peer["procs"][0]["metrics"] = 'sglang_dsv41_kv_staging_batches_total{path="block_path"} 4.0'
    assert evaluate.evaluate_pd(peer, side("direct", [[1]]))["status"] == "fail"  # went the direct way
    peer["procs"][0]["metrics"] = 'sglang_dsv41_kv_staging_batches_total{path="peer_pages"} 4.0'
    assert evaluate.evaluate_pd(peer, side("direct", [[1]]))["status"] == "pass"


# ---------------------------------------------------------------- plan


def test_on_the_cpu_the_gpu_checks_are_skipped_with_the_reason(model):
    plan = build_plan(["status", "stock", "cp_bcg"], Options(str(model), (), "cpu", 31000))
    assert [(c.name, c.skip) for c in plan.checks] == [
        ("status", None), ("stock", None), ("cp_bcg", "CPU-only run: this check needs GPUs")]
    (pair,) = plan.pairs
    plugin, stock = pair.sides
    assert "--device" in plugin.procs[0].argv and plugin.procs[0].env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert stock.procs[0].env["SGLANG_PLUGINS"] == "not_dsv41" and not stock.procs[0].plugin


def test_too_few_gpus_and_no_vision_tower_are_skip_reasons(tmp_path, model):
    one = build_plan(["cp_bcg", "pd_peer_writes"], Options(str(model), (0,), "cuda", 31000))
    assert [c.skip for c in one.checks] == ["needs at least 2 GPUs, 1 given"] * 2 and not one.pairs
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text("{}")
    text = build_plan(["vision_cp"], Options(str(tmp_path / "text"), tuple(range(8)), "cuda", 31000))
    assert text.checks[0].skip == "the model has no vision tower (no vision_config in config.json)"


def test_eight_gpus_run_the_shipped_layouts(model):
    plan = build_plan(["pd_peer_writes", "cp_bcg"], Options(str(model), tuple(range(8)), "cuda", 31000))
    pd, bcg = plan.pairs
    prefill, decode, router = pd.sides[0].procs
    assert prefill.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and decode.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert prefill.env["SGLANG_DSV41_KV_STAGING"] == "peer" and pd.sides[1].procs[0].env[
        "SGLANG_DSV41_KV_STAGING"] == "0"
    assert "--attn-dp-size" in decode.argv and "--pd-disaggregation" in router.argv
    eager, graph = (s.procs[0] for s in bcg.sides)
    assert eager.argv[eager.argv.index("--tp") + 1] == "8" and "DSPARK" in eager.argv
    assert (eager.env["SGLANG_DSV41_CP_BCG"], graph.env["SGLANG_DSV41_CP_BCG"]) == ("0", "1")
    assert graph.env["SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED"] == "measure"


# ---------------------------------------------------------------- command line


def test_dry_run_prints_the_servers_and_requests_of_the_8_gpu_layouts(model):
    done = run_verify("--model-path", str(model), "--gpus", "0-7", "--dry-run")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for expected in ("pair plugin_stock", "pair vision_cp", "pair owner_broadcast", "pair pd_peer_writes",
                     "pair cp_bcg", "SGLANG_DSV41_OWNER_BROADCAST=always", "--tp 8",
                     "CUDA_VISIBLE_DEVICES=4,5,6,7", "sglang_router.launch_router",
                     "text prompt of 6000 words", "image prompt 2: 4 image(s)"):
        assert expected in out, expected


def fake_nvidia_smi(tmp_path, gpus: int) -> dict:
    """A stand-in for the driver's tool: the node's GPUs are the hardware we mock."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join("echo 'NVIDIA B300 SXM6'\n" for _ in range(gpus)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


@pytest.mark.parametrize("case, message", [
    ("unknown feature", "--features: unknown warp_drive; known: status, stock"),
    ("model missing", "--model-path '/nonexistent/model' is not a directory"),
    ("no config", "has no config.json (not a model folder)"),
    ("no GPU", "no GPU visible (nvidia-smi lists none)"),
    ("GPUs that do not exist", "--gpus: no GPU 2, 3 on this node (2 visible)"),
    ("bad GPU list", "--gpus 'zero': expected indices like 0-7"),
    ("busy port", "on 127.0.0.1 is busy"),
    ("bad number", "--repeats must be an integer from 0 to 10000000, got 'x'"),
    ("a digit int() refuses", "--timeout must be an integer from 1 to 10000000, got '²'"),
    ("a GPU index no node has", "no node has a GPU index of 1024 or more"),
    ("one server as both sides", "--urls: A and B are the same server; a comparison needs two"),
    ("a flag verify sets itself", "--extra-args sets --model-path, --port, which verify sets itself"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, model, case, message):
    args = ["--model-path", str(model), "--out", str(tmp_path / "out")]
    env = fake_nvidia_smi(tmp_path, 2)
    holder = None
    if case == "unknown feature":
        args += ["--features", "stock,warp_drive"]
    elif case == "model missing":
        args = ["--model-path", "/nonexistent/model"]
    elif case == "no config":
        (tmp_path / "empty").mkdir()
        args = ["--model-path", str(tmp_path / "empty")]
    elif case == "no GPU":
        env = {"PATH": "/usr/bin:/bin"}
    elif case == "GPUs that do not exist":
        args += ["--gpus", "0-3"]
    elif case == "bad GPU list":
        args += ["--gpus", "zero"]
    elif case == "busy port":
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        args += ["--device", "cpu", "--port", str(holder.getsockname()[1])]
    elif case == "bad number":
        args += ["--repeats", "x"]
    elif case == "a digit int() refuses":
        args += ["--timeout", "²"]
    elif case == "a GPU index no node has":
        args += ["--gpus", "0-99999999999"]
    elif case == "a flag verify sets itself":  # sglang would take these last values, not verify's
        args += ["--device", "cpu", "--extra-args", "--port 31000 --model-path=/other"]
    elif case == "one server as both sides":
        args = ["--urls", "http://127.0.0.1:1", "http://127.0.0.1:1/", "--features", "stock",
                "--out", str(tmp_path / "out")]
    try:
        done = run_verify(*args, env=env)
    finally:
        if holder:
            holder.close()
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert done.stdout == "" and not (tmp_path / "out").exists()


class _Answering:
    """A server on 127.0.0.1 that answers every request ``how``: "empty" ({} at once),
    "drip" (a 100000-byte body, one byte every half second) or "drip-stream" (output ids
    at once, a streamed request dripped)."""

    def __init__(self, how: str):
        import http.server
        import threading
        import time

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self):
                sent = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                now = {"empty": b"{}", "drip-stream": b'{"output_ids": [1]}'}.get(how)
                now = None if how == "drip-stream" and b'"stream": true' in sent else now
                self.send_response(200)
                self.send_header("Content-Length", str(len(now)) if now else "100000")
                self.end_headers()
                if now:
                    self.wfile.write(now)
                    return
                while not server.closing:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.5)

            do_GET = do_POST = answer

            def log_message(self, *args):
                pass

        server = self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.closing = False
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"

    def close(self):
        self.server.closing = True
        self.server.shutdown()


@pytest.mark.parametrize("how, why", [
    ("empty", ": the answer carries no output token ids to compare"),
    ("drip", ": timed out: no complete answer within 2 s"),
    ("drip-stream", " (streamed): no token within the timeout"),  # the time-to-first-token request
])
def test_servers_that_answer_nothing_comparable_fail_within_the_timeout(tmp_path, how, why):
    import time

    a, b = _Answering(how), _Answering("empty")
    try:
        started = time.monotonic()
        done = run_verify("--urls", a.url, b.url, "--features", "stock", "--timeout", "2", "--repeats", "1",
                          "--out", str(tmp_path / "out"), timeout=60)
        took = time.monotonic() - started
    finally:
        a.close()
        b.close()
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"A: {a.url}/generate{why}" in done.stdout and "NOT PASSED (0 passed, 1 failed" in done.stdout
    assert took < 30  # the timeout bounds each request, a server sending a byte at a time included


def test_checks_that_cannot_run_here_are_skipped_not_passed(tmp_path, model):
    done = run_verify("--device", "cpu", "--model-path", str(model), "--features", "vision_cp,cp_bcg",
                      "--out", str(tmp_path / "out"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "SKIP    CPU-only run: this check needs GPUs" in done.stdout
    assert "NOT PASSED (0 passed, 0 failed, 2 skipped)" in done.stdout
    report = json.loads((tmp_path / "out" / "verify-report.json").read_text())
    assert report["ok"] is False and {c["status"] for c in report["checks"]} == {"skip"}
    assert report["sides"] == {} and report["versions"]["sglang"] == PINNED_SGLANG_VERSION


def test_json_prints_the_report_it_writes(tmp_path, model):
    done = run_verify("--device", "cpu", "--model-path", str(model), "--features", "pd_peer_writes",
                      "--out", str(tmp_path / "out"), "--json")
    assert done.returncode == 1, done.stderr
    printed = json.loads(done.stdout)
    assert printed == json.loads((tmp_path / "out" / "verify-report.json").read_text())
    assert printed["checks"][0]["detail"] == "CPU-only run: this check needs GPUs"
