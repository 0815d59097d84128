"""Read Kubernetes manifests (RoleBasedGroup, Deployment, LeaderWorkerSet) into plan's service model.

Every pod a manifest would create becomes one ``Service``, as a compose service
would (command with ``$(VAR)`` expanded, environment, mounted ConfigMaps, GPUs,
readiness probe as healthcheck), addressed by its workload's DNS names, all on
one host, ``cluster``. A directory with a ``kustomization.yaml`` is rendered with
``kubectl kustomize`` first. What it does not understand where it matters is one
line (``ComposeError``), never skipped. No sglang import here.

Design: docs/design/plan.md.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sglang_dsv41.tools.plan.compose import (
    HOST_LABEL,
    MAX_FILE_BYTES,
    MAX_TOTAL_CHARS,
    BindMount,
    ComposeError,
    GpuReservation,
    Project,
    Service,
    decode_text,
    kind_of,
    parse_yaml_documents,
    read_text,
)
from sglang_dsv41.tools.plan.reader import bounded_run

CLUSTER_HOST = "cluster"
KUSTOMIZATION = "kustomization.yaml"
RBG_API = "workloads.x-k8s.io/v1alpha2"
LWS_API = "leaderworkerset.x-k8s.io/v1"
GPU_RESOURCE = "nvidia.com/gpu"
MAX_POD_GPUS = 1024  # far above any node; a count past it is a typo, not a reservation
# Objects a deployment carries beside its workloads; read for what they hold or
# accepted as they are (none of them changes what a server runs).
PASSIVE = {("v1", "Service"), ("v1", "PersistentVolumeClaim"), ("v1", "Secret"), ("v1", "ServiceAccount"),
           ("v1", "Namespace"), ("policy/v1", "PodDisruptionBudget")}
WORKLOADS = {(RBG_API, "RoleBasedGroup"), ("apps/v1", "Deployment"), (LWS_API, "LeaderWorkerSet")}
# Where a manifest's pod came from, for the checks only a manifest has (restart coupling, probes).
MANIFEST_LABEL = "sglang-dsv41.k8s"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
KUSTOMIZE_TIMEOUT_S = 60
# What the API server admits (a DNS-1123 subdomain; a ConfigMap key): plan writes
# ConfigMaps out as files by these names, so nothing else may reach the file system.
MAX_NAME_CHARS = 253
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_CONFIG_MAP_KEY = re.compile(r"[-._a-zA-Z0-9]+\Z")
OBJECT_NAME_RULE = ("lowercase letters, digits, '-' and '.', beginning and ending with a letter or digit, "
                    f"at most {MAX_NAME_CHARS} characters")
CONFIG_MAP_KEY_RULE = ("letters, digits, '-', '_' and '.', not '.' nor starting with '..', "
                       f"at most {MAX_NAME_CHARS} characters")


def is_object_name(name: str) -> bool:
    """A name the Kubernetes API accepts for metadata.name (a DNS-1123 subdomain)."""
    return len(name) <= MAX_NAME_CHARS and bool(_OBJECT_NAME.match(name))


def is_config_map_key(key: str) -> bool:
    """A key the Kubernetes API accepts in a ConfigMap's data (it becomes a file name)."""
    return (len(key) <= MAX_NAME_CHARS and bool(_CONFIG_MAP_KEY.match(key))
            and key != "." and not key.startswith(".."))


def is_manifest(path: str | Path) -> bool:
    """A kustomization directory, or a YAML file whose documents carry apiVersion and kind."""
    p = Path(path)
    if p.is_dir():
        return (p / KUSTOMIZATION).is_file()
    if p.suffix not in (".yaml", ".yml") or not p.is_file():
        return False
    try:
        head = p.read_text(errors="replace")[:65536]
    except OSError:
        return False
    return bool(re.search(r"^apiVersion\s*:", head, re.M)) and bool(re.search(r"^kind\s*:", head, re.M))


def render(path: Path) -> str:
    """The manifest text: a file as it is, a kustomization rendered by kubectl."""
    if not path.is_dir():
        return read_text(path, "manifest")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise ComposeError(f"{path}: a kustomization, and kubectl is not on PATH: render it with "
                           f"`kubectl kustomize {path} > manifest.yaml` and plan that file")
    try:  # capped as a manifest file is: a generator gone wrong must not fill the memory
        code, out, err = bounded_run([kubectl, "kustomize", str(path)], os.environ, path, what="kubectl kustomize",
                                     timeout_s=KUSTOMIZE_TIMEOUT_S, max_output=MAX_FILE_BYTES)
    except ComposeError as exc:
        raise ComposeError(f"{path}: {exc}") from None
    if code != 0:
        lines = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
        raise ComposeError(f"{path}: kubectl kustomize failed: {lines[-1] if lines else code}")
    return decode_text(out, f"{path}: the output of kubectl kustomize")


def load_manifests(path: str | Path) -> Project:
    """Every pod of the workloads in a manifest file or kustomization, as plan's services."""
    source = Path(path).resolve()
    shown = source.name
    # The compose reader's bounds (size, nesting, alias expansion) over the whole stream of documents.
    documents = [d for d in parse_yaml_documents(render(source), shown) if d is not None]
    if not documents:
        raise ComposeError(f"{shown}: no Kubernetes object in it")
    objects = []
    for n, doc in enumerate(documents):
        if not isinstance(doc, dict):
            raise ComposeError(f"{shown}: document {n + 1} is not a mapping")
        key = (doc.get("apiVersion"), doc.get("kind"))
        name = _get(doc, "metadata", "name")
        if not isinstance(name, str) or not name:
            raise ComposeError(f"{shown}: document {n + 1} ({key[1]}) has no metadata.name")
        if key not in WORKLOADS and key not in PASSIVE and key != ("v1", "ConfigMap"):
            known = sorted({k for _, k in WORKLOADS} | {"ConfigMap"} | {k for _, k in PASSIVE})
            raise ComposeError(f"{shown}: {key[1]} {name} (apiVersion {key[0]}) is not a kind plan reads "
                               f"({', '.join(f'{a} {k}' for a, k in sorted(WORKLOADS))}; also "
                               f"{', '.join(known)})")
        if not is_object_name(name):
            raise ComposeError(f"{shown}: {key[1]} {name[:80]!r}: metadata.name is not a Kubernetes object name "
                               f"({OBJECT_NAME_RULE})")
        objects.append(doc)
    reader = _Reader(source, {})
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            reader.context = f"ConfigMap {obj['metadata']['name']}"
            reader.config_maps[obj["metadata"]["name"]] = reader.config_map_data(obj)
    services: list[Service] = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in WORKLOADS:
            services += reader.workload(obj)
    if not services:
        raise ComposeError(f"{shown}: no workload (RoleBasedGroup, Deployment, LeaderWorkerSet) in it")
    names = [s.name for s in services]
    if len(set(names)) != len(names):
        raise ComposeError(f"{shown}: two pods of one name ({sorted(n for n in names if names.count(n) > 1)[0]})")
    # Not a compose project: two manifests collide only through objects of one name in one namespace.
    namespace = _get(objects[0], "metadata", "namespace") or "default"
    workloads = sorted(o["metadata"]["name"] for o in objects if (o["apiVersion"], o["kind"]) in WORKLOADS)
    return Project(name=f"k8s:{namespace}/{','.join(workloads)}", compose_file=source, services=services)


def _get(node: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


# The types plan reads a manifest's fields as (what the Kubernetes API itself would insist on).
_EXPECTED = {
    "a mapping": lambda v: isinstance(v, dict),
    "a list": lambda v: isinstance(v, list),
    "a string": lambda v: isinstance(v, str),
    "a whole number": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "true or false": lambda v: isinstance(v, bool),
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
PROBE_NUMBERS = ("initialDelaySeconds", "periodSeconds", "timeoutSeconds", "successThreshold", "failureThreshold")


class _Reader:
    def __init__(self, source: Path, config_maps: dict[str, dict]):
        self.source = source
        self.shown = source.name
        self.config_maps = config_maps
        self._files: Path | None = None
        self.kind = ""
        self.context = ""  # the object being read, e.g. "RoleBasedGroup g", for type errors
        self.expanded_chars = 0  # what $(VAR) references have produced in all, capped

    def config_map_data(self, obj: dict) -> dict[str, str]:
        """A ConfigMap's data as the API admits it: keys that are file names, values that are strings."""
        data = self.typed(obj, "data", "a mapping", "", {})
        checked = {}
        for key in data:
            # YAML reads `1: x` as a number; kubectl sends it as the string "1"
            name = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
            if not isinstance(name, str) or not is_config_map_key(name):
                raise ComposeError(f"{self.shown}: {self.context}: data key {key!r:.80} is not a ConfigMap key "
                                   f"({CONFIG_MAP_KEY_RULE})")
            checked[name] = self.typed(data, key, "a string", "data", "")
        return checked

    def substitute(self, text: str, environment: dict[str, str], where: str) -> str:
        """``$(VAR)`` references replaced as the kubelet does, refused before they build a value past
        the budget (each entry may double the one before it: 40 entries ask for a terabyte)."""
        if "$(" not in text:  # a literal costs nothing beyond the file that holds it
            return text
        size = len(text)
        for match in _VAR.finditer(text):
            size += len(environment.get(match.group(1), match.group(0))) - len(match.group(0))
            if self.expanded_chars + size > MAX_TOTAL_CHARS:
                raise ComposeError(f"{self.shown}: {where}: $(VAR) references expand past {MAX_TOTAL_CHARS} "
                                   "characters")
        self.expanded_chars += size
        return _VAR.sub(lambda m: environment.get(m.group(1), m.group(0)), text)

    def typed(self, node: dict, key: str, expected: str, path: str, default: Any = None) -> Any:
        """node[key] when it has the expected type (default when absent or null); otherwise one line
        naming the field by its path, so odd input never reaches a check that would trip over it."""
        value = node.get(key)
        if value is None:
            return default
        if _EXPECTED[expected](value):
            return value
        raise self.wrong_type(f"{path}.{key}" if path else key, expected, value)

    def wrong_type(self, field: str, expected: str, value: Any) -> ComposeError:
        shown = f" ({value!r:.40})" if isinstance(value, (str, int, float)) else ""
        return ComposeError(f"{self.shown}: {self.context}: {field} must be {expected}, not {kind_of(value)}{shown}")

    def mappings(self, node: dict, key: str, path: str) -> list[tuple[str, dict]]:
        """A list of mappings (env, volumes, ...), each with its path."""
        items = []
        for n, item in enumerate(self.typed(node, key, "a list", path, [])):
            at = f"{path}.{key}[{n}]" if path else f"{key}[{n}]"
            if not isinstance(item, dict):
                raise self.wrong_type(at, "a mapping", item)
            items.append((at, item))
        return items

    # ----------------------------------------------------------------- workloads

    def workload(self, obj: dict) -> list[Service]:
        kind, name = obj["kind"], obj["metadata"]["name"]
        self.kind, self.context = kind, f"{kind} {name}"
        spec = self.typed(obj, "spec", "a mapping", "", {})
        if kind == "RoleBasedGroup":
            return self._rbg(name, spec)
        if kind == "Deployment":
            replicas = self._replicas(spec, f"Deployment {name}")
            template = self._template(spec, "spec", f"Deployment {name}")
            return [self._pod(f"{name}-{i}", template, "spec.template", {"DEPLOYMENT": name},
                              aliases=(name,) if replicas == 1 else (), role=name, restart=None)
                    for i in range(replicas)]
        replicas = self._replicas(spec, f"LeaderWorkerSet {name}")
        group = self.typed(spec, "leaderWorkerTemplate", "a mapping", "spec", {})
        size = self.typed(group, "size", "a whole number", "spec.leaderWorkerTemplate") or 1
        which = "leaderTemplate" if group.get("leaderTemplate") else "workerTemplate"
        template = self._template(group, "spec.leaderWorkerTemplate", f"LeaderWorkerSet {name}", which)
        restart = self.typed(group, "restartPolicy", "a string", "spec.leaderWorkerTemplate")
        return [self._pod(f"{name}-{i}", template, f"spec.leaderWorkerTemplate.{which}",
                          {"LWS_LEADER_ADDRESS": f"{name}-{i}.{name}",
                           "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": "0"},
                          aliases=(f"{name}-{i}.{name}",), role=name, restart=restart, group_size=size)
                for i in range(replicas)]

    def _rbg(self, group: str, spec: dict) -> list[Service]:
        roles = spec.get("roles")
        if not isinstance(roles, list) or not roles:
            raise ComposeError(f"{self.shown}: RoleBasedGroup {group} has no roles")
        role_names = [r.get("name") for r in roles if isinstance(r, dict)]
        pods: list[Service] = []
        by_role: dict[str, list[str]] = {}
        for n, role in enumerate(roles):
            rname = role.get("name") if isinstance(role, dict) else None
            where = f"RoleBasedGroup {group} role {rname}"
            at = f"spec.roles[{n}]"
            if not isinstance(rname, str) or not rname:
                raise ComposeError(f"{self.shown}: RoleBasedGroup {group}: a role without a name")
            replicas = self._replicas(role, where)
            patterns = [k for k in ("standalonePattern", "leaderWorkerPattern", "customComponentsPattern")
                        if k in role]
            if len(patterns) != 1 or patterns[0] == "customComponentsPattern":
                raise ComposeError(f"{self.shown}: {where}: plan reads roles with exactly one of "
                                   "standalonePattern or leaderWorkerPattern")
            pattern = self.typed(role, patterns[0], "a mapping", at, {})
            at_pattern = f"{at}.{patterns[0]}"
            size = 1
            if patterns[0] == "leaderWorkerPattern":
                size = self.typed(pattern, "size", "a whole number", at_pattern) or 1
            template = self._template(pattern, at_pattern, where)
            dependencies = self.typed(role, "dependencies", "a list", at, [])
            for dep in dependencies:
                if dep not in role_names:
                    raise ComposeError(f"{self.shown}: {where} depends on role {dep}, which the group lacks")
            restart = (self.typed(role, "restartPolicy", "a string", at)
                       or self.typed(self.typed(pattern, "restartPolicy", "a mapping", at_pattern, {}), "type",
                                     "a string", f"{at_pattern}.restartPolicy"))
            by_role[rname] = []
            for i in range(replicas):
                pod = f"{group}-{rname}-{i}"
                address = f"{pod}.s-{group}-{rname}"
                env = {"RBG_GROUP_NAME": group, "RBG_ROLE_NAME": rname, "RBG_ROLE_INDEX": str(i),
                       "RBG_LWP_LEADER_ADDRESS": address, "RBG_LWP_GROUP_SIZE": str(size),
                       "RBG_LWP_WORKER_INDEX": "0"}
                service = self._pod(f"{rname}-{i}", template, f"{at_pattern}.template", env, aliases=(address,),
                                    role=rname, restart=restart, group_size=size)
                service.raw["dependencies"] = list(dependencies)
                pods.append(service)
                by_role[rname].append(service.name)
        for service in pods:
            for dep in service.raw["dependencies"]:
                for name in by_role[dep]:
                    service.depends_on[name] = "service_healthy"
        return pods

    def _replicas(self, spec: dict, where: str) -> int:
        replicas = spec.get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= 256:
            raise ComposeError(f"{self.shown}: {where}: replicas must be a whole number 0-256, not {replicas!r}")
        return replicas

    def _template(self, parent: dict, path: str, where: str, key: str = "template") -> dict:
        template = self.typed(parent, key, "a mapping", path, {})
        spec = self.typed(template, "spec", "a mapping", f"{path}.{key}", {})
        if not self.typed(spec, "containers", "a list", f"{path}.{key}.spec"):
            raise ComposeError(f"{self.shown}: {where}: a pod template with containers is required")
        return template

    # ----------------------------------------------------------------- one pod

    def _pod(self, name: str, template: dict, path: str, injected: dict[str, str], *, aliases: tuple[str, ...],
             role: str, restart: str | None, group_size: int = 1) -> Service:
        spec = template["spec"]
        at_spec = f"{path}.spec"
        containers = self.mappings(spec, "containers", at_spec)
        if len(containers) != 1:
            raise ComposeError(f"{self.shown}: pod {name}: plan reads pods of one container "
                               f"(this one has {len(containers)})")
        at, container = containers[0]
        where = f"{self.shown}: pod {name}"
        environment = dict(injected)
        for _, ref in self.mappings(container, "envFrom", at):
            cm = _get(ref, "configMapRef", "name")
            if not isinstance(cm, str) or cm not in self.config_maps:
                raise ComposeError(f"{where}: envFrom names no ConfigMap of this manifest ({ref!r})")
            environment.update({str(k): str(v) for k, v in self.config_maps[cm].items()})
        for _, item in self.mappings(container, "env", at):
            if not isinstance(item.get("name"), str):
                raise ComposeError(f"{where}: an env entry without a name")
            if "value" in item:
                environment[item["name"]] = self.substitute(str(item["value"]), environment,
                                                            f"pod {name}: env {item['name'][:80]}")
            else:  # valueFrom: known only in the cluster
                environment[item["name"]] = f"$({item['name']})"
        argv = [str(t) for t in self.typed(container, "command", "a list", at, [])
                + self.typed(container, "args", "a list", at, [])]
        argv = [self.substitute(t, environment, f"pod {name}: its command") for t in argv]
        metadata = self.typed(template, "metadata", "a mapping", path, {})
        labels = {str(k): str(v) for k, v in self.typed(metadata, "labels", "a mapping", f"{path}.metadata",
                                                         {}).items()}
        labels[HOST_LABEL] = CLUSTER_HOST
        labels[MANIFEST_LABEL] = role
        resources = self.typed(container, "resources", "a mapping", at, {})
        limits = self.typed(resources, "limits", "a mapping", f"{at}.resources", {})
        requests = self.typed(resources, "requests", "a mapping", f"{at}.resources", {})
        probes = {}
        for key in PROBES:  # the probe rules do arithmetic on these numbers
            probes[key] = self.typed(container, key, "a mapping", at)
            for number in PROBE_NUMBERS if probes[key] else ():
                self.typed(probes[key], number, "a whole number", f"{at}.{key}")
        host = {key: self.typed(spec, key, "true or false", at_spec, False)
                for key in ("hostNetwork", "hostPID", "hostIPC")}
        raw = {"pod": name, "role": role, "kind": self.kind,
               "node_selector": self.typed(spec, "nodeSelector", "a mapping", at_spec, {}),
               "restart": restart, "group_size": group_size, "probes": probes,
               "resources": {**requests, **limits}, "volumes": [v for _, v in self.mappings(spec, "volumes", at_spec)],
               "mounts": [m for _, m in self.mappings(container, "volumeMounts", at)], "host_ipc": host["hostIPC"]}
        return Service(
            name=name,
            compose_file=self.source,
            image=self.typed(container, "image", "a string", at),
            argv=argv,
            environment=environment,
            network_mode="host" if host["hostNetwork"] else None,
            published_ports=[],
            binds=self._binds(name, spec, at_spec, container, at),
            depends_on={},
            healthcheck=_healthcheck(probes["readinessProbe"]),
            labels=labels,
            container_name=aliases[0] if aliases else None,
            gpu_reservation=self._gpus(f"{self.shown}/{name}", limits, f"{at}.resources.limits", environment, where),
            raw=raw,
            project="",
            pid="host" if host["hostPID"] else None,
            ipc="host" if host["hostIPC"] else None,
        )

    def _binds(self, pod: str, spec: dict, at_spec: str, container: dict, at: str) -> list[BindMount]:
        volumes = {self.typed(v, "name", "a string", v_at): (v_at, v)
                   for v_at, v in self.mappings(spec, "volumes", at_spec)}
        binds = []
        for m_at, mount in self.mappings(container, "volumeMounts", at):
            v_at, volume = volumes.get(self.typed(mount, "name", "a string", m_at), ("", None))
            target = mount.get("mountPath")
            if volume is None or not isinstance(target, str):
                raise ComposeError(f"{self.shown}: pod {pod}: volumeMount {mount.get('name')!r} names no volume")
            if "configMap" in volume:
                config_map = self.typed(volume, "configMap", "a mapping", v_at, {})
                source = self._config_map_dir(self.typed(config_map, "name", "a string", f"{v_at}.configMap"), pod)
            elif "hostPath" in volume:
                host_path = self.typed(volume, "hostPath", "a mapping", v_at, {})
                source = Path(self.typed(host_path, "path", "a string", f"{v_at}.hostPath") or "/")
            elif "persistentVolumeClaim" in volume:
                claim = self.typed(volume, "persistentVolumeClaim", "a mapping", v_at, {})
                source = Path("/persistentVolumeClaim") / str(claim.get("claimName"))
            else:
                continue  # emptyDir and the like: nothing plan reads from them
            sub_path = self.typed(mount, "subPath", "a string", m_at)
            if sub_path:
                source = source / sub_path
            binds.append(BindMount(source, target, self.typed(mount, "readOnly", "true or false", m_at, False)))
        return binds

    def _config_map_dir(self, name: str, pod: str) -> Path:
        if name not in self.config_maps:
            raise ComposeError(f"{self.shown}: pod {pod} mounts ConfigMap {name}, which this manifest lacks")
        if self._files is None:
            self._files = Path(tempfile.mkdtemp(prefix="dsv41-plan-k8s-"))
            atexit.register(shutil.rmtree, self._files, True)
        # Names and keys were checked when read; resolved again so that no path leaves the temp dir.
        root = self._files.resolve()
        folder = (root / name).resolve()
        if folder.parent != root:
            raise ComposeError(f"{self.shown}: ConfigMap {name[:80]!r}: not a name plan can write as a folder")
        if not folder.exists():
            folder.mkdir()
            for key, value in self.config_maps[name].items():
                file = (folder / key).resolve()
                if file.parent != folder:
                    raise ComposeError(f"{self.shown}: ConfigMap {name}: data key {key[:80]!r} is no file name")
                file.write_text(value)
        return folder

    def _gpus(self, pod: str, limits: dict, path: str, environment: dict[str, str], where: str) -> GpuReservation:
        raw = limits.get(GPU_RESOURCE)
        if raw is None:
            return GpuReservation(False, (), "no nvidia.com/gpu limit")
        try:  # a quantity: 8 or "8"
            count = int(str(raw))
        except ValueError:
            raise self.wrong_type(f"{path}.{GPU_RESOURCE}", "a whole number", raw) from None
        if not 0 <= count <= MAX_POD_GPUS:  # checked before anything is built for each GPU
            raise ComposeError(f"{where}: {GPU_RESOURCE}: {count} is not a GPU count a pod can get "
                               f"(0 to {MAX_POD_GPUS})")
        ids = [f"{pod}#{i}" for i in range(count)]
        how = f"{GPU_RESOURCE}: {count}"
        visible = environment.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            picks = [p.strip() for p in visible.split(",") if p.strip()]
            if any(not p.isdigit() or int(p) >= count for p in picks):
                raise ComposeError(f"{where}: CUDA_VISIBLE_DEVICES={visible} names a GPU the pod does not get ({how})")
            ids = [ids[int(p)] for p in picks]
            how += " + CUDA_VISIBLE_DEVICES"
        return GpuReservation(True, tuple(ids), how, (), count)


def _healthcheck(probe: Any) -> dict | None:
    """The readiness probe in the compose shape the healthcheck rule reads."""
    get = _get(probe, "httpGet")
    if isinstance(get, dict):
        return {"test": ["CMD", "httpGet", f"http://127.0.0.1:{get.get('port')}{get.get('path', '/')}"]}
    socket = _get(probe, "tcpSocket")
    if isinstance(socket, dict):
        return {"test": ["CMD", "tcpSocket", f"127.0.0.1:{socket.get('port')}"]}
    command = _get(probe, "exec", "command")
    if isinstance(command, list):
        return {"test": ["CMD"] + [str(c) for c in command]}
    return None
