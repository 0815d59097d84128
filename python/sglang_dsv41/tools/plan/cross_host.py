"""Rules for deployments spread over several machines: PD pairs across hosts, and what
only a Kubernetes manifest says (restart coupling, start-up probes, shared memory).

A compose service's machine is its ``sglang-dsv41.host`` label; a pod's is its
``kubernetes.io/hostname`` node selector, and a pod without one may land on any
node, so it counts as another machine than every other pod. No sglang import.
"""

from __future__ import annotations

from sglang_dsv41.mooncake_nvlink.routing import PROTOCOL_ENV, nvlink_intra_reason
from sglang_dsv41.tools.plan.compose import Service
from sglang_dsv41.tools.plan.k8s import MANIFEST_LABEL

IB_DEVICE_FLAG = "--disaggregation-ib-device"
# sglang's Mooncake engine protocol when MOONCAKE_PROTOCOL is unset.
DEFAULT_PROTOCOL = "rdma"
RDMA_PROTOCOLS = {"rdma", "efa"}
NODE_SELECTOR = "kubernetes.io/hostname"
# DeepSeek-V4.1 loads for up to ~30 minutes (weights, DSpark draft, CUDA graphs): a
# start-up probe must allow at least this long before liveness may kill the pod.
MIN_STARTUP_SECONDS = 40 * 60
PD_RESTART_POLICY = "RecreateRBGOnPodRestart"


def offline_argv(argv: list[str]) -> list[str]:
    """The command without the RDMA device choice, which sglang validates against this
    machine's /sys/class/infiniband: plan runs on another machine than the servers,
    so the device is checked here for being named, and on the node by sglang."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == IB_DEVICE_FLAG:
            skip = True
        elif not token.startswith(IB_DEVICE_FLAG + "="):
            out.append(token)
    return out


def ib_device(service: Service) -> str | None:
    argv = service.argv
    for n, token in enumerate(argv):
        if token == IB_DEVICE_FLAG and n + 1 < len(argv):
            return argv[n + 1]
        if token.startswith(IB_DEVICE_FLAG + "="):
            return token.split("=", 1)[1]
    return None


def from_manifest(service: Service) -> bool:
    return MANIFEST_LABEL in service.labels


def machine_of(service: Service) -> str:
    if not from_manifest(service):
        return service.host
    raw = service.raw or {}
    node = ((raw.get("node_selector") or {}).get(NODE_SELECTOR))
    return f"node {node}" if node else f"pod {raw.get('pod', service.name)}"


def _rdma_access(service: Service) -> bool:
    """The server can open the HCA: /dev/infiniband in the container, or an RDMA device resource."""
    if from_manifest(service):
        return any("rdma" in key or "infiniband" in key or "hostdev" in key
                   for key in (service.raw.get("resources") or {}))
    devices = service.raw.get("devices") or []
    return any("/dev/infiniband" in str(d) for d in devices) or service.raw.get("privileged") is True


def _mentions_loopback(url: str) -> bool:
    from urllib.parse import urlsplit

    host = urlsplit(url if "//" in url else f"http://{url}").hostname or ""
    return host in ("127.0.0.1", "localhost", "::1", "0.0.0.0") or host.startswith("127.")


def check_cluster(plan, problem) -> list:
    """Every rule of this module over a resolved plan; ``problem`` builds a finding."""
    return check_cross_host_pairs(plan, problem) + check_routers_across_hosts(plan, problem) + \
        check_manifest_pods(plan, problem)


def check_cross_host_pairs(plan, problem) -> list:
    problems = []
    pd = [s for s in plan.servers if s.layout.disaggregation_mode in ("prefill", "decode")]
    for p in (s for s in pd if s.layout.disaggregation_mode == "prefill"):
        for d in (s for s in pd if s.layout.disaggregation_mode == "decode"):
            ps, ds = p.service, d.service
            if machine_of(ps) == machine_of(ds):
                continue
            pair = f"{ps.label} -> {ds.label}"
            where = f"{machine_of(ps)} and {machine_of(ds)}"
            how = nvlink_intra_reason(ps.environment) or nvlink_intra_reason(ds.environment)
            if how:
                problems.append(problem(pair, f"the sides run on different machines ({where}), but the KV transfer "
                                              f"uses Mooncake's intra-node NVLink transport ({how}), which reaches "
                                              "GPUs of one machine only (and with it the KV peer writes): set "
                                              f"{PROTOCOL_ENV}=rdma and {IB_DEVICE_FLAG} on both sides instead"))
                continue
            protocols = {side: (s.environment.get(PROTOCOL_ENV) or DEFAULT_PROTOCOL).strip().lower()
                         for side, s in (("prefill", ps), ("decode", ds))}
            if len(set(protocols.values())) > 1:
                problems.append(problem(pair, f"{PROTOCOL_ENV} differs: prefill {protocols['prefill']}, decode "
                                              f"{protocols['decode']}; one Mooncake transport must serve both"))
                continue
            if protocols["prefill"] not in RDMA_PROTOCOLS:
                continue  # tcp: slow, but it crosses machines
            for side, s in (("prefill", ps), ("decode", ds)):
                if not ib_device(s):
                    problems.append(problem(s.label, f"is the {side} of a PD pair across machines ({where}) over "
                                                     f"Mooncake {protocols[side]}, but names no RDMA device: give "
                                                     f"{IB_DEVICE_FLAG} (the HCA of its GPUs)"))
                elif not _rdma_access(s):
                    what = ("request an RDMA device resource (e.g. rdma/ib) from the RDMA device plugin"
                            if from_manifest(s) else "add `devices: [/dev/infiniband:/dev/infiniband]`")
                    problems.append(problem(s.label, f"names RDMA device {ib_device(s)} for a PD pair across "
                                                     f"machines, but its container cannot open it: {what}"))
    return problems


def check_routers_across_hosts(plan, problem) -> list:
    """A PD router's prefill URL is also where decodes dial the bootstrap server: with
    servers on several machines it must be an address every one of them reaches."""
    problems = []
    for router in plan.routers:
        if not router.pd:
            continue
        machines = {machine_of(s.service) for s in plan.servers
                    if s.layout.disaggregation_mode in ("prefill", "decode")}
        if len(machines) < 2:
            continue
        for url, _bootstrap in router.prefill:
            if _mentions_loopback(url):
                problems.append(problem(router.service.label,
                                        f"--prefill {url}: the PD servers run on several machines "
                                        f"({', '.join(sorted(machines))}), and decodes reach the prefill's "
                                        "bootstrap server at the host of this URL; a loopback address is each "
                                        "decode's own machine: use the prefill host's address"))
    return problems


def check_manifest_pods(plan, problem) -> list:
    problems = []
    for server in plan.servers:
        svc = server.service
        if not from_manifest(svc):
            continue
        raw = svc.raw
        lay = server.layout
        if lay.disaggregation_mode in ("prefill", "decode") and raw.get("kind") == "RoleBasedGroup" \
                and raw.get("restart") != PD_RESTART_POLICY:
            problems.append(problem(svc.label, f"is a PD {lay.disaggregation_mode} whose role has restartPolicy "
                                               f"{raw.get('restart') or 'unset'}: a restarted side would rejoin a "
                                               "peer holding transfers of the old one; set restartPolicy: "
                                               f"{PD_RESTART_POLICY} on the PD roles"))
        startup = (raw.get("probes") or {}).get("startupProbe")
        budget = 0
        if isinstance(startup, dict):
            budget = int(startup.get("initialDelaySeconds") or 0) + \
                int(startup.get("periodSeconds") or 10) * int(startup.get("failureThreshold") or 3)
        if budget < MIN_STARTUP_SECONDS:
            said = f"allows {budget} s" if startup else "is missing"
            problems.append(problem(svc.label, f"its startupProbe {said}; DeepSeek-V4.1 takes up to half an hour "
                                               "to load, so liveness would kill it while loading: give a "
                                               f"startupProbe of at least {MIN_STARTUP_SECONDS} s "
                                               "(periodSeconds x failureThreshold)"))
        if not raw.get("host_ipc") and not _memory_shm(raw):
            problems.append(problem(svc.label, "has neither hostIPC nor a memory emptyDir at /dev/shm: the "
                                               "container's default 64 MiB /dev/shm is too small for sglang's "
                                               "processes"))
        size = int(raw.get("group_size") or 1)
        if size != lay.nnodes:
            problems.append(problem(svc.label, f"its instance has {size} pods (leaderWorkerPattern size) but "
                                               f"sglang runs --nnodes {lay.nnodes}"))
    return problems


def _memory_shm(raw: dict) -> bool:
    memory = {v.get("name") for v in raw.get("volumes") or []
              if isinstance(v, dict) and (v.get("emptyDir") or {}).get("medium") == "Memory"}
    return any(m.get("mountPath") == "/dev/shm" and m.get("name") in memory for m in raw.get("mounts") or [])
