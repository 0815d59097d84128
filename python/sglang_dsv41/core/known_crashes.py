"""Flag combinations that resolve cleanly but crash a DeepSeek-V4.1 server on the GPU.

sglang's argument resolution accepts these; the original deployment found them
the hard way on B300 nodes and only wrote them down in YAML comments. They are
checked on the *resolved* arguments, because sglang 0.5.23 turns decoder SWA
bounded replay on by itself where it considers it supported (DP attention
included), so a server can land in a crashing combination without naming the
flag. Each rule says how to get out of it.

These come from field reports against the fork the seed was built on; re-test
them on 0.5.23 GPUs before relaxing one (the lead's GPU runs cannot start a
full sglang server).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CrashFeatures:
    dspark: bool
    decoder_swa_bounded_replay: bool
    enable_prefill_cp: bool
    attn_cp_size: int
    attn_dp_size: int


def known_crash(features: CrashFeatures) -> str | None:
    """Why this resolved layout is known to crash, or None."""
    if not (features.dspark and features.decoder_swa_bounded_replay):
        return None
    if features.enable_prefill_cp or features.attn_cp_size > 1:
        return (
            "prefill context parallelism + DSpark + decoder SWA bounded replay crashes "
            "at runtime (field report: 'cp4 + dspark + replay always crashes'); remove "
            "--enable-decoder-swa-bounded-replay (CP + DSpark without replay is the "
            "known-good combination)"
        )
    if features.attn_dp_size > 1:
        return (
            "DP attention + DSpark cannot run decoder SWA bounded replay (field report: "
            "'dp + dspark cannot use --enable-decoder-swa-bounded-replay'); sglang 0.5.23 "
            "turns replay on by default for this layout, so pass "
            "--no-enable-decoder-swa-bounded-replay"
        )
    return None
