"""``sglang-dsv41 upgrade-check``: what a candidate sglang release changes under our patches.

The candidate (a wheel, a folder holding the ``sglang`` package, or a version
that ``pip download`` fetches) is read as source, never imported, and every
patch-table entry and pinned internal is fingerprinted in it with
``fingerprint.fingerprint_of``, the function the load-time check uses. An entry
is ``same`` when the loader would accept the candidate for it, ``DRIFT`` when its
fingerprint differs (the reasons name the parts: signature, body, re-bound,
name now defined upstream, ...), ``GONE`` when its target no longer exists.
Each drifted entry comes with a unified diff of what its fingerprint covers,
pinned release against candidate.
"""

from __future__ import annotations

import difflib
import io
import json
import math
import re
import struct
import subprocess
import sys
import tempfile
import tokenize
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglang_dsv41.plugin import fingerprint as fp
from sglang_dsv41.plugin.pin import PINNED_SGLANG_VERSION

SAME, DRIFT, GONE = "same", "DRIFT", "GONE"

_VERSION = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")
LATEST = "latest"
MAX_DOWNLOAD_TIMEOUT_S = 86400


class BadInput(Exception):
    """Input upgrade-check cannot read; the message is the one line it prints."""


# ---------------------------------------------------------------- opening a candidate
#
# A candidate comes from anywhere: every file is read up to a size cap, a
# wheel's directory is sized before zipfile loads it, and source bytes are
# decoded as Python decodes a module (PEP 263). Whatever cannot be read is
# BadInput, one line naming the file.

MAX_SOURCE_BYTES = 16 << 20  # sglang 0.5.23's largest source file is under 300 KiB
MAX_WHEEL_MEMBERS = 200_000  # its wheel has about 10,500
# A directory entry is 46 fixed bytes, then its name, extra field and comment;
# sglang 0.5.23's longest member name is 157 bytes, the average 64.
DIRECTORY_ENTRY_BYTES = 46
MAX_ENTRY_NAME_BYTES = 256  # name, extra field and comment of one entry, on average
_END_OF_DIRECTORY = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")


def source_text(raw: bytes, where: str) -> str:
    """Source bytes as Python reads a module: a BOM or a coding line, else UTF-8."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return io.TextIOWrapper(io.BytesIO(raw), encoding).read()
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        why = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        raise BadInput(f"{where}: not readable as Python source ({why})") from None


class _CandidateReading:
    """What a candidate tree adds to fingerprint's trees: parse failures that are
    not SyntaxError (null bytes, nesting past the parser's limits) as BadInput."""

    def parse(self, rel: str):
        try:
            return super().parse(rel)
        except (ValueError, RecursionError, MemoryError) as exc:
            why = str(exc) or type(exc).__name__
            raise BadInput(f"{self.label}: {rel}: Python cannot parse it ({why[:120]})") from None


class CandidateFolder(_CandidateReading, fp.FolderTree):
    def read_text(self, rel: str) -> str | None:
        path = self.root / rel
        if not path.is_file():
            return None
        try:
            with path.open("rb") as handle:
                raw = handle.read(MAX_SOURCE_BYTES + 1)
        except OSError as exc:
            raise BadInput(f"{path}: cannot read it ({exc.strerror or exc})") from None
        if len(raw) > MAX_SOURCE_BYTES:
            raise BadInput(f"{path}: larger than {MAX_SOURCE_BYTES >> 20} MiB, not a source file")
        return source_text(raw, str(path))


class CandidateWheel(_CandidateReading, fp.WheelTree):
    def read_text(self, rel: str) -> str | None:
        try:
            info = self._zip.getinfo(rel)
        except KeyError:
            return None
        where = f"{self.path}: {rel}"
        if info.file_size > MAX_SOURCE_BYTES:
            raise BadInput(f"{where} inflates to {info.file_size} bytes, over the "
                           f"{MAX_SOURCE_BYTES >> 20} MiB a source file may have")
        try:
            with self._zip.open(rel) as member:
                raw = member.read(MAX_SOURCE_BYTES + 1)  # zipfile stops at the declared size
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError,
                NotImplementedError, ValueError) as exc:  # corrupt, encrypted, unknown method
            raise BadInput(f"{where}: cannot read the member ({' '.join(str(exc).split())[:160]})") from None
        if len(raw) > MAX_SOURCE_BYTES:
            raise BadInput(f"{where} inflates past {MAX_SOURCE_BYTES >> 20} MiB")
        return source_text(raw, where)


def _wheel_directory(path: Path) -> tuple[int, int]:
    """How many members a zip's directory claims and how many bytes it spans,
    from the end records zipfile itself reads (it walks the directory by its
    byte size, building an object per entry, whatever the count says)."""
    with path.open("rb") as handle:
        size = handle.seek(0, io.SEEK_END)
        start = max(0, size - (1 << 16) - _END_OF_DIRECTORY.size)
        handle.seek(start)
        tail = handle.read()
    # zipfile's choice: the last 22 bytes when they are a comment-less end record,
    # else the last signature within a maximal comment's reach.
    last = len(tail) - _END_OF_DIRECTORY.size
    if last >= 0 and tail.startswith(b"PK\x05\x06", last) and tail.endswith(b"\0\0"):
        at = last
    else:
        at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _END_OF_DIRECTORY.size:
        raise BadInput(f"{path}: not a wheel (no zip directory at its end)")
    end = _END_OF_DIRECTORY.unpack_from(tail, at)
    members, directory_bytes = end[4], end[5]
    # zipfile takes the zip64 record whenever its locator sits right before the end
    # record and the record right before that, whether or not the counts overflowed.
    locator_at = at - _ZIP64_LOCATOR.size
    zip64_at = locator_at - _ZIP64_END.size
    if start + zip64_at < 0:
        return members, directory_bytes
    with path.open("rb") as handle:
        handle.seek(start + zip64_at)
        records = handle.read(_ZIP64_END.size + _ZIP64_LOCATOR.size)
    if records[_ZIP64_END.size:].startswith(b"PK\x06\x07") and records.startswith(b"PK\x06\x06"):
        zip64 = _ZIP64_END.unpack_from(records)
        members, directory_bytes = zip64[7], zip64[8]
    return members, directory_bytes


def _refuse_oversized_directory(path: Path) -> None:
    """BadInput for a directory bigger than the member cap allows, or not the size its count implies."""
    members, directory_bytes = _wheel_directory(path)
    entry_max = DIRECTORY_ENTRY_BYTES + MAX_ENTRY_NAME_BYTES
    if directory_bytes > MAX_WHEEL_MEMBERS * entry_max:
        raise BadInput(f"{path}: its directory spans {directory_bytes} bytes, more than the "
                       f"{MAX_WHEEL_MEMBERS} members a wheel of sglang may have could fill")
    if members > MAX_WHEEL_MEMBERS:
        raise BadInput(f"{path}: its directory lists {members} members, more than the "
                       f"{MAX_WHEEL_MEMBERS} a wheel of sglang may have")
    # Bytes beyond what the listed entries can fill are entries the count hides.
    low, high = members * DIRECTORY_ENTRY_BYTES, members * entry_max
    if not low <= directory_bytes <= high:
        raise BadInput(f"{path}: its directory lists {members} members but spans "
                       f"{directory_bytes} bytes, where that many take {low} to {high}")


def _folder_tree(path: Path) -> fp.FolderTree:
    # Accept the folder holding sglang/ (site-packages, an unpacked wheel), the
    # sglang package folder itself, or a source checkout (python/sglang).
    for root in (path, path.parent if path.name == "sglang" else None, path / "python"):
        if root is not None and (root / "sglang" / "__init__.py").is_file():
            return _with_package(CandidateFolder(root))
    raise BadInput(f"{path}: no sglang package inside (expected sglang/__init__.py)")


def _wheel_tree(path: Path) -> fp.WheelTree:
    if not zipfile.is_zipfile(path):
        raise BadInput(f"{path}: not a wheel (not a zip file)")
    try:
        _refuse_oversized_directory(path)
        tree = CandidateWheel(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
        raise BadInput(f"{path}: cannot read the wheel: {exc}") from None
    if tree.text("sglang/__init__.py") is None:
        raise BadInput(f"{path}: no sglang package inside the wheel")
    return _with_package(tree)


def _with_package(tree: fp.SourceTree) -> fp.SourceTree:
    """The tree, once its sglang/__init__.py parses: a package whose top cannot be read is not one."""
    try:
        tree.parse("sglang/__init__.py")
    except fp.TargetNotFound as exc:
        raise BadInput(f"{tree.label}: {exc}") from None
    return tree


def pip_download(version: str, dest: Path, timeout_s: float) -> Path:
    """``pip download --no-deps`` one sglang wheel into ``dest``; the wheel's path."""
    requirement = "sglang" if version == LATEST else f"sglang=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-q", "-d", str(dest), requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BadInput(f"pip download {requirement}: no answer within {timeout_s:g} s") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        why = (errors or lines or [f"exit status {proc.returncode}"])[-1]
        raise BadInput(f"pip download {requirement} failed: {why}")
    wheels = sorted(dest.glob("sglang-*.whl"))
    if not wheels:
        raise BadInput(f"pip download {requirement} produced no sglang wheel in {dest}")
    return wheels[-1]


def open_tree(spec: str, workdir: Path, timeout_s: float = 600) -> fp.SourceTree:
    """A source tree from a wheel path, a folder, or a version to download."""
    path = Path(spec)
    if path.is_dir():
        return _folder_tree(path)
    if path.is_file():
        return _wheel_tree(path)
    if spec == LATEST or _VERSION.match(spec):
        dest = workdir / f"download-{len(list(workdir.iterdir()))}"
        dest.mkdir()
        tree = _wheel_tree(pip_download(spec, dest, timeout_s))
        tree.label = f"{tree.path.name}, pip download of {'the newest sglang' if spec == LATEST else 'sglang==' + spec}"
        return tree
    raise BadInput(f"{spec}: no such file or folder, and not a version number")


def describe(tree: fp.SourceTree) -> dict:
    try:
        version = tree.version()
    except fp.TargetNotFound as exc:  # a version file Python cannot parse
        raise BadInput(f"{tree.label}: {exc}") from None
    if version and not (version.isascii() and version.isprintable() and len(version) <= 64):
        # a candidate's own string is printed in the report's head: no control characters
        version = ascii(version[:64])
    return {"version": version or "unknown", "source": tree.label}


# ---------------------------------------------------------------- comparing one entry

_REASONS = {
    "signature": "signature",
    "code": "body",
    "binding": "re-bound",
    "decorators": "decorators",
    "absent": "name now defined upstream",
    "value": "value",
}


@dataclass
class Finding:
    id: str
    target: str
    status: str
    reasons: list[str] = field(default_factory=list)
    depends_on: str = "source"
    diff: str = ""
    note: str = ""  # used_by, for an internal


def _reasons(before: dict[str, str], after: dict[str, str]) -> list[str]:
    out = []
    order = ["signature", "shape", "decorators", "code", "binding", "absent", "value"]
    keys = set(before) | set(after)
    for key in sorted(keys, key=lambda k: (order.index(k) if k in order else len(order), k)):
        a, b = before.get(key), after.get(key)
        if a == b:
            continue
        if key == "shape":
            out.append(f"now {b} (was {a})")
        elif key.startswith("relies_on:"):
            method = key.split(":", 1)[1]
            state = "gone" if b == fp.MISSING else "now defined" if a == fp.MISSING else "changed"
            out.append(f"relied-on {method} {state}")
        else:
            out.append(_REASONS.get(key, key))
    return out


def _segment(text: str, node) -> str:
    lines = text.splitlines()
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[start - 1:node.end_lineno])


def _header(text: str, node) -> str:
    """Decorators and the def/class line(s), without the body."""
    lines = text.splitlines()
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[start - 1:node.body[0].lineno - 1]).rstrip()


def covered_source(item, tree: fp.SourceTree) -> tuple[str, str]:
    """(where, text): the source a fingerprint of ``item`` covers, for a diff."""
    found = fp.resolve(item.fingerprint_target, tree, allow_variable=item.allows_variable)
    where = f"{found.rel} ({'.'.join(found.qualname)})"
    if found.node is None:
        return where, "\n".join(_segment(found.text, s) for s in found.bindings)
    new_name = item.new_attribute
    if new_name is not None:
        parts = [_header(found.text, found.node)]
        defined = fp.new_name_definition(found, new_name)
        if defined is not None:
            parts.append(_segment(found.text, defined))
        for method in item.relies_on:
            try:
                used = fp.resolve(f"{item.fingerprint_target}.{method}", tree)
            except fp.TargetNotFound:
                continue
            parts.append(_segment(used.text, used.node))
            parts += [_segment(used.text, s) for s in used.rebinds]
    elif item.depends_on == "signature":
        parts = [_header(found.text, found.node)]
    else:
        parts = [_segment(found.text, found.node)]
    parts += [_segment(found.text, s) for s in found.rebinds]
    return where, "\n\n".join(parts)


def _diff(item, pinned: fp.SourceTree, candidate: fp.SourceTree, pinned_name: str, cand_name: str) -> str:
    try:
        where_a, a = covered_source(item, pinned)
        where_b, b = covered_source(item, candidate)
    except fp.TargetNotFound:
        return ""
    return "".join(difflib.unified_diff(
        (a + "\n").splitlines(keepends=True), (b + "\n").splitlines(keepends=True),
        fromfile=f"sglang {pinned_name} {where_a}", tofile=f"sglang {cand_name} {where_b}", n=2,
    ))


def check_item(item, pinned: fp.SourceTree, candidate: fp.SourceTree, *,
               use_table: bool, pinned_name: str = "pinned",
               cand_name: str = "candidate") -> Finding:
    """Compare one patch or internal between the pinned release and the candidate.

    ``use_table``: the verdict compares the candidate with the fingerprint written
    in the table (what the loader would compare); otherwise with the pinned tree.
    """
    finding = Finding(id=item.id, target=item.fingerprint_target, status=SAME,
                      depends_on="new attribute" if item.new_attribute else item.depends_on,
                      note=getattr(item, "used_by", ""))
    try:
        after = fp.components_of(item, candidate)
    except fp.TargetNotFound as exc:
        finding.status, finding.reasons = GONE, [str(exc)]
        return finding
    try:
        before = fp.components_of(item, pinned)
    except fp.TargetNotFound as exc:
        before = {}
        finding.reasons.append(f"not in the pinned release: {exc}")
    got = fp.fingerprint_from_components(after)
    if use_table:
        expected = fp.Fingerprint(item.signature, item.ast_sha)
    else:
        expected = fp.fingerprint_from_components(before) if before else None
    if got == expected:
        return finding
    finding.status = DRIFT
    finding.reasons += _reasons(before, after) if before else []
    if not finding.reasons:
        finding.reasons.append("the table's fingerprint is not the pinned release's (run doctor)")
    finding.diff = _diff(item, pinned, candidate, pinned_name, cand_name)
    return finding


# ---------------------------------------------------------------- the report


@dataclass
class Report:
    pinned: dict
    candidate: dict
    patches: list[Finding]
    internals: list[Finding]

    @property
    def exit_code(self) -> int:
        return 1 if any(f.status != SAME for f in self.patches + self.internals) else 0

    def counts(self, findings) -> dict[str, int]:
        return {s: sum(f.status == s for f in findings) for s in (SAME, DRIFT, GONE)}

    def to_json(self) -> dict:
        return {
            "pinned": self.pinned,
            "candidate": self.candidate,
            "patches": [asdict(f) for f in self.patches],
            "internals": [asdict(f) for f in self.internals],
            "summary": {"patches": self.counts(self.patches), "internals": self.counts(self.internals)},
            "exit_code": self.exit_code,
        }

    def to_text(self) -> str:
        out = [f"upgrade-check: sglang {self.pinned['version']} ({self.pinned['source']}) -> "
               f"sglang {self.candidate['version']} ({self.candidate['source']})", ""]
        out.append(f"patches ({len(self.patches)}):")
        for f in self.patches:
            line = f"  {f.status:<5}  {f.id:<16} {f.target}"
            if f.status == SAME:
                line += f"  [{f.depends_on}]"
            else:
                line += ": " + "; ".join(f.reasons)
            out.append(line)
        changed = [f for f in self.internals if f.status != SAME]
        out += ["", f"pinned internals ({len(self.internals)}): "
                    f"{len(self.internals) - len(changed)} same, {len(changed)} changed"]
        for f in changed:
            out.append(f"  {f.status:<5}  {f.target}: {'; '.join(f.reasons)}  (used by {f.note})")
        diffs = [f for f in self.patches + self.internals if f.diff]
        if diffs:
            out += ["", "diffs of what each drifted fingerprint covers:"]
            for f in diffs:
                out += ["", f"### {f.id}", f.diff.rstrip("\n")]
        p, i = self.counts(self.patches), self.counts(self.internals)
        out += ["", f"summary: patches {p[SAME]} same, {p[DRIFT]} DRIFT, {p[GONE]} GONE; "
                    f"internals {i[SAME]} same, {i[DRIFT]} DRIFT, {i[GONE]} GONE; "
                    + ("review needed (exit 1)" if self.exit_code else "nothing to review (exit 0)")]
        return "\n".join(out) + "\n"


def build_report(pinned: fp.SourceTree, candidate: fp.SourceTree, *, use_table: bool,
                 patches=None, internals=None) -> Report:
    from sglang_dsv41.plugin.table import PATCHES
    from sglang_dsv41.plugin.internals import INTERNALS

    patches = PATCHES if patches is None else patches
    internals = INTERNALS if internals is None else internals
    pinned_info, cand_info = describe(pinned), describe(candidate)
    names = dict(pinned_name=pinned_info["version"], cand_name=cand_info["version"])
    return Report(
        pinned=pinned_info,
        candidate=cand_info,
        patches=[check_item(p, pinned, candidate, use_table=use_table, **names) for p in patches],
        internals=[check_item(i, pinned, candidate, use_table=use_table, **names) for i in internals],
    )


def _default_pinned() -> fp.SourceTree:
    found = fp.installed_version("sglang")
    if found is None or found.split("+", 1)[0] != PINNED_SGLANG_VERSION:
        raise BadInput(
            f"the installed sglang is {found or 'missing'}, not the pinned {PINNED_SGLANG_VERSION}; "
            f"pass --pinned <wheel | folder | {PINNED_SGLANG_VERSION}>"
        )
    try:
        return fp.installed_tree()
    except fp.TargetNotFound as exc:
        raise BadInput(str(exc)) from None


def main(args) -> int:
    """The CLI handler: 0 nothing drifted, 1 something did, 2 bad input."""
    try:
        timeout_s = float(args.download_timeout)
    except ValueError:
        timeout_s = math.nan
    if not 1 <= timeout_s <= MAX_DOWNLOAD_TIMEOUT_S:  # NaN fails this too
        print(f"upgrade-check: --download-timeout {args.download_timeout!r}: expected seconds from 1 "
              f"to {MAX_DOWNLOAD_TIMEOUT_S}", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="sglang-dsv41-upgrade-") as tmp:
            workdir = Path(tmp)
            if args.pinned:
                pinned, use_table = open_tree(args.pinned, workdir, timeout_s), False
            else:
                pinned, use_table = _default_pinned(), True
            candidate = open_tree(args.candidate, workdir, timeout_s)
            report = build_report(pinned, candidate, use_table=use_table)
    except BadInput as exc:
        print(f"upgrade-check: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(report.to_text())
    return report.exit_code
