"""``sglang-dsv41``: one entry point for the operator tools; each command lives in its own module."""

from __future__ import annotations

import argparse
import os
import sys

from sglang_dsv41.tools.docs import patches_doc_cmd, settings_doc_cmd
from sglang_dsv41.tools.doctor import doctor, versions
from sglang_dsv41.tools.fingerprint_cmd import fingerprint_cmd

def plan_cmd(args) -> int:
    from sglang_dsv41.tools.plan.cli import run as plan_run

    return plan_run(args)


def upgrade_check_cmd(args) -> int:
    from sglang_dsv41.tools.upgrade_check import main as upgrade_main

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
    from sglang_dsv41.tools.smoke import main as smoke_main

    return smoke_main(args)


def verify_cmd(args) -> int:
    from sglang_dsv41.tools.verify.cli import main as verify_main

    return verify_main(args)


def main(argv=None) -> int:
    """Every command; an error no command handled ends in one line on stderr (exit 2), a
    reader that went away (``| head``) in silence."""
    try:
        return _main(argv)
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141  # as a shell reports a command ended by SIGPIPE
    except Exception as exc:
        _stdout_to_devnull()
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
        print(f"sglang-dsv41: stopped on an error it does not handle ({text})", file=sys.stderr)
        return 2


def _stdout_to_devnull() -> None:
    """Output still buffered for a closed or full stdout would fail again at exit, with a traceback."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-dsv41")
    parser.add_argument("--version", action=_VersionAction,
                        help="print this package's version, the pinned and the installed sglang")
    sub = parser.add_subparsers(dest="cmd", required=True)
    doc = sub.add_parser("doctor", help="check the install: pin, fingerprints, entry point, conflicts")
    doc.add_argument("--json", action="store_true", help="one JSON report instead of text lines")
    f = sub.add_parser("fingerprint", help="compare (or --update) the table's upstream fingerprints")
    f.add_argument("--update", action="store_true",
                   help="rewrite the literals in each feature's patches.py (all, or only the given ids)")
    f.add_argument("ids", nargs="*", metavar="PATCH_ID",
                   help="only these patches or pinned internals (default: all)")
    f.add_argument("--json", action="store_true", help="the comparison as JSON")
    d = sub.add_parser("patches-doc", help="render docs/PATCHES.md from the patch table")
    d.add_argument("--write", metavar="PATH")
    s = sub.add_parser("settings-doc", help="render the README's runtime-switches table from settings.py")
    s.add_argument("--write", metavar="README", help="replace the generated table in this file")
    pl = sub.add_parser("plan", help="check docker compose topologies offline")
    from sglang_dsv41.tools.plan.cli import add_arguments as add_plan_arguments

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
    u.add_argument("--download-timeout", default="600", metavar="SECONDS",
                   help="seconds pip download may take, 1 to 86400 (default 600)")
    from sglang_dsv41.tools.smoke import add_arguments as add_smoke_arguments

    add_smoke_arguments(sub.add_parser(
        "smoke", help="check running servers: health, one chat completion, the plugin's metrics"))
    from sglang_dsv41.tools.verify.cli import add_arguments as add_verify_arguments

    add_verify_arguments(sub.add_parser(
        "verify", help="start plugin and stock servers on this node and prove each feature: one report",
        description="Start the server pairs each check needs (one at a time, on the GPUs given), send "
        "a fixed prompt set, compare greedy tokens and the plugin's figures, stop them. Exit 0: every "
        "selected check passed; 1: one failed or was skipped (the reason is in the report); 2: bad input."))
    args = parser.parse_args(argv)
    handler = {"doctor": doctor, "fingerprint": fingerprint_cmd,
               "patches-doc": patches_doc_cmd, "plan": plan_cmd, "smoke": smoke_cmd,
               "settings-doc": settings_doc_cmd,
               "upgrade-check": upgrade_check_cmd, "verify": verify_cmd}[args.cmd]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
