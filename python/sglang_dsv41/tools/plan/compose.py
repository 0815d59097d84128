"""Read docker compose files the way ``docker compose`` does, for offline checks.

Covers the compose features our topologies and their likely neighbours use
(anchors, interpolation, ``.env``, ``include``, ``extends``, ``profiles``, the
short and long syntaxes) and the output of ``docker compose config``. Anything
it cannot interpret raises ``ComposeError`` with one line naming the file (and
service), never skipped; input size and expansion are capped.
No sglang import here: this is plain data handling.

Design: docs/design/plan.md.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

HOST_LABEL = "sglang-dsv41.host"
# A service plan must not interpret (a sidecar of the user's own) carries this label set to "true".
IGNORE_LABEL = "sglang-dsv41.ignore"
LOCAL_HOST = "local"

# Limits that keep any input cheap to read. Compose files are a few KiB; these
# are far above any real deployment and far below what hurts a laptop.
MAX_FILE_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 200_000  # after alias expansion
MAX_YAML_ALIASES = 10_000
MAX_TEXT_CHARS = 1 << 16  # one interpolated value
MAX_TOTAL_CHARS = 1 << 24  # all interpolated values of one load
MAX_EXTENDS_DEPTH = 32
MAX_INCLUDE_DEPTH = 32
MAX_PORTS_PER_SERVICE = 65_536
MAX_PUBLISHED_PORTS = 262_144  # all services of one load

# yaml's C loader is much faster; the pure-Python one is the fallback.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:-|-|:\?|\?|:\+|\+)(.*))?\Z", re.S)
# Service names compose accepts (and which are safe to print on one line).
_SERVICE_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*\Z")
_PROJECT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*\Z")
# Attributes whose value replaces the base value under ``extends`` instead of
# being merged (the compose merge rules call these shell commands).
_REPLACED = {"command", "entrypoint"}
_KEYED_MAPPINGS = {"environment", "labels", "extra_hosts", "sysctls", "annotations"}


class ComposeError(ValueError):
    """A compose file that cannot be read the way docker compose reads it.

    The message is always one line: it names the file (and the service, where
    there is one) and the reason."""

    def __init__(self, message: str):
        text = " ".join(str(message).split())
        if len(text) > 500:
            text = text[:497] + "..."
        super().__init__(text)


def _show(value: Any, limit: int = 60) -> str:
    """A user value, quoted and cut short, safe inside a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


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
    project: str = ""
    pid: str | None = None  # the PID namespace: "host", "service:x", "container:x" or None (its own)
    ipc: str | None = None
    extra_hosts: dict[str, str] = field(default_factory=dict)
    profiles: tuple[str, ...] = ()
    optional_depends_on: frozenset = frozenset()  # depends_on entries with required: false

    @property
    def label(self) -> str:
        return f"{self.compose_file.name}/{self.name}"

    @property
    def host(self) -> str:
        """Which machine the service runs on; services of one host share GPUs and ports."""
        return self.labels.get(HOST_LABEL, LOCAL_HOST)

    @property
    def ignored(self) -> bool:
        """The user marked this service as unrelated to the deployment plan checks."""
        return self.labels.get(IGNORE_LABEL, "").strip().lower() == "true"

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
    # Host GPU ids the file names anywhere (device_ids, NVIDIA_VISIBLE_DEVICES,
    # CUDA_VISIBLE_DEVICES with every GPU), and a GPU count it asks docker for.
    named_ids: tuple[str, ...] = ()
    count: int | None = None


@dataclass
class Project:
    """One ``docker compose -f FILE up``: its project name and active services."""

    name: str
    compose_file: Path
    services: list[Service]
    # Services left out because none of their profiles is active: name -> profiles.
    inactive: dict[str, tuple[str, ...]] = field(default_factory=dict)
    env_file: Path | None = None


# --------------------------------------------------------------------------- bounded reading


def read_text(path: Path, what: str = "file") -> str:
    """A small UTF-8 text file, refused when it is not one."""
    shown = _display(path)
    try:
        if not path.exists():
            raise ComposeError(f"{shown}: no such {what}")
        if not path.is_file():
            raise ComposeError(f"{shown}: not a regular file")
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ComposeError(f"{shown}: cannot read the {what}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a path with a NUL byte
        raise ComposeError(f"{shown}: unusable path: {exc}") from None
    return decode_text(data, shown)


def decode_text(data: bytes, shown: str) -> str:
    if len(data) > MAX_FILE_BYTES:
        raise ComposeError(f"{shown}: larger than {MAX_FILE_BYTES // 1024} KiB; not a compose file plan reads")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ComposeError(f"{shown}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    return text[1:] if text.startswith("\ufeff") else text


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def check_yaml_bounds(text: str, shown: str) -> None:
    """Refuse deep nesting and alias bombs, and nothing else (YAML errors are the reader's to report)."""
    _check_yaml_size(text, shown, syntax_errors=False)


def _check_yaml_size(text: str, shown: str, syntax_errors: bool = True) -> None:
    """Walk the YAML events once and refuse deep nesting and alias bombs.

    An alias stands for the whole node it names, so the size after expansion is
    counted with each anchor's own expanded size: a "billion laughs" document is
    refused after a few thousand events instead of being expanded."""
    sizes: dict[str, int] = {}
    open_anchors: list[str | None] = []
    counts: list[int] = [0]
    aliases = 0
    loader = _YAML_LOADER(text)
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                open_anchors.append(event.anchor)
                counts.append(0)
                if len(open_anchors) > MAX_YAML_DEPTH:
                    raise ComposeError(f"{shown}: nested deeper than {MAX_YAML_DEPTH} levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                size = counts.pop() + 1
                anchor = open_anchors.pop()
                if anchor is not None:
                    sizes[anchor] = size
                counts[-1] += size
            elif isinstance(event, yaml.ScalarEvent):
                if event.anchor is not None:
                    sizes[event.anchor] = 1
                counts[-1] += 1
            elif isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_YAML_ALIASES:
                    raise ComposeError(f"{shown}: more than {MAX_YAML_ALIASES} YAML aliases")
                if event.anchor in open_anchors:
                    raise ComposeError(f"{shown}: the YAML alias *{event.anchor} refers to a node that contains it")
                counts[-1] += sizes.get(event.anchor, 1)
            if counts[-1] > MAX_YAML_NODES:
                raise ComposeError(f"{shown}: more than {MAX_YAML_NODES} YAML nodes once aliases are "
                                   "expanded (an alias bomb?)")
    except yaml.YAMLError as exc:
        if syntax_errors:
            raise ComposeError(f"{shown}: not valid YAML: {_yaml_problem(exc)}") from None
    finally:
        loader.dispose()


def parse_yaml(text: str, shown: str) -> Any:
    _check_yaml_size(text, shown)
    try:
        return yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        raise ComposeError(f"{shown}: not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ComposeError(f"{shown}: nested too deeply") from None


def parse_yaml_documents(text: str, shown: str) -> list[Any]:
    """Every document of a YAML stream (``---`` between them), under the bounds of ``parse_yaml``.

    The node bound holds for the whole stream, not each document: many small
    alias bombs in one file would otherwise add up to the same expansion."""
    _check_yaml_size(text, shown)
    try:
        return list(yaml.load_all(text, Loader=_YAML_LOADER))
    except yaml.YAMLError as exc:
        raise ComposeError(f"{shown}: not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ComposeError(f"{shown}: nested too deeply") from None


# --------------------------------------------------------------------------- interpolation


class _Budget:
    """Interpolated text of one load, capped in total."""

    def __init__(self):
        self.used = 0
        self.ports = 0  # published ports of the whole load (a range is many)

    def spend(self, text: str, where: str) -> str:
        if len(text) > MAX_TEXT_CHARS:
            raise ComposeError(f"{where}: a value longer than {MAX_TEXT_CHARS} characters after interpolation")
        self.used += len(text)
        if self.used > MAX_TOTAL_CHARS:
            raise ComposeError(f"{where}: more than {MAX_TOTAL_CHARS} characters of text after interpolation")
        return text


def _unquote_env_value(raw: str, where: str) -> tuple[str, bool]:
    """The value of one ``.env`` line and whether it is subject to interpolation."""
    value = raw.strip()
    if value[:1] in ("'", '"'):
        quote = value[0]
        end = 1
        while end < len(value) and value[end] != quote:
            end += 2 if (quote == '"' and value[end] == "\\") else 1
        if end >= len(value):
            raise ComposeError(f"{where}: unterminated {quote} quote")
        rest = value[end + 1:].strip()
        if rest and not rest.startswith("#"):
            raise ComposeError(f"{where}: text after the closing quote: {_show(rest)}")
        body = value[1:end]
        if quote == "'":
            return body, False  # single quotes: literal, no interpolation
        escapes = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}
        return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), m.group(0)), body), True
    if " #" in value or "\t#" in value:
        value = re.split(r"[ \t]#", value, 1)[0].rstrip()
    return value, True


def read_env_file(path: Path, environ: Mapping[str, str] | None = None,
                  budget: _Budget | None = None) -> dict[str, str]:
    """``KEY=VALUE`` lines as compose reads them (comments, ``export``, quotes),
    with ``${VAR}`` in values expanded from the environment, then from the lines
    above (single-quoted values stay literal)."""
    environ = {} if environ is None else environ
    budget = budget or _Budget()
    values: dict[str, str] = {}
    shown = _display(path)

    def lookup(name: str) -> str | None:
        return environ[name] if name in environ else values.get(name)

    for lineno, line in enumerate(read_text(path, "env file").splitlines(), 1):
        where = f"{shown}:{lineno}"
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("export "):
            text = text[len("export "):].lstrip()
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not _NAME.fullmatch(key):
            raise ComposeError(f"{where}: not a KEY=VALUE line: {_show(line)}")
        value, expand = _unquote_env_value(value, where)
        values[key] = interpolate(value, lookup, where, budget) if expand else budget.spend(value, where)
    return values


def interpolate(text: str, lookup: Callable[[str], str | None], where: str,
                budget: _Budget | None = None) -> str:
    """Expand ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``, ``${VAR:?e}``,
    ``${VAR?e}``, ``${VAR:+a}``, ``${VAR+a}`` and ``$$``; an unset variable
    without a default is an error (compose would substitute an empty string)."""
    budget = budget or _Budget()
    return budget.spend(_interpolate(text, lookup, where, budget), where)


def _interpolate(text: str, lookup, where: str, budget: _Budget) -> str:
    out: list[str] = []
    size = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$":
            j = text.find("$", i)
            j = len(text) if j < 0 else j
            out.append(text[i:j])
            size += j - i
            i = j
            continue
        nxt = text[i + 1:i + 2]
        if nxt == "$":
            out.append("$")
            size += 1
            i += 2
            continue
        if nxt == "{":
            depth, j = 1, i + 2
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise ComposeError(f"{where}: unterminated ${{...}} in {_show(text)}")
            piece = _expand_braced(text[i + 2:j - 1], lookup, where, budget)
            i = j
        else:
            match = _NAME.match(text, i + 1)
            if not match:
                out.append("$")
                size += 1
                i += 1
                continue
            name = match.group()
            piece = lookup(name)
            if piece is None:
                raise ComposeError(f"{where}: variable {name} is not set and has no default")
            i = match.end()
        out.append(piece)
        size += len(piece)
        if size > MAX_TEXT_CHARS:
            raise ComposeError(f"{where}: a value longer than {MAX_TEXT_CHARS} characters after interpolation")
    return "".join(out)


def _expand_braced(body: str, lookup, where: str, budget: _Budget) -> str:
    match = _BRACED.match(body)
    if not match:
        raise ComposeError(f"{where}: cannot read ${{{_show(body)[1:-1]}}}")
    name, op, arg = match.groups()
    value = lookup(name)
    if op is None:
        if value is None:
            raise ComposeError(f"{where}: variable {name} is not set and has no default")
        return value
    empty = value is None or (op.startswith(":") and value == "")
    if op in (":-", "-"):
        return _interpolate(arg, lookup, where, budget) if empty else value
    if op in (":?", "?"):
        if empty:
            reason = _interpolate(arg, lookup, where, budget) or "is required"
            raise ComposeError(f"{where}: variable {name}: {reason}")
        return value
    return "" if empty else _interpolate(arg, lookup, where, budget)  # :+ and +


def _interpolate_tree(node: Any, lookup, where: str, budget: _Budget) -> Any:
    """Values interpolated, keys kept; iterative, so deep input cannot overflow the stack."""
    if isinstance(node, str):
        return interpolate(node, lookup, where, budget)
    if not isinstance(node, (dict, list)):
        return node
    root: list = [None]
    stack = [(root, 0, node, where)]
    while stack:
        parent, key, value, here = stack.pop()
        if isinstance(value, str):
            parent[key] = interpolate(value, lookup, here, budget)
        elif isinstance(value, dict):
            copy: dict = {}
            parent[key] = copy
            for k, v in value.items():
                copy[k] = None
                stack.append((copy, k, v, f"{here}.{k}"))
        elif isinstance(value, list):
            copy_list: list = [None] * len(value)
            parent[key] = copy_list
            for n, v in enumerate(value):
                stack.append((copy_list, n, v, f"{here}[{n}]"))
        else:
            parent[key] = value
    return root[0]


# --------------------------------------------------------------------------- typed access


def kind_of(value: Any) -> str:
    """What a YAML value is, as an error message names it ("a list", "a string", ...)."""
    if value is None:
        return "empty"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _mapping(value: Any, where: str, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ComposeError(f"{where}: {what} must be a mapping, not {kind_of(value)}")
    return value


def _list(value: Any, where: str, what: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ComposeError(f"{where}: {what} must be a list, not {kind_of(value)}")
    return value


def _string(value: Any, where: str, what: str, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ComposeError(f"{where}: {what} must be a string, not {kind_of(value)}")
    return str(value)


def _scalar_text(value: Any, where: str = "", what: str = "a value") -> str | None:
    """Compose's scalar values: strings, numbers, booleans (as compose writes them) or empty."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    raise ComposeError(f"{where}: {what} must be a string, number or boolean, not {kind_of(value)}")


def _key_text(key: Any, where: str) -> str:
    text = _scalar_text(key, where, "a key")
    return "" if text is None else text


def _as_mapping(value: Any, where: str, what: str = "the value") -> dict[str, str | None]:
    """``environment``/``labels`` as a mapping; list items are ``KEY=VALUE`` or ``KEY``."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {_key_text(k, where): _scalar_text(v, where, f"{what} {_show(k)}") for k, v in value.items()}
    if isinstance(value, list):
        result: dict[str, str | None] = {}
        for item in value:
            text = _scalar_text(item, where, f"an item of {what}")
            key, sep, val = (text or "").partition("=")
            result[key] = val if sep else None
        return result
    raise ComposeError(f"{where}: {what} must be a list or a mapping, not {kind_of(value)}")


def _volume_target(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry.get("target", ""))
    parts = str(entry).split(":")
    return parts[1] if len(parts) >= 2 else parts[0]


def _merge(base: Any, local: Any, key: str | None, where: str) -> Any:
    """The compose merge rules for ``extends``/multi-file merges."""
    if key in _REPLACED or local is None:
        return base if local is None else local
    if key in _KEYED_MAPPINGS:
        merged = _as_mapping(base, where, key)
        merged.update(_as_mapping(local, where, key))
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
                merged[k] = _merge(base.get(k), v, k, where) if k in base else v
        return merged
    if isinstance(base, list) and isinstance(local, list):
        seen = {_identity(v) for v in base}
        return base + [v for v in local if _identity(v) not in seen]
    return local


def _identity(value: Any) -> str:
    """A hashable stand-in for a YAML value, so list merges stay linear."""
    if isinstance(value, dict):
        return "{" + ",".join(sorted(f"{_identity(k)}:{_identity(v)}" for k, v in value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_identity(v) for v in value) + "]"
    return repr(value)


def _absolute_binds(service: dict, base_dir: Path, where: str) -> dict:
    """Bind sources made absolute relative to the file that declared them."""
    volumes = _list(service.get("volumes"), where, "volumes")
    if not volumes:
        return service
    fixed = []
    for entry in volumes:
        if isinstance(entry, dict):
            if entry.get("type") == "bind" and "source" in entry:
                source = _string(entry["source"], where, "a bind source", optional=False)
                entry = {**entry, "source": str(_host_path(source, base_dir, where))}
        elif isinstance(entry, str):
            parts = entry.split(":")
            if len(parts) >= 2 and _looks_like_path(parts[0]):
                parts[0] = str(_host_path(parts[0], base_dir, where))
                entry = ":".join(parts)
        else:
            raise ComposeError(f"{where}: a volume must be a string or a mapping, not {kind_of(entry)}")
        fixed.append(entry)
    return {**service, "volumes": fixed}


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", ".", "~"))


def _host_path(source: str, base_dir: Path, where: str) -> Path:
    if "\x00" in source:
        raise ComposeError(f"{where}: a path contains a NUL character")
    try:
        path = Path(os.path.expanduser(source))
        return path if path.is_absolute() else (base_dir / path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise ComposeError(f"{where}: cannot use the path {_show(source)}: {exc}") from None


# --------------------------------------------------------------------------- loading


@dataclass
class _Document:
    path: Path
    services: dict[str, dict]
    tree: dict
    # Which file each service comes from (itself, or an included file).
    origin: dict[str, "_Document"] = field(default_factory=dict)
    shown: str = ""  # the path as messages print it


class _Loader:
    def __init__(self, lookup, budget: _Budget):
        self.lookup = lookup
        self.budget = budget
        self.cache: dict[Path, _Document] = {}

    def document(self, path: Path, depth: int = 0) -> _Document:
        if depth > MAX_INCLUDE_DEPTH:
            raise ComposeError(f"{_display(path)}: include/extends files nested deeper than {MAX_INCLUDE_DEPTH}")
        try:
            path = path.resolve()
        except (OSError, RuntimeError) as exc:
            raise ComposeError(f"{_display(path)}: cannot resolve the path: {exc}") from None
        if path in self.cache:
            return self.cache[path]
        shown = _display(path)
        tree = parse_yaml(read_text(path, "compose file"), shown)
        if not isinstance(tree, dict):
            raise ComposeError(f"{shown}: a compose file is a mapping at the top level, not {kind_of(tree)}")
        tree = {_key_text(k, shown): v for k, v in tree.items()}
        tree = _interpolate_tree(tree, self.lookup, path.name, self.budget)
        services: dict[str, dict] = {}
        for name, where, body in _service_entries(tree, shown):
            services[name] = _absolute_binds(body, path.parent, where)
        doc = _Document(path, services, tree, shown=shown)
        doc.origin = {name: doc for name in services}
        self.cache[path] = doc
        for included in self._includes(tree.get("include"), path, shown):
            other = self.document(included, depth + 1)
            for name, body in other.services.items():
                if name in services:
                    raise ComposeError(f"{shown}: service {name} is defined both here and in {included.name}")
                services[name] = body
                doc.origin[name] = other.origin[name]
        return doc

    @staticmethod
    def _includes(spec: Any, path: Path, shown: str) -> list[Path]:
        found = []
        for item in _list(spec, shown, "include"):
            paths = item.get("path") if isinstance(item, dict) else item
            items = [paths] if isinstance(paths, str) else _list(paths, shown, "an include path")
            for one in items:
                text = _string(one, shown, "an include path", optional=False)
                found.append(_host_path(text, path.parent, shown))
        return found

    def resolved(self, doc: _Document, name: str, chain: tuple = ()) -> dict:
        key = (doc.path, name)
        where = f"{doc.shown}: service {name}"
        if key in chain:
            raise ComposeError(f"{where}: extends cycle through service {name}")
        if len(chain) > MAX_EXTENDS_DEPTH:
            raise ComposeError(f"{where}: extends chain longer than {MAX_EXTENDS_DEPTH}")
        if name not in doc.services:
            raise ComposeError(f"{doc.shown}: no service named {_show(name)}")
        body = dict(doc.services[name])
        ext = body.pop("extends", None)
        if ext is None:
            return body
        if isinstance(ext, str):
            base_doc, base_name = doc, ext
        elif isinstance(ext, dict) and isinstance(ext.get("service"), str):
            file = _string(ext.get("file"), where, "extends.file")
            base_doc = self.document(_host_path(file, doc.path.parent, where), len(chain) + 1) if file else doc
            base_name = ext["service"]
        else:
            raise ComposeError(f"{where}: extends needs a service name")
        base = self.resolved(base_doc, base_name, chain + (key,))
        merged = dict(base)
        for k, v in body.items():
            merged[k] = _merge(base.get(k), v, k, where) if k in base else v
        return merged


def project_env_file(compose_file: Path) -> Path | None:
    """The variables file of a project: ``.env`` beside the file, else its ``.env.example``."""
    directory = compose_file.resolve().parent
    for name in (".env", ".env.example"):
        if (directory / name).is_file():
            return directory / name
    return None


def project_lookup(compose_file: Path, environ: Mapping[str, str],
                   budget: _Budget | None = None) -> tuple[Callable, Path | None]:
    """Variables for interpolation: the process environment over the project's
    ``.env``; without a ``.env``, its ``.env.example`` stands in (reported)."""
    env_path = project_env_file(compose_file)
    file_values = read_env_file(env_path, environ, budget) if env_path is not None else {}

    def lookup(name: str) -> str | None:
        if name in environ:
            return environ[name]
        return file_values.get(name)

    return lookup, env_path


def _service_entries(tree: dict, shown: str):
    """(name, where, body) of each service of a compose tree, names and shapes checked."""
    for raw_name, body in _mapping(tree.get("services"), shown, "services").items():
        name = _key_text(raw_name, shown)
        if not _SERVICE_NAME.match(name):
            raise ComposeError(f"{shown}: {_show(name)} is not a valid service name")
        where = f"{shown}: service {name}"
        if not isinstance(body, dict):
            raise ComposeError(f"{where}: a service must be a mapping, not {kind_of(body)}")
        yield name, where, {_key_text(k, where): v for k, v in body.items()}


def _normalize_project_name(text: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", text.lower()).lstrip("_-")


def _project_name(tree: dict, compose_file: Path, lookup, shown: str) -> str:
    """The project name as compose picks it: COMPOSE_PROJECT_NAME, the top-level
    ``name``, else the directory of the file."""
    from_env = lookup("COMPOSE_PROJECT_NAME")
    declared = _string(tree.get("name"), shown, "the top-level name")
    name = from_env or declared
    if name:
        if not _PROJECT_NAME.match(name):
            raise ComposeError(f"{shown}: project name {_show(name)} must be lowercase letters, digits, "
                               "dashes and underscores, starting with a letter or digit")
        return name
    return _normalize_project_name(compose_file.resolve().parent.name) or "default"


def _active_profiles(profiles: list[str] | None, lookup) -> set[str]:
    if profiles is not None:
        return {p for p in profiles if p}
    from_env = lookup("COMPOSE_PROFILES") or ""
    return {p.strip() for p in from_env.split(",") if p.strip()}


def _profiles_of(body: dict, where: str) -> tuple[str, ...]:
    return tuple(_string(p, where, "a profile", optional=False) for p in _list(body.get("profiles"), where, "profiles"))


def load_project(compose_file: str | Path, environ: Mapping[str, str] | None = None,
                 profiles: list[str] | None = None) -> Project:
    """One compose project: its name and its services with extends, includes
    and profiles applied (``profiles`` None: COMPOSE_PROFILES, else none)."""
    path = Path(compose_file)
    try:
        return _load_project(path, os.environ if environ is None else environ, profiles)
    except RecursionError:
        raise ComposeError(f"{_display(path)}: nested too deeply to read") from None
    except OSError as exc:
        raise ComposeError(f"{_display(path)}: {exc.strerror or exc}") from None


def _load_project(path: Path, environ: Mapping[str, str], profiles: list[str] | None) -> Project:
    budget = _Budget()
    if not path.exists():
        raise ComposeError(f"{_display(path)}: no such compose file")
    lookup, env_path = project_lookup(path, environ, budget)
    loader = _Loader(lookup, budget)
    doc = loader.document(path)
    shown = doc.shown
    resolved_path = path.resolve()
    active = _active_profiles(profiles, lookup)
    project = Project(_project_name(doc.tree, path, lookup, shown), path.resolve(), [], {}, env_path)
    env_cache: dict[Path, dict[str, str]] = {}
    for name in doc.services:
        body = loader.resolved(doc.origin[name], name)
        where = f"{shown}: service {name}"
        wanted = _profiles_of(body, where)
        if wanted and not (active & set(wanted)) and "*" not in active:
            project.inactive[name] = wanted
            continue
        project.services.append(_service(name, resolved_path, body, lookup, where, project.name, env_cache, budget))
    return project


def load_services(compose_file: str | Path, environ: Mapping[str, str] | None = None,
                  profiles: list[str] | None = None) -> tuple[list[Service], Path | None]:
    """All active services of one compose project, extends and includes applied."""
    project = load_project(compose_file, environ, profiles)
    return project.services, project.env_file


def load_compose_config(source: str, stdin=None) -> Project:
    """The normalized output of ``docker compose config`` (a file, or ``-`` for stdin).

    compose has already applied interpolation, ``.env``, extends, includes and
    profiles; only ``$$`` escapes remain to undo."""
    if source == "-":
        text = decode_text(_read_stdin(stdin if stdin is not None else sys.stdin), "<stdin>")
        path = Path.cwd() / "compose-config.stdin"
        shown = "<stdin>"
    else:
        path = Path(source).resolve() if "\x00" not in source else Path(source)
        shown = _display(path)
        text = read_text(path, "compose config")
    try:
        return _load_compose_config(text, path, shown)
    except RecursionError:
        raise ComposeError(f"{shown}: nested too deeply to read") from None


def _read_stdin(stream) -> bytes:
    """What was piped in; a closed, empty or interactive stdin is a usage mistake, said plainly."""
    def refuse(why: str) -> ComposeError:
        return ComposeError(f"--from-compose-config -: stdin {why}; pipe `docker compose config` into it")

    if stream is None:  # Python sets sys.stdin to None when fd 0 is closed
        raise refuse("is closed")
    if stream.isatty():  # would sit waiting for typed input
        raise refuse("is a terminal")
    try:
        data = getattr(stream, "buffer", stream).read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise refuse(f"cannot be read ({exc.strerror or exc})") from None
    if not data.strip():
        raise refuse("is empty")
    return data


def _load_compose_config(text: str, path: Path, shown: str) -> Project:
    return compose_config_project(parse_yaml(text, shown), path, shown)


def compose_config_project(tree: Any, path: Path, shown: str) -> Project:
    """A project from the parsed output of ``docker compose config``."""
    budget = _Budget()
    if not isinstance(tree, dict):
        raise ComposeError(f"{shown}: the output of docker compose config is a mapping, not {kind_of(tree)}")

    def lookup(name: str) -> str | None:
        raise ComposeError(f"{shown}: still refers to ${{{name}}}; give plan the output of "
                           "`docker compose config` (interpolated), not a compose file")

    tree = _interpolate_tree({_key_text(k, shown): v for k, v in tree.items()}, lookup, shown, budget)
    for key in ("include", "extends"):
        if key in tree:
            raise ComposeError(f"{shown}: has a top-level {key}: this is not `docker compose config` output")
    name = _string(tree.get("name"), shown, "the top-level name")
    if not name:
        raise ComposeError(f"{shown}: no top-level name: this is not `docker compose config` output")
    project = Project(name, path, [], {}, None)
    env_cache: dict[Path, dict[str, str]] = {}
    for service_name, where, body in _service_entries(tree, shown):
        if "extends" in body:
            raise ComposeError(f"{where}: still has extends: this is not `docker compose config` output")
        body.pop("env_file", None)  # compose config has already merged env files into environment
        body = _absolute_binds(body, path.parent, where)
        project.services.append(_service(service_name, path, body, lambda _n: None, where, name, env_cache, budget))
    return project


def _command(value: Any, where: str, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ComposeError(f"{where}: cannot split the {what}: {exc}") from None
    if isinstance(value, list):
        return [_scalar_text(v, where, f"an item of {what}") or "" for v in value]
    raise ComposeError(f"{where}: {what} must be a string or a list, not {kind_of(value)}")


def _service(name: str, compose_file: Path, body: dict, lookup, where: str, project: str,
             env_cache: dict, budget: _Budget) -> Service:
    environment: dict[str, str] = {}
    for env_file in _env_files(body.get("env_file"), compose_file.parent, where):
        if env_file not in env_cache:
            env_cache[env_file] = read_env_file(env_file, {}, budget)
        environment.update(env_cache[env_file])
    for key, value in _as_mapping(body.get("environment"), where, "environment").items():
        if value is None:
            value = lookup(key)  # "KEY" alone takes the caller's value
            if value is None:
                continue
        environment[key] = value
    healthcheck = _mapping(body.get("healthcheck"), where, "healthcheck") or None
    if healthcheck is not None and healthcheck.get("test") is not None:
        _command(healthcheck["test"], where, "healthcheck test")
    deps, optional = _depends_on(body.get("depends_on"), where)
    return Service(
        name=name,
        compose_file=compose_file,
        image=_string(body.get("image"), where, "image"),
        argv=_command(body.get("entrypoint"), where, "entrypoint") + _command(body.get("command"), where, "command"),
        environment=environment,
        network_mode=_string(body.get("network_mode"), where, "network_mode"),
        published_ports=_ports(body.get("ports"), where, budget),
        binds=_binds(body.get("volumes"), where),
        depends_on=deps,
        healthcheck=healthcheck,
        labels={k: v or "" for k, v in _as_mapping(body.get("labels"), where, "labels").items()},
        container_name=_string(body.get("container_name"), where, "container_name"),
        gpu_reservation=_gpus(body, environment, where),
        raw=body,
        project=project,
        pid=_string(body.get("pid"), where, "pid"),
        ipc=_string(body.get("ipc"), where, "ipc"),
        extra_hosts=_extra_hosts(body.get("extra_hosts"), where),
        profiles=_profiles_of(body, where),
        optional_depends_on=frozenset(optional),
    )


def _extra_hosts(spec: Any, where: str) -> dict[str, str]:
    if isinstance(spec, list):
        hosts = {}
        for item in spec:
            text = _scalar_text(item, where, "an extra_hosts item") or ""
            host, sep, address = text.replace("=", ":", 1).partition(":")
            if not sep:
                raise ComposeError(f"{where}: extra_hosts item {_show(text)} is not HOST:ADDRESS")
            hosts[host] = address
        return hosts
    return {k: v or "" for k, v in _as_mapping(spec, where, "extra_hosts").items()}


def _env_files(spec: Any, base_dir: Path, where: str) -> list[Path]:
    if not spec:
        return []
    items = [spec] if isinstance(spec, (str, dict)) else _list(spec, where, "env_file")
    paths = []
    for item in items:
        if isinstance(item, dict):
            text = _string(item.get("path"), where, "env_file path", optional=False)
            required = item.get("required", True)
            if not isinstance(required, bool):
                raise ComposeError(f"{where}: env_file required must be true or false")
        else:
            text = _string(item, where, "an env_file", optional=False)
            required = True
        path = _host_path(text, base_dir, where)
        if path.is_file():
            paths.append(path)
        elif required:
            raise ComposeError(f"{where}: env_file {_display(path)} does not exist")
    return paths


def _depends_on(spec: Any, where: str) -> tuple[dict[str, str], set[str]]:
    if not spec:
        return {}, set()
    if isinstance(spec, list):
        return {_string(s, where, "a depends_on entry", optional=False): "service_started" for s in spec}, set()
    if isinstance(spec, dict):
        deps, optional = {}, set()
        for k, v in spec.items():
            name = _key_text(k, where)
            options = _mapping(v, where, f"depends_on {name}")
            deps[name] = _string(options.get("condition"), where, "a depends_on condition") or "service_started"
            if options.get("required") is False:
                optional.add(name)
        return deps, optional
    raise ComposeError(f"{where}: depends_on must be a list or a mapping, not {kind_of(spec)}")


def _binds(volumes: Any, where: str) -> list[BindMount]:
    binds = []
    for entry in _list(volumes, where, "volumes"):
        if isinstance(entry, dict):
            if entry.get("type") != "bind":
                continue
            source = _string(entry.get("source"), where, "a bind source", optional=False)
            target = _string(entry.get("target"), where, "a bind target", optional=False)
            binds.append(BindMount(Path(source), target, bool(entry.get("read_only"))))
            continue
        if not isinstance(entry, str):
            raise ComposeError(f"{where}: a volume must be a string or a mapping, not {kind_of(entry)}")
        parts = entry.split(":")
        if len(parts) < 2 or not _looks_like_path(parts[0]):
            continue  # a named or anonymous volume
        mode = parts[2] if len(parts) > 2 else ""
        binds.append(BindMount(Path(parts[0]), parts[1], "ro" in mode.split(",")))
    return binds


def _ports(entries: Any, where: str, budget: _Budget | None = None) -> list[PublishedPort]:
    budget = budget or _Budget()
    ports: list[PublishedPort] = []
    for entry in _list(entries, where, "ports"):
        if isinstance(entry, dict):
            if entry.get("published") in (None, ""):
                continue
            host = _port_range(_scalar_text(entry["published"], where, "a published port") or "", where)
            target = _port_range(_scalar_text(entry.get("target"), where, "a target port") or "", where)
            protocol = _string(entry.get("protocol"), where, "a port protocol") or "tcp"
        elif isinstance(entry, (str, int)) and not isinstance(entry, bool):
            text, _, protocol = str(entry).partition("/")
            protocol = protocol or "tcp"
            parts = text.rsplit(":", 2)
            if len(parts) == 1:
                _port_range(parts[0], where)
                continue  # container port only: docker picks an ephemeral host port
            host = _port_range(parts[-2], where) if parts[-2] else []
            target = _port_range(parts[-1], where)
        else:
            raise ComposeError(f"{where}: a port must be a string, a number or a mapping, not {kind_of(entry)}")
        if len(host) == 1 and len(target) > 1:
            raise ComposeError(f"{where}: port mapping {_show(entry)} maps a range onto one port")
        if len(host) > 1 and len(target) not in (1, len(host)):
            raise ComposeError(f"{where}: port mapping {_show(entry)} maps ranges of different lengths")
        budget.ports += len(host)
        if len(ports) + len(host) > MAX_PORTS_PER_SERVICE:
            raise ComposeError(f"{where}: publishes more than {MAX_PORTS_PER_SERVICE} ports")
        if budget.ports > MAX_PUBLISHED_PORTS:
            raise ComposeError(f"{where}: the files publish more than {MAX_PUBLISHED_PORTS} ports in all")
        for n, host_port in enumerate(host):
            ports.append(PublishedPort(host_port, target[min(n, len(target) - 1)], protocol))
    return ports


def _port_range(text: str, where: str) -> list[int]:
    low, _, high = text.partition("-")
    if not (low.isdigit() and (high.isdigit() or not high)) or len(text) > 11:
        raise ComposeError(f"{where}: cannot read port {_show(text)}")
    first, last = int(low), int(high or low)
    if not (0 < first <= last <= 65535):
        raise ComposeError(f"{where}: port {_show(text)} is outside 1-65535")
    return list(range(first, last + 1))


def _gpu_text(pick: str) -> str:
    return pick if re.fullmatch(r"[\w.-]{1,40}", pick) else _show(pick)


def _ids(values: Any, where: str, what: str) -> list[str]:
    return [i.strip() for d in _list(values, where, what)
            for i in (_scalar_text(d, where, f"an item of {what}") or "").split(",") if i.strip()]


def _gpus(body: dict, environment: dict[str, str], where: str) -> GpuReservation:
    """Host GPUs the container sees, narrowed by CUDA_VISIBLE_DEVICES inside it."""
    ids: list[str] | None = None
    declared = False
    how = ""
    count: int | None = None
    named: list[str] = []
    deploy = _mapping(body.get("deploy"), where, "deploy")
    resources = _mapping(deploy.get("resources"), where, "deploy.resources")
    reservations = _mapping(resources.get("reservations"), where, "deploy.resources.reservations")
    requests: list[tuple[dict, str]] = []
    for device in _list(reservations.get("devices"), where, "deploy.resources.reservations.devices"):
        if not isinstance(device, dict):
            raise ComposeError(f"{where}: a reserved device must be a mapping, not {kind_of(device)}")
        capabilities = {_scalar_text(c, where, "a capability")
                        for c in _list(device.get("capabilities"), where, "device capabilities")}
        driver = _string(device.get("driver"), where, "a device driver")
        if driver not in (None, "nvidia") and "gpu" not in capabilities:
            continue
        requests.append((device, "device_ids"))
    gpus = body.get("gpus")
    if "gpus" in body:
        if gpus == "all":
            declared = True
            how = "gpus: all"
        else:
            for item in _list(gpus, where, "gpus (\"all\" or a list)"):
                if not isinstance(item, dict):
                    raise ComposeError(f"{where}: an item of gpus must be a mapping, not {kind_of(item)}")
                requests.append((item, "gpus.device_ids"))
    for device, kind in requests:
        declared = True
        if device.get("device_ids") is not None:
            found = _ids(device["device_ids"], where, "device_ids")
            ids = (ids or []) + found
            named += found
            how = kind
            continue
        raw_count = device.get("count", "all")
        if raw_count in ("all", -1):  # docker compose config writes "all" as -1
            how = how or "count: all"
            continue
        if isinstance(raw_count, bool) or not isinstance(raw_count, int) or raw_count < 0:
            raise ComposeError(f"{where}: a GPU count must be a whole number or \"all\", not {_show(raw_count)}")
        count = (count or 0) + raw_count
    if count is not None and ids is None:
        return GpuReservation(True, None, f"count: {count} (docker picks the GPUs)", tuple(named), count)
    if count is not None:
        raise ComposeError(f"{where}: GPUs are reserved both by count and by device_ids")
    nvidia_visible = environment.get("NVIDIA_VISIBLE_DEVICES")
    if nvidia_visible and nvidia_visible not in ("all", "none", "void"):
        ids = [i.strip() for i in nvidia_visible.split(",") if i.strip()]
        named += ids
        how = "NVIDIA_VISIBLE_DEVICES"
        declared = True
    if not declared:
        return GpuReservation(False, (), "no GPU reservation")
    cuda_visible = environment.get("CUDA_VISIBLE_DEVICES")
    if cuda_visible is not None:
        picks = [i.strip() for i in cuda_visible.split(",") if i.strip()]
        if ids is None:
            # Every host GPU is in the container, numbered as on the host.
            return GpuReservation(True, tuple(picks), f"{how} + CUDA_VISIBLE_DEVICES", tuple(named + picks))
        chosen = []
        for pick in picks:
            if pick.isdigit() and int(pick) < len(ids):
                chosen.append(ids[int(pick)])
            elif pick in ids:
                chosen.append(pick)
            else:
                raise ComposeError(
                    f"{where}: CUDA_VISIBLE_DEVICES={cuda_visible} names GPU {_gpu_text(pick)}, which the "
                    f"container does not have ({how}: {','.join(ids)})"
                )
        return GpuReservation(True, tuple(chosen), f"{how} + CUDA_VISIBLE_DEVICES", tuple(named))
    if ids is None:
        return GpuReservation(True, None, f"{how} without CUDA_VISIBLE_DEVICES (every GPU of the host)")
    return GpuReservation(True, tuple(ids), how, tuple(named))
