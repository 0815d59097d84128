"""Run `sglang-dsv41 plan` on many cases in one interpreter (sglang imports once).

Used by test_plan.py through conftest.run_python; prints one line
``PLAN-RESULTS <json>`` mapping each case name to its exit status and output.
A case is a list of compose files, or a mapping with ``files`` and any of
``configs`` (--from-compose-config), ``profiles``, ``gpus_per_node`` and
``host_memory_gb``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

from sglang_dsv41.tools.plan.checks import PlanOptions
from sglang_dsv41.tools.plan.cli import main


def run(cases: dict) -> dict[str, dict]:
    results = {}
    for name, spec in cases.items():
        if isinstance(spec, list):
            spec = {"files": spec}
        options = PlanOptions(gpus_per_node=spec.get("gpus_per_node", 8),
                              host_memory_gb=spec.get("host_memory_gb"))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(spec.get("files", []), profiles=spec.get("profiles"),
                      compose_configs=spec.get("configs", []), options=options)
        results[name] = {"rc": rc, "output": out.getvalue()}
    return results


if __name__ == "__main__":
    print("PLAN-RESULTS " + json.dumps(run(json.loads(sys.argv[1]))))
