#!/usr/bin/env bash
# Fill the git-ignored wheel folders that scripts/gpu_check.sh installs from on a lent GPU machine
# (Python 3.12, x86-64, CUDA 13, no network), so that all of them travel in one call of the device
# tool (at most 64 MiB with the working tree):
#
#   .whl/         the project's test dependencies the machine may lack (grpc, protobuf, pytest, ...)
#   .whl-ucx/     the ucxx stack for CUDA 13 (ucxx-cu13, libucxx, rmm, cuda-bindings, ...), less
#                 libucx itself
#   .whl-libucx/  libucx-cu13, thinned by scripts/thin_wheel.py: the wheel (40 MiB) also holds
#                 UCX's static archives, a third copy of each shared library (libX.so.0.0.0, which
#                 nothing loads: libraries need libX.so.0, UCX's module loader opens libX.so),
#                 perftest, tools and headers; the libraries ucxx loads are about 11 MiB
#
#   run(carry=[".whl", ".whl-ucx", ".whl-libucx"], command="bash scripts/gpu_check.sh", timeout_s=450)
#
# With ucxx importable the ucx cuda rows of benchmarks/gpu_p2p.py and the ucx GPU tests run.
# Should the three ever be over the limit together, this script says so, and two calls do it:
# the first installs into /tmp/tensorwire-site-pyX.Y, which stays while the machine is warm (the
# next call within its idle time):
#   run(carry=[".whl", ".whl-ucx"], command="bash scripts/gpu_check.sh --install-only")
#   run(carry=[".whl", ".whl-libucx"], command="bash scripts/gpu_check.sh")
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
    'ml_dtypes>=0.4' 'crc32c>=2.4' 'pytest>=8.4' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3' 'pytest-xdist>=3.5' \
    'hypothesis>=6.100' 'cryptography>=42' packaging
rm -f .whl/numpy-*.whl  # the machine's own numpy stays

# what a run never loads from the libucx wheel (scripts/thin_wheel.py; checked on CPU by running
# the ucx tests over the thinned wheel, and by UCX_LOG_LEVEL=debug showing the modules it opens)
THIN=('*.a' '*.la' '*.so.0.0.0' 'libucx/bin/*' 'libucx/share/*' 'libucx/include/*'
      'libucx/lib/cmake/*' 'libucx/lib/pkgconfig/*' 'libucx/lib/ucx/libucx_perftest*')
# the ucxx stack with its dependencies, then sorted: numpy is on the machine already
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q "${PLAT[@]}" -d "$tmp" ucxx-cu13
for w in "$tmp"/*.whl; do
    case "$(basename "$w")" in
        numpy-*) ;;
        libucx_cu13-*) "$PY" scripts/thin_wheel.py "$w" .whl-libucx "${THIN[@]}" ;;
        *) mv "$w" .whl-ucx/ ;;
    esac
done

for d in .whl .whl-ucx .whl-libucx; do
    printf '%-13s %3d wheels %6.1f MiB\n' "$d" "$(find "$d" -name '*.whl' | wc -l)" "$(echo "$(du -sb "$d" | cut -f1) / 1048576" | bc -l)"
done
size=$(du -scb .whl .whl-ucx .whl-libucx | tail -1 | cut -f1)
if [ "$size" -le "$LIMIT" ]; then
    echo "one call carries them all: run(carry=[\".whl\", \".whl-ucx\", \".whl-libucx\"], command=\"bash scripts/gpu_check.sh\", timeout_s=450)"
    exit 0
fi
status=0
for d in .whl-ucx .whl-libucx; do  # two calls, each carrying .whl and one of these
    size=$(du -scb .whl "$d" | tail -1 | cut -f1)
    if [ "$size" -gt "$LIMIT" ]; then
        echo ".whl and $d together are over the carry limit: split them" >&2
        status=1
    fi
done
[ "$status" -eq 0 ] && echo "over the limit together: two calls (gpu_check.sh --install-only first, see the top of this script)"
exit "$status"
