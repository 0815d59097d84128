#!/usr/bin/env bash
# Mooncake intra-node NVLink routing on the GPU machine: GPU test, then benchmarks.
#
#   bash test/mooncake_nvlink/run_mooncake_gpu.sh <carried folder> [all|dsv41] [dsv41 benchmark options]
#
# all (default): the GPU test, the block-shape benchmark, then the DeepSeek-V4.1
# request benchmark three times; dsv41: that benchmark alone, with the options
# given (default --repeat 3), e.g. --repeat 3 --rounds 5 --json /tmp/dsv41.json.
#
# <carried folder> holds wheels/mooncake_transfer_engine_cuda13-0.3.14-cp312-*.whl
# (and, optional, pyzmq / msgspec wheels: the side channel then uses zmq, as
# sglang does) and debs/*.deb (libibverbs1 librdmacm1 libnuma1 ibverbs-providers,
# Debian bookworm). The wheels go into a scratch --target dir, the debs are
# unpacked with dpkg -x onto LD_LIBRARY_PATH; nothing is installed system-wide.
# Needs python3 with torch (CUDA); imports torch, mooncake and sglang_dsv41.mooncake_nvlink's
# plain modules (routing, memory, kv_staging's peer writes; no sglang) only.
set -uo pipefail

CARRY="$(cd "${1:?usage: run_mooncake_gpu.sh <carried folder with wheels/ and debs/> [all|dsv41] [options]}" && pwd)"
WHAT="${2:-all}"
case "$WHAT" in
  all|dsv41) ;;
  *) echo "run_mooncake_gpu.sh: unknown part '$WHAT' (all or dsv41)" >&2; exit 2 ;;
esac
shift $(( $# < 2 ? $# : 2 ))
DSV41_ARGS=("$@")
[ ${#DSV41_ARGS[@]} -gt 0 ] || DSV41_ARGS=(--repeat 3)
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-python3}"
WORK="${TMPDIR:-/tmp}/dsv41-mooncake-gpu"
rm -rf "$WORK" && mkdir -p "$WORK/site" "$WORK/libs"

wheel=$(ls "$CARRY"/wheels/mooncake_transfer_engine_cuda13-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "no mooncake_transfer_engine_cuda13 wheel under $CARRY/wheels" >&2; exit 2; }
for whl in "$wheel" $(ls "$CARRY"/wheels/pyzmq-*.whl "$CARRY"/wheels/msgspec-*.whl 2>/dev/null); do
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$whl" 2>/dev/null; then
    "$PY" -m zipfile -e "$whl" "$WORK/site"  # a wheel is a zip laid out for site-packages
  fi
done

for deb in "$CARRY"/debs/*.deb; do
  if command -v dpkg >/dev/null; then
    dpkg -x "$deb" "$WORK/libs"
  else  # a .deb is an ar archive holding data.tar.*
    "$PY" - "$deb" "$WORK/libs" <<'EOF'
import io, sys, tarfile
raw = open(sys.argv[1], "rb").read()
pos = 8
while pos < len(raw):
    name, size = raw[pos:pos + 16].decode().strip(), int(raw[pos + 48:pos + 58])
    body = raw[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(body)).extractall(sys.argv[2])
    pos += 60 + size + (size & 1)
EOF
  fi
done

# CUDA runtime of torch's wheels (libcudart.so.13), for Mooncake's engine.so.
cudart_dirs=$("$PY" - <<'EOF'
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
found = {os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "libcudart.so*"), recursive=True)}
print(":".join(sorted(found)))
EOF
)
export LD_LIBRARY_PATH="$WORK/libs/usr/lib/x86_64-linux-gnu:$WORK/libs/lib/x86_64-linux-gnu:${cudart_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$REPO/python:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export MC_LOG_LEVEL="${MC_LOG_LEVEL:-WARNING}"
cd "$REPO"

echo "== environment"
nvidia-smi -L || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
if ! "$PY" -c "import mooncake.engine; print('mooncake engine', mooncake.engine.__file__)"; then
  echo "mooncake.engine does not import; missing libraries:" >&2
  ldd "$WORK/site/mooncake/engine.so" | grep "not found" >&2
  exit 3
fi
"$PY" -c "import zmq" 2>/dev/null && echo "side channel: zmq" || echo "side channel: socket (no pyzmq)"

status=0
if [ "$WHAT" = dsv41 ]; then
  echo "== benchmark: DeepSeek-V4.1 requests, one GPU, two processes"
  "$PY" benchmarks/mooncake_nvlink/mooncake_routing.py --pattern dsv41 --mode gpu --gpu 0 --peer-gpu 0 "${DSV41_ARGS[@]}"
  exit $?
fi
echo "== GPU test: test/mooncake_nvlink/test_mooncake_nvlink_gpu.py"
"$PY" test/mooncake_nvlink/test_mooncake_nvlink_gpu.py || status=1

echo "== benchmark: one GPU, two processes"
"$PY" benchmarks/mooncake_nvlink/mooncake_routing.py --mode gpu --gpu 0 --peer-gpu 0 || status=1
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  echo "== benchmark: GPU 1 -> GPU 0"
  "$PY" benchmarks/mooncake_nvlink/mooncake_routing.py --mode gpu --gpu 0 --peer-gpu 1 || status=1
else
  echo "== benchmark GPU 1 -> GPU 0: skipped (one GPU)"
fi
echo "== benchmark: DeepSeek-V4.1 requests, one GPU, two processes"
"$PY" benchmarks/mooncake_nvlink/mooncake_routing.py --pattern dsv41 --mode gpu --gpu 0 --peer-gpu 0 "${DSV41_ARGS[@]}" || status=1
exit $status
