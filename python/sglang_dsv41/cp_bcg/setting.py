"""The CP breakable-graph opt-in and its DSpark verification: their names and parsers.

Plain and without a load-time check, so the launch guard's rules (which `plan`
imports in the operator's shell) can read the same name.
"""

from __future__ import annotations

import math
import os

CP_BCG_ENV = "SGLANG_DSV41_CP_BCG"
# What deploy/b300-build/verify-cp-bcg.sh prints when the draft's acceptance length
# under the graph matched eager; the value the script's own opt-in server runs with.
DSPARK_VERIFIED_ENV = "SGLANG_DSV41_CP_BCG_DSPARK_VERIFIED"
MEASURING = "measure"
# The graph's acceptance length may fall this far below eager's (run-to-run noise of
# greedy DSpark is far smaller; corrupted draft inputs cost much more).
ACCEPTANCE_TOLERANCE = 0.02


def parse_cp_bcg_setting(raw: str | None) -> bool:
    """``1`` turns the DeepSeek-V4 CP breakable graph on; unset, empty or ``0`` is off."""
    value = (raw or "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{CP_BCG_ENV} must be 0 or 1 (unset means 0), got {raw!r}")


def cp_bcg_enabled() -> bool:
    """The one reading of the setting. Read where it is used, not cached: `plan`
    resolves every server of a deployment in one process, each under its own
    environment."""
    return parse_cp_bcg_setting(os.environ.get(CP_BCG_ENV))


def dspark_verification_value(release: str, eager: float, graph: float) -> str:
    """The value the script prints for a passing comparison."""
    return f"{release}:{eager:.3f}:{graph:.3f}"


def acceptance_holds(eager: float, graph: float) -> bool:
    return graph >= eager * (1 - ACCEPTANCE_TOLERANCE)


def dspark_verification_problem(raw: str | None, release: str) -> str | None:
    """None when ``raw`` records a passing acceptance comparison on ``release``
    (or is the script's own measuring run), else what is missing."""
    value = (raw or "").strip()
    if value == MEASURING:
        return None
    if not value:
        return f"{DSPARK_VERIFIED_ENV} is not set"
    parts = value.split(":")
    try:
        eager, graph = (float(x) for x in parts[1:]) if len(parts) == 3 else (math.nan, math.nan)
    except ValueError:
        eager = graph = math.nan
    if not (math.isfinite(eager) and math.isfinite(graph) and eager > 0 and graph > 0):
        return f"{DSPARK_VERIFIED_ENV}={raw!r} is not a value verify-cp-bcg.sh prints"
    if parts[0] != release:
        return f"{DSPARK_VERIFIED_ENV} was measured on sglang {parts[0]}, this is {release}"
    if not acceptance_holds(eager, graph):
        return (f"{DSPARK_VERIFIED_ENV} records an acceptance length of {graph:g} under the graph "
                f"against {eager:g} eager")
    return None
