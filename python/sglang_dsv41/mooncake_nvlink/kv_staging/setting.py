"""KV peer writes' settings: read once, refused whole when any value is wrong.

Plain module: the loader, the hooks, doctor and plan read the same function.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

STAGING_ENV = "SGLANG_DSV41_KV_STAGING"
MIN_BLOCKS_ENV = "SGLANG_DSV41_KV_STAGING_MIN_BLOCKS"
MODE_PEER = "peer"
# A peer write costs one kernel launch and a synchronize (tens of us); the
# engine about 7 us per block: below a handful of blocks the direct path wins.
DEFAULT_MIN_BLOCKS = 8
MAX_MIN_BLOCKS = 1 << 20

# Settings of slot staging (`SGLANG_DSV41_KV_STAGING=1`), which peer writes replaced:
# left in an environment they would do nothing, so they stop the server instead.
REMOVED_SETTINGS = (
    "SGLANG_DSV41_KV_STAGING_SLOTS",
    "SGLANG_DSV41_KV_STAGING_SLOT_MB",
    "SGLANG_DSV41_KV_STAGING_ACK_TIMEOUT_S",
)


class StagingConfigError(ValueError):
    """A KV staging setting with a value this package does not accept."""


@dataclass(frozen=True)
class StagingConfig:
    min_blocks: int = DEFAULT_MIN_BLOCKS


def staging_config(environ: Optional[Mapping[str, str]] = None) -> Optional[StagingConfig]:
    """The peer-write settings, or None when off. Bad or removed values raise StagingConfigError."""
    env = os.environ if environ is None else environ
    for name in REMOVED_SETTINGS:
        if (env.get(name) or "").strip():
            raise StagingConfigError(
                f"{name} belonged to slot staging, which was removed; unset it "
                f"(peer writes, {STAGING_ENV}=peer, need no sizes)")
    switch = (env.get(STAGING_ENV) or "").strip()
    if switch in ("", "0"):
        return None
    if switch == "1":
        raise StagingConfigError(
            f"{STAGING_ENV}=1 (slot staging) was removed: peer writes are faster in every measured "
            f"pattern and need no staging memory; set {STAGING_ENV}=peer on prefill and decode, or unset it")
    if switch != MODE_PEER:
        raise StagingConfigError(f"{STAGING_ENV}={switch!r}: use peer (peer writes) or 0 / unset (off)")
    raw = (env.get(MIN_BLOCKS_ENV) or "").strip()
    if not raw:
        return StagingConfig()
    try:
        value = int(raw)
    except ValueError:
        raise StagingConfigError(f"{MIN_BLOCKS_ENV}={raw!r} is not an integer") from None
    if not 1 <= value <= MAX_MIN_BLOCKS:
        raise StagingConfigError(f"{MIN_BLOCKS_ENV}={value} is outside 1..{MAX_MIN_BLOCKS}")
    return StagingConfig(min_blocks=value)
