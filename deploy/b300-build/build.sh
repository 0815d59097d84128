#!/usr/bin/env bash
# Build the sglang-dsv41 image on a build host (a B300 node or any Docker host).
#
#   deploy/b300-build/build.sh [IMAGE_REF]
#
# Default tag: $IMAGE_REPO:<branch>-<sha9>-local-<UTC yyyymmdd-hhmm>, plus the
# alias $IMAGE_REPO:<branch>-latest-local.
#
# Fast path: when python/pyproject.toml and the base image are the same as in the
# last successful build, the plugin's requirements are not resolved again
# (PLUGIN_DEPS=skip); otherwise, or with FULL=1, they are (PLUGIN_DEPS=resolve).
# sglang's own dependencies are never re-resolved: the plugin goes in with
# `pip install --no-deps` on top of the base image either way.
#
# Settings (environment):
#   IMAGE_REPO      image repository for the default tag  (default: sglang-dsv41)
#   BASE_IMAGE      upstream sglang 0.5.23 image or mirror (default: lmsysorg/sglang:v0.5.23)
#   PIP_INDEX_URL   PyPI or a mirror                       (default: https://pypi.org/simple)
#   FULL=1          always resolve the plugin's requirements
#   BUILD_STATE_DIR where the last successful build is remembered
#                   (default: $XDG_STATE_HOME/sglang-dsv41-build or ~/.local/state/sglang-dsv41-build)
#   DOCKER          docker command (default: docker)
set -euo pipefail

repo_root=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
cd "$repo_root"

image_repo=${IMAGE_REPO:-sglang-dsv41}
base_image=${BASE_IMAGE:-lmsysorg/sglang:v0.5.23}
pip_index=${PIP_INDEX_URL:-https://pypi.org/simple}
docker_cmd=${DOCKER:-docker}
state_dir=${BUILD_STATE_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/sglang-dsv41-build}

branch=$(git rev-parse --abbrev-ref HEAD | tr -c 'A-Za-z0-9_.\n-' '-')
sha9=$(git rev-parse --short=9 HEAD)
stamp=$(date -u +%Y%m%d-%H%M)
tag=${1:-$image_repo:$branch-$sha9-local-$stamp}

# What the last successful build resolved against: the requirements and the base.
fingerprint="$(sha256sum python/pyproject.toml | cut -d' ' -f1) $base_image"
state_file=$state_dir/last-resolved
previous=$(cat "$state_file" 2>/dev/null || true)

if [[ "$fingerprint" == "$previous" && "${FULL:-0}" != 1 ]]; then
    plugin_deps=skip
    echo "== python/pyproject.toml and base image unchanged since the last build: fast path (PLUGIN_DEPS=skip)"
else
    plugin_deps=resolve
    echo "== resolving the plugin's requirements against $base_image (PLUGIN_DEPS=resolve)"
fi

echo "== building $tag from $(git log --oneline -1)"
"$docker_cmd" build \
    -f docker/Dockerfile \
    --build-arg "BASE_IMAGE=$base_image" \
    --build-arg "PIP_INDEX_URL=$pip_index" \
    --build-arg "PLUGIN_DEPS=$plugin_deps" \
    -t "$tag" \
    .

# Only a successful build is remembered and aliased.
mkdir -p "$state_dir"
printf '%s\n' "$fingerprint" >"$state_file"
"$docker_cmd" tag "$tag" "$image_repo:$branch-latest-local"
echo "== done: $tag (alias $image_repo:$branch-latest-local)"
