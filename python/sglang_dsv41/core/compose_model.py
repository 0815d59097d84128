"""Read docker compose files the way ``docker compose`` does, for offline checks.

Covers what our topologies use and what a user is likely to write around them:
YAML anchors and merge keys, ``${VAR}`` interpolation with the compose
operators, top-level ``include``, ``extends`` (same file or another file) with
the compose merge rules, the short and long syntax of ``volumes`` and
``ports``, ``environment`` as a list or a mapping, ``env_file``, and GPU
reservations. Anything it cannot interpret raises ``ComposeError`` instead of
being skipped, so the checker never passes a file it did not understand.

No sglang import here: this is plain data handling.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

HOST_LABEL = "sglang-dsv41.host"
LOCAL_HOST = "local"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:-|-|:\?|\?|:\+|\+)(.*))?\Z", re.S)
# Attributes whose value replaces the base value under ``extends`` instead of
# being merged (the compose merge rules call these shell commands).
_REPLACED = {"command", "entrypoint"}
_KEYED_MAPPINGS = {"environment", "labels", "extra_hosts", "sysctls", "annotations"}


class ComposeError(ValueError):
    """A compose file that cannot be read the way docker compose reads it."""


@dataclass(frozen=True)
class BindMount:
    source: Path  # absolute host path
    target: str  # absolute container path
    read_only: bool


@dataclass(frozen=True)
class PublishedPort:
    host_port: int
    container_port: int
    protocol: str = "tcp"


@dataclass
class Service:
    name: str
    compose_file: Path  # the top-level file given to the checker
    image: str | None
    argv: list[str]  # entrypoint + command, as the container runs it
    environment: dict[str, str]
    network_mode: str | None
    published_ports: list[PublishedPort]
    binds: list[BindMount]
    depends_on: dict[str, str]  # service -> condition
    healthcheck: dict | None
    labels: dict[str, str]
    container_name: str | None
    gpu_reservation: "GpuReservation"
    raw: dict = field(repr=False, default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.compose_file.name}/{self.name}"

    @property
    def host(self) -> str:
        """Which machine the service runs on; services of one host share GPUs and ports."""
        return self.labels.get(HOST_LABEL, LOCAL_HOST)

    def host_path(self, container_path: str) -> Path | None:
        """The host file behind a container path, through the service's bind mounts."""
        best = None
        for bind in self.binds:
            target = bind.target.rstrip("/") or "/"
            if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
                if best is None or len(target) > len(best.target):
                    best = bind
        if best is None:
            return None
        rest = container_path[len(best.target.rstrip("/")):].lstrip("/")
        return best.source / rest if rest else best.source


@dataclass(frozen=True)
class GpuReservation:
    """GPUs a container can see, as host GPU ids, in the order CUDA numbers them.

    ``None`` visible means the set is chosen by docker at start time (a count
    without ids), which no offline check can reason about.
    """

    declared: bool
    visible: tuple[str, ...] | None
    how: str


# --------------------------------------------------------------------------- interpolation


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines as compose reads them (comments, ``export``, quotes)."""
    values: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("export "):
            text = text[len("export "):].lstrip()
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not _NAME.fullmatch(key):
            raise ComposeError(f"{path}:{lineno}: not a KEY=VALUE line: {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[key] = value
    return values


def interpolate(text: str, lookup: Callable[[str], str | None], where: str) -> str:
    """Expand ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``, ``${VAR:?e}``,
    ``${VAR?e}``, ``${VAR:+a}``, ``${VAR+a}`` and ``$$``; an unset variable
    without a default is an error (compose would substitute an empty string)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$":
            out.append(char)
            i += 1
            continue
        nxt = text[i + 1:i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
            continue
        if nxt == "{":
            depth, j = 1, i + 2
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise ComposeError(f"{where}: unterminated ${{...}} in {text!r}")
            out.append(_expand_braced(text[i + 2:j - 1], lookup, where))
            i = j
            continue
        match = _NAME.match(text, i + 1)
        if not match:
            out.append("$")
            i += 1
            continue
        name = match.group()
        value = lookup(name)
        if value is None:
            raise ComposeError(f"{where}: variable {name} is not set and has no default")
        out.append(value)
        i = match.end()
    return "".join(out)


def _expand_braced(body: str, lookup, where: str) -> str:
    match = _BRACED.match(body)
    if not match:
        raise ComposeError(f"{where}: cannot read ${{{body}}}")
    name, op, arg = match.groups()
    value = lookup(name)
    if op is None:
        if value is None:
            raise ComposeError(f"{where}: variable {name} is not set and has no default")
        return value
    empty = value is None or (op.startswith(":") and value == "")
    if op in (":-", "-"):
        return interpolate(arg, lookup, where) if empty else value
    if op in (":?", "?"):
        if empty:
            reason = interpolate(arg, lookup, where) or "is required"
            raise ComposeError(f"{where}: variable {name}: {reason}")
        return value
    return "" if empty else interpolate(arg, lookup, where)  # :+ and +


def _interpolate_tree(node: Any, lookup, where: str) -> Any:
    if isinstance(node, str):
        return interpolate(node, lookup, where)
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, lookup, f"{where}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate_tree(v, lookup, f"{where}[{n}]") for n, v in enumerate(node)]
    return node


# --------------------------------------------------------------------------- normalisation


def _as_mapping(value: Any, where: str) -> dict[str, str | None]:
    """``environment``/``labels`` as a mapping; list items are ``KEY=VALUE`` or ``KEY``."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): _scalar_text(v) for k, v in value.items()}
    if isinstance(value, list):
        result: dict[str, str | None] = {}
        for item in value:
            key, sep, val = str(item).partition("=")
            result[key] = val if sep else None
        return result
    raise ComposeError(f"{where}: expected a list or a mapping")


def _scalar_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _volume_target(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry.get("target", ""))
    parts = str(entry).split(":")
    return parts[1] if len(parts) >= 2 else parts[0]


def _merge(base: Any, local: Any, key: str | None = None) -> Any:
    """The compose merge rules for ``extends``/multi-file merges."""
    if key in _REPLACED or local is None:
        return base if local is None else local
    if key in _KEYED_MAPPINGS:
        merged = _as_mapping(base, key)
        merged.update(_as_mapping(local, key))
        return merged
    if key == "volumes" and isinstance(base, list) and isinstance(local, list):
        by_target = {_volume_target(v): v for v in base}
        by_target.update({_volume_target(v): v for v in local})
        return list(by_target.values())
    if isinstance(base, dict) and isinstance(local, dict):
        merged = dict(base)
        for k, v in local.items():
            if key == "healthcheck" and k == "test":
                merged[k] = v
            else:
                merged[k] = _merge(base.get(k), v, k) if k in base else v
        return merged
    if isinstance(base, list) and isinstance(local, list):
        return base + [v for v in local if v not in base]
    return local


def _absolute_binds(service: dict, base_dir: Path) -> dict:
    """Bind sources made absolute relative to the file that declared them."""
    volumes = service.get("volumes")
    if not volumes:
        return service
    fixed = []
    for entry in volumes:
        if isinstance(entry, dict):
            if entry.get("type") == "bind" and "source" in entry:
                entry = {**entry, "source": str(_host_path(entry["source"], base_dir))}
        else:
            parts = str(entry).split(":")
            if len(parts) >= 2 and _looks_like_path(parts[0]):
                parts[0] = str(_host_path(parts[0], base_dir))
                entry = ":".join(parts)
        fixed.append(entry)
    return {**service, "volumes": fixed}


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", ".", "~"))


def _host_path(source: str, base_dir: Path) -> Path:
    path = Path(os.path.expanduser(source))
    return path if path.is_absolute() else (base_dir / path).resolve()


# --------------------------------------------------------------------------- loading


@dataclass
class _Document:
    path: Path
    services: dict[str, dict]
    # Which file each service comes from (itself, or an included file).
    origin: dict[str, "_Document"] = field(default_factory=dict)


class _Loader:
    def __init__(self, lookup):
        self.lookup = lookup
        self.cache: dict[Path, _Document] = {}

    def document(self, path: Path) -> _Document:
        path = path.resolve()
        if path in self.cache:
            return self.cache[path]
        if not path.is_file():
            raise ComposeError(f"{path}: no such compose file")
        try:
            tree = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ComposeError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(tree, dict):
            raise ComposeError(f"{path}: a compose file is a mapping at the top level")
        tree = _interpolate_tree(tree, self.lookup, path.name)
        services = dict(tree.get("services") or {})
        for name, body in services.items():
            if not isinstance(body, dict):
                raise ComposeError(f"{path.name}: service {name} is not a mapping")
            services[name] = _absolute_binds(body, path.parent)
        doc = _Document(path, services)
        doc.origin = {name: doc for name in services}
        self.cache[path] = doc
        for included in self._includes(tree.get("include"), path):
            other = self.document(included)
            for name, body in other.services.items():
                if name in services:
                    raise ComposeError(
                        f"{path.name}: service {name} is defined both here and in {included.name}"
                    )
                services[name] = body
                doc.origin[name] = other.origin[name]
        return doc

    @staticmethod
    def _includes(spec: Any, path: Path) -> list[Path]:
        if not spec:
            return []
        found = []
        for item in spec:
            paths = item.get("path") if isinstance(item, dict) else item
            for one in [paths] if isinstance(paths, str) else list(paths or []):
                found.append(_host_path(one, path.parent))
        return found

    def resolved(self, doc: _Document, name: str, chain: tuple = ()) -> dict:
        key = (doc.path, name)
        if key in chain:
            raise ComposeError(f"{doc.path.name}: extends cycle through service {name}")
        if name not in doc.services:
            raise ComposeError(f"{doc.path.name}: no service named {name}")
        body = dict(doc.services[name])
        ext = body.pop("extends", None)
        if ext is None:
            return body
        if isinstance(ext, str):
            base_doc, base_name = doc, ext
        elif isinstance(ext, dict) and "service" in ext:
            base_doc = self.document(_host_path(ext["file"], doc.path.parent)) if ext.get("file") else doc
            base_name = ext["service"]
        else:
            raise ComposeError(f"{doc.path.name}: service {name}: extends needs a service name")
        base = self.resolved(base_doc, base_name, chain + (key,))
        merged = dict(base)
        for k, v in body.items():
            merged[k] = _merge(base.get(k), v, k) if k in base else v
        return merged


def project_lookup(compose_file: Path, environ: Mapping[str, str]) -> tuple[Callable, Path | None]:
    """Variables for interpolation: the process environment over the project's
    ``.env``; without a ``.env``, its ``.env.example`` stands in (reported)."""
    directory = compose_file.resolve().parent
    env_path = directory / ".env"
    if not env_path.is_file():
        env_path = directory / ".env.example"
    file_values = read_env_file(env_path) if env_path.is_file() else {}
    if not env_path.is_file():
        env_path = None

    def lookup(name: str) -> str | None:
        if name in environ:
            return environ[name]
        return file_values.get(name)

    return lookup, env_path


def load_services(compose_file: str | Path, environ: Mapping[str, str] | None = None) -> tuple[list[Service], Path | None]:
    """All services of one compose project, extends and includes applied."""
    path = Path(compose_file)
    lookup, env_path = project_lookup(path, os.environ if environ is None else environ)
    loader = _Loader(lookup)
    doc = loader.document(path)
    services = []
    for name in doc.services:
        body = loader.resolved(doc.origin[name], name)
        services.append(_service(name, path.resolve(), body, lookup))
    return services, env_path


def _command(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ComposeError(f"{where}: cannot split the command: {exc}") from exc
    if isinstance(value, list):
        return [str(v) for v in value]
    raise ComposeError(f"{where}: a command is a string or a list")


def _service(name: str, compose_file: Path, body: dict, lookup) -> Service:
    where = f"{compose_file.name}/{name}"
    environment: dict[str, str] = {}
    for env_file in _env_files(body.get("env_file"), compose_file.parent):
        environment.update(read_env_file(env_file))
    for key, value in _as_mapping(body.get("environment"), where).items():
        if value is None:
            value = lookup(key)  # "KEY" alone takes the caller's value
            if value is None:
                continue
        environment[key] = value
    return Service(
        name=name,
        compose_file=compose_file,
        image=body.get("image"),
        argv=_command(body.get("entrypoint"), where) + _command(body.get("command"), where),
        environment=environment,
        network_mode=body.get("network_mode"),
        published_ports=_ports(body.get("ports") or [], where),
        binds=_binds(body.get("volumes") or [], where),
        depends_on=_depends_on(body.get("depends_on"), where),
        healthcheck=body.get("healthcheck"),
        labels={k: v or "" for k, v in _as_mapping(body.get("labels"), where).items()},
        container_name=body.get("container_name"),
        gpu_reservation=_gpus(body, environment, where),
        raw=body,
    )


def _env_files(spec: Any, base_dir: Path) -> list[Path]:
    if not spec:
        return []
    items = [spec] if isinstance(spec, (str, dict)) else list(spec)
    paths = []
    for item in items:
        path = _host_path(item["path"] if isinstance(item, dict) else item, base_dir)
        required = item.get("required", True) if isinstance(item, dict) else True
        if path.is_file():
            paths.append(path)
        elif required:
            raise ComposeError(f"env_file {path} does not exist")
    return paths


def _depends_on(spec: Any, where: str) -> dict[str, str]:
    if not spec:
        return {}
    if isinstance(spec, list):
        return {str(s): "service_started" for s in spec}
    if isinstance(spec, dict):
        return {str(k): (v or {}).get("condition", "service_started") for k, v in spec.items()}
    raise ComposeError(f"{where}: depends_on is a list or a mapping")


def _binds(volumes: list, where: str) -> list[BindMount]:
    binds = []
    for entry in volumes:
        if isinstance(entry, dict):
            if entry.get("type") != "bind":
                continue
            binds.append(BindMount(Path(entry["source"]), str(entry["target"]), bool(entry.get("read_only"))))
            continue
        parts = str(entry).split(":")
        if len(parts) < 2 or not _looks_like_path(parts[0]):
            continue  # a named or anonymous volume
        mode = parts[2] if len(parts) > 2 else ""
        binds.append(BindMount(Path(parts[0]), parts[1], "ro" in mode.split(",")))
    return binds


def _ports(entries: list, where: str) -> list[PublishedPort]:
    ports = []
    for entry in entries:
        if isinstance(entry, dict):
            if entry.get("published") is None:
                continue
            host = _port_range(str(entry["published"]), where)
            target = _port_range(str(entry["target"]), where)
            protocol = entry.get("protocol", "tcp")
        else:
            text, _, protocol = str(entry).partition("/")
            protocol = protocol or "tcp"
            parts = text.rsplit(":", 2)
            if len(parts) == 1:
                continue  # container port only: docker picks an ephemeral host port
            host = _port_range(parts[-2], where) if parts[-2] else []
            target = _port_range(parts[-1], where)
        if len(host) == 1 and len(target) > 1:
            raise ComposeError(f"{where}: port mapping {entry!r} maps a range onto one port")
        for n, host_port in enumerate(host):
            ports.append(PublishedPort(host_port, target[min(n, len(target) - 1)], protocol))
    return ports


def _port_range(text: str, where: str) -> list[int]:
    try:
        low, _, high = text.partition("-")
        first, last = int(low), int(high or low)
    except ValueError as exc:
        raise ComposeError(f"{where}: cannot read port {text!r}") from exc
    return list(range(first, last + 1))


def _gpus(body: dict, environment: dict[str, str], where: str) -> GpuReservation:
    """Host GPUs the container sees, narrowed by CUDA_VISIBLE_DEVICES inside it."""
    ids: list[str] | None = None
    declared = False
    how = ""
    devices = (((body.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    for device in devices:
        capabilities = {c for group in [device.get("capabilities") or []] for c in group}
        if device.get("driver") not in (None, "nvidia") and "gpu" not in capabilities:
            continue
        declared = True
        if device.get("device_ids"):
            ids = (ids or []) + [i.strip() for d in device["device_ids"] for i in str(d).split(",")]
            how = "device_ids"
        elif str(device.get("count", "all")) == "all":
            how = how or "count: all"
        else:
            return GpuReservation(True, None, f"count: {device['count']} (docker picks the GPUs)")
    if "gpus" in body:
        declared = True
        gpus = body["gpus"]
        if gpus == "all":
            how = how or "gpus: all"
        else:
            for item in gpus or []:
                if item.get("device_ids"):
                    ids = (ids or []) + [str(i) for i in item["device_ids"]]
                    how = "gpus.device_ids"
                else:
                    return GpuReservation(True, None, "gpus with a count (docker picks the GPUs)")
    nvidia_visible = environment.get("NVIDIA_VISIBLE_DEVICES")
    if nvidia_visible and nvidia_visible not in ("all", "none", "void"):
        ids = [i.strip() for i in nvidia_visible.split(",") if i.strip()]
        how = "NVIDIA_VISIBLE_DEVICES"
        declared = True
    if not declared:
        return GpuReservation(False, (), "no GPU reservation")
    cuda_visible = environment.get("CUDA_VISIBLE_DEVICES")
    if cuda_visible is not None:
        picks = [i.strip() for i in cuda_visible.split(",") if i.strip()]
        if ids is None:
            # Every host GPU is in the container, numbered as on the host.
            return GpuReservation(True, tuple(picks), f"{how} + CUDA_VISIBLE_DEVICES")
        chosen = []
        for pick in picks:
            if pick.isdigit() and int(pick) < len(ids):
                chosen.append(ids[int(pick)])
            elif pick in ids:
                chosen.append(pick)
            else:
                raise ComposeError(
                    f"{where}: CUDA_VISIBLE_DEVICES={cuda_visible} names GPU {pick}, which the "
                    f"container does not have ({how}: {','.join(ids)})"
                )
        return GpuReservation(True, tuple(chosen), f"{how} + CUDA_VISIBLE_DEVICES")
    if ids is None:
        return GpuReservation(True, None, f"{how} without CUDA_VISIBLE_DEVICES (every GPU of the host)")
    return GpuReservation(True, tuple(ids), how)
