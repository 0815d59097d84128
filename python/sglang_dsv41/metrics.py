"""The plugin's Prometheus series (``sglang_dsv41_*``), exported through sglang's own ``/metrics``.

Hooks call the ``count_*`` functions: with metrics off a call returns after one
flag check; with metrics on it adds to the calling thread's tally, which a
flusher thread exports every ``FLUSH_INTERVAL_S``. ``configure`` decides once per
process, and ``prometheus_client`` is imported only once sglang's multiprocess
directory is set. Never imports sglang.

Design: docs/design/metrics.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

logger = logging.getLogger("sglang_dsv41.metrics")

PREFIX = "sglang_dsv41_"
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
FLUSH_INTERVAL_S = 1.0
NO_GUARD_RULE = "none"  # launch_guard_active's label when no known-crash rule applied


@dataclass(frozen=True)
class Series:
    name: str  # without the prefix; counters get "_total" from prometheus_client
    kind: str  # "counter" or "gauge"
    label: Optional[str]
    help: str
    label_values: str = ""  # for the documentation

    @property
    def exported_name(self) -> str:
        return PREFIX + self.name + ("_total" if self.kind == "counter" else "")


_ROLES = "scheduler, tokenizer_worker, detokenizer, detokenizer_router, dp_controller, launcher"

SERIES: Tuple[Series, ...] = (
    Series("patches_applied", "gauge", "role",
           "Patches of the plugin verified installed in a process of this role (the "
           "launcher's as it counted them resolving the server's arguments, published by the "
           "schedulers).", _ROLES),
    Series("patches_owed", "gauge", "role",
           "Patches the plugin owes to a process of this role.", _ROLES),
    Series("processes_verified", "counter", "role",
           "Processes of this role that verified their patches (started with the plugin active).",
           _ROLES),
    Series("owner_routes", "counter", "route",
           "Image chunks routed by the owner-broadcast routing, per route, summed over the "
           "ranks of each replicating group.", "no-spans, known, not-worth, owner"),
    Series("owner_encodes_saved", "counter", None,
           "Image spans a rank took from a peer's broadcast instead of encoding them itself."),
    Series("owner_agreement_rounds", "counter", None,
           "Agreement collectives (status rounds, flag and report gathers) of owner-broadcast "
           "sessions, summed over ranks."),
    Series("owner_agreement_failures", "counter", None,
           "Owner-broadcast sessions that ended in an error agreed by the whole group. The error "
           "then ends the scheduler, and in sglang 0.5.23 the server, so a running server shows "
           "0: watch restarts and the logged error."),
    Series("side_channel_bytes", "counter", "direction",
           "Host-block bytes on the Mooncake NVLink side channel: sent (prefill) or "
           "written (decode).", "sent, written"),
    Series("side_channel_blocks", "counter", "direction",
           "Host blocks on the Mooncake NVLink side channel: sent (prefill) or written (decode).",
           "sent, written"),
    Series("side_channel_drops", "counter", "direction",
           "Host-block transfers not delivered (send) or messages dropped by the receiver "
           "(receive).", "send, receive"),
    Series("kv_staging_batches", "counter", "path",
           "Prefill, peer writes on: peer_pages (a whole KV or state send written from its page "
           "lists straight into the decode's KV, no block list), failed (a peer write made at once, "
           "on an earlier chunk, failed or named a page outside its buffers: that request failed; "
           "a request's held last write is counted peer_pages here and its failure only in "
           "kv_staging_held_writes), or a device batch sglang "
           "built that went the direct way, labelled with why (block_path: a send the page path "
           "does not cover).",
           "peer_pages, failed, few_blocks, block_path, no_peer_map, peer_map_unusable, outside_peer_map, "
           "source_not_device, not_pages"),
    Series("kv_staging_held_writes", "counter", "outcome",
           "Prefill, peer mode: a request's last sends (final KV chunk, state) held and written "
           "as one peer write before its status: written, failed (the request's transfer "
           "failed), or dropped (never written: the request failed first, or the worker took "
           "its next chunk without concluding it).", "written, failed, dropped"),
    Series("kv_staging_peer_maps", "counter", "event",
           "Peer writes on: peer maps sent (decode, sent), and on the prefill the mappings of a "
           "decode session released, by reason: decode_gone (its decode stopped answering "
           "probes: ended or restarted; the session is then counted failed with sglang), "
           "registered_again (same session), session_failed (sglang counts the session "
           "failed), limit (too many sessions mapped), teardown.",
           "sent, decode_gone, registered_again, session_failed, limit, teardown"),
    Series("nvlink_cross_host_peers", "counter", None,
           "Prefill, Mooncake's intra-node NVLink transport configured: decode sessions found on "
           "another host (counted once per session); their transfers skip the host-block routing "
           "and KV peer writes and go to Mooncake unchanged."),
    Series("pd_pairings_refused", "counter", None,
           "PD handshakes a decode refused (the DSpark pairing rule, or sglang's own page size, "
           "KV dtype, layout or TP checks); the requests bound to them failed, the decode kept serving."),
    Series("retraction_aborts", "counter", "reason",
           "Requests a decode's retraction aborted instead of retracting, by reason. "
           "vision_inputs: a DeepSeek-V4 PD decode recomputes retracted requests from token "
           "ids only, so a request with images cannot resume (stock words it as a missing "
           "backup).", "vision_inputs, no_backup, host_pool_exhausted, beam_group, out_of_memory"),
    Series("launch_guard_active", "gauge", "rule",
           "The launch guard's verdict on this server's arguments, as its schedulers received "
           "them: 1 for the known-crash rule that turned a default off, or for rule=\"none\" "
           "when no rule applied (a refused layout never starts, so it never shows). Absent "
           "when the launcher ran without the plugin.",
           "the guard's rule name, or none"),
)
BY_NAME: Dict[str, Series] = {s.name: s for s in SERIES}

# Counts of the hot paths live in a tally per thread (no lock: only its thread
# writes it; the flusher copies it, which is atomic under the GIL). The rare
# ones go to ``_shared`` under a lock. Totals only grow; the flusher exports the
# difference to what it exported before.
class _Tally:
    __slots__ = ("rounds", "saved", "sc_blocks", "sc_bytes", "kv")

    def __init__(self):
        self.rounds = 0
        self.saved = 0
        self.sc_blocks: Dict[str, int] = {}
        self.sc_bytes: Dict[str, int] = {}
        self.kv: Dict[Tuple[str, str], int] = {}  # KV staging events: (series, label) -> count


_local = threading.local()
_tallies: list = []  # every thread's tally, for the flusher
# Per-route chunk counts the owner routers keep anyway (route -> chunks), read
# by the flusher: routing, which runs on every image chunk, pays nothing more.
_route_counts: list = []
_shared: Dict[str, Dict[str, float]] = {s.name: {} for s in SERIES}
_gauges: Dict[str, Dict[str, float]] = {s.name: {} for s in SERIES if s.kind == "gauge"}
_exported: Dict[Tuple[str, str], float] = {}
_lock = threading.Lock()

# True while undecided (counts are kept) and when on; False once off.
_counting = True
_decided: Optional[bool] = None
_metrics: Dict[str, object] = {}
_flusher: Optional[threading.Thread] = None
_wake = threading.Event()


def _new_tally() -> _Tally:
    tally = _local.tally = _Tally()
    with _lock:
        _tallies.append(tally)
    return tally


# --------------------------------------------------------------------------
# Increments (hot paths first)


def export_route_counts(counts: Dict) -> None:
    """Export an owner router's own per-route chunk counts (a dict it keeps
    incrementing, keyed by ``Route`` or its string value) as
    ``owner_routes``. Called once per router, when the model builds it."""
    if _counting:
        with _lock:
            _route_counts.append(counts)


def count_agreement_round() -> None:
    if _counting:
        try:
            _local.tally.rounds += 1
        except AttributeError:
            _new_tally().rounds += 1


def count_encodes_saved(spans: int) -> None:
    if _counting and spans:
        try:
            _local.tally.saved += spans
        except AttributeError:
            _new_tally().saved += spans


def count_side_channel(direction: str, blocks: int, nbytes: int) -> None:
    """Host blocks moved on the side channel: ``direction`` is "sent" or "written"."""
    if _counting:
        try:
            tally = _local.tally
        except AttributeError:
            tally = _new_tally()
        tally.sc_blocks[direction] = tally.sc_blocks.get(direction, 0) + blocks
        tally.sc_bytes[direction] = tally.sc_bytes.get(direction, 0) + nbytes


def _add(series: str, label: str = "", amount: float = 1) -> None:
    if _counting:
        totals = _shared[series]
        with _lock:
            totals[label] = totals.get(label, 0) + amount
        _wake.set()  # rare: export soon


def count_side_channel_drop(direction: str) -> None:
    """A transfer whose host blocks were not delivered ("send"), or a dropped message ("receive")."""
    _add("side_channel_drops", direction)


_KV_STAGING_SERIES = frozenset(s.name for s in SERIES if s.name.startswith("kv_staging_"))


def count_kv_staging(series: str, label: str) -> None:
    """One KV peer-write event: ``series`` is kv_staging_batches, _held_writes or _peer_maps.

    A hot path (every send of a request in peer mode): counted in this thread's
    tally; a failure is exported soon.
    """
    if _counting:
        if series not in _KV_STAGING_SERIES:
            raise KeyError(f"not a KV staging series: {series}")
        try:
            tally = _local.tally
        except AttributeError:
            tally = _new_tally()
        key = (series, label)
        tally.kv[key] = tally.kv.get(key, 0) + 1
        if label == "failed":
            _wake.set()


def count_agreement_failure() -> None:
    _add("owner_agreement_failures")


def count_cross_host_peer() -> None:
    """A decode session on another host, met once per session."""
    _add("nvlink_cross_host_peers")


def count_pairing_refused() -> None:
    _add("pd_pairings_refused")


def count_retraction_abort(reason: str) -> None:
    """A request a retraction aborted (rare: once per aborted request)."""
    _add("retraction_aborts", reason)


def launch_guard_verdict(rule: Optional[str]) -> None:
    """The launch guard's verdict that reached this process with the server's
    arguments: the rule that changed them, or None when no rule applied.

    Called by the schedulers, not by the launcher where the guard runs: the
    launcher's values never reach /metrics, and every scheduler receives the
    verdict with its arguments.
    """
    if _counting:
        with _lock:
            _gauges["launch_guard_active"][NO_GUARD_RULE if rule is None else str(rule)] = 1
        _wake.set()


def launcher_patches(applied: int, owed: int) -> None:
    """The launcher's patch count as it reached this process with the server's
    arguments (published by the schedulers, like the launch guard's verdict)."""
    if _counting:
        with _lock:
            _gauges["patches_applied"]["launcher"] = applied
            _gauges["patches_owed"]["launcher"] = owed
        _wake.set()


def role_verified(role: str, applied: int, owed: int) -> None:
    """A process of ``role`` verified ``applied`` of the ``owed`` patches."""
    if _counting:
        with _lock:
            _gauges["patches_applied"][role] = applied
            _gauges["patches_owed"][role] = owed
        _add("processes_verified", role)


def totals() -> Dict[str, Dict[str, float]]:
    """This process's counts so far, per series and label ("" for none)."""
    with _lock:
        tallies = list(_tallies)
        route_counts = list(_route_counts)
        out = {name: dict(per) for name, per in _shared.items()}
    for counts in route_counts:
        into = out["owner_routes"]
        for route, value in dict(counts).items():
            if value:
                label = getattr(route, "value", route)
                into[label] = into.get(label, 0) + value
    for tally in tallies:
        for (name, label), value in dict(tally.kv).items():
            into = out[name]
            into[label] = into.get(label, 0) + value
        for name, per in (("side_channel_blocks", dict(tally.sc_blocks)),
                          ("side_channel_bytes", dict(tally.sc_bytes)),
                          ("owner_agreement_rounds", {"": tally.rounds}),
                          ("owner_encodes_saved", {"": tally.saved})):
            into = out[name]
            for label, value in per.items():
                if value:
                    label = getattr(label, "value", label)  # a str enum member: its value
                    into[label] = into.get(label, 0) + value
    return out


# --------------------------------------------------------------------------
# Decision and export


def configure(enabled: bool, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Decide for this process whether the series are exported; returns the decision.

    ``enabled`` is the server's ``--enable-metrics``. On also needs sglang's
    multiprocess directory (set by its launcher when metrics are on); without
    it nothing would reach ``/metrics``, so the series stay off with a warning.
    The first decision of a process stands.
    """
    global _counting, _decided
    if _decided is not None:
        return _decided
    environ = os.environ if environ is None else environ
    if enabled and not environ.get(MULTIPROC_DIR_ENV):
        logger.warning(
            "[sglang-dsv41] --enable-metrics is on but %s is not set in this process "
            "(pid %d); the plugin's series are not exported from it",
            MULTIPROC_DIR_ENV, os.getpid(),
        )
        enabled = False
    if enabled:
        enabled = _create_metrics()
    with _lock:
        _decided = enabled
        _counting = enabled
        if not enabled:
            for per in _shared.values():
                per.clear()
            for per in _gauges.values():
                per.clear()
            _tallies.clear()
            _route_counts.clear()
    if enabled:
        _start_flusher()
        flush()
    return enabled


def _create_metrics() -> bool:
    from prometheus_client import Counter, Gauge, values

    if not getattr(values.ValueClass, "_multiprocess", False):
        logger.warning(
            "[sglang-dsv41] prometheus_client was imported in pid %d before %s was set; "
            "its values stay in this process, so the plugin's series are not exported from it",
            os.getpid(), MULTIPROC_DIR_ENV,
        )
        return False
    for series in SERIES:
        labels = (series.label,) if series.label else ()
        name = PREFIX + series.name
        if series.kind == "counter":
            metric = Counter(name, series.help, labels, registry=None)
        else:
            # Every process of a role reports the same numbers: show one, not the sum.
            metric = Gauge(name, series.help, labels, registry=None, multiprocess_mode="max")
        _metrics[series.name] = metric
    return True


def _child(series: str, label: str):
    metric = _metrics[series]
    return metric.labels(label) if BY_NAME[series].label else metric


def flush() -> None:
    """Copy this process's counts into prometheus_client (no-op unless on)."""
    if not _decided:
        return
    with _lock:
        gauges = [(name, label, value) for name, per in _gauges.items() for label, value in per.items()]
    for name, per in totals().items():
        for label, value in per.items():
            key = (name, label)
            delta = value - _exported.get(key, 0)
            if delta:
                _child(name, label).inc(delta)
                _exported[key] = value
    for name, label, value in gauges:
        _child(name, label).set(value)


def _flush_loop() -> None:
    while True:
        _wake.wait(FLUSH_INTERVAL_S)
        _wake.clear()
        try:
            flush()
        except Exception:  # the export must never take a process down
            logger.exception("[sglang-dsv41] exporting the plugin's metrics failed")


def _start_flusher() -> None:
    global _flusher
    if _flusher is not None and _flusher.is_alive():
        return
    _flusher = threading.Thread(target=_flush_loop, name="sglang-dsv41-metrics", daemon=True)
    _flusher.start()


def _after_fork_in_child() -> None:
    """A forked child starts from what its parent already counted (the parent exports
    that) and needs a flusher of its own (threads do not survive a fork)."""
    global _flusher, _lock
    _lock = threading.Lock()
    _flusher = None
    for name, per in totals().items():
        for label, value in per.items():
            _exported[(name, label)] = value
    if _decided:
        _start_flusher()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(flush)


def render_markdown() -> str:
    """docs/METRICS.md, from ``SERIES`` (a test keeps the file equal to this)."""
    lines = [
        "# Plugin metrics",
        "",
        "<!-- Generated: PYTHONPATH=python python -m sglang_dsv41.metrics "
        "> docs/METRICS.md -->",
        "",
        "With `--enable-metrics` (the shipped topologies turn it on) every process of a",
        "server exports these series through sglang's own `/metrics`, next to sglang's",
        "`sglang:*` series. Counters are summed over the server's processes (ranks);",
        "gauges show the largest value any process reported (the processes of one role",
        "all report the same). Without `--enable-metrics` nothing is exported and the",
        "counting calls return at once.",
        "",
        "The launcher process is the exception: sglang 0.5.23 imports `prometheus_client`",
        "there before it sets the multiprocess directory, so nothing it exports reaches",
        "`/metrics` (the plugin logs one warning saying so). The launch guard's verdict",
        "and the launcher's patch count travel to the schedulers with the server's",
        "arguments and are published from there (`role=\"launcher\"` of the patch series,",
        "`sglang_dsv41_launch_guard_active`), counted when the launcher resolved them.",
        "",
        "`sglang-dsv41 smoke` reads `sglang_dsv41_patches_applied`,",
        "`sglang_dsv41_patches_owed` and `sglang_dsv41_launch_guard_active` to tell that the",
        "plugin is active in the schedulers and in the launcher.",
        "",
        "| series | type | label | meaning |",
        "|---|---|---|---|",
    ]
    for series in SERIES:
        label = f"`{series.label}`: {series.label_values}" if series.label else ""
        lines.append(f"| `{series.exported_name}` | {series.kind} | {label} | {series.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
