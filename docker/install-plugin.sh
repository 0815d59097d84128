#!/bin/sh
# Install the sglang-dsv41 wheel into an environment that already holds sglang
# 0.5.23 (the upstream image), then prove the install with `sglang-dsv41 doctor`.
# The image build runs exactly this script; test/deploy runs it on the CPU machine.
#
# usage: install-plugin.sh WHEEL_DIR
#   PLUGIN_DEPS=resolve (default): check the plugin's own requirements against
#       what the base image has: a requirement the base has in a version that
#       does not fit (e.g. not sglang 0.5.23) fails the build; a missing one is
#       installed with every installed package pinned to its current version.
#       sglang's dependency tree is neither walked nor re-resolved.
#   PLUGIN_DEPS=skip: trust the last successful check (the local build's fast
#       path when python/pyproject.toml and the base image have not changed).
set -eu

wheel_dir=${1:?usage: install-plugin.sh WHEEL_DIR}
deps=${PLUGIN_DEPS:-resolve}

set -- "$wheel_dir"/sglang_dsv41-*.whl
if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then
    echo "install-plugin.sh: expected exactly one sglang_dsv41 wheel in $wheel_dir" >&2
    exit 1
fi
wheel=$1

# --no-deps: sglang's dependency tree (torch, kernels, ...) stays exactly as the base image has it.
python3 -m pip install --no-cache-dir --no-deps --no-index "$wheel"

case $deps in
resolve)
    work=$(mktemp -d)
    # The plugin's direct requirements only; prints the missing ones, fails on a misfit.
    python3 - "$work/missing.txt" <<'PY'
import importlib.metadata as metadata
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement

missing, misfits = [], []
for text in metadata.requires("sglang-dsv41") or []:
    requirement = Requirement(text)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue  # an extra (e.g. the test tools), not needed at run time
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        missing.append(str(requirement))
        continue
    if not requirement.specifier.contains(installed, prereleases=True):
        misfits.append(f"{requirement.name} {installed} does not satisfy '{requirement}'")
if misfits:
    sys.exit("install-plugin.sh: the base image does not fit sglang-dsv41: " + "; ".join(misfits))
with open(sys.argv[1], "w") as out:
    out.write("".join(line + "\n" for line in missing))
print("install-plugin.sh: plugin requirements " + ("missing from the base: " + ", ".join(missing) if missing else "all present in the base"))
PY
    if [ -s "$work/missing.txt" ]; then
        python3 -m pip list --format=freeze --exclude sglang-dsv41 >"$work/base.txt"
        python3 -m pip install --no-cache-dir --constraint "$work/base.txt" --requirement "$work/missing.txt"
    fi
    rm -rf "$work"
    ;;
skip)
    echo "install-plugin.sh: PLUGIN_DEPS=skip: plugin requirements not re-checked"
    ;;
*)
    echo "install-plugin.sh: PLUGIN_DEPS must be resolve or skip, got '$deps'" >&2
    exit 1
    ;;
esac

# Fails the build when the pin, a fingerprint, the entry point or another plugin is wrong.
sglang-dsv41 doctor
