"""The ``verify`` command line: input checks, the run, the table and the JSON report.

Exit 0 only when every selected check passed; 1 when one failed or could not
run here (skipped, with its reason); 2 for bad input (one line); 130 when
interrupted (every server started is stopped first).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from sglang_dsv41.plugin.spec import Role
from sglang_dsv41.plugin.table import owed_to
from sglang_dsv41.tools.verify import client, evaluate
from sglang_dsv41.tools.verify.plan import (CLAIMS, CPU_FEATURES, FEATURES, PORT_SPAN, Check,
                                            Options, Plan, build_plan, ports_used)
from sglang_dsv41.tools.verify.servers import ServerFailed, Started, progress, stop_all

REPORT_NAME = "verify-report.json"
URL_FEATURES = ("stock", "vision_cp", "owner_broadcast", "cp_bcg")


class BadInput(ValueError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", help="the model folder (with config.json) every server loads")
    parser.add_argument("--gpus", help="GPU indices to use, e.g. 0-7 or 0,1,2,3 (default: every GPU)")
    parser.add_argument("--features", help="comma-separated checks (default: all; on --device cpu: "
                        f"{','.join(CPU_FEATURES)}): {', '.join(FEATURES)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: CPU servers (sglang's CPU engine); the GPU checks are skipped")
    parser.add_argument("--out", default="sglang-dsv41-verify",
                        help=f"folder for {REPORT_NAME} and the server logs (default ./sglang-dsv41-verify)")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the servers and requests it would run, start nothing")
    parser.add_argument("--port", default="31000",
                        help=f"first of the {PORT_SPAN} ports on 127.0.0.1 it uses (default 31000)")
    parser.add_argument("--extra-args", default="",
                        help="more `sglang serve` arguments for every server (one shell-quoted string)")
    parser.add_argument("--prompt-words", default=" ".join(map(str, client.DEFAULT_WORDS)),
                        help="text prompt lengths in words (default '40 300 1200 3000 6000')")
    parser.add_argument("--max-new-tokens", default="32", help="greedy tokens per prompt (default 32)")
    parser.add_argument("--repeats", default="3", help="timed requests per prompt for TTFT (default 3)")
    parser.add_argument("--wait-s", default="2400", help="seconds a server may take to start (default 2400)")
    parser.add_argument("--timeout", default="600", help="seconds one request may take (default 600)")
    parser.add_argument("--urls", nargs=2, metavar=("URL_A", "URL_B"),
                        help="compare two servers started by hand instead (one of "
                        f"{', '.join(URL_FEATURES)}; A is the plugin's path, B the reference)")
    # Test aid: side B of every pair serves this model, so a test can make the sides differ.
    parser.add_argument("--reference-model-path", help=argparse.SUPPRESS)


# Flags verify gives each server itself (plan.server_command): --extra-args may not repeat them.
OWNED_FLAGS = frozenset(("--model-path", "--host", "--port", "--nccl-port", "--engine-info-bootstrap-port",
                         "--random-seed", "--device", "--disaggregation-mode", "--disaggregation-bootstrap-port"))
MAX_NUMBER = 10 ** 7  # above any timeout, word count or wait this tool means


def _positive_int(name: str, text: str, low: int = 1) -> int:
    if not (text.isascii() and text.isdigit()) or not low <= int(text) <= MAX_NUMBER:
        raise BadInput(f"{name} must be an integer from {low} to {MAX_NUMBER}, got {text!r}")
    return int(text)


def _model_dir(flag: str, path: str | None) -> str:
    if not path:
        raise BadInput(f"{flag} is required")
    if not Path(path).is_dir():
        raise BadInput(f"{flag} {path!r} is not a directory")
    if not (Path(path) / "config.json").is_file():
        raise BadInput(f"{flag} {path!r} has no config.json (not a model folder)")
    return str(Path(path).resolve())


MAX_GPU_INDEX = 1024


def _parse_gpus(text: str) -> tuple:
    gpus = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not (low.isascii() and low.isdigit()) or (dash and not (high.isascii() and high.isdigit())):
            raise BadInput(f"--gpus {text!r}: expected indices like 0-7 or 0,1,2,3")
        if int(high if dash else low) >= MAX_GPU_INDEX:
            raise BadInput(f"--gpus {text!r}: no node has a GPU index of {MAX_GPU_INDEX} or more")
        gpus.extend(range(int(low), int(high) + 1) if dash else [int(low)])
    if not gpus or len(set(gpus)) != len(gpus):
        raise BadInput(f"--gpus {text!r}: empty or repeated indices")
    return tuple(gpus)


def node_gpus() -> list[str]:
    """GPU names by index, from nvidia-smi; empty without a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def _features(text: str | None, device: str) -> list:
    if not text:
        return list(CPU_FEATURES if device == "cpu" else FEATURES)
    chosen = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FEATURES]
    if unknown or not chosen:
        raise BadInput(f"--features: unknown {', '.join(unknown) or '(none given)'}; known: "
                       f"{', '.join(FEATURES)}")
    return chosen


def _port_busy(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _sglang_command() -> str:
    beside = Path(sys.executable).with_name("sglang")
    return str(beside) if beside.exists() else shutil.which("sglang") or ""


def settings(args) -> tuple:
    """(features, Options, run numbers, GPU names) from the arguments, or BadInput."""
    features = _features(args.features, args.device)
    port = _positive_int("--port", args.port)
    if port + PORT_SPAN - 1 > 65535:
        raise BadInput(f"--port {port}: the {PORT_SPAN} ports from it must end by 65535")
    words = args.prompt_words.split()
    if not words:
        raise BadInput("--prompt-words is empty")
    numbers = {"words": tuple(_positive_int("--prompt-words", w) for w in words),
               "max_new_tokens": _positive_int("--max-new-tokens", args.max_new_tokens),
               "repeats": _positive_int("--repeats", args.repeats, 0),
               "wait_s": _positive_int("--wait-s", args.wait_s),
               "timeout": _positive_int("--timeout", args.timeout)}
    try:
        extra = tuple(shlex.split(args.extra_args))
    except ValueError as exc:
        raise BadInput(f"--extra-args: {exc}") from None
    owned = sorted({a.split("=", 1)[0] for a in extra} & OWNED_FLAGS)
    if owned:  # sglang takes the last of a repeated flag: the server would not be the one verify checks
        raise BadInput(f"--extra-args sets {', '.join(owned)}, which verify sets itself for each server; "
                       "use verify's own options (--model-path, --port, --gpus, --device)")
    if args.urls:
        if len(features) != 1 or features[0] not in URL_FEATURES:
            raise BadInput(f"--urls compares one of {', '.join(URL_FEATURES)}: give exactly one "
                           "with --features")
        for url in args.urls:
            if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
                raise BadInput(f"--urls: {url!r} is not an http(s) URL")
        if args.urls[0].rstrip("/") == args.urls[1].rstrip("/"):
            raise BadInput("--urls: A and B are the same server; a comparison needs two")
        return features, None, numbers, []
    model = _model_dir("--model-path", args.model_path)
    reference = (_model_dir("--reference-model-path", args.reference_model_path)
                 if args.reference_model_path else None)
    names = [] if args.device == "cpu" else node_gpus()
    if args.device == "cpu":
        if args.gpus:
            raise BadInput("--gpus does not go with --device cpu")
        gpus = ()
    elif args.gpus:
        gpus = _parse_gpus(args.gpus)
        if not args.dry_run:
            if not names:
                raise BadInput("no GPU visible (nvidia-smi lists none); --device cpu runs the CPU checks")
            missing = [g for g in gpus if g >= len(names)]
            if missing:
                raise BadInput(f"--gpus: no GPU {', '.join(map(str, missing))} on this node "
                               f"({len(names)} visible)")
    elif names:
        gpus = tuple(range(len(names)))
    else:
        raise BadInput("no GPU visible (nvidia-smi lists none); --device cpu runs the CPU checks")
    sglang = _sglang_command()
    if not sglang and not args.dry_run:
        raise BadInput("the `sglang` command is not on PATH")
    opts = Options(model, gpus, args.device, port, extra, reference, sglang or "sglang", sys.executable)
    return features, opts, numbers, names


def _versions() -> dict:
    found = {"python": platform.python_version()}
    for dist in ("sglang-dsv41", "sglang", "sglang-router", "torch", "mooncake-transfer-engine"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def _owed() -> dict:
    return {role.value: len(owed_to(role)) for role in Role}


# --------------------------------------------------------------------------
# Running


def _measure(side, pair, numbers, log_dir: Path) -> dict:
    measured = {"label": side.label, "url": side.url, "error": None, "prompts": [], "procs": []}
    started = []
    try:
        for proc in side.procs:
            progress(f"starting {proc.name}: {shlex.join(proc.argv)}")
            started.append(Started(proc, log_dir).start())
            started[-1].wait_healthy(numbers["wait_s"])
        progress(f"sending the prompts to {side.label}")
        if pair.images:
            measured["prompts"] = client.measure_images(side.url, numbers["max_new_tokens"],
                                                        numbers["timeout"])
        else:
            measured["prompts"] = client.measure_text(side.url, numbers["words"],
                                                      numbers["max_new_tokens"], numbers["repeats"],
                                                      numbers["timeout"])
        time.sleep(2)  # the plugin exports its counts once a second
    except (ServerFailed, client.RequestError) as exc:
        measured["error"] = str(exc)
    finally:
        for one in started:
            metrics = (client.fetch_metrics(f"http://127.0.0.1:{one.proc.port}", min(60, numbers["timeout"]))
                       if one.proc.metrics and one.popen.poll() is None else None)
            measured["procs"].append({"name": one.proc.name, "argv": one.proc.argv,
                                      "env": one.proc.env, "plugin": one.proc.plugin,
                                      "log_path": str(one.log_path), "metrics": metrics,
                                      "healthy_after_s": one.healthy_after_s})
        for one in reversed(started):
            one.stop()
        for one, record in zip(started, measured["procs"]):
            record["log"] = one.log()
        progress(f"stopped {side.label}")
    return measured


def _url_side(label: str, url: str, numbers, images: bool) -> dict:
    url = url.rstrip("/")
    measured = {"label": label, "url": url, "error": None, "prompts": [], "procs": []}
    try:
        measured["prompts"] = (client.measure_images(url, numbers["max_new_tokens"], numbers["timeout"])
                               if images else
                               client.measure_text(url, numbers["words"], numbers["max_new_tokens"],
                                                   numbers["repeats"], numbers["timeout"]))
    except client.RequestError as exc:
        measured["error"] = str(exc)
    return measured


def judge(plan: Plan, measured: dict, release: str | None) -> list[dict]:
    """One result per check, from the measured sides of each pair."""
    results = []
    for check in plan.checks:
        if check.skip:
            results.append(evaluate.result(check.name, "skip", check.skip))
            continue
        sides = measured.get(check.pair, [])
        if check.name == "status":
            results.append(evaluate.evaluate_status(sides[0], _owed()))
        elif check.name == "stock":
            results.append(evaluate.evaluate_stock(*sides))
        elif check.name == "owner_broadcast":
            results.append(evaluate.evaluate_owner_broadcast(*sides))
        elif check.name == "pd_peer_writes":
            results.append(evaluate.evaluate_pd(*sides))
        elif check.name == "cp_bcg":
            results.append(evaluate.evaluate_cp_bcg(*sides, release or "unknown"))
        elif check.name == "launch_guards":
            results.append(evaluate.evaluate_launch_guards([s for ss in measured.values() for s in ss]))
        else:
            results.append(evaluate.evaluate_tokens_only(check.name, *sides))
    return results


def _table(results: list) -> str:
    width = max(len(r["check"]) for r in results)
    lines = [f"{'check':<{width}}  result  detail"]
    lines += [f"{r['check']:<{width}}  {r['status'].upper():<6}  {r['detail']}" for r in results]
    return "\n".join(lines)


def _dry_run(plan: Plan, numbers) -> str:
    out = []
    for check in plan.checks:
        where = check.pair or "(reads the others)"
        state = f"skipped: {check.skip}" if check.skip else f"runs on pair {where}"
        out.append(f"check {check.name}: {state}\n    proves: {CLAIMS[check.name]}")
    for pair in plan.pairs:
        out.append(f"pair {pair.name} (one side at a time, on the same GPUs):")
        for side in pair.sides:
            out.append(f"  side {side.label}, prompts to {side.url}:")
            for proc in side.procs:
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in proc.env.items())
                out.append(f"    {proc.name}: {env + ' ' if env else ''}{shlex.join(proc.argv)}")
        prompts = client.describe_prompts(numbers["words"], pair.images)
        how = ("POST /v1/chat/completions, temperature 0, return_token_ids" if pair.images else
               f"POST /generate, temperature 0, then {numbers['repeats']} streamed one-token requests "
               "for TTFT")
        out.append(f"  requests to each side ({how}, {numbers['max_new_tokens']} new tokens): "
                   + "; ".join(prompts))
        out.append("  then GET /metrics of every server, and the status lines of its log")
    return "\n".join(out)


def main(args) -> int:
    try:
        features, opts, numbers, gpu_names = settings(args)
        plan = build_plan(features, opts) if opts else None
        if plan and not args.dry_run:
            busy = [p for p in ports_used(plan) if _port_busy(p)]
            if busy:
                raise BadInput(f"port {busy[0]} on 127.0.0.1 is busy (--port picks the first of "
                               f"{PORT_SPAN})")
    except BadInput as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        if plan is None:
            print(f"compare {args.urls[0]} (A) with {args.urls[1]} (B) on check {features[0]}")
        else:
            print(_dry_run(plan, numbers))
        return 0
    out = Path(args.out)
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"verify: --out {args.out!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    versions = _versions()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    measured: dict = {}
    try:
        if plan is None:
            images = features[0] in ("vision_cp", "owner_broadcast")
            plan = Plan([Check(features[0], None, "urls")])
            measured["urls"] = [_url_side("A", args.urls[0], numbers, images),
                                _url_side("B", args.urls[1], numbers, images)]
            for side, url in zip(measured["urls"], args.urls):
                side["procs"] = [{"name": side["label"], "argv": [], "env": {}, "plugin": True,
                                  "log": None, "metrics": client.fetch_metrics(url.rstrip("/"), min(60, numbers["timeout"]))}]
        else:
            for pair in plan.pairs:
                progress(f"pair {pair.name}")
                measured[pair.name] = [_measure(side, pair, numbers, out / "logs") for side in pair.sides]
    except KeyboardInterrupt:
        started = stop_all()
        print(f"verify: interrupted; every server it started is stopped ({started} in all)",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    results = judge(plan, measured, versions.get("sglang"))
    ok = all(r["status"] == "pass" for r in results)
    verified = next((r["figures"].get("dspark_verified") for r in results
                     if r["check"] == "cp_bcg" and r["figures"].get("dspark_verified")), None)
    report = {"tool": "sglang-dsv41", "command": "verify", "ok": ok, "argv": sys.argv,
              "versions": versions, "device": args.device, "gpus": gpu_names,
              "gpus_used": list(opts.gpus) if opts else [], "model_path": opts.model_path if opts else None,
              "checks": results, "dspark_verified": verified,
              "sides": {pair: [_side_record(s) for s in sides] for pair, sides in measured.items()}}
    report_path = out / REPORT_NAME
    try:
        report_path.write_text(json.dumps(report, indent=1))
    except OSError as exc:  # the figures are still printed below
        print(f"verify: cannot write the report {report_path}: {exc.strerror or exc}", file=sys.stderr)
        report_path = None
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(_table(results))
        counts = {s: sum(r["status"] == s for r in results) for s in ("pass", "fail", "skip")}
        print(f"verify: {'PASSED' if ok else 'NOT PASSED'} ({counts['pass']} passed, {counts['fail']} "
              f"failed, {counts['skip']} skipped); " + (f"report {report_path}" if report_path else "no report"))
        if verified:
            from sglang_dsv41.cp_bcg.setting import DSPARK_VERIFIED_ENV

            print(f"{DSPARK_VERIFIED_ENV}={verified}")
    return 0 if ok else 1


def _side_record(side: dict) -> dict:
    """What the report keeps of a side: commands, start-up times, answers; not the logs."""
    return {"label": side["label"], "url": side["url"], "error": side["error"],
            "prompts": side["prompts"],
            "servers": [{k: p.get(k) for k in ("name", "argv", "env", "log_path", "healthy_after_s")}
                        for p in side["procs"]]}


def _interrupt(signum, frame):
    raise KeyboardInterrupt
