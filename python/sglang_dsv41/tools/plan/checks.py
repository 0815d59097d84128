"""Cross-service checks of a deployment: GPUs, ports, routers, PD pairs, Mooncake.

Works on services read by ``compose_model`` and on each sglang server's layout
as resolved by sglang (the caller resolves; nothing here imports sglang). Every
finding names the service and the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from sglang_dsv41.tools.plan.compose import LOCAL_HOST, Project, Service
from sglang_dsv41.tools.plan.commands import ExpansionBudget, ShellRefused, unwrap
from sglang_dsv41.tools.plan.cross_host import check_cluster
from sglang_dsv41.launch_guards.rules import CrashFeatures, known_crash
from sglang_dsv41.mooncake_nvlink.routing import nvlink_intra_reason
from sglang_dsv41.mooncake_nvlink.kv_staging.setting import STAGING_ENV, StagingConfigError, staging_config

LOOPBACK = {"127.0.0.1", "localhost", "0.0.0.0", "::1", "[::1]"}
MOONCAKE_MASTER_RPC_PORT = 50051  # mooncake_master's default --rpc_port
MOONCAKE_MASTER_METRICS_PORT = 9003  # mooncake_master's default --metrics_port
ROUTER_DEFAULT_PORT = 30000
ROUTER_DEFAULT_PROMETHEUS_PORT = 29000
DEFAULT_BOOTSTRAP_PORT = 8998


@dataclass(frozen=True)
class ServerLayout:
    """What sglang resolved for one server, plus where it listens."""

    tp_size: int
    pp_size: int
    nnodes: int
    ep_size: int
    dp_size: int
    attn_tp_size: int
    attn_dp_size: int
    attn_cp_size: int
    base_gpu_id: int
    gpu_id_step: int
    port: int
    disaggregation_mode: str  # "null", "prefill" or "decode"
    bootstrap_port: int | None
    transfer_backend: str | None
    dspark: bool
    speculative_num_draft_tokens: int | None
    decoder_swa_bounded_replay: bool
    enable_prefill_cp: bool
    cp_strategy: str | None
    hierarchical_cache: bool
    hicache_storage_backend: str | None
    vision: bool
    kv_cache_dtype: str
    page_size: int
    model_type: str
    # What identifies the served weights (the model directory on the host): two
    # servers' DSpark transfer layouts can only be equal if this is.
    model_identity: str = ""
    kv_pool: str | None = None  # "mla" when sglang runs the model with an MLA KV pool
    all_cp_ranks_transfer: bool = False  # SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER
    # Ports sglang binds besides --port and the bootstrap port (DP attention's ZMQ ports).
    derived_ports: tuple[int, ...] = ()
    # host:port of the Mooncake master the store connects to, when the store is used.
    mooncake_master: str | None = None
    # Host memory the server takes: the Mooncake store segment it contributes
    # (bytes, for the whole server) and its hierarchical-cache host pool
    # (--hicache-size, GB per rank; 0 when sized by --hicache-ratio).
    mooncake_segment_bytes: int = 0
    hicache_size_gb: float = 0.0
    hicache_ratio: float = 0.0

    @property
    def gpu_indices(self) -> list[int]:
        """Which of the container's GPUs (CUDA numbering) the ranks on one node use,
        as sglang assigns them: DP replicas (DP without DP attention) each take a
        TP x PP block; inside a block, PP stages and TP ranks per node."""
        nnodes = max(self.nnodes, 1)
        pp_per_node = max(self.pp_size // nnodes, 1)  # the split sglang's launcher makes
        tp_per_node = self.tp_size // max(nnodes // self.pp_size, 1)
        replicas = self.dp_size if self.attn_dp_size == 1 else 1
        indices = []
        for replica in range(replicas):
            block = self.base_gpu_id + replica * self.tp_size * self.pp_size * self.gpu_id_step
            for pp_rank in range(pp_per_node):
                for tp_rank in range(tp_per_node):
                    indices.append(block + pp_rank * tp_per_node + tp_rank * self.gpu_id_step)
        return indices

    @property
    def gpus_needed(self) -> int:
        return len(self.gpu_indices)

    @property
    def uses_mooncake_store(self) -> bool:
        return self.hierarchical_cache and self.hicache_storage_backend == "mooncake"


@dataclass
class PlannedServer:
    service: Service
    layout: ServerLayout


@dataclass
class PlannedRouter:
    service: Service
    port: int
    prometheus_port: int | None
    pd: bool
    prefill: list[tuple[str, int | None]]
    decode: list[str]
    workers: list[str]


@dataclass
class PlannedMaster:
    service: Service
    rpc_port: int
    other_ports: list[tuple[int, str]]


@dataclass
class Problem:
    service: str
    reason: str

    def __str__(self) -> str:
        return f"{self.service}: {self.reason}"


@dataclass
class Plan:
    servers: list[PlannedServer] = field(default_factory=list)
    routers: list[PlannedRouter] = field(default_factory=list)
    masters: list[PlannedMaster] = field(default_factory=list)
    # sglang services whose arguments did not resolve (already reported).
    unresolved: list[Service] = field(default_factory=list)


# --------------------------------------------------------------------------- what a service is


def sglang_serve_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``sglang serve`` / ``-m sglang.launch_server``, or None."""
    for i, token in enumerate(argv):
        name = token.rsplit("/", 1)[-1]
        if name == "sglang" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return argv[i + 2:]
        if token == "-m" and i + 1 < len(argv) and argv[i + 1] in ("sglang.launch_server", "sglang.launch_server.py"):
            return argv[i + 2:]
    return None


def router_args(argv: list[str]) -> list[str] | None:
    for i, token in enumerate(argv):
        if token == "-m" and i + 1 < len(argv) and argv[i + 1] == "sglang_router.launch_router":
            return argv[i + 2:]
        if token.rsplit("/", 1)[-1] == "sglang-router":
            rest = argv[i + 1:]
            return rest[1:] if rest[:1] == ["launch"] else rest
    return None


def mooncake_master_args(argv: list[str]) -> list[str] | None:
    for i, token in enumerate(argv):
        if token.rsplit("/", 1)[-1] == "mooncake_master":
            return argv[i + 1:]
    return None


def parse_router(service: Service, args: list[str]) -> PlannedRouter:
    """The router flags that decide where traffic goes (sglang_router's spelling)."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=ROUTER_DEFAULT_PORT)
    parser.add_argument("--pd-disaggregation", action="store_true")
    parser.add_argument("--prefill", nargs="+", action="append", default=[])
    parser.add_argument("--decode", nargs="+", action="append", default=[])
    parser.add_argument("--worker-urls", nargs="+", default=[])
    parser.add_argument("--prometheus-port", type=int, default=ROUTER_DEFAULT_PROMETHEUS_PORT)
    known = _parse_known(parser, args, "the router arguments")
    prefill = []
    for group in known.prefill:
        url = group[0]
        bootstrap = None
        if len(group) > 1 and group[1].lower() != "none":
            if not group[1].isdigit():
                raise ValueError(f"--prefill {' '.join(group)}: the bootstrap port is not a number")
            bootstrap = int(group[1])
        prefill.append((url, bootstrap))
    decode = [url for group in known.decode for url in group]
    return PlannedRouter(service, known.port, known.prometheus_port, known.pd_disaggregation,
                         prefill, decode, list(known.worker_urls))


def parse_master(service: Service, args: list[str]) -> PlannedMaster:
    """mooncake_master's gflags: ``--name=value`` or ``--name value``."""
    flags: dict[str, str] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if token.startswith("-"):
            name, sep, value = token.lstrip("-").partition("=")
            if not sep and i + 1 < len(args) and not args[i + 1].startswith("-"):
                value = args[i + 1]
                i += 1
            flags[name] = value if (sep or value) else "true"
        i += 1
    rpc_port = int(flags.get("rpc_port") or flags.get("port") or MOONCAKE_MASTER_RPC_PORT)
    others = [(int(flags.get("metrics_port", MOONCAKE_MASTER_METRICS_PORT)), "Mooncake master metrics")]
    if flags.get("enable_http_metadata_server", "false").lower() in ("1", "true"):
        others.append((int(flags.get("http_metadata_server_port", 8080)), "Mooncake HTTP metadata"))
    return PlannedMaster(service, rpc_port, others)


# --------------------------------------------------------------------------- checks


def check_plan(plan: Plan, all_services: list[Service], options: "PlanOptions | None" = None) -> list[Problem]:
    options = options or PlanOptions()
    problems: list[Problem] = []
    problems += check_known_crashes(plan)
    problems += check_gpus(plan)
    problems += check_ports(plan, all_services)
    problems += check_healthchecks(plan)
    pairs, routing_problems = check_routers(plan)
    problems += routing_problems
    problems += check_pd_pairs(pairs)
    problems += check_kv_staging(plan, pairs)
    problems += check_mooncake(plan)
    problems += check_nvlink_intra(plan)
    problems += check_host_memory(plan, options)
    problems += check_cluster(plan, Problem)  # PD across machines, manifests' own rules
    return problems


def check_known_crashes(plan: Plan) -> list[Problem]:
    problems = []
    for server in plan.servers:
        lay = server.layout
        reason = known_crash(CrashFeatures(
            dspark=lay.dspark,
            decoder_swa_bounded_replay=lay.decoder_swa_bounded_replay,
            enable_prefill_cp=lay.enable_prefill_cp,
            attn_cp_size=lay.attn_cp_size,
            attn_dp_size=lay.attn_dp_size,
        ))
        if reason:
            problems.append(Problem(server.service.label, reason))
    return problems


def used_gpus(server: PlannedServer) -> tuple[tuple[str, ...] | None, str | None]:
    """Host GPUs the server's ranks use, or a reason why that cannot be known."""
    reservation = server.service.gpu_reservation
    lay = server.layout
    if not reservation.declared:
        return None, "reserves no GPU (deploy.resources.reservations.devices or gpus)"
    if reservation.visible is None:
        return None, (f"its GPU set is not fixed ({reservation.how}); name the GPUs with "
                      "CUDA_VISIBLE_DEVICES or device_ids so overlaps can be checked")
    visible = reservation.visible
    picks = lay.gpu_indices
    replicas = f" x DP replicas {lay.dp_size}" if lay.dp_size > 1 and lay.attn_dp_size == 1 else ""
    shape = f"TP {lay.tp_size} x PP {lay.pp_size}{replicas}{f' / {lay.nnodes} nodes' if lay.nnodes > 1 else ''}"
    if picks and min(picks) < 0:
        return None, f"its layout starts at GPU {min(picks)} (--base-gpu-id must not be negative)"
    if picks and max(picks) >= len(visible):
        return None, (f"needs {len(picks)} GPUs ({shape}) but sees "
                      f"{len(visible)}: {','.join(visible) or 'none'}")
    if len(visible) != len(set(picks)):
        return None, (f"sees GPUs {','.join(visible)} but its layout uses {len(picks)} of them "
                      f"({shape}); the rest would sit idle")
    return tuple(visible[p] for p in picks), None


def check_gpus(plan: Plan) -> list[Problem]:
    """One problem per pair of services sharing GPUs of a host, naming every shared GPU."""
    problems = []
    owner: dict[tuple[str, str], str] = {}
    for server in plan.servers:
        gpus, reason = used_gpus(server)
        if reason:
            problems.append(Problem(server.service.label, reason))
            continue
        shared: dict[str, list[str]] = {}
        for gpu in gpus:
            key = (server.service.host, gpu)
            if key in owner:
                shared.setdefault(owner[key], []).append(gpu)
            else:
                owner[key] = server.service.label
        for other, overlap in shared.items():
            which = f"GPU {overlap[0]} is" if len(overlap) == 1 else f"GPUs {','.join(overlap)} are"
            problems.append(Problem(server.service.label,
                                    f"{which} also used by {other} (host {server.service.host})"))
    return problems


def _is_host_network(service: Service) -> bool:
    return service.network_mode == "host"


def listening_ports(plan: Plan, all_services: list[Service]) -> list[tuple[Service, int, str]]:
    """(service, host port, purpose) for every port a service binds on its host."""
    found: list[tuple[Service, int, str]] = []
    covered: set[int] = set()
    for server in plan.servers:
        svc, lay = server.service, server.layout
        covered.add(id(svc))
        if _is_host_network(svc):
            found.append((svc, lay.port, "HTTP (--port)"))
            if lay.disaggregation_mode == "prefill" and lay.bootstrap_port:
                found.append((svc, lay.bootstrap_port, "PD bootstrap"))
            found += [(svc, port, "DP-attention ZMQ (derived from --port)") for port in lay.derived_ports]
    for router in plan.routers:
        covered.add(id(router.service))
        if _is_host_network(router.service):
            found.append((router.service, router.port, "router HTTP"))
            if router.prometheus_port:
                found.append((router.service, router.prometheus_port, "router metrics"))
    for master in plan.masters:
        covered.add(id(master.service))
        if _is_host_network(master.service):
            found.append((master.service, master.rpc_port, "Mooncake master RPC"))
            found += [(master.service, port, what) for port, what in master.other_ports]
    for svc in all_services:
        if not _is_host_network(svc):
            found += [(svc, p.host_port, f"published {p.container_port}/{p.protocol}")
                      for p in svc.published_ports]
    return found


def check_ports(plan: Plan, all_services: list[Service]) -> list[Problem]:
    problems = []
    owner: dict[tuple[str, int], tuple[Service, str]] = {}
    for svc, port, what in listening_ports(plan, all_services):
        if not 1 <= port <= 65535:
            problems.append(Problem(svc.label, f"port {port} ({what}) is not a TCP port (1 to 65535)"))
            continue
        key = (svc.host, port)
        # By identity: two copies of one file (two deployments) share their labels.
        if key in owner and owner[key][0] is not svc:
            other, other_what = owner[key]
            problems.append(Problem(svc.label, f"port {port} ({what}) is also bound by {other.label} ({other_what})"))
        elif key in owner:
            problems.append(Problem(svc.label, f"port {port} is bound twice ({owner[key][1]} and {what})"))
        else:
            owner[key] = (svc, what)
    return problems


def _health_text(service: Service) -> str | None:
    check = service.healthcheck
    if not check or check.get("disable"):
        return None
    test = check.get("test")
    if not test or test == ["NONE"]:
        return None
    text = test if isinstance(test, str) else " ".join(str(t) for t in test)

    def expand(match: re.Match) -> str:
        return service.environment.get(match.group(1) or match.group(2), match.group(0))

    return re.sub(r"\$\$?\{?([A-Za-z_][A-Za-z0-9_]*)\}?|\$(\w+)", expand, text)


def _probes(service: Service, port: int) -> tuple[bool, str]:
    text = _health_text(service)
    if text is None:
        return False, "has no healthcheck"
    if not re.search(rf"(?<!\d){port}(?!\d)", text):
        return False, f"healthcheck does not probe its port {port}: {text}"
    return True, ""


def check_healthchecks(plan: Plan) -> list[Problem]:
    problems = []
    targets = ([(s.service, s.layout.port) for s in plan.servers]
               + [(r.service, r.port) for r in plan.routers]
               + [(m.service, m.rpc_port) for m in plan.masters])
    for svc, port in targets:
        ok, reason = _probes(svc, port)
        if not ok:
            problems.append(Problem(svc.label, reason))
    return problems


def _server_for_url(router: PlannedRouter, url: str, plan: Plan) -> tuple[PlannedServer | None, str]:
    try:
        parts = urlsplit(url if "//" in url else f"http://{url}")
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # a port out of range, a broken IPv6 literal
        return None, f"{url}: not a server URL ({exc})"
    rsvc = router.service
    if host in LOOPBACK or host == rsvc.host:
        if not _is_host_network(rsvc):
            return None, (f"{url}: a router on a bridge network reaches its own container at "
                          f"{host}, not a server; use network_mode: host or the service name")
        for server in plan.servers:
            svc = server.service
            if svc.host != rsvc.host:
                continue
            if _is_host_network(svc) and server.layout.port == port:
                return server, ""
            if any(p.host_port == port and p.container_port == server.layout.port for p in svc.published_ports):
                return server, ""
        return None, f"{url}: no sglang server of host {rsvc.host} listens on port {port}"
    for server in plan.servers:
        svc = server.service
        if host == svc.host and _is_host_network(svc) and server.layout.port == port:
            return server, ""  # another host's server, by that host's address
        if svc.compose_file == rsvc.compose_file and host in (svc.name, svc.container_name):
            if server.layout.port != port:
                return None, f"{url}: {svc.label} listens on {server.layout.port}, not {port}"
            return server, ""
    return None, f"{url}: host {host} is not an sglang service of this plan"


def check_routers(plan: Plan) -> tuple[list[tuple[PlannedServer, PlannedServer, str]], list[Problem]]:
    """Each router URL reaches a server of the right role; returns the PD pairs routed together."""
    problems: list[Problem] = []
    pairs: list[tuple[PlannedServer, PlannedServer, str]] = []
    routed: set[int] = set()
    for router in plan.routers:
        label = router.service.label
        if router.pd:
            if router.workers:
                problems.append(Problem(label, "--worker-urls and --pd-disaggregation together; "
                                               "list PD servers with --prefill/--decode"))
            if not router.prefill or not router.decode:
                problems.append(Problem(label, "a PD router needs at least one --prefill and one --decode"))
        elif router.prefill or router.decode:
            problems.append(Problem(label, "--prefill/--decode given without --pd-disaggregation"))
        prefills, decodes = [], []
        def unreachable(url: str, why: str) -> None:
            # A router URL may point at a server that failed to resolve; that
            # server's own error says what is wrong.
            if not any(u.compose_file == router.service.compose_file for u in plan.unresolved):
                problems.append(Problem(label, why))

        for url, bootstrap in router.prefill:
            server, why = _server_for_url(router, url, plan)
            if server is None:
                unreachable(url, why)
                continue
            routed.add(id(server))
            lay = server.layout
            if lay.disaggregation_mode != "prefill":
                problems.append(Problem(label, f"--prefill {url} is {server.service.label}, which runs "
                                               f"disaggregation mode {lay.disaggregation_mode}"))
                continue
            expected = bootstrap if bootstrap is not None else DEFAULT_BOOTSTRAP_PORT
            if lay.bootstrap_port != expected:
                said = f"bootstrap port {bootstrap}" if bootstrap is not None else \
                    f"no bootstrap port (so {DEFAULT_BOOTSTRAP_PORT})"
                problems.append(Problem(label, f"--prefill {url} gives {said}, but {server.service.label} "
                                               f"serves bootstrap on {lay.bootstrap_port}"))
            prefills.append(server)
        for url in router.decode:
            server, why = _server_for_url(router, url, plan)
            if server is None:
                unreachable(url, why)
                continue
            routed.add(id(server))
            if server.layout.disaggregation_mode != "decode":
                problems.append(Problem(label, f"--decode {url} is {server.service.label}, which runs "
                                               f"disaggregation mode {server.layout.disaggregation_mode}"))
                continue
            decodes.append(server)
        for url in router.workers:
            server, why = _server_for_url(router, url, plan)
            if server is None:
                unreachable(url, why)
                continue
            routed.add(id(server))
            if server.layout.disaggregation_mode != "null":
                problems.append(Problem(label, f"--worker-urls {url} is {server.service.label}, a PD "
                                               f"{server.layout.disaggregation_mode} server; route it "
                                               "with --pd-disaggregation"))
        pairs += [(p, d, label) for p in prefills for d in decodes]
    # PD servers no router joins are still checked against every server of the
    # other role, so the pairing verdict is there even before a router is added.
    prefills_all = [s for s in plan.servers if s.layout.disaggregation_mode == "prefill"]
    decodes_all = [s for s in plan.servers if s.layout.disaggregation_mode == "decode"]
    pairs += [(p, d, "") for p in prefills_all for d in decodes_all
              if id(p) not in routed or id(d) not in routed]
    by_file: dict = {}
    for server in plan.servers:
        by_file.setdefault(server.service.compose_file, []).append(server)
    for servers in by_file.values():
        needs_router = len(servers) > 1 or any(s.layout.disaggregation_mode != "null" for s in servers)
        if not needs_router:
            continue
        for server in servers:
            if id(server) not in routed:
                why = ("a PD server" if server.layout.disaggregation_mode != "null"
                       else f"one of {len(servers)} instances in {server.service.compose_file.name}")
                problems.append(Problem(server.service.label, f"is {why} but no router in the plan sends it traffic"))
    return pairs, problems


def check_pd_pairs(pairs) -> list[Problem]:
    problems = []
    seen = set()
    for prefill, decode, router_label in pairs:
        key = (id(prefill), id(decode))
        if key in seen:
            continue
        seen.add(key)
        pl, dl = prefill.layout, decode.layout
        who = f"{prefill.service.label} -> {decode.service.label}"
        if pl.transfer_backend != dl.transfer_backend:
            problems.append(Problem(who, f"transfer backends differ: prefill {pl.transfer_backend}, "
                                         f"decode {dl.transfer_backend}"))
            continue
        if pl.vision != dl.vision:
            problems.append(Problem(who, "vision is on for one side only (prefill "
                                         f"{'on' if pl.vision else 'off'}, decode {'on' if dl.vision else 'off'}); "
                                         "both sides take the same requests, so image requests would fail"))
        reason = pairing_rejection(pl, dl)
        if reason:
            problems.append(Problem(who, f"the PD handshake would reject this pair: {reason}"))
    return problems


def check_kv_staging(plan: Plan, pairs) -> list[Problem]:
    """KV peer-write settings a PD server would refuse at start, or that would do nothing."""
    problems = []
    setting: dict[int, object] = {}
    for server in plan.servers:
        if server.layout.disaggregation_mode not in ("prefill", "decode"):
            continue
        env = server.service.environment
        try:
            setting[id(server)] = staging_config(env)
        except StagingConfigError as exc:
            problems.append(Problem(server.service.label,
                                    f"{exc}: the server would stop when its KV transfer manager starts"))
            continue
        if setting[id(server)] is not None and not nvlink_intra_reason(env):
            problems.append(Problem(server.service.label,
                                    f"{STAGING_ENV}={_switch(env)} has no effect without Mooncake's intra-node NVLink "
                                    "transport (MC_INTRANODE_NVLINK or MOONCAKE_PROTOCOL=nvlink_intra)"))
    seen = set()
    for prefill, decode, _ in pairs:
        if (id(prefill), id(decode)) in seen or id(prefill) not in setting or id(decode) not in setting:
            continue
        seen.add((id(prefill), id(decode)))
        on = {side: setting[id(s)] is not None for side, s in (("prefill", prefill), ("decode", decode))}
        pair = f"{prefill.service.label} -> {decode.service.label}"
        if on["prefill"] != on["decode"]:
            only = "prefill" if on["prefill"] else "decode"
            value = _switch((prefill if on["prefill"] else decode).service.environment)
            problems.append(Problem(pair,
                                    f"{STAGING_ENV}={value} on the {only} only: it needs the same value on "
                                    "both sides (the decode side exports its KV, the prefill side writes "
                                    "into it), so this pair would send every block directly"))
    return problems


def _switch(env) -> str:
    return (env.get(STAGING_ENV) or "").strip()


def pairing_rejection(prefill: ServerLayout, decode: ServerLayout) -> str | None:
    """The runtime handshake's verdict on a prefill/decode pair (None = accepted)."""
    try:
        from sglang_dsv41.pd_handshake import pairing as pd_pairing
    except ImportError as exc:  # the rule ships with the PD handshake work
        return f"the PD pairing rule is not available in this install ({exc})"
    try:
        pd_pairing.check_pairing(pd_side(prefill, pd_pairing), pd_side(decode, pd_pairing))
    except pd_pairing.PairingRejected as exc:
        return str(exc)
    except ValueError as exc:  # a side that cannot be described (inconsistent sizes)
        return f"cannot describe the pair to the pairing rule: {exc}"
    return None


def pd_side(layout: ServerLayout, pd_pairing):
    """One server's published parallel info, as the handshake sees it.

    Without a memory pool there is no real DSpark layout to publish; the stand-in
    is equal exactly when the real ones would be: same weights, same verify
    width, same KV dtype (page size and pool kind are compared on their own)."""
    spec_layout = None
    if layout.dspark:
        spec_layout = {"model": layout.model_identity,
                       "num_draft_tokens": layout.speculative_num_draft_tokens,
                       "kv_cache_dtype": layout.kv_cache_dtype}
    return pd_pairing.side_from_args(
        tp_size=layout.tp_size,
        attn_cp_size=layout.attn_cp_size,
        dp_size=layout.attn_dp_size if layout.attn_dp_size > 1 else layout.dp_size,
        enable_dp_attention=layout.attn_dp_size > 1,
        pp_size=layout.pp_size,
        speculative_algorithm="DSPARK" if layout.dspark else None,
        spec_layout=spec_layout,
        kv_pool=layout.kv_pool,
        page_size=layout.page_size,
        kv_cache_dtype=layout.kv_cache_dtype,
        all_cp_ranks_transfer=layout.all_cp_ranks_transfer,
    )


def check_mooncake(plan: Plan) -> list[Problem]:
    problems = []
    for server in plan.servers:
        lay = server.layout
        if not lay.uses_mooncake_store:
            continue
        svc = server.service
        if not lay.mooncake_master:
            problems.append(Problem(svc.label, "uses the Mooncake store (--hicache-storage-backend mooncake) "
                                               "but names no master: set MOONCAKE_MASTER, "
                                               "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH or "
                                               "--hicache-storage-backend-extra-config"))
            continue
        host, colon, port_text = lay.mooncake_master.rpartition(":")
        if colon and not (port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
            problems.append(Problem(svc.label, f"Mooncake master {lay.mooncake_master!r}: the port is not "
                                               "a TCP port (1 to 65535)"))
            continue
        port = int(port_text) if colon else MOONCAKE_MASTER_RPC_PORT
        master = None
        for candidate in plan.masters:
            msvc = candidate.service
            local = host in LOOPBACK or host == svc.host
            same_host = local and msvc.host == svc.host and _is_host_network(msvc) and _is_host_network(svc)
            by_name = (host in (msvc.name, msvc.container_name) and msvc.compose_file == svc.compose_file) or \
                (host == msvc.host and host not in LOOPBACK)
            if (same_host or by_name) and candidate.rpc_port == port:
                master = candidate
                break
        if master is None:
            problems.append(Problem(svc.label, f"uses the Mooncake store with master {lay.mooncake_master}, "
                                               "but no mooncake_master service of the plan listens there"))
            continue
        if master.service.compose_file == svc.compose_file and master.service.name not in svc.depends_on:
            problems.append(Problem(svc.label, f"does not depend_on {master.service.name}, so it can start "
                                               "before its Mooncake master"))
    return problems


# --------------------------------------------------------------------------- fail closed on what a service is

IGNORE_HINT = 'label it `sglang-dsv41.ignore: "true"` if it has nothing to do with serving'
# Programs (or image names) of services that sit beside a deployment without
# taking part in serving: Mooncake's metadata servers and monitoring.
KNOWN_HELPERS = {"etcd", "mooncake_http_metadata_server", "prometheus", "grafana", "grafana-server",
                 "node_exporter", "node-exporter", "dcgm-exporter", "dcgm_exporter"}
PLUGIN_NAME = "dsv41"


@dataclass
class PlanOptions:
    gpus_per_node: int = 8
    host_memory_gb: float | None = None


@dataclass
class Classified:
    """The services of a plan, each recognised as what it runs (or a problem)."""

    servers: list[tuple[Service, list[str]]] = field(default_factory=list)
    routers: list[tuple[Service, list[str]]] = field(default_factory=list)
    masters: list[tuple[Service, list[str]]] = field(default_factory=list)
    helpers: list[Service] = field(default_factory=list)
    ignored: list[Service] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)  # every service, as unwrapped
    problems: list[Problem] = field(default_factory=list)


def _runs_checked_program(words: list[str]) -> bool:
    return any(f(words) is not None for f in (sglang_serve_args, router_args, mooncake_master_args))


def _helper_name(service: Service, argv: list[str]) -> str | None:
    if argv and argv[0].rsplit("/", 1)[-1] in KNOWN_HELPERS:
        return argv[0].rsplit("/", 1)[-1]
    if not argv and service.image:
        repo = service.image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
        if repo in KNOWN_HELPERS:
            return repo
    return None


def classify_services(services: list[Service]) -> Classified:
    """Sort services into servers, routers, Mooncake masters and helpers; any
    other service is a problem unless labelled as unrelated, so nothing is
    skipped silently. Shell-wrapped commands are followed or refused."""
    out = Classified()
    budget = ExpansionBudget()  # one for all services: each keeps what its script expanded to
    for service in services:
        try:
            unwrapped = unwrap(service.argv, service.environment, _runs_checked_program, budget)
        except ShellRefused as exc:
            out.services.append(service)
            if service.ignored:
                out.ignored.append(service)
                continue
            mentions = " ".join(service.argv)
            if any(w in mentions for w in ("sglang", "mooncake_master", "launch_server")):
                out.problems.append(Problem(service.label, f"its command is a shell script plan cannot follow "
                                                           f"({exc}); write the sglang command as the service's "
                                                           "command (a list) so plan can check it"))
            else:
                out.problems.append(Problem(service.label, f"plan cannot tell what this service runs ({exc}); "
                                                           + IGNORE_HINT))
            continue
        if unwrapped.via:
            service = dataclasses.replace(service, argv=unwrapped.argv, environment=unwrapped.environment)
        out.services.append(service)
        argv = service.argv
        if (args := sglang_serve_args(argv)) is not None:
            out.servers.append((service, args))
        elif (args := router_args(argv)) is not None:
            out.routers.append((service, args))
        elif (args := mooncake_master_args(argv)) is not None:
            out.masters.append((service, args))
        elif service.ignored:
            out.ignored.append(service)
        elif _helper_name(service, argv):
            out.helpers.append(service)
        else:
            shown = " ".join(argv)[:80] if argv else f"the default command of image {service.image or '?'}"
            out.problems.append(Problem(service.label, f"is not an sglang server, router, Mooncake master or known "
                                                       f"helper (it runs {shown}); plan cannot check it: "
                                                       + IGNORE_HINT))
    for service, _args in out.servers:
        reason = plugin_filtered_out(service.environment)
        if reason:
            out.problems.append(Problem(service.label, reason))
    return out


def plugin_filtered_out(environment: dict[str, str]) -> str | None:
    """Why a container with this environment would run stock sglang (None: it would not)."""
    allowed = environment.get("SGLANG_PLUGINS")
    if allowed is not None and allowed.strip():
        names = {x.strip() for x in allowed.split(",") if x.strip()}
        if PLUGIN_NAME not in names:
            return (f"SGLANG_PLUGINS={allowed} leaves out the {PLUGIN_NAME} plugin, so this container would run "
                    f"stock sglang without the DeepSeek-V4.1 fixes; add {PLUGIN_NAME} to the list or remove it")
    return None


# --------------------------------------------------------------------------- compose-level checks


def project_host(project: Project) -> str:
    """The host whose Docker daemon runs a compose file: the ``sglang-dsv41.host``
    label its services carry (``local`` without one). One ``docker compose up``
    talks to one daemon, so its services share that host; check_project_hosts
    reports a file whose services disagree (this then answers the first, sorted)."""
    hosts = sorted({service.host for service in project.services})
    return hosts[0] if hosts else LOCAL_HOST


def check_project_hosts(projects: list[Project]) -> list[Problem]:
    problems = []
    for project in projects:
        hosts = sorted({service.host for service in project.services})
        if len(hosts) > 1:
            problems.append(Problem(project.compose_file.name,
                                    f"its services are labelled for hosts {', '.join(hosts)}, but one `docker "
                                    "compose up` starts them all on one Docker daemon: give each host its own file"))
    return problems


def check_projects(projects: list[Project], services: list[Service], options: PlanOptions) -> list[Problem]:
    """What compose itself would refuse or get wrong, before any resolution."""
    problems: list[Problem] = []
    problems += check_project_hosts(projects)
    problems += check_depends_on(projects)
    problems += check_names(projects)
    problems += check_host_network_names(projects, services)
    problems += check_gpu_ids(services, options)
    return problems


def check_depends_on(projects: list[Project]) -> list[Problem]:
    problems = []
    for project in projects:
        names = {s.name for s in project.services}
        for service in project.services:
            for dep in service.depends_on:
                if dep in names or dep in service.optional_depends_on:
                    continue
                if dep in project.inactive:
                    wanted = ", ".join(project.inactive[dep])
                    problems.append(Problem(service.label, f"depends_on {dep}, which is only in profile(s) {wanted}; "
                                                           "compose refuses to start it: activate the profile "
                                                           "(--profile) or drop the dependency"))
                else:
                    problems.append(Problem(service.label, f"depends_on {dep}, which is not a service of "
                                                           f"{service.compose_file.name}"))
    return problems


def check_names(projects: list[Project]) -> list[Problem]:
    """Files started together on one host must not share a project name or a
    container name (each host's Docker daemon has its own names)."""
    problems = []
    seen_projects: dict[tuple[str, str], Project] = {}
    for project in projects:
        key = (project_host(project), project.name)
        other = seen_projects.get(key)
        if other is not None and other.compose_file != project.compose_file:
            problems.append(Problem(project.compose_file.name,
                                    f"project name {project.name!r} is also the project of {other.compose_file.name} "
                                    f"(host {key[0]}): started one after the other, compose treats them as one "
                                    "project and the second `up` replaces or orphans the first one's containers; "
                                    "give each file its own top-level name"))
        seen_projects.setdefault(key, project)
    owners: dict[tuple[str, str], Service] = {}
    for project in projects:
        for service in project.services:
            if not service.container_name:
                continue
            key = (service.host, service.container_name)
            other = owners.get(key)
            if other is not None:
                problems.append(Problem(service.label, f"container_name {service.container_name} is also the "
                                                       f"container name of {other.label}; docker allows one "
                                                       "container per name"))
            else:
                owners[key] = service
    return problems


_ADDRESS = re.compile(r"(?:^|[\s/@=,;\"'(\[])([A-Za-z0-9][A-Za-z0-9_.-]*):(\d{1,5})(?!\d)")
_URL_HOST = re.compile(r"\b[a-z][a-z0-9+.-]*://([A-Za-z0-9][A-Za-z0-9_.-]*)(?=[/:?#]|$)")


def _addressed_hosts(service: Service) -> list[tuple[str, str]]:
    """(host, text) for each host name the service's command or environment addresses."""
    found = []
    texts = list(service.argv) + [f"{k}={v}" for k, v in service.environment.items()]
    for text in texts:
        for pattern in (_ADDRESS, _URL_HOST):
            for match in pattern.finditer(text):
                found.append((match.group(1), text))
    return found


def check_host_network_names(projects: list[Project], services: list[Service]) -> list[Problem]:
    """Service names resolve only on compose networks: not from a host-network
    service, and not to a host-network service."""
    problems = []
    by_project: dict[tuple[str, str], dict[str, Service]] = {}
    for service in services:
        names = by_project.setdefault((service.host, service.project), {})
        names.setdefault(service.name, service)
        if service.container_name:
            names.setdefault(service.container_name, service)
    for service in services:
        names = by_project.get((service.host, service.project), {})
        reported = set()
        for host, text in _addressed_hosts(service):
            target = names.get(host)
            if target is None or target is service or host in LOOPBACK or host in service.extra_hosts:
                continue
            if host in reported:
                continue
            shown = text if len(text) <= 80 else text[:77] + "..."
            if _is_host_network(service):
                reported.add(host)
                problems.append(Problem(service.label, f"runs on the host network but addresses {host} by its "
                                                       f"service name ({shown}); service names resolve only on "
                                                       "compose networks, not from the host network: use the "
                                                       "host's address (127.0.0.1 on one machine)"))
            elif _is_host_network(target):
                reported.add(host)
                problems.append(Problem(service.label, f"addresses {host} by its service name ({shown}), but "
                                                       f"{target.label} runs on the host network, where no service "
                                                       "name resolves to it: use the host's address"))
    return problems


def check_gpu_ids(services: list[Service], options: PlanOptions) -> list[Problem]:
    problems = []
    limit = options.gpus_per_node
    for service in services:
        reservation = service.gpu_reservation
        beyond = sorted({i for i in reservation.named_ids if i.isdigit() and int(i) >= limit}, key=int)
        if beyond:
            problems.append(Problem(service.label, f"names GPU {', '.join(beyond)}, but a node has GPUs 0-{limit - 1} "
                                                   f"(--gpus-per-node {limit})"))
        if reservation.count is not None and reservation.count > limit:
            problems.append(Problem(service.label, f"reserves {reservation.count} GPUs, but a node has {limit} "
                                                   f"(--gpus-per-node {limit})"))
    return problems


# --------------------------------------------------------------------------- Mooncake and host memory

def expandable_segments_setting(environment: dict[str, str]) -> str | None:
    """The allocator variable that turns PyTorch's expandable segments on, if any."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in environment.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return var
    return None


def _share_pid_namespace(a: Service, b: Service) -> bool:
    def joins(x: Service, y: Service) -> bool:
        return (x.pid == f"service:{y.name}" and x.project == y.project) or \
            (bool(y.container_name) and x.pid == f"container:{y.container_name}")

    if a.pid == "host" and b.pid == "host":
        return True
    if joins(a, b) or joins(b, a):
        return True
    return bool(a.pid) and a.pid == b.pid and a.pid.startswith(("service:", "container:")) and a.project == b.project


def check_nvlink_intra(plan: Plan) -> list[Problem]:
    """Mooncake's intra-node NVLink transport registers KV memory with
    cudaIpcGetMemHandle and maps the peer's with cudaIpcOpenMemHandle: legacy
    CUDA IPC, which works only between processes that see each other (one PID
    namespace) and only on cudaMalloc memory, not on the virtual-memory
    allocations PyTorch's expandable segments make."""
    problems = []
    pd = [s for s in plan.servers if s.layout.disaggregation_mode in ("prefill", "decode")
          and (s.layout.transfer_backend or "mooncake") == "mooncake"]
    for server in pd:
        how = nvlink_intra_reason(server.service.environment)
        var = expandable_segments_setting(server.service.environment)
        if how and var:
            problems.append(Problem(server.service.label,
                                    f"{var} turns on expandable_segments while the KV transfer uses Mooncake's "
                                    f"intra-node NVLink transport ({how}): expandable segments come from CUDA's "
                                    "virtual-memory API, and that transport shares memory with legacy CUDA IPC "
                                    "(cudaIpcGetMemHandle), which works only on cudaMalloc memory; drop "
                                    "expandable_segments:True"))
    prefills = [s for s in pd if s.layout.disaggregation_mode == "prefill"]
    decodes = [s for s in pd if s.layout.disaggregation_mode == "decode"]
    for p in prefills:
        for d in decodes:
            ps, ds = p.service, d.service
            if ps.host != ds.host:
                continue
            how = nvlink_intra_reason(ps.environment) or nvlink_intra_reason(ds.environment)
            if not how or _share_pid_namespace(ps, ds):
                continue
            problems.append(Problem(f"{ps.label} -> {ds.label}",
                                    f"the KV transfer uses Mooncake's intra-node NVLink transport ({how}), which "
                                    "opens the peer's GPU memory through CUDA IPC handles; processes in separate "
                                    f"PID namespaces cannot open them (pid: {ps.pid or 'own'} and "
                                    f"{ds.pid or 'own'}): give both `pid: host`, or one `pid: \"service:<other>\"`"))
    return problems


def parse_segment_size(text: str) -> int:
    """A Mooncake segment size as sglang reads it: bytes, or a number of GiB with ``gb``."""
    value = text.strip().lower()
    if value.endswith("gb"):
        return int(value[:-2].strip()) * 1024 ** 3
    return int(value)


def check_host_memory(plan: Plan, options: PlanOptions) -> list[Problem]:
    """The host memory the servers of one machine pin, against --host-memory-gb."""
    if options.host_memory_gb is None:
        return []
    problems = []
    totals: dict[str, list[tuple[str, float]]] = {}
    for server in plan.servers:
        lay, svc = server.layout, server.service
        parts = totals.setdefault(svc.host, [])
        if lay.hierarchical_cache:
            if lay.hicache_size_gb <= 0:
                problems.append(Problem(svc.label, f"its hierarchical cache's host pool is sized by --hicache-ratio "
                                                   f"{lay.hicache_ratio:g} of the GPU KV pool, which plan cannot know "
                                                   "offline; give --hicache-size (GB per rank) so host memory can be "
                                                   "checked"))
            else:
                ranks = max(lay.gpus_needed, 1)
                parts.append((f"{svc.label} hicache {lay.hicache_size_gb:g} GB x {ranks} ranks",
                              lay.hicache_size_gb * ranks))
        if lay.uses_mooncake_store and lay.mooncake_segment_bytes:
            parts.append((f"{svc.label} Mooncake segment", lay.mooncake_segment_bytes / 1e9))
    for host, parts in totals.items():
        total = sum(gb for _, gb in parts)
        if total > options.host_memory_gb:
            detail = ", ".join(f"{what} {gb:.0f} GB" for what, gb in parts)
            problems.append(Problem(f"host {host}", f"the servers pin {total:.0f} GB of host memory ({detail}), "
                                                    f"more than --host-memory-gb {options.host_memory_gb:g}"))
    return problems


# --------------------------------------------------------------------------- PD routers that hang on a dead server

# sglang_router's defaults for the flags that decide how long a client waits
# when a PD server dies (deploy/b300-ds41/base/services.yml says why).
ROUTER_FAULT_DEFAULTS = {"cb_failure_threshold": 10, "cb_timeout_duration_secs": 60,
                         "health_check_interval_secs": 60, "health_failure_threshold": 3}
BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
BOOTSTRAP_TIMEOUT_DEFAULT_S = 300
FAST_FAILURE_S = 15


def router_fault_settings(args: list[str]) -> dict[str, int | bool]:
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for name, default in ROUTER_FAULT_DEFAULTS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    parser.add_argument("--disable-circuit-breaker", action="store_true")
    parser.add_argument("--disable-health-check", action="store_true")
    return vars(_parse_known(parser, args, "the router's fault settings"))


def _parse_known(parser: argparse.ArgumentParser, args: list[str], what: str) -> argparse.Namespace:
    """The flags ``parser`` knows, or ValueError. Some argparse errors (an ambiguous
    abbreviation) exit even with exit_on_error off: they become the ValueError too."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return parser.parse_known_args(args)[0]
    except (argparse.ArgumentError, ValueError) as exc:
        raise ValueError(f"cannot read {what}: {exc}") from exc
    except SystemExit:
        last = (said.getvalue().strip().splitlines() or ["unreadable"])[-1]
        raise ValueError(f"cannot read {what}: {last.split('error: ', 1)[-1]}") from None


def pd_router_hang_warnings(plan: Plan) -> list[Problem]:
    """PD routers whose client would wait for the prefill's bootstrap timeout when a decode dies.

    The router retries a failed request on a pair it still believes healthy and
    waits for that retry's prefill half, which waits for a decode that never
    comes until the bootstrap timeout. Only a circuit that opens at the first
    failure, and health checks that take the dead server out before the circuit
    half-opens, keep the router from sending a request there.
    """
    warnings = []
    for router in plan.routers:
        if not router.pd:
            continue
        try:
            flags = router_fault_settings(router_args(router.service.argv) or [])
        except ValueError as exc:
            warnings.append(Problem(router.service.label, str(exc)))
            continue
        prefills = [_server_for_url(router, url, plan)[0] for url, _ in router.prefill]
        try:
            waits = [int(s.service.environment.get(BOOTSTRAP_TIMEOUT_ENV) or BOOTSTRAP_TIMEOUT_DEFAULT_S)
                     for s in prefills if s is not None]
        except ValueError:
            warnings.append(Problem(router.service.label, f"a prefill's {BOOTSTRAP_TIMEOUT_ENV} is not "
                                    "a whole number of seconds"))
            continue
        wait = max(waits, default=BOOTSTRAP_TIMEOUT_DEFAULT_S)
        if wait <= FAST_FAILURE_S:
            continue
        hang = (f"a client whose decode dies would wait about {wait} s (the prefill's {BOOTSTRAP_TIMEOUT_ENV}) "
                "for an error, because the router retries on the dead pair and waits for the retry's prefill half")
        if flags["disable_circuit_breaker"] or flags["cb_failure_threshold"] > 1:
            warnings.append(Problem(router.service.label, f"{hang}; give --cb-failure-threshold 1"))
        elif flags["disable_health_check"] or (
                flags["health_check_interval_secs"] * flags["health_failure_threshold"]
                >= flags["cb_timeout_duration_secs"]):
            warnings.append(Problem(router.service.label, (
                f"{hang} once its circuit half-opens after --cb-timeout-duration-secs "
                f"{flags['cb_timeout_duration_secs']}, before the health checks (every "
                f"{flags['health_check_interval_secs']} s, {flags['health_failure_threshold']} failures) take the "
                "dead server out; check health more often than the circuit reopens")))
    return warnings
