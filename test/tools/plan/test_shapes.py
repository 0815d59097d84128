"""Every deployment shape of the original fork's 31 compose files, as the
mapping table of deploy/b300-ds41/README.md claims it.

The table is parsed from the README; for each row the named files are planned
by `sglang-dsv41 plan` (sglang 0.5.23's real parser and resolution, this
plugin's validators) in a copy of deploy/b300-ds41 whose `.env` is
`.env.example` plus the row's `.env` change, and plan's resolved layout is
compared with the row's layout column: role and host GPUs of each server, TP,
attention DP and attention CP widths, DSpark, L3, text or vision, and decoder
SWA replay where the row states it. Refused rows must be refused by plan.
All cases run in one interpreter (importing sglang is the slow part).
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run_python

DEPLOY = REPO_ROOT / "deploy" / "b300-ds41"
README = DEPLOY / "README.md"
HERE = Path(__file__).resolve().parent

# The original fork's compose files (deploy/b300-ds41/dockerserve*.yml there).
ORIGINAL_FILES = {
    f"dockerserve{suffix}.yml" for suffix in (
        "", "-3cp2-pd", "-b4-dp", "-b4-tp", "-b4", "-cp2x4", "-cp8", "-cpdspark-l3-b4-nocap",
        "-cpdspark-l3-b4", "-cpdspark-l3-nocap", "-cpdspark-l3", "-cpdspark-nr-b4", "-cpdspark-nr",
        "-cpdspark", "-dp2", "-dp4test", "-dp8", "-p", "-pd-d-vision", "-pd-d", "-pd-p-dp",
        "-pd-p-vision", "-pd-p", "-pd2-d-r2", "-pd2-d", "-pd2-p-r1", "-pd2-p-r2", "-pd2-p",
        "-replay-off", "-replay-on", "-tp2",
    )
}

ENV = {
    "IMAGE": "registry.invalid/sglang-dsv41:test",
    "MODEL_PATH": "/data/models/DeepSeek-V4.1-Flash",
    "SGLANG_CACHE_DIR": "/data/cache/sglang",
}


@dataclass(frozen=True)
class ClaimedServer:
    role: str  # server, prefill or decode
    gpus: tuple[str, ...]
    props: tuple[str, ...]


@dataclass(frozen=True)
class Row:
    original: str
    verdict: str
    files: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    layout: str
    notes: str

    @property
    def case(self) -> str:
        return json.dumps([self.files, self.env])


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def parse_table(text: str) -> list[Row]:
    section = text.split("## Every original deployment shape", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| ")]
    header = _cells(lines[0])
    assert header == ["original file", "verdict", "our files", "`.env` change", "layout", "notes"], header
    rows = []
    for line in lines[2:]:
        original, verdict, files, env, layout, notes = _cells(line)
        rows.append(Row(
            original=original.strip("`"),
            verdict=verdict,
            files=tuple(re.findall(r"`([^`]+\.yml)`", files)),
            env=tuple(re.findall(r"`([A-Z][A-Z0-9_]*)=([^`]*)`", env)),
            layout=layout,
            notes=notes,
        ))
    return rows


def _gpu_range(text: str) -> tuple[str, ...]:
    low, _, high = text.strip().partition("-")
    return tuple(str(g) for g in range(int(low), int(high or low) + 1))


def parse_layout(layout: str) -> list[ClaimedServer]:
    """``prefill 0-1 / 2-3: TP 2, CP 2, DSpark, L3, vision + decode 6-7: ...``"""
    servers = []
    for group in layout.split(" + "):
        head, _, props = group.partition(":")
        role, _, gpu_sets = head.strip().partition(" ")
        assert role in ("server", "prefill", "decode"), f"unknown role in {group!r}"
        items = tuple(p.strip() for p in props.split(","))
        assert ("text" in items) != ("vision" in items), f"say text or vision: {group!r}"
        for gpus in gpu_sets.split("/"):
            servers.append(ClaimedServer(role, _gpu_range(gpus), items))
    return servers


def planned_servers(output: str) -> list[tuple[tuple[str, ...], str]]:
    """(host GPUs, resolved layout line) for each sglang server plan printed."""
    lines = output.splitlines()
    found = []
    for n, line in enumerate(lines):
        match = re.match(r"\S+ \[host \S+\] port \d+, GPUs ([\d,]+)$", line)
        if match and n + 1 < len(lines):
            found.append((tuple(match.group(1).split(",")), lines[n + 1].strip()))
    return found


def layout_mismatches(claimed: ClaimedServer, resolved: str) -> list[str]:
    props = claimed.props
    width = {name: 1 for name in ("TP", "DP", "CP")}
    for item in props:
        match = re.fullmatch(r"(TP|DP|CP) (\d+)", item)
        if match:
            width[match.group(1)] = int(match.group(2))
    expected = [
        (f"TP {width['TP']}, EP", True),
        (f"attention DP {width['DP']},", True),
        (re.compile(rf"attention CP {width['CP']}\b"), True),
        ({"server": "; no PD;", "prefill": "; PD prefill", "decode": "; PD decode"}[claimed.role], True),
        ("DSpark on", "DSpark" in props),
        ("L3 mooncake", "L3" in props),
        ("vision on", "vision" in props),
    ]
    if "replay" in props or "no replay" in props:
        expected.append(("decoder SWA replay on", "replay" in props))
    wrong = []
    for fragment, wanted in expected:
        present = bool(fragment.search(resolved)) if isinstance(fragment, re.Pattern) else fragment in resolved
        if present != wanted:
            shown = fragment.pattern if isinstance(fragment, re.Pattern) else fragment
            wrong.append(f"{'missing' if wanted else 'unexpected'} {shown!r}")
    return wrong


ROWS = parse_table(README.read_text())


def _deployment_dir(root: Path, name: str, env: tuple[tuple[str, str], ...]) -> Path:
    """A copy of deploy/b300-ds41 whose .env is .env.example plus ``env``."""
    target = root / name / "b300-ds41"
    shutil.copytree(DEPLOY, target, ignore=shutil.ignore_patterns(".env"))
    text = (DEPLOY / ".env.example").read_text()
    text += "".join(f"\n{key}={value}" for key, value in env) + "\n"
    (target / ".env").write_text(text)
    return target


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("shapes")
    cases: dict[str, list[str]] = {}
    # The node's one Mooncake master runs from its own folder: a second
    # deployment's COMPOSE_PROJECT_NAME must not rename the master's project
    # (README, "Two deployments of one file").
    node = _deployment_dir(root, "node", ())
    for n, row in enumerate(ROWS):
        if row.case in cases:
            continue  # rows that share files and .env change are one plan run
        folder = _deployment_dir(root, f"row{n}", row.env)
        renamed = any(key == "COMPOSE_PROJECT_NAME" for key, _ in row.env)
        cases[row.case] = [str((node if renamed and f == "mooncake-master.yml" else folder) / f)
                           for f in row.files]
    # Two L3 deployments of one file on one node sharing the node's master.
    first = next(r for r in ROWS if r.original == "dockerserve-cpdspark-l3.yml")
    second = next(r for r in ROWS if r.original == "dockerserve-cpdspark-l3-b4.yml")
    a = _deployment_dir(root, "l3-a", first.env)
    b = _deployment_dir(root, "l3-b", second.env)
    cases["two-l3"] = [str(a / "mooncake-master.yml"), str(a / "cp-dspark-l3.yml"), str(b / "cp-dspark-l3.yml")]
    # The same pair without the second one's GPU and port change must collide.
    c = _deployment_dir(root, "l3-c", first.env + (("COMPOSE_PROJECT_NAME", "ds41-cp-dspark-l3-c"),))
    cases["two-l3-colliding"] = [str(a / "mooncake-master.yml"), str(a / "cp-dspark-l3.yml"), str(c / "cp-dspark-l3.yml")]
    # An L3 file without the master file: plan finds no master.
    cases["l3-without-master"] = [str(a / "cp-dspark-l3.yml")]
    code = f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        import _plan_harness
        print("PLAN-RESULTS " + json.dumps(_plan_harness.run({cases!r})))
    """
    proc = run_python(textwrap.dedent(code), env=ENV, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PLAN-RESULTS ")), None)
    assert line, f"harness failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("PLAN-RESULTS "):])


def test_table_maps_each_original_file_once():
    originals = [row.original for row in ROWS]
    assert sorted(originals) == sorted(ORIGINAL_FILES), set(originals) ^ ORIGINAL_FILES
    for row in ROWS:
        assert row.verdict in ("runs", "refused"), row
        assert row.files, f"{row.original}: names no file"
        for name in row.files:
            assert (DEPLOY / name).is_file(), f"{row.original}: {name} is not shipped"
        if row.verdict == "refused":
            assert row.layout == "known crash" and row.notes, row
        else:
            parse_layout(row.layout)


def test_every_shipped_topology_is_used_by_the_table():
    used = {name for row in ROWS if row.verdict == "runs" for name in row.files}
    assert {p.name for p in DEPLOY.glob("*.yml")} <= used


def test_env_changes_name_only_known_variables():
    from sglang_dsv41.tools.plan.compose import read_env_file

    known = set(read_env_file(DEPLOY / ".env.example")) | {"COMPOSE_PROJECT_NAME"}
    for row in ROWS:
        unknown = {key for key, _ in row.env} - known
        assert not unknown, f"{row.original}: {unknown} not in .env.example"


def test_layout_parser_catches_a_wrong_claim():
    resolved = ("TP 4, EP 4, DP 1, attention TP 1, attention DP 1, attention CP 4 (interleave); no PD; "
                "DSpark on (6 verify tokens); decoder SWA replay off; hierarchical cache off; vision off")
    good = ClaimedServer("server", ("0",), ("TP 4", "CP 4", "DSpark", "text", "no replay"))
    assert layout_mismatches(good, resolved) == []
    for props in [("TP 4", "CP 2", "DSpark", "text"), ("TP 4", "CP 4", "text"), ("TP 4", "CP 4", "DSpark", "vision"),
                  ("TP 4", "CP 4", "DSpark", "L3", "text"), ("TP 4", "CP 4", "DP 4", "DSpark", "text"),
                  ("TP 4", "CP 4", "DSpark", "text", "replay")]:
        assert layout_mismatches(ClaimedServer("server", ("0",), props), resolved), props
    assert layout_mismatches(ClaimedServer("prefill", ("0",), good.props), resolved)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.original)
def test_row_plans_with_the_claimed_layout(results, row):
    result = results[row.case]
    output = result["output"]
    if row.verdict == "refused":
        assert result["rc"] == 1, output
        assert any("ERROR" in ln and "crash" in ln for ln in output.splitlines()), output
        return
    assert result["rc"] == 0, output
    claimed = parse_layout(row.layout)
    planned = planned_servers(output)
    assert len(planned) == len(claimed), output
    for server in claimed:
        match = [resolved for gpus, resolved in planned if gpus == server.gpus]
        assert len(match) == 1, f"no single server on GPUs {','.join(server.gpus)}:\n{output}"
        wrong = layout_mismatches(server, match[0])
        assert not wrong, f"{server}: {wrong}\n{match[0]}"


def test_two_l3_deployments_share_one_master(results):
    result = results["two-l3"]
    assert result["rc"] == 0, result["output"]
    assert "plan: OK (2 sglang servers, 0 routers, 1 Mooncake masters)" in result["output"]
    gpus = sorted(g for g, _ in planned_servers(result["output"]))
    assert gpus == [("0", "1", "2", "3"), ("4", "5", "6", "7")]
    assert result["output"].count("L3 mooncake (master 127.0.0.1:50051)") == 2


def test_two_l3_deployments_on_the_same_gpus_collide(results):
    output = results["two-l3-colliding"]["output"]
    assert results["two-l3-colliding"]["rc"] == 1
    assert "GPUs 0,1,2,3 are also used by" in output and "port 30000" in output, output


def test_l3_file_alone_has_no_master(results):
    output = results["l3-without-master"]["output"]
    assert results["l3-without-master"]["rc"] == 1
    assert "no mooncake_master service of the plan listens there" in output, output
