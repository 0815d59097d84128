"""Cross-service checks of a deployment: GPUs, ports, routers, PD pairs, Mooncake.

Works on services read by ``compose_model`` and on each sglang server's layout
as resolved by sglang (the caller resolves; nothing here imports sglang). Every
finding names the service and the reason.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from sglang_dsv41.core.compose_model import Service
from sglang_dsv41.core.known_crashes import CrashFeatures, known_crash

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
    try:
        known, _ = parser.parse_known_args(args)
    except (argparse.ArgumentError, ValueError) as exc:
        raise ValueError(f"cannot read the router arguments: {exc}") from exc
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


def check_plan(plan: Plan, all_services: list[Service]) -> list[Problem]:
    problems: list[Problem] = []
    problems += check_known_crashes(plan)
    problems += check_gpus(plan)
    problems += check_ports(plan, all_services)
    problems += check_healthchecks(plan)
    pairs, routing_problems = check_routers(plan)
    problems += routing_problems
    problems += check_pd_pairs(pairs)
    problems += check_mooncake(plan)
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
    if picks and max(picks) >= len(visible):
        return None, (f"needs {len(picks)} GPUs ({shape}) but sees "
                      f"{len(visible)}: {','.join(visible) or 'none'}")
    if len(visible) != len(set(picks)):
        return None, (f"sees GPUs {','.join(visible)} but its layout uses {len(picks)} of them "
                      f"({shape}); the rest would sit idle")
    return tuple(visible[p] for p in picks), None


def check_gpus(plan: Plan) -> list[Problem]:
    problems = []
    owner: dict[tuple[str, str], str] = {}
    for server in plan.servers:
        gpus, reason = used_gpus(server)
        if reason:
            problems.append(Problem(server.service.label, reason))
            continue
        for gpu in gpus:
            key = (server.service.host, gpu)
            if key in owner:
                problems.append(Problem(server.service.label,
                                        f"GPU {gpu} is also used by {owner[key]} (host {server.service.host})"))
            else:
                owner[key] = server.service.label
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
    owner: dict[tuple[str, int], tuple[str, str]] = {}
    for svc, port, what in listening_ports(plan, all_services):
        key = (svc.host, port)
        if key in owner and owner[key][0] != svc.label:
            other, other_what = owner[key]
            problems.append(Problem(svc.label, f"port {port} ({what}) is also bound by {other} ({other_what})"))
        elif key in owner:
            problems.append(Problem(svc.label, f"port {port} is bound twice ({owner[key][1]} and {what})"))
        else:
            owner[key] = (svc.label, what)
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
    parts = urlsplit(url if "//" in url else f"http://{url}")
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
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


def pairing_rejection(prefill: ServerLayout, decode: ServerLayout) -> str | None:
    """The runtime handshake's verdict on a prefill/decode pair (None = accepted)."""
    try:
        from sglang_dsv41.core import pd_pairing
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
        host, _, port_text = lay.mooncake_master.rpartition(":")
        port = int(port_text) if port_text.isdigit() else MOONCAKE_MASTER_RPC_PORT
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
