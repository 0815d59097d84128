#!/bin/sh
# Install the sglang-dsv41 wheel into an environment that already holds sglang
# 0.5.23 (the upstream image), then prove the install with `sglang-dsv41 doctor`.
# The image build runs exactly this script; test/deploy runs it on the CPU machine.
#
# usage: install-plugin.sh WHEEL_DIR
#   PLUGIN_DEPS=resolve (default): after the --no-deps install, let pip check the
#       plugin's own requirements with every installed package pinned to the
#       version the base image has; it installs only what is missing and fails on
#       a conflict (e.g. a base without sglang 0.5.23). Nothing already installed
#       is re-resolved, upgraded or downloaded again.
#   PLUGIN_DEPS=skip: trust the last successful resolution (the local build's fast
#       path when python/pyproject.toml has not changed).
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
    constraints=$(mktemp)
    python3 -m pip list --format=freeze --exclude sglang-dsv41 >"$constraints"
    python3 -m pip install --no-cache-dir --constraint "$constraints" "$wheel"
    rm -f "$constraints"
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
