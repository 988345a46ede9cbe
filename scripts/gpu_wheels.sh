#!/usr/bin/env bash
# Fill the git-ignored wheel folders that scripts/gpu_check.sh installs from on a lent GPU machine
# (Python 3.12, x86-64, CUDA 13, no network), in pieces that each fit the device tool's 64 MiB
# carry limit:
#
#   .whl/       the project's test dependencies the machine lacks (grpc, protobuf, pytest, ...)
#   .whl-ucx/   the ucxx stack for CUDA 13 (ucxx-cu13, libucxx, rmm, cuda-bindings, ...), less
#               libucx itself
#   .whl-libucx/  libucx-cu13 alone (about 41 MB: UCX with its cuda_copy/cuda_ipc transports)
#
# Carry one folder per call; each call installs what it carried into /tmp/tensorwire-site, which
# stays while the machine is warm (calls less than a minute apart), and the last runs the check:
#   run(carry=[".whl"], command="bash scripts/gpu_check.sh --install-only")
#   run(carry=[".whl-ucx"], command="bash scripts/gpu_check.sh --install-only")
#   run(carry=[".whl-libucx"], command="bash scripts/gpu_check.sh")
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

"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d .whl \
    grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 'protobuf>=7.35.1,<8' \
    'ml_dtypes>=0.4' 'crc32c>=2.4' 'pytest>=8.4' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3' \
    'hypothesis>=6.100' 'cryptography>=42' cffi pycparser sortedcontainers attrs packaging

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
    size=$(du -sb "$d" | cut -f1)
    printf '%-13s %3d wheels %6.1f MiB\n' "$d" "$(find "$d" -name '*.whl' | wc -l)" "$(echo "$size / 1048576" | bc -l)"
    if [ "$size" -gt "$LIMIT" ]; then
        echo "  over the carry limit: split it" >&2
        status=1
    fi
done
exit "$status"
