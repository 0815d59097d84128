"""The owner protocol over NCCL on two GPUs (skips with fewer than two).

The CPU suite (test/owner_broadcast/test_gloo_group.py) runs the protocol on
gloo; production runs its status rounds, span broadcasts and the text
embedding's all-reduce on NCCL, with spans and caches on the GPU. Here two
processes, one per GPU, run the same scenario list that way
(``_gloo_scenarios.py --nccl``): cold and cached chunks, the owner's cache
served or evicted, the status-only session of mode guarded, and a failure
injected at every phase on either rank. A hang fails the test through the
process timeout.

Imports only torch, msgspec and sglang_dsv41.owner_broadcast's plain modules
(protocol, routing; no sglang). Runs under pytest or as a script: ``PYTHONPATH=python python test/owner_broadcast/test_owner_nccl_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE.parent / "owner_broadcast" / "_gloo_scenarios.py"
PYTHON_DIR = HERE.parent.parent / "python"
PROCESS_TIMEOUT_S = 400


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def run_pair() -> dict:
    """{scenario: {rank: result}} from the two NCCL ranks."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank{rank}.jsonl" for rank in range(2)]
        procs = [
            subprocess.Popen([sys.executable, str(WORKER), "--nccl", str(rank), f"{tmp}/store", str(out)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank, out in enumerate(outs)
        ]
        logs = []
        try:
            for proc in procs:
                logs.append(proc.communicate(timeout=PROCESS_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
            raise AssertionError(f"a rank did not finish within {PROCESS_TIMEOUT_S}s (hang)")
        for rank, proc in enumerate(procs):
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{logs[rank][-3000:]}"
        results: dict = {}
        for out in outs:
            for line in out.read_text().splitlines():
                result = json.loads(line)
                results.setdefault(result["scenario"], {})[result["rank"]] = result
    return results


@unittest.skipIf(_gpu_count() < 2, "needs two GPUs")
class OwnerProtocolOverNccl(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = run_pair()

    def pair(self, name):
        ranks = self.results[name]
        self.assertEqual(sorted(ranks), [0, 1], name)
        return ranks[0], ranks[1]

    def test_cold_chunk_identical_features_one_encode_per_span(self):
        r0, r1 = self.pair("cold")
        for r in (r0, r1):
            self.assertEqual(r["status"], "ok", r.get("error"))
            self.assertTrue(r["features_match_reference"] and r["text_matches_reference"])
            self.assertTrue(r["cache_all_valid"])
        self.assertEqual(r0["digest"], r1["digest"])
        encoded = r0["encoded"] + r1["encoded"]
        self.assertEqual(sorted(encoded), sorted(set(encoded)), "a span encoded twice")
        self.assertEqual(len(encoded), 4)  # hashes 0..3, two per owner
        self.assertTrue(r0["broadcasts"] > 0)

    def test_spans_cached_everywhere_skip_encoder_and_broadcast(self):
        for r in self.pair("all-cached"):
            self.assertEqual(r["status"], "ok", r.get("error"))
            self.assertTrue(r["features_match_reference"])
            self.assertEqual((r["encoded"], r["broadcasts"]), ([], 0))

    def test_owner_cache_served_and_bad_entries_evicted(self):
        for name in ("owner-cached", "bad-cache"):
            r0, r1 = self.pair(name)
            for r in (r0, r1):
                self.assertEqual(r["status"], "ok", (name, r.get("error")))
                self.assertTrue(r["features_match_reference"] and r["cache_all_valid"], name)
            self.assertEqual(r0["digest"], r1["digest"], name)

    def test_status_only_session(self):
        for name in ("local-cold", "local-cold-text-local"):
            r0, r1 = self.pair(name)
            for r in (r0, r1):
                self.assertEqual(r["status"], "ok", (name, r.get("error")))
                self.assertTrue(r["features_match_reference"])
                self.assertEqual(sorted(r["encoded"]), [0, 1, 2, 3], "every rank encodes")
                self.assertEqual(r["broadcasts"], 0)

    FAILING_PREFIXES = ("fault-", "local-fault-", "cached-fault-", "cached-local-fault-")
    FAILING_NAMES = ("duplicate-geometry", "rid-mismatch", "cached-span-length-mismatch",
                     "cached-extra-span", "cached-rid-mismatch")

    def failing(self, name):
        return name.startswith(self.FAILING_PREFIXES) or name in self.FAILING_NAMES

    def test_a_failure_anywhere_is_the_same_error_on_both_ranks(self):
        names = [n for n in self.results if self.failing(n)]
        self.assertGreater(len(names), 40)
        for name in names:
            r0, r1 = self.pair(name)
            self.assertEqual((r0["status"], r1["status"]), ("agreed-error", "agreed-error"),
                             (name, r0.get("error"), r1.get("error")))
            self.assertEqual(r0["error"], r1["error"], name)
            self.assertTrue(r0["cache_all_valid"] and r1["cache_all_valid"], name)
            if "-rank" in name:
                rank = int(name.rsplit("-rank", 1)[1])
                self.assertIn(f"group rank {rank} (global rank {rank})", r0["error"], name)

    def test_every_other_scenario_serves_the_same_bytes_on_both_ranks(self):
        names = [n for n in self.results if not self.failing(n)]
        self.assertGreater(len(names), 10)
        for name in names:
            r0, r1 = self.pair(name)
            self.assertEqual((r0["status"], r1["status"]), ("ok", "ok"),
                             (name, r0.get("error"), r1.get("error")))
            self.assertEqual(r0["digest"], r1["digest"], name)
            self.assertTrue(r0["features_match_reference"] and r1["features_match_reference"], name)

    def test_the_group_goes_on_after_the_failures(self):
        for r in self.pair("after-faults"):
            self.assertEqual(r["status"], "ok", r.get("error"))
            self.assertTrue(r["features_match_reference"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
