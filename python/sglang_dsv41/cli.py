"""``sglang-dsv41``: doctor, fingerprint, patches-doc, plan, smoke, upgrade-check."""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang_dsv41 import checks
from sglang_dsv41 import fingerprint as fp
from sglang_dsv41._pin import (
    DISTRIBUTION_NAME,
    ENTRY_POINT_GROUP,
    ENTRY_POINT_NAME,
    PINNED_SGLANG_VERSION,
)
from sglang_dsv41.patch_table import PATCHES

OK, BAD, WARN = "ok  ", "FAIL", "warn"


def _line(verdict: str, text: str) -> None:
    print(f"[{verdict}] {text}")


def _entry_point_findings() -> list[tuple[str, str]]:
    from importlib.metadata import entry_points

    findings = []
    eps = list(entry_points(group=ENTRY_POINT_GROUP))
    ours = [ep for ep in eps if ep.name == ENTRY_POINT_NAME]
    mine = [ep for ep in ours if ep.dist and ep.dist.name == DISTRIBUTION_NAME]
    if not mine:
        findings.append((BAD, f"entry point {ENTRY_POINT_NAME!r} of {DISTRIBUTION_NAME} is not "
                              f"discoverable in group {ENTRY_POINT_GROUP}; reinstall the package"))
    else:
        findings.append((OK, f"entry point {ENTRY_POINT_NAME} = {mine[0].value} is discoverable"))
    others = [ep for ep in ours if not (ep.dist and ep.dist.name == DISTRIBUTION_NAME)]
    if others:
        findings.append((BAD, f"another distribution also names an entry point {ENTRY_POINT_NAME!r} "
                              f"({others[0].dist.name if others[0].dist else '?'}); sglang keeps only one"))
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed:
        names = {x.strip() for x in allowed.split(",") if x.strip()}
        if ENTRY_POINT_NAME not in names:
            findings.append((BAD, f"SGLANG_PLUGINS={allowed!r} filters out {ENTRY_POINT_NAME}; "
                                  "the server would run stock sglang"))
        else:
            findings.append((OK, f"SGLANG_PLUGINS={allowed!r} includes {ENTRY_POINT_NAME}"))
    selected = os.environ.get("SGLANG_PLATFORM", "")
    if selected:
        platform_eps = entry_points(group="sglang.srt.platforms")
        excluded = {ep.dist.name for ep in platform_eps if ep.dist and ep.name != selected}
        if DISTRIBUTION_NAME in excluded:
            findings.append((BAD, f"SGLANG_PLATFORM={selected!r} excludes {DISTRIBUTION_NAME}"))
        else:
            findings.append((OK, f"SGLANG_PLATFORM={selected!r} does not exclude {DISTRIBUTION_NAME}"))
    return findings


def _foreign_hook_findings() -> list[tuple[str, str]]:
    """Run the other general plugins, as sglang would, and look for shared targets."""
    from importlib.metadata import entry_points

    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, _current_plugin_source

    findings = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.dist and ep.dist.name == DISTRIBUTION_NAME:
            continue
        token = _current_plugin_source.set(
            HookSource(plugin_name=ep.name, dist_name=ep.dist.name if ep.dist else None)
        )
        try:
            ep.load()()
        except BaseException as exc:  # a foreign plugin failing is a finding, not a crash
            findings.append((WARN, f"other plugin {ep.name} failed to load here: {exc!r}"))
        finally:
            _current_plugin_source.reset(token)
    ours = {p.target for p in PATCHES}
    for target, hooks in HookRegistry._hooks.items():
        if target not in ours:
            continue
        for _kind, _hook, src in hooks:
            if src is None or src.dist_name != DISTRIBUTION_NAME:
                name = f"{src.plugin_name} ({src.dist_name})" if src else "unknown source"
                findings.append((BAD, f"{name} also hooks {target}"))
    our_steps = {p.resolution_step for p in PATCHES if p.kind.value == "resolution"}
    for step in our_steps:
        if len(resolution_hooks._HOOKS.get(step, ())) > 0:
            findings.append((BAD, f"another plugin wraps resolution step {step}"))
    if not findings:
        findings.append((OK, "no other installed plugin hooks a target of ours"))
    return findings


@dataclass(frozen=True)
class Finding:
    """One line of ``doctor``: the same record behind its text and its JSON."""

    check: str  # sglang-pin | patch | internal | entry-point | plugin-filter | platform-filter | foreign-plugin
    status: str  # ok | fail | warn
    message: str
    patch_id: str | None = None
    target: str | None = None

    @property
    def verdict(self) -> str:
        return {"ok": OK, "fail": BAD, "warn": WARN}[self.status]


_STATUS_OF = {OK: "ok", BAD: "fail", WARN: "warn"}


def _check_of(text: str) -> str:
    if text.startswith("SGLANG_PLUGINS"):
        return "plugin-filter"
    if text.startswith("SGLANG_PLATFORM"):
        return "platform-filter"
    if "entry point" in text:
        return "entry-point"
    return "foreign-plugin"


def doctor_findings() -> list[Finding]:
    found = fp.installed_version("sglang")
    pin = checks.version_problem()
    findings = [
        Finding("sglang-pin", "fail", str(pin)) if pin else
        Finding("sglang-pin", "ok", f"sglang {found} matches the pin sglang=={PINNED_SGLANG_VERSION}")
    ]
    for patch in PATCHES:
        problems = checks.patch_problems(patch)
        if problems:
            findings.append(Finding("patch", "fail", f"{patch.id:<14} {patch.target}: "
                                    + "; ".join(p.message for p in problems), patch.id, patch.target))
        else:
            findings.append(Finding("patch", "ok", f"{patch.id:<14} {patch.kind.value:<13} "
                                    f"{patch.target} fingerprint {patch.ast_sha}", patch.id, patch.target))
    from sglang_dsv41 import pinned_internals

    drifted = 0
    for internal in pinned_internals.INTERNALS:
        problems = pinned_internals.problems(internal)
        if problems:
            drifted += 1
            findings.append(Finding("internal", "fail", f"internal {internal.name} ({internal.used_by}): "
                                    + "; ".join(problems), None, internal.name))
    if not drifted:
        findings.append(Finding("internal", "ok", f"{len(pinned_internals.INTERNALS)} pinned sglang "
                                "internals the tooling uses match their fingerprints"))
    for verdict, text in _entry_point_findings() + _foreign_hook_findings():
        findings.append(Finding(_check_of(text), _STATUS_OF[verdict], text))
    staging = _kv_staging_finding()
    if staging is not None:
        findings.append(staging)
    return findings


def _kv_staging_finding() -> Finding | None:
    """KV staging as this environment sets it (nothing when it is off): its values, and Triton."""
    from sglang_dsv41.core.kv_staging import STAGING_ENV, StagingConfigError, staging_config

    try:
        config = staging_config()
    except StagingConfigError as exc:
        return Finding("kv-staging", "fail", f"{exc}: the PD server would stop at start")
    if config is None:
        return None
    import importlib.util

    from sglang_dsv41.core.kv_staging import MODE_PEER

    value = "peer" if config.mode == MODE_PEER else "1"
    if importlib.util.find_spec("triton") is None:
        return Finding("kv-staging", "fail", f"{STAGING_ENV}={value} needs Triton for its batched copy, "
                       "and triton is not installed: the PD server would stop at start")
    if config.mode == MODE_PEER:
        from sglang_dsv41.core.batch_copy_native import NativeWriteError, build

        try:
            build()
        except NativeWriteError as exc:  # the Python path works: slower, not wrong
            return Finding("kv-staging", "warn", f"{STAGING_ENV}=peer: the native writer does not build here "
                           f"({exc}); peer writes will fill and launch their tables from Python, slower")
        return Finding("kv-staging", "ok", f"{STAGING_ENV}=peer: KV and state sends of {config.min_blocks}+ "
                       "device blocks written straight into the decode's KV over CUDA IPC, from their "
                       "page lists where sglang's send allows; a request's last chunk as one write "
                       "(native writer builds)")
    return Finding("kv-staging", "ok", f"{STAGING_ENV}=1: {config.slots} slots of "
                   f"{config.slot_bytes >> 20} MiB per side, batches of {config.min_blocks}+ blocks staged")


def versions() -> dict:
    """This package's version, the sglang release it is pinned to, the installed sglang."""
    from importlib.metadata import PackageNotFoundError, version

    from sglang_dsv41 import __version__

    try:
        ours = version(DISTRIBUTION_NAME)
    except PackageNotFoundError:  # run from a source tree that is not installed
        ours = __version__
    return {"version": ours, "pinned_sglang": PINNED_SGLANG_VERSION,
            "installed_sglang": fp.installed_version("sglang")}


def doctor(args) -> int:
    findings = doctor_findings()
    failed = any(f.status == "fail" for f in findings)
    if getattr(args, "json", False):
        report = {"tool": "sglang-dsv41", "command": "doctor", **versions(),
                  "ok": not failed, "findings": [asdict(f) for f in findings]}
        print(json.dumps(report, indent=2))
        return 1 if failed else 0
    for finding in findings:
        _line(finding.verdict, finding.message)
    print("doctor: " + ("PROBLEMS FOUND" if failed else "all checks passed"))
    return 1 if failed else 0


def _rewrite_fingerprints(table_path: Path, items, call_name: str, key: str,
                          namespace: dict, only: set[str] | None = None) -> int:
    """Rewrite the signature/ast_sha literals of every ``call_name(...)`` entry of a
    table module from the installed sources (``key`` is the field naming it)."""
    text = table_path.read_text()
    tree = ast.parse(text)
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    by_key = {item.id: item for item in items}
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == call_name):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        # The key may be built from module constants (an f-string): evaluate it there.
        name = eval(compile(ast.Expression(kw[key]), str(table_path), "eval"), dict(namespace))
        item = by_key[name]
        if only and item.id not in only:
            continue
        got = fp.fingerprint_of(item)
        for field, value in (("signature", got.signature), ("ast_sha", got.ast_sha)):
            v = kw[field]
            start = offsets[v.lineno - 1] + v.col_offset
            end = offsets[v.end_lineno - 1] + v.end_col_offset
            edits.append((start, end, json.dumps(value)))  # a valid Python str literal
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    table_path.write_text(text)
    return len(edits) // 2


def _source_checkout_of(module_file: str) -> Path | None:
    """The source checkout this package is imported from, or None for an installed copy.

    ``fingerprint --update`` rewrites Python sources; doing that to a copy in
    site-packages would silently change what the loader checks on that machine.
    """
    package_dir = Path(module_file).resolve().parent
    pyproject = package_dir.parent / "pyproject.toml"
    if "site-packages" in package_dir.parts or "dist-packages" in package_dir.parts:
        return None
    try:
        declares_us = f'name = "{DISTRIBUTION_NAME}"' in pyproject.read_text()
    except OSError:
        return None
    return package_dir.parent if declares_us else None


def fingerprint_cmd(args) -> int:
    from sglang_dsv41 import pinned_internals

    items = PATCHES + pinned_internals.INTERNALS
    known = {item.id for item in items}
    unknown = [i for i in args.ids if i not in known]
    if unknown:
        print(f"fingerprint: unknown id(s) {', '.join(unknown)}; known ids are the patch ids of "
              "docs/PATCHES.md and the pinned internals' names", file=sys.stderr)
        return 2
    if args.update:
        import sglang_dsv41.patch_table as table

        if _source_checkout_of(table.__file__) is None:
            print(f"fingerprint --update: refusing to rewrite {table.__file__}: it is not in a "
                  "source checkout of this package (run it from the repository, "
                  "`pip install -e ./python`)", file=sys.stderr)
            return 2
        only = set(args.ids) or None
        n = _rewrite_fingerprints(Path(table.__file__), PATCHES, "Patch", "id", vars(table), only)
        m = _rewrite_fingerprints(Path(pinned_internals.__file__), pinned_internals.INTERNALS,
                                  "Internal", "name", vars(pinned_internals), only)
        print(f"rewrote fingerprints of {n} patches in {table.__file__} and of {m} internals "
              f"in {pinned_internals.__file__}")
        return 0
    wanted = set(args.ids)
    rows = []
    for item in items:
        if wanted and item.id not in wanted:
            continue
        row = {"id": item.id, "target": item.fingerprint_target,
               "expected": {"ast_sha": item.ast_sha, "signature": item.signature}}
        try:
            got = fp.fingerprint_of(item)
        except fp.TargetNotFound as exc:
            row.update(verdict="MISSING", found=None, reason=str(exc))
        else:
            same = got.signature == item.signature and got.ast_sha == item.ast_sha
            row.update(verdict="same" if same else "DRIFT",
                       found={"ast_sha": got.ast_sha, "signature": got.signature})
        rows.append(row)
    drift = sum(r["verdict"] != "same" for r in rows)
    if args.json:
        print(json.dumps({"sglang": fp.installed_version("sglang"), "drifted": drift,
                          "targets": rows}, indent=2))
    else:
        for r in rows:
            if r["found"] is None:
                print(f"{r['id']}: MISSING {r['reason']}")
            else:
                print(f"{r['id']}: {r['verdict']} {r['target']} "
                      f"{r['found']['ast_sha']} {r['found']['signature']}")
    return 1 if drift else 0


def patches_doc_cmd(args) -> int:
    from sglang_dsv41.patches_doc import render

    text = render()
    if args.write:
        Path(args.write).write_text(text)
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(text)
    return 0


def settings_doc_cmd(args) -> int:
    from sglang_dsv41.settings import render_table, replace_table

    if not args.write:
        print(render_table())
        return 0
    path = Path(args.write)
    try:
        text = path.read_text()
        updated = replace_table(text)
    except (OSError, ValueError) as exc:
        print(f"settings-doc: cannot update {path}: {exc}", file=sys.stderr)
        return 2
    path.write_text(updated)
    print(f"wrote the runtime-switches table in {path}")
    return 0


def plan_cmd(args) -> int:
    from sglang_dsv41.deploy_plan import run as plan_run

    return plan_run(args)


def upgrade_check_cmd(args) -> int:
    from sglang_dsv41.upgrade_check import main as upgrade_main

    return upgrade_main(args)


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        v = versions()
        print(f"sglang-dsv41 {v['version']} (pinned sglang=={v['pinned_sglang']}; "
              f"installed sglang {v['installed_sglang'] or 'not installed'})")
        parser.exit(0)


def smoke_cmd(args) -> int:
    from sglang_dsv41.smoke import main as smoke_main

    return smoke_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-dsv41")
    parser.add_argument("--version", action=_VersionAction,
                        help="print this package's version, the pinned and the installed sglang")
    sub = parser.add_subparsers(dest="cmd", required=True)
    doc = sub.add_parser("doctor", help="check the install: pin, fingerprints, entry point, conflicts")
    doc.add_argument("--json", action="store_true", help="one JSON report instead of text lines")
    f = sub.add_parser("fingerprint", help="compare (or --update) the table's upstream fingerprints")
    f.add_argument("--update", action="store_true",
                   help="rewrite the literals in patch_table.py (all, or only the given ids)")
    f.add_argument("ids", nargs="*", metavar="PATCH_ID",
                   help="only these patches or pinned internals (default: all)")
    f.add_argument("--json", action="store_true", help="the comparison as JSON")
    d = sub.add_parser("patches-doc", help="render docs/PATCHES.md from the patch table")
    d.add_argument("--write", metavar="PATH")
    s = sub.add_parser("settings-doc", help="render the README's runtime-switches table from settings.py")
    s.add_argument("--write", metavar="README", help="replace the generated table in this file")
    pl = sub.add_parser("plan", help="check docker compose topologies offline")
    from sglang_dsv41.deploy_plan import add_arguments as add_plan_arguments

    add_plan_arguments(pl)
    u = sub.add_parser(
        "upgrade-check",
        help="compare a candidate sglang release with the pinned one under every patch",
        description="Read a candidate sglang (wheel, folder holding the sglang package, a "
        "version to pip download, or 'latest') without importing it; one line per patch: "
        "same / DRIFT / GONE. Exit 0: nothing to review; 1: something drifted; 2: bad input.")
    u.add_argument("candidate", metavar="WHEEL|FOLDER|VERSION")
    u.add_argument("--pinned", metavar="WHEEL|FOLDER|VERSION",
                   help="compare against this release instead of the installed pinned sglang")
    u.add_argument("--json", action="store_true", help="the report as JSON")
    u.add_argument("--download-timeout", type=float, default=600, metavar="SECONDS")
    from sglang_dsv41.smoke import add_arguments as add_smoke_arguments

    add_smoke_arguments(sub.add_parser(
        "smoke", help="check running servers: health, one chat completion, the plugin's metrics"))
    args = parser.parse_args(argv)
    handler = {"doctor": doctor, "fingerprint": fingerprint_cmd,
               "patches-doc": patches_doc_cmd, "plan": plan_cmd, "smoke": smoke_cmd,
               "settings-doc": settings_doc_cmd,
               "upgrade-check": upgrade_check_cmd}[args.cmd]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
