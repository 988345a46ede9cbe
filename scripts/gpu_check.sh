#!/usr/bin/env bash
# Every GPU test and the GPU benchmarks, in one call, on a machine with a CUDA GPU and CuPy.
#
#   bash scripts/gpu_check.sh            # from anywhere; runs in the repository root
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#   BENCH_ARGS="--gib 0.25" bash scripts/gpu_check.sh      # benchmarks/gpu_pack.py's arguments
#   P2P_ARGS="--sizes 1M,1G" bash scripts/gpu_check.sh     # benchmarks/gpu_p2p.py's arguments
#   KV_ARGS="--block-kib 16" bash scripts/gpu_check.sh     # benchmarks/kv_rows.py's (with --memory cuda)
#   bash scripts/gpu_check.sh --install-only   # only install carried wheels (scripts/gpu_wheels.sh;
#                                              # for when they need two device calls)
#
# The project's Python dependencies are installed first where they are missing or too old:
# from the package index when it can be reached, else from wheels carried in .whl/ (git-ignored;
# see docs/gpu.md for how to fill it), into /tmp/tensorwire-site-pyX.Y (this Python's version),
# which goes on PYTHONPATH.
# Ends with a summary; exits non-zero when a test or the benchmark failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# a Python that does not start would otherwise read as "all dependencies present" and every step
# as exit 127: say so once and stop
if ! "$PY" -c 'pass' 2>/dev/null; then
    echo "GPU CHECK: FAIL: $PY does not run here (set PYTHON to a Python 3 interpreter)"
    exit 2
fi
# one folder per Python version: a folder another Python filled (its compiled modules) must not
# go on this one's path
SITE=/tmp/tensorwire-site-py$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# the logs go where the device tool brings files back from ($OUT), so that a failure's whole
# traceback comes back even when the reply's tail is too short for it; else /tmp
LOGS=${OUT:-/tmp}
# and all this script says goes there too: a long failure output would push the versions at its
# start out of the reply's tail
exec > >(tee "$LOGS/tensorwire-gpu-check.log") 2>&1
TEE=$!
trap 'exec >&- 2>&-; wait "$TEE" 2>/dev/null' EXIT
INSTALL_ONLY=0
[ "${1:-}" = "--install-only" ] && INSTALL_ONLY=1  # install what was carried (see gpu_wheels.sh), no tests
# what an earlier call on this (warm) machine installed counts as installed
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

echo "== machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null \
    || nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
# what a failure needs to be read in one run: CuPy, its CUDA runtime, driver and NVRTC, each
# device, and torch's CUDA build (each part says why where it cannot)
timeout -k 5 30 "$PY" - <<'EOF' || echo "WARNING: the version report failed or ran out of time"
import os
import sys

print("python", sys.version.split()[0])
try:
    import cupy

    rt = cupy.cuda.runtime
    line = f"cupy {cupy.__version__} | CUDA runtime {rt.runtimeGetVersion()} | driver {rt.driverGetVersion()}"
    try:
        from cupy.cuda import nvrtc

        line += " | NVRTC %d.%d" % nvrtc.getVersion()
    except Exception as exc:
        line += f" | NVRTC: {exc!r}"
    print(line)
    for d in range(rt.getDeviceCount()):
        p = rt.getDeviceProperties(d)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        print(f"  device {d}: {name}, sm_{p['major']}{p['minor']}, {p['totalGlobalMem'] >> 20} MiB")
except Exception as exc:
    print(f"WARNING: CuPy or CUDA is not usable here ({exc!r}); the GPU tests will skip")
try:
    import torch

    ok = torch.cuda.is_available()
    name = f" | {torch.cuda.get_device_name(0)}" if ok else ""
    print(f"torch {torch.__version__} | built for CUDA {torch.version.cuda} | cuda available {ok}{name}")
except Exception as exc:
    print(f"torch: not usable here ({exc!r}); the torch GPU tests will skip")
print("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=" + os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "(unset)"))
EOF
# memory from cudaMallocAsync pools or torch's expandable segments is not cuda_ipc-able in UCX 1.21
# (UCX moves it another way, silently): say when the machine asks for either
echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-(unset)}"

deps() { "$PY" scripts/gpu_deps.py "$@"; }  # missing | wheels DIR...: what to install (see there)
online() { "$PY" -c 'import socket; socket.create_connection(("pypi.org", 443), timeout=3).close()' 2>/dev/null; }

echo "== dependencies"
"$PY" -c 'import pytest; print("pytest", pytest.__version__)'
NEED=$(deps missing)
if [ -n "$NEED" ]; then
    echo "missing or too old: $NEED"
    if online; then
        echo "installing from the package index"
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --disable-pip-version-check --target "$SITE" $NEED
    elif [ -d .whl ]; then
        WHEELS=$(deps wheels .whl)
        echo "no network: installing carried wheels: $(echo $WHEELS)"
        # shellcheck disable=SC2086
        [ -n "$WHEELS" ] && "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$SITE" $WHEELS
    else
        echo "no network and no .whl/ folder: continuing without them"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    STILL=$(deps missing)
    [ -n "$STILL" ] && echo "still missing: $STILL"
else
    echo "all present"
fi

# ucxx for the ucx cuda rows: from the index, or from the folders scripts/gpu_wheels.sh fills
if ! "$PY" -c 'import ucxx' 2>/dev/null; then
    UCX_WHEELS=$(deps wheels .whl-ucx .whl-libucx)
    if [ -n "$UCX_WHEELS" ]; then
        echo "ucxx: installing carried wheels: $(echo $UCX_WHEELS | xargs -n1 basename | tr '\n' ' ')"
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
            --target "$SITE" $UCX_WHEELS || echo "ucxx: install failed"
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    elif online; then
        echo "ucxx: installing ucxx-cu13 from the package index"
        "$PY" -m pip install -q --disable-pip-version-check --target "$SITE" ucxx-cu13 || echo "ucxx: install failed"
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
"$PY" -c 'import ucxx, importlib.metadata as m; print("ucxx", ucxx.__version__, "| UCX %d.%d.%d" % ucxx.get_ucx_version(), "| libucx", *[d.metadata["Name"] + " " + d.version for d in m.distributions() if d.metadata["Name"].startswith("libucx-")])' 2>/dev/null \
    || echo "ucxx: not importable here; the ucx GPU rows and tests skip (scripts/gpu_wheels.sh fills .whl-ucx/ and .whl-libucx/)"
# the carried (thinned) libucx has no ucx_info: the doctor below lists UCX's version and lanes
command -v ucx_info >/dev/null && ucx_info -v

echo "== packages the GPU code calls"
"$PY" -c 'import importlib.metadata as m, re
want = re.compile(r"(cupy|torch|numpy|ml.dtypes|ucxx|libucx|rmm|librmm|cuda|nvidia|pytest)", re.I)
names = {(d.metadata["Name"] or "") + " " + d.version for d in m.distributions()}
print(*sorted(n for n in names if want.match(n)), sep="\n")'
echo "== tensorwire doctor (GPUs; UCX and its lanes: cuda_copy/cuda_ipc where UCX has CUDA)"
timeout -k 5 30 "$PY" -c 'import sys; from tensorwire.cli import main; sys.exit(main(["doctor"]))' \
    || echo "WARNING: tensorwire doctor failed or ran out of time"

if [ "$INSTALL_ONLY" -eq 1 ]; then
    echo "installed into $SITE; run the check in a later call on this machine"
    exit 0
fi

# each step has a time limit, so that the whole check stays under ~9.5 minutes (a lent machine
# gives one command 10); a step that runs out reports exit 124. The limits, plus 10 s of kill
# grace each (timeout -k), come to 545 s: about 55 s are left for installing carried wheels and
# for the version report and the doctor above (usually ~10 s together, at most 35 s each)
T_TESTS=${T_TESTS:-200}
T_PACK=${T_PACK:-75}
T_P2P=${T_P2P:-170}
T_KV=${T_KV:-60}

# -ra: the short summary names every failure and error, and every skip with its reason (-rs
# alone drops the FAILED lines); a limit per test (T_TEST), so that one hang cannot eat the
# step. -v names each test as it starts (the log's last name is the one running when the step
# ran out; the PASSED lines stay in the log only). At the step's limit pytest gets SIGINT, so it
# still prints the failures so far and its summary. Deprecation and future warnings from the
# GPU stack (CuPy, torch, pynvml, ...) land in the warnings summary instead of failing every
# test that meets them on this one run; STRICT_WARNINGS=1 keeps them errors, as pyproject.toml has it.
PYTEST_ARGS=(-m gpu tests/ -v -ra -p no:cacheprovider --continue-on-collection-errors --durations=10)
"$PY" -c 'import pytest_timeout' 2>/dev/null && PYTEST_ARGS+=(--timeout="${T_TEST:-60}")
[ "${STRICT_WARNINGS:-0}" = 1 ] || PYTEST_ARGS+=(-W default::DeprecationWarning -W default::FutureWarning)
echo "== GPU tests: $PY -m pytest ${PYTEST_ARGS[*]} (limit ${T_TESTS}s)"
timeout -s INT -k 10 "$T_TESTS" "$PY" -m pytest "${PYTEST_ARGS[@]}" 2>&1 | tee "$LOGS/tensorwire-gpu-tests.log" \
    | grep --line-buffered -v -E ' PASSED +\[ *[0-9]+%\]$'
TESTS_RC=${PIPESTATUS[0]}

echo "== GPU benchmark: $PY benchmarks/gpu_pack.py ${BENCH_ARGS:-} (limit ${T_PACK}s)"
# shellcheck disable=SC2086
PYTHONUNBUFFERED=1 timeout -k 10 "$T_PACK" "$PY" benchmarks/gpu_pack.py ${BENCH_ARGS:-} 2>&1 | tee "$LOGS/tensorwire-gpu-bench.log"
BENCH_RC=${PIPESTATUS[0]}

echo "== GPU benchmark: $PY benchmarks/gpu_p2p.py ${P2P_ARGS:-} (limit ${T_P2P}s)"
# shellcheck disable=SC2086
PYTHONUNBUFFERED=1 timeout -k 10 "$T_P2P" "$PY" benchmarks/gpu_p2p.py ${P2P_ARGS:-} 2>&1 | tee "$LOGS/tensorwire-gpu-p2p.log"
P2P_RC=${PIPESTATUS[0]}

# one-sided reads of scattered KV-cache blocks, GPU memory to GPU memory (ucx: cuda_ipc gets; tcp:
# the owner stages them); a small run: two block sizes, 8 in flight and batches
KV=${KV_ARGS:---pool-mib 256 --total-mib 32 --block-kib 64 1024 --inflight 8 --batch 16 --repeat 2}
echo "== GPU benchmark: $PY benchmarks/kv_rows.py --memory cuda $KV (limit ${T_KV}s)"
# shellcheck disable=SC2086
PYTHONUNBUFFERED=1 timeout -k 10 "$T_KV" "$PY" benchmarks/kv_rows.py --memory cuda $KV 2>&1 | tee "$LOGS/tensorwire-gpu-kv.log"
KV_RC=${PIPESTATUS[0]}

echo "== summary"
echo "tests:     $(grep -E '(passed|failed|skipped|error|no tests ran)' "$LOGS/tensorwire-gpu-tests.log" | tail -1 | sed 's/^=* *//; s/ *=*$//') (exit $TESTS_RC)"
grep -E '^(FAILED|ERROR) ' "$LOGS/tensorwire-gpu-tests.log" | head -30
# the warnings let through above (by kind), and a crash or a test out of time
sed -n '/warnings summary/,/-- Docs/p' "$LOGS/tensorwire-gpu-tests.log" | grep -E '[A-Za-z]+Warning' | sort | uniq -c | head -15
grep -E -m5 '^(Fatal Python error|\+* Timeout \+*)' "$LOGS/tensorwire-gpu-tests.log"
[ "$TESTS_RC" -eq 124 ] && echo "tests ran out of time in: $(grep -E '^tests/' "$LOGS/tensorwire-gpu-tests.log" | tail -1)"
echo "gpu_pack:  $(grep -m1 '^device:' "$LOGS/tensorwire-gpu-bench.log" || echo 'no device line') (exit $BENCH_RC)"
echo "gpu_p2p:   $(grep -m1 '^device:' "$LOGS/tensorwire-gpu-p2p.log" || echo 'no device line') (exit $P2P_RC)"
grep -E '^(\||tcp path|ucx path|ucx used: |.* receipt: |note: |ucx cuda: skipped|.*FAILED)' "$LOGS/tensorwire-gpu-p2p.log"
echo "kv_rows:   $(grep -m1 '^device:' "$LOGS/tensorwire-gpu-kv.log" || echo 'no device line') (exit $KV_RC)"
grep -E '^(\||(ucx|tcp): path|Traceback|.*Error)' "$LOGS/tensorwire-gpu-kv.log"
if [ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$P2P_RC" -eq 0 ] && [ "$KV_RC" -eq 0 ]; then
    echo "GPU CHECK: PASS"
    exit 0
fi
echo "GPU CHECK: FAIL (exit codes: tests $TESTS_RC, gpu_pack $BENCH_RC, gpu_p2p $P2P_RC, kv_rows $KV_RC; 124 = ran out of time)"
exit 1
