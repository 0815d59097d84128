#!/usr/bin/env bash
# Acceptance check for SGLANG_DSV41_CP_BCG=1 (DeepSeek-V4 interleave prefill CP in the
# breakable prefill CUDA graph) on a GPU node: `sglang-dsv41 verify --features cp_bcg`
# under the name the docs and the launch guard point to.
#
#   deploy/b300-build/verify-cp-bcg.sh MODEL_PATH [TP]
#       an eager CP server (setting off), then the opt-in one (SGLANG_DSV41_CP_BCG=1), the
#       shipped CP + DSpark layout, text only, TP = attention CP = TP (default 8) on GPUs
#       0..TP-1, one after the other.
#   deploy/b300-build/verify-cp-bcg.sh --urls EAGER_URL BCG_URL
#       compares two servers you started yourself the same way.
#
# Passes (exit 0) when every prompt's greedy output tokens are equal on both servers, the
# draft's acceptance length under the graph is at most 2% below eager's (greedy tokens
# cannot show corrupted draft inputs: the target verifies every draft token), and, when
# it started them, the opt-in server logged that it captured the CP breakable graph and
# the eager one did not. Prints the TTFT ratio (graph / eager), the acceptance lengths,
# and on a passing DSpark run the SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED value a DSpark server
# under the opt-in needs; OUT/verify-report.json holds the whole comparison. Exit 1: a
# mismatch or a server that did not come up; exit 2: bad input.
#
# Settings (environment): PORT (first port, default 31000), MAX_NEW_TOKENS (32),
# PROMPT_WORDS ("40 300 1200 3000 6000"), REPEATS (3), WAIT_S (2400), EXTRA_ARGS (more
# `sglang serve` arguments for both servers), OUT (report folder, default ./verify-cp-bcg),
# PYTHON (python with sglang 0.5.23 and sglang-dsv41, default python3).
set -euo pipefail

usage="usage: $0 MODEL_PATH [TP>=2]  |  $0 --urls EAGER_URL BCG_URL"
die_usage() { echo "verify-cp-bcg: $1" >&2; echo "$usage" >&2; exit 2; }

if [[ ${1:-} == --urls ]]; then
  [[ $# -eq 3 ]] || die_usage "--urls takes exactly two URLs"
  target=(--urls "$2" "$3")
else
  [[ $# -ge 1 && $# -le 2 ]] || die_usage "expected MODEL_PATH [TP]"
  tp=${2:-8}
  [[ $tp =~ ^[0-9]+$ && $tp -ge 2 ]] || die_usage "TP must be an integer >= 2, got '$tp'"
  target=(--model-path "$1" --gpus "0-$((tp - 1))")
fi
exec "${PYTHON:-python3}" -m sglang_dsv41.tools.cli verify --features cp_bcg "${target[@]}" \
  --port "${PORT:-31000}" --max-new-tokens "${MAX_NEW_TOKENS:-32}" \
  --prompt-words "${PROMPT_WORDS:-40 300 1200 3000 6000}" --repeats "${REPEATS:-3}" \
  --wait-s "${WAIT_S:-2400}" --extra-args "${EXTRA_ARGS:-}" --out "${OUT:-./verify-cp-bcg}"
