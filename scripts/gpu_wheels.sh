#!/usr/bin/env bash
# Fill the git-ignored wheel folders that scripts/gpu_check.sh installs from on a lent GPU machine
# (Python 3.12, x86-64, CUDA 13, no network), in pieces that fit the device tool's 64 MiB carry
# limit two at a time (with the working tree):
#
#   .whl/       the project's test dependencies the machine lacks (grpc, protobuf, pytest, ...)
#   .whl-ucx/   the ucxx stack for CUDA 13 (ucxx-cu13, libucxx, rmm, cuda-bindings, ...), less
#               libucx itself
#   .whl-libucx/  libucx-cu13 alone (about 41 MB: UCX with its cuda_copy/cuda_ipc transports)
#
# Two calls, .whl/ in both: the first installs into /tmp/tensorwire-site-pyX.Y, which stays while
# the machine is warm (the next call within its idle time), and the second installs the rest and
# runs the check. Should the machine have gone cold in between, the second still has every test
# dependency, and only the ucx rows skip (and say why):
#   run(carry=[".whl", ".whl-ucx"], command="bash scripts/gpu_check.sh --install-only")
#   run(carry=[".whl", ".whl-libucx"], command="bash scripts/gpu_check.sh")
# With ucxx importable the ucx cuda rows of benchmarks/gpu_p2p.py and the ucx GPU tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
LIMIT=$((60 * 1024 * 1024))  # leave room for the working tree in the 64 MiB

rm -rf .whl .whl-ucx .whl-libucx
mkdir -p .whl .whl-ucx .whl-libucx

# with their own dependencies (typing-extensions for grpc, pluggy and iniconfig for pytest, ...),
# so that a bare Python 3.12 has all it needs; gpu_check.sh installs only what is absent or older
"$PY" -m pip download -q "${PLAT[@]}" -d .whl \
    grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 'protobuf>=7.35.1,<8' \
    'ml_dtypes>=0.4' 'crc32c>=2.4' 'pytest>=8.4' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3' \
    'hypothesis>=6.100' 'cryptography>=42' packaging
rm -f .whl/numpy-*.whl  # the machine's own numpy stays

# the ucxx stack with its dependencies, then sorted: numpy is on the machine already
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q "${PLAT[@]}" -d "$tmp" ucxx-cu13
for w in "$tmp"/*.whl; do
    case "$(basename "$w")" in
        numpy-*) ;;
        libucx_cu13-*) mv "$w" .whl-libucx/ ;;
        *) mv "$w" .whl-ucx/ ;;
    esac
done

status=0
for d in .whl .whl-ucx .whl-libucx; do
    printf '%-13s %3d wheels %6.1f MiB\n' "$d" "$(find "$d" -name '*.whl' | wc -l)" "$(echo "$(du -sb "$d" | cut -f1) / 1048576" | bc -l)"
done
for d in .whl-ucx .whl-libucx; do  # each call carries .whl and one of these
    size=$(du -scb .whl "$d" | tail -1 | cut -f1)
    if [ "$size" -gt "$LIMIT" ]; then
        echo ".whl and $d together are over the carry limit: split them" >&2
        status=1
    fi
done
exit "$status"
