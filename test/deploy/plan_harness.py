"""Run `sglang-dsv41 plan` on many cases in one interpreter (sglang imports once).

Used by test_plan.py through conftest.run_python; prints one line
``PLAN-RESULTS <json>`` mapping each case name to its exit status and output.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

from sglang_dsv41.deploy_plan import main


def run(cases: dict[str, list[str]]) -> dict[str, dict]:
    results = {}
    for name, files in cases.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(files)
        results[name] = {"rc": rc, "output": out.getvalue()}
    return results


if __name__ == "__main__":
    print("PLAN-RESULTS " + json.dumps(run(json.loads(sys.argv[1]))))
