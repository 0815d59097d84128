"""What a verify run starts: the checks, the server pairs they need, the reasons one is skipped.

Plain data and pure functions (no process is started here), so ``--dry-run``
and the unit tests see exactly what a real run would start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sglang_dsv41.cp_bcg.setting import CP_BCG_ENV, DSPARK_VERIFIED_ENV, MEASURING
from sglang_dsv41.mooncake_nvlink.kv_staging.setting import STAGING_ENV
from sglang_dsv41.owner_broadcast.routing import ENV_MODE as OWNER_BROADCAST_ENV

# What each check proves, in the order they run.
CLAIMS = {
    "status": "every role of a plugin server logs its status line with every owed patch applied, "
              "and /metrics carries the plugin's series and the launch guard's verdict",
    "stock": "the plugin's server and stock sglang give the same greedy tokens",
    "vision_cp": "image prompts under prefill CP give the same greedy tokens as without CP",
    "owner_broadcast": "owner broadcast on against off: same greedy tokens, images encoded once "
                       "per group (encodes saved in /metrics)",
    "pd_peer_writes": "a prefill/decode pair with KV peer writes gives the same greedy tokens as "
                      "the direct path, and the peer path carried the KV",
    "cp_bcg": "the CP breakable prefill graph gives eager's greedy tokens and, with DSpark, its "
              "draft acceptance length",
    "launch_guards": "every DSpark server published the launch guard's resolved replay verdict",
}
FEATURES = tuple(CLAIMS)
# What means something on a CPU server (the default there).
CPU_FEATURES = ("status", "stock")
GPU_FEATURES = ("vision_cp", "owner_broadcast", "pd_peer_writes", "cp_bcg")
# The shipped DSpark flags (deploy/b300-ds41/cp-dspark.yml and the PD servers).
DSPARK_ARGS = ("--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "5")
CP_ARGS = ("--enable-prefill-cp", "--cp-strategy", "interleave")
# Plugin variables a side sets itself, dropped from the caller's environment.
CONTROLLED_ENV = ("SGLANG_PLUGINS", "SGLANG_HTTP_SERVER_APP_PATH", "SGLANG_DSV41_INNER_APP_PATH",
                  CP_BCG_ENV, DSPARK_VERIFIED_ENV, STAGING_ENV, OWNER_BROADCAST_ENV)
STOCK_PLUGINS = "not_dsv41"  # sglang's plugin filter with a name that is not ours: stock sglang
GRAPH_LINE = "Prefill CP breakable CUDA graph enabled"
# Ports from --port: serve/prefill, decode, router, PD bootstrap, then the NCCL and
# engine-info ports of each sglang process, then the router's metrics.
PORT_SPAN = 9


@dataclass
class Proc:
    """One process of a side: an ``sglang serve`` or sglang's PD router."""
    name: str
    argv: list
    env: dict  # set on top of the caller's environment
    port: int
    plugin: bool  # whether it runs our plugin (status lines, /metrics series)
    metrics: bool = True


@dataclass
class Side:
    label: str
    procs: list
    url: str  # where the prompts go


@dataclass
class Check:
    name: str
    skip: str | None = None  # why it cannot run here
    pair: str | None = None  # the pair whose measurements it reads


@dataclass
class Pair:
    name: str
    sides: list
    images: bool = False  # image prompts instead of text


@dataclass
class Plan:
    checks: list
    pairs: list = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    model_path: str
    gpus: tuple  # GPU indices; empty on the CPU
    device: str  # "cuda" or "cpu"
    port: int
    extra_args: tuple = ()
    reference_model_path: str | None = None  # test aid: side B serves another model
    sglang: str = "sglang"
    python: str = "python3"


def model_has_vision(model_path: str) -> bool | None:
    """Whether the model's config.json describes a vision tower; None without a readable config."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def _serve(name: str, opts: Options, port: int, nccl_port: int, args=(), env=None, *,
           plugin: bool = True, model: str | None = None) -> Proc:
    argv = [opts.sglang, "serve", "--model-path", model or opts.model_path,
            "--host", "127.0.0.1", "--port", str(port), "--nccl-port", str(nccl_port),
            "--engine-info-bootstrap-port", str(nccl_port + 1), "--random-seed", "0",
            "--enable-metrics"]
    if opts.device == "cpu":
        argv += ["--device", "cpu"]
    elif opts.gpus and "--tp" not in args:
        argv += ["--tp", str(len(opts.gpus))]
    full_env = dict(env or {})
    if opts.device == "cpu":
        full_env["SGLANG_USE_CPU_ENGINE"] = "1"  # sglang's own switch for its CPU engine
    else:
        full_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, opts.gpus))
    if not plugin:
        full_env["SGLANG_PLUGINS"] = STOCK_PLUGINS
    return Proc(name, argv + list(args) + list(opts.extra_args), full_env, port, plugin)


def _single(label: str, opts: Options, args=(), env=None, *, plugin=True, reference=False) -> Side:
    model = opts.reference_model_path if reference else None
    proc = _serve(label, opts, opts.port, opts.port + 4, args, env, plugin=plugin, model=model)
    return Side(label, [proc], f"http://127.0.0.1:{opts.port}")


def _pd_side(label: str, opts: Options, staging: str, reference: bool) -> Side:
    """The shipped 1P1D layout on the GPUs given, half each: prefill with CP, decode with
    DP attention, both DSpark, Mooncake between them, sglang's router in front."""
    half = len(opts.gpus) // 2
    model = opts.reference_model_path if reference else None
    env = {STAGING_ENV: staging, "MC_INTRA_NVLINK": "1", "SGLANG_HOST_IP": "127.0.0.1"}
    common = ("--language-model-only", "--disaggregation-transfer-backend", "mooncake", *DSPARK_ARGS)
    prefill_opts = Options(**{**opts.__dict__, "gpus": opts.gpus[:half]})
    decode_opts = Options(**{**opts.__dict__, "gpus": opts.gpus[half:]})
    bootstrap = opts.port + 3
    prefill = _serve(f"{label}-prefill", prefill_opts, opts.port, opts.port + 4,
                     ("--tp", str(half), "--ep-size", str(half), *CP_ARGS, *common,
                      "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                      str(bootstrap)), env, model=model)
    decode = _serve(f"{label}-decode", decode_opts, opts.port + 1, opts.port + 6,
                    ("--tp", str(half), "--ep-size", str(half), "--attn-dp-size", str(half),
                     "--enable-dp-lm-head", *common, "--disaggregation-mode", "decode"),
                    env, model=model)
    router_port = opts.port + 2
    router = Proc(f"{label}-router", [
        opts.python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", f"http://127.0.0.1:{opts.port}", str(bootstrap),
        "--decode", f"http://127.0.0.1:{opts.port + 1}", "--host", "127.0.0.1",
        "--port", str(router_port), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(opts.port + 8)], {}, router_port, plugin=False, metrics=False)
    return Side(label, [prefill, decode, router], f"http://127.0.0.1:{router_port}")


def _skip_reason(feature: str, opts: Options, vision: bool | None) -> str | None:
    if feature in GPU_FEATURES and opts.device == "cpu":
        return "CPU-only run: this check needs GPUs"
    need = {"vision_cp": 2, "owner_broadcast": 2, "cp_bcg": 2, "pd_peer_writes": 2}.get(feature, 0)
    if len(opts.gpus) < need and opts.device != "cpu":
        return f"needs at least {need} GPUs, {len(opts.gpus)} given"
    if feature == "pd_peer_writes" and len(opts.gpus) % 2:
        return f"needs an even number of GPUs (half prefill, half decode), {len(opts.gpus)} given"
    if feature in ("vision_cp", "owner_broadcast") and not vision:
        return ("the model has no vision tower (no vision_config in config.json)" if vision is False
                else "no readable config.json: cannot tell whether the model has a vision tower")
    return None


def build_plan(features: list, opts: Options) -> Plan:
    """The checks in ``FEATURES`` order and the pairs they need, each pair once."""
    vision = model_has_vision(opts.model_path)
    ref = opts.reference_model_path is not None
    plan = Plan([])
    wanted = [f for f in FEATURES if f in features]
    for feature in wanted:
        skip = _skip_reason(feature, opts, vision)
        pair = None if skip or feature == "launch_guards" else feature
        if feature in ("status", "stock"):
            pair = "plugin_stock"
        plan.checks.append(Check(feature, skip, pair))
    needed = {c.pair for c in plan.checks if c.pair}
    if "plugin_stock" in needed:
        sides = [_single("plugin", opts)]
        if "stock" in wanted:
            sides.append(_single("stock", opts, plugin=False, reference=ref))
        plan.pairs.append(Pair("plugin_stock", sides))
    if "vision_cp" in needed:
        plan.pairs.append(Pair("vision_cp", [
            _single("cp", opts, CP_ARGS), _single("no-cp", opts, reference=ref)], images=True))
    if "owner_broadcast" in needed:
        plan.pairs.append(Pair("owner_broadcast", [
            _single("broadcast", opts, CP_ARGS, {OWNER_BROADCAST_ENV: "always"}),
            _single("no-broadcast", opts, CP_ARGS, {OWNER_BROADCAST_ENV: "0"}, reference=ref),
        ], images=True))
    if "pd_peer_writes" in needed:
        plan.pairs.append(Pair("pd_peer_writes", [
            _pd_side("peer", opts, "peer", False), _pd_side("direct", opts, "0", ref)]))
    if "cp_bcg" in needed:
        # Text only, the shipped CP + DSpark layout; the opt-in side is the measuring run
        # the launch guard lets through.
        args = (*CP_ARGS, "--language-model-only", *DSPARK_ARGS)
        plan.pairs.append(Pair("cp_bcg", [
            _single("eager", opts, args, {CP_BCG_ENV: "0"}),
            _single("graph", opts, args, {CP_BCG_ENV: "1", DSPARK_VERIFIED_ENV: MEASURING},
                    reference=ref)]))
    return plan


def ports_used(plan: Plan) -> list[int]:
    ports = set()
    for pair in plan.pairs:
        for side in pair.sides:
            for proc in side.procs:
                ports.add(proc.port)
                for flag in ("--nccl-port", "--engine-info-bootstrap-port",
                             "--disaggregation-bootstrap-port", "--prometheus-port"):
                    if flag in proc.argv:
                        ports.add(int(proc.argv[proc.argv.index(flag) + 1]))
    return sorted(ports)
