#!/usr/bin/env bash
# PyPI's pyverbs (the `verbs` extra) on the Soft-RoCE guest of scripts/rxe-vm.sh.
#
#   scripts/pyverbs-pypi.sh build                  build it once (cached; see below)
#   scripts/pyverbs-pypi.sh check                  exit 0 if the build is there (no side effects)
#   scripts/pyverbs-pypi.sh run DIR -- CMD...      rxe-vm.sh run, with PyPI's pyverbs and rdma-core 59 in use
#   scripts/pyverbs-pypi.sh run2 DIR -- CMD_A -- CMD_B   rxe-vm.sh run2, likewise in both guests
#   scripts/pyverbs-pypi.sh env                    print what a guest command exports to use them
#   scripts/pyverbs-pypi.sh mount                  print HOST_DIR:GUEST_DIR for rxe-vm.sh's EXTRA_MOUNT
#
# PyPI's pyverbs 59.0 is an sdist carrying all of rdma-core 59. Its wheel holds only the pyverbs
# package and links against the system's libibverbs.so.1 with rdma-core 59's private symbol
# version, so it loads only next to rdma-core 59's libraries; the guest (Debian bookworm) has 44.
# `build` therefore makes, from the same sdist (sha256 pinned):
#   1. the wheel, exactly as `pip install pyverbs==59.0` builds it (pip wheel; Cython < 3.1,
#      --no-build-isolation, because one of its mlx5 modules does not compile with newer Cython),
#      installed with pip --target into PREFIX/python;
#   2. rdma-core 59's userspace libraries (libibverbs, librdmacm, the providers, rxe's included),
#      configured for PREFIX and installed under the cache, so that libibverbs reads its provider
#      list from PREFIX/etc/libibverbs.d (not /etc: the configuration dir is compiled in, and
#      CMake would make it /etc/opt/... for a prefix under /opt) and loads librxe-rdmav59.so from
#      PREFIX/lib/libibverbs.
# PREFIX is /opt/rdma-core-59 in the guest: `run` mounts the cached tree there (rxe-vm.sh's
# EXTRA_MOUNT) and runs CMD with PYTHONPATH and LD_LIBRARY_PATH pointing into it.
#
# The build runs on the host, which must be Debian bookworm x86_64 like the guest (same glibc and
# Python 3.11 ABI); it needs gcc, cmake, ninja, pkg-config, python3-dev, python3-venv, libnl-3-dev
# and libnl-route-3-dev (installed with apt-get when missing and run as root) and network access
# to PyPI. Cached in TW_PYVERBS_DIR (default ~/.cache/tensorwire-pyverbs-pypi); REBUILD=1 rebuilds.
# Environment for `run`: as rxe-vm.sh (TW_RXE_DIR, ACCEL, SMP, MEM, RUN_TIMEOUT, ...).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
W=${TW_PYVERBS_DIR:-$HOME/.cache/tensorwire-pyverbs-pypi}
VERSION=59.0
SDIST=pyverbs-$VERSION.tar.gz
SHA256=b30d56bb620b3d3b4301876f9a04c964be1c76cc6553a451e1465f1c6ac9f20e
PREFIX=/opt/rdma-core-59
# the build backend pyverbs names (scikit-build-core, setuptools_scm), with a Cython that compiles it
BUILD_REQS="cython==3.0.12 scikit-build-core==1.1.2 setuptools_scm==10.3.4"
DEBS="gcc cmake ninja-build pkg-config python3-dev python3-venv libnl-3-dev libnl-route-3-dev"
BUILD_VERSION=2

log() { echo "pyverbs-pypi: $*" >&2; }

stamp() { printf '%s\n' "$VERSION" "$SHA256" "$PREFIX" "$BUILD_REQS" "$BUILD_VERSION"; }

ready() { [ "$(cat "$W/stamp" 2>/dev/null)" = "$(stamp)" ] && [ -d "$W/root$PREFIX/python/pyverbs" ]; }

check() {
  ready || { echo "PyPI pyverbs $VERSION is not built in $W (run: $0 build)"; return 1; }
}

missing_debs() {
  local d out=""
  for d in $DEBS; do dpkg-query -W -f='${Status}' "$d" 2>/dev/null | grep -q 'install ok installed' || out="$out $d"; done
  echo "$out"
}

install_debs() {
  command -v dpkg-query >/dev/null || { log "not a Debian host: the build needs Debian bookworm like the guest"; return 1; }
  local miss; miss=$(missing_debs)
  [ -z "$miss" ] && return 0
  [ "$(id -u)" = 0 ] || { log "missing build packages:$miss (apt-get install needs root)"; return 1; }
  export DEBIAN_FRONTEND=noninteractive
  log "apt-get install$miss"
  timeout 300 apt-get update -q >&2
  # shellcheck disable=SC2086
  timeout 900 apt-get install -y -q --no-install-recommends $miss >&2
}

build() {
  mkdir -p "$W"
  if ready && [ -z "${REBUILD:-}" ]; then log "PyPI pyverbs $VERSION ready in $W"; return 0; fi
  grep -qs 'bookworm' /etc/os-release && [ "$(uname -m)" = x86_64 ] \
    || { log "the build must run on Debian bookworm x86_64 (the guest's system)"; return 1; }
  install_debs
  local t0=$SECONDS
  cd "$W"
  rm -f stamp
  if [ ! -x venv/bin/python ] || [ "$(cat venv.done 2>/dev/null)" != "$BUILD_REQS" ]; then
    rm -rf venv venv.done
    # the system's Python 3.11: the guest runs Debian's python3, the same build
    /usr/bin/python3 -m venv venv
    # shellcheck disable=SC2086
    timeout 600 venv/bin/pip install -q --disable-pip-version-check $BUILD_REQS >&2
    echo "$BUILD_REQS" > venv.done
  fi
  if [ "$(sha256sum "$SDIST" 2>/dev/null | cut -d' ' -f1)" != "$SHA256" ]; then
    rm -f "$SDIST"
    log "pip download pyverbs==$VERSION (the sdist)"
    timeout 900 venv/bin/pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      --no-build-isolation -d . "pyverbs==$VERSION" >&2
    [ "$(sha256sum "$SDIST" | cut -d' ' -f1)" = "$SHA256" ] || { log "$SDIST: unexpected sha256"; return 1; }
  fi

  if [ "$(cat wheel.done 2>/dev/null)" != "$SHA256 $BUILD_REQS" ] || [ -n "${REBUILD:-}" ]; then
    log "pip wheel $SDIST (the PyPI package as pip builds it; about 6 min on 2 cores)"
    rm -rf dist wheel.done && mkdir dist
    nice -n 10 timeout 1800 venv/bin/pip wheel -q --disable-pip-version-check --no-cache-dir --no-deps \
      --no-build-isolation -w dist "$SDIST" > wheel.log 2>&1 || { tail -30 wheel.log >&2; return 1; }
    echo "$SHA256 $BUILD_REQS" > wheel.done
    log "wheel: $(ls dist) ($((SECONDS - t0)) s)"
  fi

  log "rdma-core $VERSION libraries for $PREFIX"
  rm -rf src build root
  mkdir src && tar -xzf "$SDIST" -C src --strip-components=1
  nice -n 10 cmake -S src/rdma-core -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$PREFIX" \
    -DCMAKE_INSTALL_SYSCONFDIR="$PREFIX/etc" -DNO_MAN_PAGES=1 -DNO_PYVERBS=1 > libs.log 2>&1 || { tail -30 libs.log >&2; return 1; }
  nice -n 10 timeout 1800 ninja -C build >> libs.log 2>&1 || { tail -30 libs.log >&2; return 1; }
  DESTDIR="$W/root" ninja -C build install >> libs.log 2>&1 || { tail -30 libs.log >&2; return 1; }
  venv/bin/pip install -q --disable-pip-version-check --no-deps --no-compile --target "root$PREFIX/python" dist/*.whl >&2
  rm -rf src build
  stamp > stamp
  log "ready in $W ($((SECONDS - t0)) s): $(ls "root$PREFIX/lib"/libibverbs.so.1.*), $(ls "root$PREFIX/python" | tr '\n' ' ')"
}

mount_spec() {  # HOST_DIR:GUEST_DIR for rxe-vm.sh's EXTRA_MOUNT
  echo "$W/root$PREFIX:$PREFIX"
}

guest_env() {  # what a guest command exports
  echo "export PYTHONPATH=$PREFIX/python:\$PYTHONPATH LD_LIBRARY_PATH=$PREFIX/lib TW_VERBS_STACK=$PREFIX"
}

run() {  # run DIR -- CMD...
  local dir=$1; shift; [ "${1:-}" = "--" ] && shift
  check >&2 || return 1
  EXTRA_MOUNT="$(mount_spec)" bash "$HERE/rxe-vm.sh" run "$dir" -- "$(guest_env); $*"
}

run2() {  # run2 DIR -- CMD_A -- CMD_B
  local dir=$1; shift; [ "${1:-}" = "--" ] && shift
  local a="" b="" seen=0
  for arg in "$@"; do
    if [ "$arg" = "--" ] && [ $seen = 0 ]; then seen=1; continue; fi
    if [ $seen = 0 ]; then a="$a $arg"; else b="$b $arg"; fi
  done
  [ -n "$b" ] || { log "run2 needs DIR -- CMD_A -- CMD_B"; return 2; }
  check >&2 || return 1
  EXTRA_MOUNT="$(mount_spec)" bash "$HERE/rxe-vm.sh" run2 "$dir" -- "$(guest_env);$a" -- "$(guest_env);$b"
}

case "${1:-}" in
  build) build ;;
  check) check ;;
  env) guest_env ;;
  mount) check >&2 && mount_spec ;;
  run) shift; run "$@" ;;
  run2) shift; run2 "$@" ;;
  *) echo "usage: $0 build | check | env | mount | run DIR -- CMD... | run2 DIR -- CMD_A -- CMD_B" >&2; exit 2 ;;
esac
