"""deploy/b300-build/verify-cp-bcg.sh (``sglang-dsv41 verify --features cp_bcg``): input
checks, and its comparison against two real HTTP servers on 127.0.0.1 that stand in for
the eager and the opt-in sglang servers (the launch itself needs GPUs and runs only on the
B300 node)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "deploy" / "b300-build" / "verify-cp-bcg.sh"


def run_script(*args, env=None, timeout=120):
    full_env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": "/tmp",
                "PROMPT_WORDS": "5 9", "REPEATS": "1", **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def report(out):
    return json.loads((out / "verify-report.json").read_text())


def cp_bcg(out) -> dict:
    (check,) = report(out)["checks"]
    return check


def test_bcg_verify_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_bcg_verify_script_shellcheck():
    proc = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(
    "args, env, message",
    [
        ((), {}, "expected MODEL_PATH [TP]"),
        (("/nonexistent/model",), {}, "is not a directory"),
        (("/tmp", "1"), {}, "TP must be an integer >= 2, got '1'"),
        (("/tmp", "four"), {}, "TP must be an integer >= 2, got 'four'"),
        (("/tmp", "2", "3"), {}, "expected MODEL_PATH [TP]"),
        (("--urls", "http://127.0.0.1:1"), {}, "--urls takes exactly two URLs"),
        (("--urls", "localhost:1", "http://x"), {}, "is not an http(s) URL"),
        (("--urls", "http://a", "http://b"), {"PORT": "abc"}, "--port must be an integer"),
        (("--urls", "http://a", "http://b"), {"PROMPT_WORDS": "10 x"}, "--prompt-words must be"),
    ],
)
def test_bcg_verify_script_bad_input_is_one_line_and_exit_2(args, env, message):
    proc = run_script(*args, env=env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr.splitlines()[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def _stand_in_server(differ_on: str | None, accept: float | None = None):
    """/generate: greedy ids derived from the prompt; streamed replies in SSE lines.

    ``accept``: answer as a speculative server whose draft accepts that many tokens
    per verify step (sglang's meta_info fields), else as one without speculation.
    """

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = [len(body["text"]) % 97, body["text"].count(" ")]
            if differ_on is not None and differ_on in body["text"].split("\n")[1].split()[0:1]:
                ids = ids + [1]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            if body.get("stream"):
                self.wfile.write(b"data: " + json.dumps({"text": "x"}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
            else:
                meta = {"completion_tokens": 30}
                if accept is not None:
                    meta["spec_verify_ct"] = round(30 / accept)
                self.wfile.write(json.dumps({"text": "t", "output_ids": ids, "meta_info": meta}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("differ", [False, True])
def test_bcg_verify_script_compares_tokens_and_prints_the_ttft_ratio(tmp_path, differ):
    eager, eager_url = _stand_in_server(None)
    # the 9-word prompt's first word; the opt-in stand-in answers it differently
    bcg, bcg_url = _stand_in_server("quartz" if differ else None)
    try:
        proc = run_script("--urls", eager_url, bcg_url + "/", env={"OUT": str(tmp_path)})
    finally:
        eager.shutdown()
        bcg.shutdown()
    assert "median TTFT ratio (graph / eager)" in proc.stdout, proc.stderr
    check = cp_bcg(tmp_path)
    assert [p["prompt"] for p in report(tmp_path)["sides"]["urls"][0]["prompts"]] == ["text-5w", "text-9w"]
    assert check["figures"]["ttft_ratio"] > 0
    if differ:
        assert proc.returncode == 1 and "FAIL" in proc.stdout, proc.stdout
        assert check["figures"]["mismatches"] == ["text-9w: tokens differ from position 2 (2 vs 3 tokens)"]
    else:
        assert proc.returncode == 0 and "PASS" in proc.stdout and "differ" not in proc.stdout
        assert check["figures"]["mismatches"] == []


@pytest.mark.timeout(60)
def test_bcg_verify_script_unreachable_server_fails_naming_it(tmp_path):
    proc = run_script("--urls", "http://127.0.0.1:9", "http://127.0.0.1:19", env={"OUT": str(tmp_path)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "A: http://127.0.0.1:9/generate:" in cp_bcg(tmp_path)["detail"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eager_accept, graph_accept, passes", [
    (3.0, 3.0, True),      # the same acceptance: the value to set is printed
    (3.0, 2.0, False),     # the graph feeds the draft something else: equal tokens, fewer accepted
    (3.0, None, False),    # only one server speculates: not a comparison
])
def test_bcg_verify_script_compares_the_drafts_acceptance_length(tmp_path, eager_accept, graph_accept, passes):
    from sglang_dsv41.cp_bcg.setting import DSPARK_VERIFIED_ENV, dspark_verification_problem

    eager, eager_url = _stand_in_server(None, eager_accept)
    bcg, bcg_url = _stand_in_server(None, graph_accept)
    try:
        proc = run_script("--urls", eager_url, bcg_url, env={"OUT": str(tmp_path)})
    finally:
        eager.shutdown()
        bcg.shutdown()
    saved = report(tmp_path)
    assert cp_bcg(tmp_path)["figures"]["mismatches"] == [], proc.stdout
    verified = [line for line in proc.stdout.splitlines() if line.startswith(DSPARK_VERIFIED_ENV + "=")]
    if passes:
        assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout + proc.stderr
        assert "acceptance length eager 3.000, graph 3.000" in proc.stdout
        (line,) = verified
        value = line.split("=", 1)[1]
        assert value == saved["dspark_verified"]
        # The value the launch guard accepts on this sglang release.
        from sglang_dsv41.plugin.pin import PINNED_SGLANG_VERSION
        assert dspark_verification_problem(value, PINNED_SGLANG_VERSION) is None
    else:
        assert proc.returncode == 1 and "FAIL" in proc.stdout and not verified, proc.stdout
        assert saved["dspark_verified"] is None


@pytest.mark.timeout(120)
def test_bcg_verify_script_without_speculation_says_acceptance_was_not_measured(tmp_path):
    eager, eager_url = _stand_in_server(None)
    bcg, bcg_url = _stand_in_server(None)
    try:
        proc = run_script("--urls", eager_url, bcg_url, env={"OUT": str(tmp_path)})
    finally:
        eager.shutdown()
        bcg.shutdown()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "acceptance length not measured (no speculative decoding)" in proc.stdout
    assert "SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED=" not in proc.stdout
