"""Judge each check from what its sides measured: pure functions of plain data.

A side is a dict: ``label``; ``error`` (why it could not be measured, or None);
``prompts`` (``client.measure_*`` results); ``procs``, each with ``name``,
``argv``, ``plugin``, ``log`` (the text) and ``metrics`` (the /metrics text or
None). A result is ``{"check", "status": pass|fail|skip, "detail", "figures"}``.
"""

from __future__ import annotations

import re
import statistics

from sglang_dsv41.cp_bcg.setting import (ACCEPTANCE_TOLERANCE, acceptance_holds,
                                         dspark_verification_value)
from sglang_dsv41.metrics import PREFIX
from sglang_dsv41.tools.smoke import MetricsError, launch_guard_rules, plugin_status
from sglang_dsv41.tools.verify.client import metric_values
from sglang_dsv41.tools.verify.plan import GRAPH_LINE

STATUS_LINE = re.compile(r"\[sglang-dsv41\] role=(?P<role>\w+) pid=(?P<pid>\d+) "
                         r"patches applied=(?P<applied>\d+)/(?P<owed>\d+) owed")
# Roles every plugin server has; tokenizer workers and DP controllers come with their flags.
REQUIRED_ROLES = ("launcher", "scheduler", "detokenizer")


def result(check: str, status: str, detail: str, **figures) -> dict:
    return {"check": check, "status": status, "detail": detail, "figures": figures}


def status_lines(log: str) -> list[dict]:
    return [{"role": m["role"], "pid": int(m["pid"]), "applied": int(m["applied"]),
             "owed": int(m["owed"])} for m in STATUS_LINE.finditer(log)]


def compare_tokens(a: list, b: list) -> list[str]:
    """One line per prompt whose greedy output differs between the two sides."""
    mismatches = []
    for pa, pb in zip(a, b):
        ta, tb = pa.get("output_ids"), pb.get("output_ids")
        if not isinstance(ta, list) or not isinstance(tb, list):  # nothing to compare is no match
            mismatches.append(f"{pa['prompt']}: no output token ids to compare")
            continue
        if ta == tb:
            continue
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        mismatches.append(f"{pa['prompt']}: tokens differ from position {first} "
                          f"({len(ta)} vs {len(tb)} tokens)")
    if len(a) != len(b):
        mismatches.append(f"{len(a)} answers against {len(b)}")
    return mismatches


def acceptance_length(prompts: list) -> float | None:
    """Tokens per verify step over every prompt; None without speculative decoding."""
    steps = [p.get("spec_verify_ct") for p in prompts]
    if not prompts or not all(type(s) is int and s > 0 for s in steps):
        return None
    tokens = [p.get("completion_tokens") for p in prompts]
    if not all(type(t) is int for t in tokens):
        return None
    return sum(tokens) / sum(steps)


def median_of(prompts: list, key: str) -> float | None:
    values = [p[key] for p in prompts if isinstance(p.get(key), (int, float))]
    return statistics.median(values) if values else None


def _side_error(check: str, *sides) -> dict | None:
    for side in sides:
        if side.get("error"):
            return result(check, "fail", f"{side['label']}: {side['error']}")
    return None


def _tokens_detail(a: dict, b: dict, mismatches: list) -> str:
    if mismatches:
        return f"greedy tokens differ between {a['label']} and {b['label']}: " + "; ".join(mismatches)
    return f"greedy tokens equal on {len(a['prompts'])} prompts ({a['label']} vs {b['label']})"


def _metric_total(proc: dict, series: str, labels: str | None = None) -> float:
    values = metric_values(proc.get("metrics"), PREFIX + series)
    return sum(v for k, v in values.items() if labels is None or k == labels)


def evaluate_status(plugin: dict, owed: dict) -> dict:
    """``owed``: {role: patches the installed plugin owes it}."""
    error = _side_error("status", plugin)
    if error:
        return error
    problems, figures = [], {}
    for proc in (p for p in plugin["procs"] if p["plugin"]):
        lines = status_lines(proc["log"])
        roles = sorted({line["role"] for line in lines})
        missing = [r for r in REQUIRED_ROLES if r not in roles]
        short = [f"{line['role']} pid {line['pid']} {line['applied']}/{line['owed']}" for line in lines
                 if line["applied"] != line["owed"] or line["owed"] != owed.get(line["role"], -1)]
        if missing:
            problems.append(f"{proc['name']}: no status line of {', '.join(missing)}")
        if short:
            problems.append(f"{proc['name']}: patches missing ({', '.join(short)})")
        text = proc.get("metrics")
        if text is None:
            problems.append(f"{proc['name']}: no /metrics")
            continue
        try:
            counts = plugin_status(text)
        except MetricsError as exc:
            problems.append(f"{proc['name']}: /metrics: {exc}")
            continue
        guard = launch_guard_rules(text)
        for role in ("scheduler", "launcher"):
            applied, owed_here = counts.get(role, (0, 0))
            if role not in counts or applied != owed_here or owed_here != owed.get(role):
                problems.append(f"{proc['name']}: /metrics has no full patch count of the {role}")
        if not guard:
            problems.append(f"{proc['name']}: /metrics has no launch guard verdict")
        figures[proc["name"]] = {"status_lines": {r: sum(1 for line in lines if line["role"] == r)
                                                  for r in roles},
                                 "metrics_roles": {r: list(c) for r, c in sorted(counts.items())},
                                 "launch_guard": guard}
    if problems:
        return result("status", "fail", "; ".join(problems), **figures)
    lines = ", ".join(f"{r}x{n}" for f in figures.values() for r, n in f["status_lines"].items())
    return result("status", "pass", f"status lines {lines}, every owed patch applied; /metrics "
                  "carries the plugin's counts and the launch guard's verdict", **figures)


def evaluate_stock(plugin: dict, stock: dict) -> dict:
    error = _side_error("stock", plugin, stock)
    if error:
        return error
    mismatches = compare_tokens(plugin["prompts"], stock["prompts"])
    leaked = [p["name"] for p in stock["procs"] if status_lines(p["log"] or "")]
    if leaked:
        mismatches.append(f"the stock side logged plugin status lines ({', '.join(leaked)}): "
                          "it was not stock")
    return result("stock", "fail" if mismatches else "pass", _tokens_detail(plugin, stock, mismatches),
                  mismatches=mismatches)


def evaluate_tokens_only(check: str, a: dict, b: dict) -> dict:
    error = _side_error(check, a, b)
    if error:
        return error
    mismatches = compare_tokens(a["prompts"], b["prompts"])
    return result(check, "fail" if mismatches else "pass", _tokens_detail(a, b, mismatches),
                  mismatches=mismatches,
                  latency_s={s["label"]: median_of(s["prompts"], "latency_s") for s in (a, b)})


def evaluate_owner_broadcast(on: dict, off: dict) -> dict:
    verdict = evaluate_tokens_only("owner_broadcast", on, off)
    if on.get("error") or off.get("error"):
        return verdict
    saved_on = sum(_metric_total(p, "owner_encodes_saved_total") for p in on["procs"])
    saved_off = sum(_metric_total(p, "owner_encodes_saved_total") for p in off["procs"])
    routes = {k: v for p in on["procs"]
              for k, v in metric_values(p.get("metrics"), PREFIX + "owner_routes_total").items()}
    verdict["figures"].update(encodes_saved={on["label"]: saved_on, off["label"]: saved_off},
                              routes=routes)
    problems = []
    if saved_on <= 0:
        problems.append(f"{on['label']}: no image was taken from a peer's broadcast "
                        "(sglang_dsv41_owner_encodes_saved_total is 0): every rank encoded every image")
    if saved_off > 0:
        problems.append(f"{off['label']}: encodes were saved with the broadcast off")
    if problems:
        verdict["status"] = "fail"
        verdict["detail"] += "; " + "; ".join(problems)
    else:
        verdict["detail"] += f"; {saved_on:g} image encodes saved by the broadcast"
    return verdict


def evaluate_pd(peer: dict, direct: dict) -> dict:
    verdict = evaluate_tokens_only("pd_peer_writes", peer, direct)
    if peer.get("error") or direct.get("error"):
        return verdict
    batches = {s["label"]: {k: v for p in s["procs"] for k, v in
                            metric_values(p.get("metrics"), PREFIX + "kv_staging_batches_total").items()}
               for s in (peer, direct)}
    written = batches[peer["label"]].get('{path="peer_pages"}', 0)
    failed = batches[peer["label"]].get('{path="failed"}', 0)
    verdict["figures"]["kv_staging_batches"] = batches
    problems = []
    if written <= 0:
        problems.append(f"{peer['label']}: no transfer batch went as a peer write")
    if failed:
        problems.append(f"{peer['label']}: {failed:g} peer writes failed")
    if problems:
        verdict["status"] = "fail"
        verdict["detail"] += "; " + "; ".join(problems)
    else:
        verdict["detail"] += f"; {written:g} batches as peer writes"
    return verdict


def evaluate_cp_bcg(eager: dict, graph: dict, release: str) -> dict:
    """Greedy tokens equal, with DSpark the graph's acceptance length at most the tolerance
    below eager's, the graph captured on the opt-in side only; the TTFT ratio as a figure.
    A passing DSpark comparison yields the value the launch guard reads."""
    error = _side_error("cp_bcg", eager, graph)
    if error:
        return error
    mismatches = compare_tokens(eager["prompts"], graph["prompts"])
    problems = list(mismatches)
    # Servers started elsewhere (--urls) come without logs.
    if any(GRAPH_LINE in (p["log"] or "") for p in eager["procs"]):
        problems.append(f"{eager['label']} captured a CP breakable graph")
    if not all(GRAPH_LINE in p["log"] for p in graph["procs"] if p["log"] is not None):
        problems.append(f"{graph['label']} did not log '{GRAPH_LINE}'")
    ttft_eager, ttft_graph = median_of(eager["prompts"], "ttft_s"), median_of(graph["prompts"], "ttft_s")
    ratio = ttft_graph / ttft_eager if ttft_eager and ttft_graph else None
    accept_eager, accept_graph = acceptance_length(eager["prompts"]), acceptance_length(graph["prompts"])
    verified = None
    if accept_eager is None and accept_graph is None:
        accept_note = "acceptance length not measured (no speculative decoding)"
    elif accept_eager is None or accept_graph is None:
        accept_note = "only one server reports speculative decoding"
        problems.append(accept_note)
    else:
        holds = acceptance_holds(accept_eager, accept_graph)
        accept_note = (f"acceptance length eager {accept_eager:.3f}, graph {accept_graph:.3f} "
                       f"({'within' if holds else 'more than'} {ACCEPTANCE_TOLERANCE:.0%} below)")
        if not holds:
            problems.append(accept_note)
        elif not problems:
            verified = dspark_verification_value(release, accept_eager, accept_graph)
    detail = _tokens_detail(eager, graph, mismatches) + f"; {accept_note}"
    if ratio is not None:
        detail += f"; median TTFT ratio (graph / eager) {ratio:.3f}"
    extra = [p for p in problems if p not in mismatches and p != accept_note]
    if extra:
        detail += "; " + "; ".join(extra)
    return result("cp_bcg", "fail" if problems else "pass", detail, mismatches=mismatches,
                  ttft_s={"eager": ttft_eager, "graph": ttft_graph}, ttft_ratio=ratio,
                  acceptance={"eager": accept_eager, "graph": accept_graph,
                              "tolerance": ACCEPTANCE_TOLERANCE},
                  dspark_verified=verified)


def evaluate_launch_guards(sides: list) -> dict:
    """The verdict of every DSpark plugin server that ran, as its schedulers published it."""
    verdicts, problems = {}, []
    for side in sides:
        for proc in side["procs"]:
            if not (proc["plugin"] and "DSPARK" in proc["argv"]):
                continue
            if proc.get("metrics") is None:
                problems.append(f"{proc['name']}: no /metrics")
                continue
            rules = launch_guard_rules(proc["metrics"])
            verdicts[proc["name"]] = rules
            if not rules:
                problems.append(f"{proc['name']}: no launch guard verdict")
    if not verdicts and not problems:
        return result("launch_guards", "skip", "no DSpark server ran among the selected checks "
                      "(cp_bcg and pd_peer_writes start them)")
    if problems:
        return result("launch_guards", "fail", "; ".join(problems), verdicts=verdicts)
    shown = "; ".join(f"{name}: {', '.join(rules)}" for name, rules in verdicts.items())
    return result("launch_guards", "pass", f"resolved replay verdicts: {shown}", verdicts=verdicts)
