"""``sglang-dsv41 doctor``: is this install one that serves patched, and what would stop it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from sglang_dsv41.plugin import drift
from sglang_dsv41.plugin import fingerprint as fp
from sglang_dsv41.plugin.pin import (
    DISTRIBUTION_NAME,
    ENTRY_POINT_GROUP,
    ENTRY_POINT_NAME,
    PINNED_SGLANG_VERSION,
)
from sglang_dsv41.plugin.table import PATCHES

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

    try:  # sglang picks its platform when these import: SGLANG_PLATFORM may name none installed
        from sglang.srt.arg_groups import resolution_hooks
        from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, _current_plugin_source
    except Exception as exc:
        return [(BAD, "sglang's plugin machinery does not import here, so no server could start: "
                 + " ".join(f"{type(exc).__name__}: {exc}".split())[:300])]

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

    check: str  # sglang-pin | patch | internal | entry-point | plugin-filter | platform-filter | foreign-plugin | setting | kv-staging
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
    if "SGLANG_PLATFORM" in text:
        return "platform-filter"
    if "entry point" in text:
        return "entry-point"
    return "foreign-plugin"


def doctor_findings() -> list[Finding]:
    found = fp.installed_version("sglang")
    pin = drift.version_problem()
    findings = [
        Finding("sglang-pin", "fail", str(pin)) if pin else
        Finding("sglang-pin", "ok", f"sglang {found} matches the pin sglang=={PINNED_SGLANG_VERSION}")
    ]
    for patch in PATCHES:
        problems = drift.patch_problems(patch)
        if problems:
            findings.append(Finding("patch", "fail", f"{patch.id:<14} {patch.target}: "
                                    + "; ".join(p.message for p in problems), patch.id, patch.target))
        else:
            findings.append(Finding("patch", "ok", f"{patch.id:<14} {patch.kind.value:<13} "
                                    f"{patch.target} fingerprint {patch.ast_sha}", patch.id, patch.target))
    from sglang_dsv41.plugin import internals as pinned_internals

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
    return findings + setting_findings()


def setting_findings() -> list[Finding]:
    """The plugin's settings this environment sets, each read with the function
    the runtime reads it with, so a value doctor passes is one the server takes."""
    from sglang_dsv41.cp_bcg.setting import CP_BCG_ENV, parse_cp_bcg_setting
    from sglang_dsv41.owner_broadcast.routing import ENV_MIN_SAVING, ENV_MODE, ENV_PER_IMAGE_COST, RoutingPolicy

    environ = os.environ
    findings = []
    if CP_BCG_ENV in environ:
        try:
            on = parse_cp_bcg_setting(environ[CP_BCG_ENV])
            findings.append(Finding("setting", "ok", f"{CP_BCG_ENV}={environ[CP_BCG_ENV]!r}: the DeepSeek-V4 "
                                    f"CP breakable prefill graph {'on where supported' if on else 'off'}"))
        except ValueError as exc:
            findings.append(Finding("setting", "fail", f"{exc}: the server would stop at plugin load"))
    from sglang_dsv41.cp_bcg.setting import DSPARK_VERIFIED_ENV, dspark_verification_problem

    if DSPARK_VERIFIED_ENV in environ:
        problem = dspark_verification_problem(environ[DSPARK_VERIFIED_ENV], fp.installed_version("sglang") or "")
        findings.append(
            Finding("setting", "fail", f"{problem}: a DSpark server under {CP_BCG_ENV}=1 would be refused at launch")
            if problem else Finding("setting", "ok", f"{DSPARK_VERIFIED_ENV}: a passing acceptance comparison on "
                                    "this sglang release"))
    owner = [name for name in (ENV_MODE, ENV_PER_IMAGE_COST, ENV_MIN_SAVING) if name in environ]
    if owner:
        try:
            policy = RoutingPolicy.from_env(environ)
            text = "off" if policy is None else (f"{policy.mode}, per-image cost {policy.per_image_cost}, "
                                                 f"minimum saving {policy.min_saving}")
            findings.append(Finding("setting", "ok", f"vision owner-broadcast ({', '.join(owner)}): {text}"))
        except ValueError as exc:
            findings.append(Finding("setting", "fail", f"{exc}: a vision model's build would stop"))
    staging = _kv_staging_finding()
    if staging is not None:
        findings.append(staging)
    return findings


def _kv_staging_finding() -> Finding | None:
    """KV peer writes as this environment sets them (nothing when off): their values, and Triton."""
    from sglang_dsv41.mooncake_nvlink.kv_staging.setting import STAGING_ENV, StagingConfigError, staging_config

    try:
        config = staging_config()
    except StagingConfigError as exc:
        return Finding("kv-staging", "fail", f"{exc}: the PD server would stop at start")
    if config is None:
        return None
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return Finding("kv-staging", "fail", f"{STAGING_ENV}=peer needs Triton for its batched copy on the "
                       "prefill, and triton is not installed: a prefill server would stop at start")
    return Finding("kv-staging", "ok", f"{STAGING_ENV}=peer: KV and state sends of {config.min_blocks}+ "
                   "device blocks written straight into the decode's KV over CUDA IPC, from their "
                   "page lists where sglang's send allows; a request's last chunk as one write "
                   "(one Triton kernel, compiled and probed at every access width when the prefill starts)")


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
