#!/usr/bin/env bash
# Acceptance check for SGLANG_DSV41_CP_BCG=1 (DeepSeek-V4 interleave prefill CP in the
# breakable prefill CUDA graph) on a GPU node. Not run anywhere but there: CPU
# machines cannot capture a graph.
#
#   deploy/b300-build/verify-cp-bcg.sh MODEL_PATH [TP]
#       starts an eager CP server (setting off), sends the prompt set, stops it; then
#       the same with SGLANG_DSV41_CP_BCG=1; both text-only (--language-model-only),
#       --enable-prefill-cp --cp-strategy interleave, TP = attention CP = TP (default 8),
#       on the same GPUs one after the other.
#   deploy/b300-build/verify-cp-bcg.sh --urls EAGER_URL BCG_URL
#       compares two servers you started yourself the same way.
#
# Passes (exit 0) when every prompt's greedy (temperature 0) output tokens are equal on
# both servers, when both run speculative decoding (DSpark flags in EXTRA_ARGS) the
# draft's acceptance length under the graph is at most 2% below eager's (greedy tokens
# cannot show corrupted draft inputs: the target verifies every draft token), and, when
# it started them, the opt-in server logged that it captured the CP breakable graph and
# the eager one did not. Prints the median time to first token of both and their ratio
# (opt-in / eager; below 1 is faster), the acceptance lengths, and on a passing DSpark
# run the SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED value a DSpark server under the opt-in
# needs. Exit 1: a mismatch or a server that did not come up; exit 2: bad input.
#
# Settings (environment):
#   PORT            first port (default 31000; the opt-in server uses PORT+1)
#   MAX_NEW_TOKENS  greedy tokens per prompt (default 32)
#   PROMPT_WORDS    prompt lengths in words, space separated (default "40 300 1200 3000 6000")
#   REPEATS         timed requests per prompt for the TTFT median (default 3)
#   WAIT_S          how long a server may take to come up (default 2400)
#   EXTRA_ARGS      more `sglang serve` arguments for both servers (word-split)
#   RESULT_FILE     where the JSON result goes (default ./verify-cp-bcg-result.json)
#   PYTHON          python with sglang 0.5.23 and sglang-dsv41 (default python3)
set -euo pipefail

usage="usage: $0 MODEL_PATH [TP>=2]  |  $0 --urls EAGER_URL BCG_URL"
die_usage() { echo "verify-cp-bcg: $1" >&2; echo "$usage" >&2; exit 2; }

python_bin=${PYTHON:-python3}
port=${PORT:-31000}
max_new_tokens=${MAX_NEW_TOKENS:-32}
prompt_words=${PROMPT_WORDS:-40 300 1200 3000 6000}
repeats=${REPEATS:-3}
wait_s=${WAIT_S:-2400}
result_file=${RESULT_FILE:-./verify-cp-bcg-result.json}

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
for pair in "PORT:$port" "MAX_NEW_TOKENS:$max_new_tokens" "REPEATS:$repeats" "WAIT_S:$wait_s"; do
  is_uint "${pair#*:}" && [[ ${pair#*:} -gt 0 ]] || die_usage "${pair%%:*} must be a positive integer, got '${pair#*:}'"
done
for words in $prompt_words; do
  is_uint "$words" && [[ $words -gt 0 ]] || die_usage "PROMPT_WORDS must be positive integers, got '$words'"
done

mode=launch
if [[ ${1:-} == --urls ]]; then
  [[ $# -eq 3 ]] || die_usage "--urls takes exactly two URLs"
  [[ $2 =~ ^https?://[^[:space:]]+$ && $3 =~ ^https?://[^[:space:]]+$ ]] || die_usage "not URLs: '$2' '$3'"
  mode=urls eager_url=${2%/} bcg_url=${3%/}
else
  [[ $# -ge 1 && $# -le 2 ]] || die_usage "expected MODEL_PATH [TP]"
  model_path=$1 tp=${2:-8}
  [[ -d $model_path ]] || die_usage "MODEL_PATH '$model_path' is not a directory"
  is_uint "$tp" && [[ $tp -ge 2 ]] || die_usage "TP must be an integer >= 2, got '$tp'"
  command -v sglang >/dev/null || die_usage "the 'sglang' command is not on PATH"
fi
"$python_bin" -c "import sglang_dsv41" 2>/dev/null || die_usage "$python_bin cannot import sglang_dsv41"

log_dir=$(mktemp -d -t verify-cp-bcg.XXXXXX)
server_pid=""
stop_server() {
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM -- "-$server_pid" 2>/dev/null || kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$server_pid" 2>/dev/null || true
  fi
  server_pid=""
}
trap stop_server EXIT INT TERM

# One client for both modes: greedy outputs of every prompt, then timed first tokens.
run_client() {  # URL OUT_JSON
  "$python_bin" - "$1" "$2" "$max_new_tokens" "$repeats" $prompt_words <<'PY'
import json, statistics, sys, time, urllib.request

url, out_path, max_new, repeats, *lengths = sys.argv[1:]
max_new, repeats, lengths = int(max_new), int(repeats), [int(n) for n in lengths]
vocabulary = ("river stone market ledger signal harbor copper lantern orchard quartz "
              "meadow engine violet summit canyon ember glacier falcon prairie tunnel").split()

def prompt(words):
    body = " ".join(vocabulary[(i * 7 + words) % len(vocabulary)] for i in range(words))
    return f"Summarize the following list in one sentence.\n{body}\nSummary:"

def post(payload):
    request = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=600)

sampling = {"temperature": 0, "max_new_tokens": max_new}
result = {"url": url, "prompts": []}

def measure(words):
    text = prompt(words)
    with post({"text": text, "sampling_params": sampling}) as response:
        reply = json.loads(response.read())
    tokens = reply.get("output_ids")
    meta = reply.get("meta_info") or {}
    ttfts = []
    for _ in range(repeats):
        start = time.perf_counter()
        with post({"text": text, "sampling_params": {**sampling, "max_new_tokens": 1},
                   "stream": True}) as response:
            for line in response:
                if line.strip():
                    ttfts.append(time.perf_counter() - start)
                    break
            for _ in response:
                pass
    if not ttfts:
        raise OSError("the streamed reply was empty")
    # Speculative servers report their verify steps; tokens per step is the acceptance length.
    return {"words": words, "output_ids": tokens, "text": reply.get("text"),
            "completion_tokens": meta.get("completion_tokens"),
            "spec_verify_ct": meta.get("spec_verify_ct"), "ttft_s": statistics.median(ttfts)}

try:
    result["prompts"] = [measure(words) for words in lengths]
except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
    sys.exit(f"verify-cp-bcg: FAIL {url}/generate: {exc}")
with open(out_path, "w") as f:
    json.dump(result, f)
PY
}

launch_and_measure() {  # NAME SETTING PORT OUT_JSON
  local name=$1 setting=$2 server_port=$3 out=$4 log="$log_dir/$1.log"
  echo "verify-cp-bcg: starting the $name server (SGLANG_DSV41_CP_BCG=$setting), log $log"
  # The opt-in server is the measurement a DSpark server under the opt-in waits for.
  local verified=""
  [[ $setting == 1 ]] && verified=measure
  # shellcheck disable=SC2086  # EXTRA_ARGS is word-split on purpose
  SGLANG_DSV41_CP_BCG=$setting SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED=$verified setsid sglang serve --model-path "$model_path" --tp "$tp" \
    --enable-prefill-cp --cp-strategy interleave --language-model-only \
    --host 127.0.0.1 --port "$server_port" ${EXTRA_ARGS:-} >"$log" 2>&1 &
  server_pid=$!
  local deadline=$((SECONDS + wait_s))
  until curl -fsS "http://127.0.0.1:$server_port/health" >/dev/null 2>&1; do
    if ! kill -0 "$server_pid" 2>/dev/null; then
      echo "verify-cp-bcg: FAIL the $name server exited; last lines of $log:" >&2
      tail -n 20 "$log" >&2; exit 1
    fi
    if ((SECONDS > deadline)); then
      echo "verify-cp-bcg: FAIL the $name server was not up after ${wait_s}s (log $log)" >&2; exit 1
    fi
    sleep 5
  done
  run_client "http://127.0.0.1:$server_port" "$out"
  stop_server
}

eager_json="$log_dir/eager.json" bcg_json="$log_dir/bcg.json"
graph_line="Prefill CP breakable CUDA graph enabled"
if [[ $mode == launch ]]; then
  launch_and_measure eager 0 "$port" "$eager_json"
  launch_and_measure opt-in 1 "$((port + 1))" "$bcg_json"
  if grep -q "$graph_line" "$log_dir/eager.log"; then
    echo "verify-cp-bcg: FAIL the eager server captured a CP breakable graph" >&2; exit 1
  fi
  if ! grep -q "$graph_line" "$log_dir/opt-in.log"; then
    echo "verify-cp-bcg: FAIL the opt-in server did not log '$graph_line' (log $log_dir/opt-in.log)" >&2
    exit 1
  fi
else
  run_client "$eager_url" "$eager_json"
  run_client "$bcg_url" "$bcg_json"
fi

"$python_bin" - "$eager_json" "$bcg_json" "$result_file" <<'PY'
import json, statistics, sys
from importlib.metadata import version

from sglang_dsv41.cp_bcg.setting import (
    ACCEPTANCE_TOLERANCE, DSPARK_VERIFIED_ENV, acceptance_holds, dspark_verification_value)

eager, bcg = (json.load(open(p)) for p in sys.argv[1:3])


def acceptance(run):
    """Tokens per verify step over every prompt; None without speculative decoding."""
    steps = [p.get("spec_verify_ct") for p in run["prompts"]]
    if not all(isinstance(s, int) and s > 0 for s in steps):
        return None
    return sum(p["completion_tokens"] for p in run["prompts"]) / sum(steps)


rows, equal_all = [], True
for a, b in zip(eager["prompts"], bcg["prompts"]):
    same = a["output_ids"] == b["output_ids"] if a["output_ids"] is not None else a["text"] == b["text"]
    equal_all &= same
    rows.append({"words": a["words"], "equal": same, "eager_ttft_s": a["ttft_s"], "bcg_ttft_s": b["ttft_s"]})
    print(f"prompt {a['words']:>6} words  tokens {'equal' if same else 'DIFFER'}  "
          f"TTFT eager {a['ttft_s'] * 1000:8.1f} ms  opt-in {b['ttft_s'] * 1000:8.1f} ms  "
          f"ratio {b['ttft_s'] / a['ttft_s']:.3f}")
eager_median = statistics.median(r["eager_ttft_s"] for r in rows)
bcg_median = statistics.median(r["bcg_ttft_s"] for r in rows)
ratio = bcg_median / eager_median
print(f"median TTFT eager {eager_median * 1000:.1f} ms, opt-in {bcg_median * 1000:.1f} ms, "
      f"ratio (opt-in / eager) {ratio:.3f}")
accept_eager, accept_graph = acceptance(eager), acceptance(bcg)
verified = None
if accept_eager is None and accept_graph is None:
    accept_ok, accept_note = True, "acceptance length not measured (no speculative decoding)"
elif accept_eager is None or accept_graph is None:
    accept_ok, accept_note = False, "only one server reports speculative decoding"
else:
    accept_ok = acceptance_holds(accept_eager, accept_graph)
    accept_note = (f"acceptance length eager {accept_eager:.3f}, opt-in {accept_graph:.3f} "
                   f"({'within' if accept_ok else 'more than'} {ACCEPTANCE_TOLERANCE:.0%} below)")
    if equal_all and accept_ok:
        verified = dspark_verification_value(version("sglang"), accept_eager, accept_graph)
print(accept_note)
passed = equal_all and accept_ok
json.dump({"tokens_equal": equal_all, "ttft_ratio": ratio,
           "acceptance": {"eager": accept_eager, "opt_in": accept_graph, "passed": accept_ok},
           "dspark_verified": verified, "prompts": rows},
          open(sys.argv[3], "w"), indent=1)
print(("PASS" if passed else "FAIL") + f": greedy tokens {'equal' if equal_all else 'differ'}; "
      f"{accept_note}; result in {sys.argv[3]}")
if verified is not None:
    print(f"{DSPARK_VERIFIED_ENV}={verified}")
sys.exit(0 if passed else 1)
PY
