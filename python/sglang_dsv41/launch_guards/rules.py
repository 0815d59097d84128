"""Flag combinations that resolve cleanly but crash (or silently waste) a DeepSeek-V4 server.

The one rule set, judged on resolved arguments: the launch guard applies it inside
`sglang serve` and `sglang-dsv41 plan` through the same resolution. What a match
does, and where the rules come from: docs/design/launch_guards.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Under the CP breakable-graph opt-in an explicit breakable prefill graph with
# prefill CP is replayed, so the guard lets it through.
from sglang_dsv41.cp_bcg.setting import (
    CP_BCG_ENV,
    DSPARK_VERIFIED_ENV,
    dspark_verification_problem,
)
from sglang_dsv41.plugin.pin import PINNED_SGLANG_VERSION

REPLAY_FLAG = "--enable-decoder-swa-bounded-replay"
NO_REPLAY_FLAG = "--no-enable-decoder-swa-bounded-replay"
LOG_PREFIX = "[sglang-dsv41]"


@dataclass(frozen=True)
class CrashFeatures:
    """What the rules read from a resolved server, plus how some of it was chosen."""

    dspark: bool
    decoder_swa_bounded_replay: bool
    enable_prefill_cp: bool
    attn_cp_size: int
    attn_dp_size: int
    # True when the operator passed --enable-decoder-swa-bounded-replay; False
    # when replay is on only because sglang resolved its default (None) to on.
    replay_requested: bool = False
    deepseek_v4: bool = False
    prefill_graph_backend: str = "disabled"  # resolved prefill CUDA graph backend
    prefill_graph_requested: bool = False  # set by a flag or --cuda-graph-config
    # sglang itself would replay a breakable prefill graph for CP batches
    # (layers.cp.bcg.supports_prefill_cp_bcg).
    cp_graph_supported: bool = False
    cp_graph_opt_in: bool = False  # CP_BCG_ENV=1
    dspark_cp_graph_verified: str | None = None  # DSPARK_VERIFIED_ENV as set

    @property
    def prefill_cp(self) -> bool:
        return self.enable_prefill_cp or self.attn_cp_size > 1


class GuardAction(str, enum.Enum):
    NONE = "none"
    TURN_OFF_REPLAY = "turn-off-replay"
    REFUSE = "refuse"


@dataclass(frozen=True)
class GuardVerdict:
    action: GuardAction
    rule: str | None = None
    message: str | None = None  # the refusal, or the log line of a change
    features: CrashFeatures | None = None  # what the verdict was taken on

    def summary(self) -> str:
        """One line for `plan`: what the guard did to this server."""
        if self.action is GuardAction.NONE:
            return "no known-crash rule applies"
        if self.action is GuardAction.TURN_OFF_REPLAY:
            return f"turned decoder SWA bounded replay off ({self.rule})"
        return f"refused ({self.rule})"


# --------------------------------------------------------------------------- rules

REPLAY_UNDER_CP = "prefill CP + DSpark + decoder SWA bounded replay"
REPLAY_UNDER_DP_ATTENTION = "DP attention + DSpark + decoder SWA bounded replay"
UNREPLAYED_CP_PREFILL_GRAPH = "prefill CUDA graph that prefill CP never replays"
UNVERIFIED_DSPARK_CP_GRAPH = "CP breakable prefill graph + DSpark, draft acceptance not verified"

_REPLAY_CRASHES = {
    REPLAY_UNDER_CP: (
        "prefill context parallelism (--enable-prefill-cp) + DSpark + decoder SWA bounded "
        "replay crashes at runtime (field report: 'cp4 + dspark + replay always crashes')",
        "CP + DSpark without replay is the known-good combination",
    ),
    REPLAY_UNDER_DP_ATTENTION: (
        "DP attention + DSpark cannot run decoder SWA bounded replay (field report: "
        "'dp + dspark cannot use --enable-decoder-swa-bounded-replay')",
        "DP attention + DSpark without replay is the known-good combination",
    ),
}


def _replay_rule(f: CrashFeatures) -> str | None:
    if not (f.dspark and f.decoder_swa_bounded_replay):
        return None
    if f.prefill_cp:
        return REPLAY_UNDER_CP
    if f.attn_dp_size > 1:
        return REPLAY_UNDER_DP_ATTENTION
    return None


def _unreplayed_prefill_graph(f: CrashFeatures) -> bool:
    """An explicit prefill graph under DeepSeek-V4 prefill CP that sglang would
    capture and then refuse for every CP batch (the model runner replays a
    prefill graph for a CP batch only from a runner that captured the CP body)."""
    if not (f.deepseek_v4 and f.prefill_cp and f.prefill_graph_requested):
        return False
    if f.prefill_graph_backend == "breakable":
        return not (f.cp_graph_supported or f.cp_graph_opt_in)
    return f.prefill_graph_backend != "disabled"


def _unverified_dspark_cp_graph(f: CrashFeatures) -> str | None:
    """Why DSpark may not run under the opt-in's CP breakable prefill graph, or None.

    Upstream kept the breakable prefill graph off for DeepSeek-V4 with speculative
    decoding because replay corrupted the hidden states the draft reads. Greedy
    tokens cannot show that (the target verifies every draft token); the draft's
    acceptance length can, so only a passing comparison of it lets this through.
    """
    if not (f.dspark and f.prefill_cp and f.cp_graph_opt_in and f.cp_graph_supported
            and f.prefill_graph_backend == "breakable"):
        return None
    return dspark_verification_problem(f.dspark_cp_graph_verified, PINNED_SGLANG_VERSION)


def launch_verdict(f: CrashFeatures) -> GuardVerdict:
    """What the launch guard does with this resolved server."""
    verdict = _verdict(f)
    return GuardVerdict(verdict.action, verdict.rule, verdict.message, f)


def _verdict(f: CrashFeatures) -> GuardVerdict:
    if _unreplayed_prefill_graph(f):
        backend = f.prefill_graph_backend
        way_out = "remove it (the prefill graph then resolves to disabled)"
        if backend == "breakable":
            way_out += f", or set {CP_BCG_ENV}=1 for the CP breakable prefill graph"
        return GuardVerdict(
            GuardAction.REFUSE,
            UNREPLAYED_CP_PREFILL_GRAPH,
            f"{LOG_PREFIX} refusing to start: an explicit {backend} prefill CUDA graph "
            f"(--cuda-graph-backend-prefill {backend}) under DeepSeek-V4 prefill context "
            "parallelism would be captured and never replayed (sglang runs every CP batch "
            f"eagerly), costing memory and start-up time for nothing; {way_out}",
        )
    unverified = _unverified_dspark_cp_graph(f)
    if unverified is not None:
        return GuardVerdict(
            GuardAction.REFUSE,
            UNVERIFIED_DSPARK_CP_GRAPH,
            f"{LOG_PREFIX} refusing to start: {CP_BCG_ENV}=1 puts DeepSeek-V4 prefill CP with "
            "DSpark in the breakable prefill graph, whose replay has not been shown to feed the "
            f"draft the hidden states eager prefill does ({unverified}); run "
            "deploy/b300-build/verify-cp-bcg.sh MODEL_PATH TP (sglang-dsv41 verify --features "
            "cp_bcg) and set "
            f"{DSPARK_VERIFIED_ENV} to the value it prints, or unset {CP_BCG_ENV} (eager CP prefill)",
        )
    rule = _replay_rule(f)
    if rule is None:
        return GuardVerdict(GuardAction.NONE)
    why, good = _REPLAY_CRASHES[rule]
    if f.replay_requested:
        return GuardVerdict(
            GuardAction.REFUSE,
            rule,
            f"{LOG_PREFIX} refusing to start: {REPLAY_FLAG} was given, but {why}; remove "
            f"{REPLAY_FLAG} (or pass {NO_REPLAY_FLAG}); {good}",
        )
    return GuardVerdict(
        GuardAction.TURN_OFF_REPLAY,
        rule,
        f"{LOG_PREFIX} decoder SWA bounded replay turned off: sglang enables it by default "
        f"here, but {why}; pass {NO_REPLAY_FLAG} to choose this yourself",
    )


def known_crash(features: CrashFeatures) -> str | None:
    """Why this resolved layout is known to crash, or None.

    A server resolved with the launch guard never gets here with a crash (the
    guard turned replay off or refused); `plan` keeps this as a check of the
    resolved layout all the same."""
    rule = _replay_rule(features)
    if rule is None:
        return None
    why, good = _REPLAY_CRASHES[rule]
    if rule == REPLAY_UNDER_CP:
        return f"{why}; remove {REPLAY_FLAG} ({good})"
    return f"{why}; remove {REPLAY_FLAG} or pass {NO_REPLAY_FLAG} ({good})"
