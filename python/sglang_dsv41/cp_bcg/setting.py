"""The CP breakable-graph opt-in: its one name and its one parser.

Plain and without a load-time check, so the launch guard's rules (which `plan`
imports in the operator's shell) can read the same name.
"""

from __future__ import annotations

import os

CP_BCG_ENV = "SGLANG_DSV41_CP_BCG"


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
