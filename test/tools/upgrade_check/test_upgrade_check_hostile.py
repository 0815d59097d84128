"""`sglang-dsv41 upgrade-check` on candidates built to break it.

Wheels with a corrupt, encrypted or unknown-method member, a member that
inflates to gigabytes, a directory claiming millions of members, members named
to escape the archive; folders whose files are gigabytes behind a symlink;
sources in other encodings (honoured as Python honours them: PEP 263), with
null bytes or nesting past the parser; version files that cannot be read;
download timeouts that are not finite. Each runs the installed console script
in a subprocess with a timeout and an address-space limit of 1 GiB (so a read
that is not capped dies instead of eating the machine) and expects one line
naming the file and the problem, exit 2, no traceback.
"""

from __future__ import annotations

import os
import resource
import shutil
import struct
import subprocess
import zipfile
import zlib
from pathlib import Path

import pytest

from _upgrade_trees import CLI, copy_installed, zip_as_wheel
from sglang_dsv41.tools import cli
from sglang_dsv41.tools import upgrade_check as uc

pytestmark = pytest.mark.timeout(300)
MEMORY_LIMIT = 1 << 30
MOONCAKE = "sglang/srt/disaggregation/mooncake/conn.py"
DETOK = "sglang/srt/managers/detokenizer_manager.py"
HOOK_REGISTRY = "sglang/srt/plugins/hook_registry.py"


def run(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run([CLI, "upgrade-check", *args], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit_memory, env=dict(os.environ))


def one_line(proc: subprocess.CompletedProcess, fragment: str, rc: int = 2) -> str:
    assert proc.returncode == rc, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert proc.stdout == "" and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("upgrade-check: ") and fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return copy_installed(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def tree(pristine, tmp_path):
    root = tmp_path / "candidate"
    shutil.copytree(pristine, root)
    return root


def stored_wheel(root: Path, wheel: Path, first: str = "sglang/__init__.py") -> Path:
    """The tree as a wheel without compression, ``first`` as its first member."""
    files = sorted((root / "sglang").rglob("*.py"), key=lambda p: p.relative_to(root).as_posix() != first)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path in files:
            z.write(path, path.relative_to(root).as_posix())
    return wheel


def edit_headers(wheel: Path, name: str, *, flags: int | None = None, method: int | None = None) -> None:
    """Rewrite one member's general-purpose flags or compression method, in both headers."""
    data = bytearray(wheel.read_bytes())
    info = zipfile.ZipFile(wheel).getinfo(name)
    local = info.header_offset
    central = data.rfind(b"PK\x01\x02" + data[local + 4:local + 6])
    while data[central + 46:central + 46 + len(name)] != name.encode():
        central = data.rfind(b"PK\x01\x02", 0, central)
    for at, field in ((local + 6, flags), (central + 8, flags), (local + 8, method), (central + 10, method)):
        if field is not None:
            data[at:at + 2] = struct.pack("<H", field)
    wheel.write_bytes(bytes(data))


def inflating_wheel(wheel: Path, name: str, size: int) -> Path:
    """A zip of one deflated member of ``size`` bytes of '#', a few MB on disk:
    a 1 MiB block compressed with a full flush is the same bytes every time."""
    block = b"#" * (1 << 20)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    body = piece * (size >> 20) + compressor.flush()
    crc = 0
    for _ in range(size >> 20):
        crc = zlib.crc32(block, crc)
    raw = name.encode()
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0x21, crc, len(body), size, len(raw), 0)
    central = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0x21, crc, len(body), size,
                          len(raw), 0, 0, 0, 0, 0, 0) + raw
    offset = len(local) + len(raw) + len(body)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central), offset, 0)
    wheel.write_bytes(local + raw + body + central + end)
    return wheel


def sparse_file(path: Path, size: int) -> Path:
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


# ---------------------------------------------------------------- archives


def test_not_a_zip_and_a_truncated_zip(tmp_path, pristine):
    junk = tmp_path / "junk.whl"
    junk.write_bytes(os.urandom(4096))
    one_line(run(str(junk)), f"{junk}: not a wheel (not a zip file)")
    good = zip_as_wheel(pristine, tmp_path / "good.whl")
    cut = tmp_path / "cut.whl"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    one_line(run(str(cut)), f"{cut}: not a wheel (not a zip file)")


def test_a_corrupt_stored_member(tmp_path, pristine):
    wheel = stored_wheel(pristine, tmp_path / "flipped.whl")
    info = zipfile.ZipFile(wheel).getinfo("sglang/__init__.py")
    data = bytearray(wheel.read_bytes())
    data[info.header_offset + 30 + len(info.filename) + info.file_size // 2] ^= 0xFF
    wheel.write_bytes(bytes(data))
    one_line(run(str(wheel)), f"{wheel}: sglang/__init__.py: cannot read the member (Bad CRC-32")


def test_a_corrupt_deflated_member(tmp_path, pristine):
    wheel = zip_as_wheel(pristine, tmp_path / "garbled.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.getinfo("sglang/__init__.py").compress_type == zipfile.ZIP_STORED  # zip_as_wheel stores
    deflated = tmp_path / "deflated.whl"
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted((pristine / "sglang").rglob("*.py")):
            z.write(path, path.relative_to(pristine).as_posix())
    info = zipfile.ZipFile(deflated).getinfo("sglang/__init__.py")
    data = bytearray(deflated.read_bytes())
    start = info.header_offset + 30 + len(info.filename)
    data[start:start + info.compress_size] = b"\xff" * info.compress_size
    deflated.write_bytes(bytes(data))
    one_line(run(str(deflated)), f"{deflated}: sglang/__init__.py: cannot read the member (")


def test_an_encrypted_member_and_an_unknown_method(tmp_path, pristine):
    encrypted = stored_wheel(pristine, tmp_path / "encrypted.whl")
    edit_headers(encrypted, "sglang/__init__.py", flags=0x1)
    one_line(run(str(encrypted)), "sglang/__init__.py: cannot read the member (File 'sglang/__init__.py' "
                                  "is encrypted, password required for extraction)")
    unknown = stored_wheel(pristine, tmp_path / "method.whl")
    edit_headers(unknown, "sglang/__init__.py", method=99)
    one_line(run(str(unknown)), "sglang/__init__.py: cannot read the member (")


def test_a_member_that_inflates_to_gigabytes_is_refused_unread(tmp_path):
    wheel = inflating_wheel(tmp_path / "bomb.whl", "sglang/__init__.py", 2 << 30)
    assert wheel.stat().st_size < 4 << 20
    one_line(run(str(wheel), timeout=60), f"{wheel}: sglang/__init__.py inflates to 2147483648 bytes, "
                                          "over the 16 MiB a source file may have")


def test_a_directory_of_millions_of_members_is_refused_before_it_is_loaded(tmp_path):
    wheel = tmp_path / "many.whl"
    zip64_end = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 5_000_000, 5_000_000, 0, 0)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, 0, 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    wheel.write_bytes(zip64_end + locator + end)
    one_line(run(str(wheel)), f"{wheel}: its directory lists 5000000 members, more than the 200000")


END_RECORD = struct.Struct("<4s4H2LH")


def listing_fewer_members(wheel: Path, members: int, listed: int) -> tuple[Path, int]:
    """A plain zip of ``members`` empty members whose end record lists ``listed``;
    returns it and the byte size of its directory (zipfile walks all of it)."""
    with zipfile.ZipFile(wheel, "w") as z:
        for i in range(members):
            z.writestr(f"sglang/m{i:05}.py", "")
    data = bytearray(wheel.read_bytes())
    at = len(data) - END_RECORD.size
    sig, disk, disk_cd, _, _, size, offset, comment = END_RECORD.unpack_from(data, at)
    END_RECORD.pack_into(data, at, sig, disk, disk_cd, listed, listed, size, offset, comment)
    wheel.write_bytes(data)
    return wheel, size


def test_a_directory_hiding_members_from_its_count_is_refused(tmp_path):
    """zipfile walks a directory by its byte size, not its count: 1001 entries
    listed as 1 (or 5000 listed in the bytes of 1001) are refused unread."""
    hidden, size = listing_fewer_members(tmp_path / "hidden.whl", 1001, 1)
    assert len(zipfile.ZipFile(hidden).infolist()) == 1001
    one_line(run(str(hidden)), f"{hidden}: its directory lists 1 members but spans {size} bytes, "
                               "where that many take 46 to 302")
    inflated, size = listing_fewer_members(tmp_path / "inflated.whl", 1001, 5000)
    one_line(run(str(inflated)), f"{inflated}: its directory lists 5000 members but spans {size} bytes")


def test_a_zip64_record_zipfile_reads_is_the_one_checked(tmp_path):
    """zipfile takes the zip64 record's size whenever one sits before the end record,
    even under a plain end record whose count and size look harmless."""
    plain, size = listing_fewer_members(tmp_path / "plain.whl", 1001, 1001)
    data = plain.read_bytes()
    at = len(data) - END_RECORD.size
    offset = END_RECORD.unpack_from(data, at)[6]
    zip64_end = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 1, 1, size, offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, at, 1)
    end = END_RECORD.pack(b"PK\x05\x06", 0, 0, 1, 1, 100, offset, 0)
    wheel = tmp_path / "zip64.whl"
    wheel.write_bytes(data[:at] + zip64_end + locator + end)
    assert len(zipfile.ZipFile(wheel).infolist()) == 1001
    one_line(run(str(wheel)), f"{wheel}: its directory lists 1 members but spans {size} bytes")


def test_a_directory_past_what_the_member_cap_could_fill_is_never_loaded(tmp_path, monkeypatch,
                                                                          capsys):
    """With the cap at 10 members, a directory of 1001 entries listed as 1 is refused
    by its size alone, before zipfile builds anything."""
    wheel, size = listing_fewer_members(tmp_path / "big.whl", 1001, 1)
    monkeypatch.setattr(uc, "MAX_WHEEL_MEMBERS", 10)

    def never(*args, **kwargs):
        raise AssertionError("zipfile.ZipFile was built for a refused wheel")

    monkeypatch.setattr(zipfile, "ZipFile", never)
    assert cli.main(["upgrade-check", str(wheel)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"upgrade-check: {wheel}: its directory spans {size} bytes, more "
                                 "than the 10 members a wheel of sglang may have could fill\n")


def test_member_names_that_escape_the_archive_are_never_followed(tmp_path, pristine):
    escape = tmp_path / "outside" / "escaped.py"
    tricks = tmp_path / "tricks.whl"
    with zipfile.ZipFile(tricks, "w") as z:
        for name in ("../outside/escaped.py", "/sglang/__init__.py", "sglang\\__init__.py",
                     "sglang/../sglang/__init__.py", "./sglang/__init__.py"):
            z.writestr(name, "x = 1\n")
    one_line(run(str(tricks)), f"{tricks}: no sglang package inside the wheel")
    # The same names beside a real tree: read as the tree, nothing written anywhere.
    wheel = zip_as_wheel(pristine, tmp_path / "beside.whl")
    with zipfile.ZipFile(wheel, "a") as z:
        z.writestr("../outside/escaped.py", "x = 1\n")
        z.writestr("/etc/escaped.py", "x = 1\n")
    proc = run(str(wheel))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not escape.exists() and not Path("/etc/escaped.py").exists()


# ---------------------------------------------------------------- folders


def test_a_source_file_of_gigabytes_behind_a_symlink(tree, tmp_path):
    target = tree / MOONCAKE
    target.unlink()
    target.symlink_to(sparse_file(tmp_path / "huge.py", 3 << 30))
    one_line(run(str(tree)), f"{target}: larger than 16 MiB, not a source file")


# ---------------------------------------------------------------- encodings, as Python reads them


def test_sources_in_other_declared_encodings_read_the_same(tree):
    """Only comments change (a fingerprint covers code), re-encoded as Python allows."""
    for rel, encoding, head in ((HOOK_REGISTRY, "latin-1", "# -*- coding: latin-1 -*-\n# café\n"),
                                (MOONCAKE, "shift_jis", "# vim: set fileencoding=shift_jis :\n# 日本語\n"),
                                (DETOK, "utf-8-sig", "# ünïcode with a byte-order mark\n")):
        path = tree / rel
        path.write_bytes((head + path.read_text(encoding="utf-8")).encode(encoding))
    proc = run(str(tree))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("nothing to review (exit 0)")


@pytest.mark.parametrize("head, fragment", [
    (b"# caf\xe9\n", "not readable as Python source (invalid or missing encoding declaration)"),
    (b"\n\n# caf\xe9\n", "not readable as Python source ('utf-8' codec can't decode byte 0xe9 in position"),
    (b"x = (\n", "cannot parse sglang/__init__.py: '(' was never closed (line 1)"),
    (b"# coding: klingon\n", "not readable as Python source (unknown encoding: klingon)"),
    (b"\xef\xbb\xbf# coding: latin-1\n", "not readable as Python source (encoding problem: utf-8)"),
    (b"# coding: rot13\n", "not readable as Python source ('rot13' is not a text encoding"),
    (b"x = 1\x00\n", "source code string cannot contain null bytes"),
    (b"x = a" + b".b" * 100_000 + b"\n", "Python cannot parse it (maximum recursion depth exceeded"),
], ids=["undeclared latin-1", "undeclared latin-1 on line 3", "syntax error", "unknown encoding", "BOM against its declaration", "not a text encoding",
        "null byte", "nesting past the parser"])
def test_sources_python_could_not_read(tree, head, fragment):
    path = tree / "sglang/__init__.py"
    path.write_bytes(head + path.read_bytes())
    line = one_line(run(str(tree)), "sglang/__init__.py")
    assert fragment in line and str(tree) in line, line


def test_a_source_deep_in_the_tree_that_python_could_not_read(tree, tmp_path):
    path = tree / MOONCAKE
    path.write_bytes(path.read_bytes() + b"\n# caf\xe9\n")
    one_line(run(str(tree)), f"{path}: not readable as Python source ('utf-8' codec can't decode byte 0xe9")
    wheel = zip_as_wheel(tree, tmp_path / "w.whl")
    one_line(run(str(wheel)), f"{wheel}: {MOONCAKE}: not readable as Python source")


# ---------------------------------------------------------------- the version file


@pytest.mark.parametrize("content, fragment", [
    (b"__version__ = (\n", "cannot parse sglang/_version.py: '(' was never closed (line 1)"),
    (b"__version__ = '0.6.0'  # \xff\n", "_version.py: not readable as Python source"),
    (None, "_version.py: larger than 16 MiB, not a source file"),
], ids=["syntax error", "not UTF-8", "gigabytes behind a symlink"])
def test_a_version_file_that_cannot_be_read(tree, tmp_path, content, fragment):
    version = tree / "sglang/_version.py"
    if content is None:
        version.unlink()
        version.symlink_to(sparse_file(tmp_path / "version.py", 3 << 30))
    else:
        version.write_bytes(content)
    one_line(run(str(tree)), fragment)
    wheel = zip_as_wheel(tree, tmp_path / "w.whl") if content is not None else None
    if wheel is not None:
        one_line(run(str(wheel)), fragment)


# ---------------------------------------------------------------- numbers


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "0", "-1", "0.5", "1e9", "ten", ""])
def test_download_timeouts_that_are_not_usable(value):
    proc = run(f"--download-timeout={value}", "0.6.0", timeout=30)
    one_line(proc, f"upgrade-check: --download-timeout {value!r}: expected seconds from 1 to 86400")
