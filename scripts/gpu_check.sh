#!/usr/bin/env bash
# Every GPU test and the GPU benchmarks, in one call, on a machine with a CUDA GPU and CuPy.
#
#   bash scripts/gpu_check.sh            # from anywhere; runs in the repository root
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#   BUDGET=390 bash scripts/gpu_check.sh                   # seconds for the whole check (default)
#   STEPS="p2p raw tests seq kv pack" bash scripts/gpu_check.sh   # which steps, in this order (default)
#   STEPS=tests LF=1 bash scripts/gpu_check.sh             # a warm rerun of the tests that failed
#   STEPS=tests FF=1 bash scripts/gpu_check.sh             # ... of all of them, those that failed first
#   XDIST=1 bash scripts/gpu_check.sh                      # the tests in one process (default 4)
#   REPORT=0 bash scripts/gpu_check.sh    # no machine, versions, packages or doctor report (default 1;
#                                         # tests/test_gpu_check.py: ~5 s of python start-ups a run)
#   STEPS=tests TESTS=tests/gpu/test_cuda_ucx.py bash scripts/gpu_check.sh   # some tests only
#   P2P_ARGS="--sizes 1M,1G" bash scripts/gpu_check.sh     # benchmarks/gpu_p2p.py's arguments
#   RAW_ARGS="--sizes 1G" bash scripts/gpu_check.sh        # benchmarks/gpu_ucx_raw.py's
#   SEQ_ARGS="--sizes 1M --repeat 2" bash scripts/gpu_check.sh   # benchmarks/ucx_seq.py's (--memory cuda)
#   STAGED_ARGS="--sizes 1M,16M" bash scripts/gpu_check.sh  # the seq step's gpu_p2p.py --no-ucx --timeline
#   SMALL_CHUNK=128K bash scripts/gpu_check.sh   # ... and its second run's staging chunk (default 256K)
#   EAGER_CREDIT=2G bash scripts/gpu_check.sh    # the seq step's ucx_seq.py --credit at 1 GiB (default 4G)
#   KV_ARGS="--block-kib 16" bash scripts/gpu_check.sh     # benchmarks/kv_rows.py's (with --memory cuda)
#   BENCH_ARGS="--gib 0.25" bash scripts/gpu_check.sh      # benchmarks/gpu_pack.py's arguments
#   bash scripts/gpu_check.sh --install-only   # only install carried wheels (scripts/gpu_wheels.sh;
#                                              # for when they need two device calls)
#
# The project's Python dependencies are installed first where they are missing or too old:
# from the package index when it can be reached, else from wheels carried in .whl/ (git-ignored;
# see docs/gpu.md for how to fill it), into /tmp/tensorwire-site-pyX.Y (this Python's version),
# which goes on PYTHONPATH.
# Ends with a summary and the line that reruns what did not pass; exits 0 when every step passed,
# 2 where CuPy finds no GPU (or the Python does not run), else 1.
set -u -o pipefail
cd "$(dirname "$0")/.."
# this checkout's tensorwire, for every step and the processes they start: a GPU machine has it
# installed nowhere (a benchmark run as a script has only benchmarks/ on its path), and an
# installed one elsewhere is not the code under test
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
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

if [ "${REPORT:-1}" != 0 ]; then  # the machine and its versions (REPORT=0: not)
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
fi

deps() { "$PY" scripts/gpu_deps.py "$@"; }  # missing | wheels DIR...: what to install (see there)
# (the name lookup has no time limit of its own: a DNS server that drops queries took 10-30 s)
online() { timeout 5 "$PY" -c 'import socket; socket.create_connection(("pypi.org", 443), timeout=3).close()' 2>/dev/null; }

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
if [ "${REPORT:-1}" != 0 ]; then  # ucxx, UCX, the packages and the doctor (REPORT=0: not)
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
fi

if [ "$INSTALL_ONLY" -eq 1 ]; then
    echo "installed into $SITE; run the check in a later call on this machine"
    exit 0
fi

# The lent machine gives a task 15 minutes of device time in all, its start (a minute or two) and
# any rerun included, so the check runs under one time budget (BUDGET, from the script's start)
# and its steps go in order of what the issue needs most: the two-process benchmark (its table is
# the issue's goals), then raw ucxx between the same two processes' GPU (the wire under its ucx
# column), then every GPU test, then what tensorwire adds to each ucx transfer of CUDA memory over
# raw ucxx, phase by phase in both processes (ucx_seq.py --timeline), then the one-sided KV
# benchmark, then the pack kernels' benchmark (measured on an H100 before; docs/gpu.md). A step
# gets its own limit or what the budget has left, whichever is less, and is not started with under 45 s left: the summary then
# says which steps did not run and the line that reruns them (a warm machine keeps the installed
# wheels and the tests' last-failed list). STEPS picks and orders the steps. Each step's limit
# plus 10 s of kill grace stays inside the budget, with 5 s for the summary.
BUDGET=${BUDGET:-390}
STEPS=${STEPS:-p2p raw tests seq kv pack}
T_P2P=${T_P2P:-150}
T_RAW=${T_RAW:-45}
T_TESTS=${T_TESTS:-150}
T_SEQ=${T_SEQ:-120}
T_KV=${T_KV:-45}
T_PACK=${T_PACK:-45}
MIN_STEP=${MIN_STEP:-30}  # the least limit a step is started with (tests/test_gpu_check.py lowers it)

declare -A RC SPENT
# a machine where CuPy finds no GPU skips every GPU test: that is no pass of the GPU check
GPUS=$("$PY" -c 'from tensorwire.memory._cuda import cuda_device_count as n; print(n())' 2>/dev/null || echo 0)
# the limit a step gets now (its own cap, or what is left of the budget), 0 when too little is left
limit_for() {
    local cap=$1 left=$((BUDGET - SECONDS - 15))
    [ "$left" -lt "$cap" ] && cap=$left
    [ "$cap" -lt "$MIN_STEP" ] && cap=0
    echo "$cap"
}

# bench LIMIT LOG SCRIPT ARGS...: one benchmark under its limit, its output also in $LOGS/LOG
bench() {
    local limit=$1 log=$2
    shift 2
    echo "== GPU benchmark: $PY benchmarks/$* (limit ${limit}s)"
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$PY" "benchmarks/$@" 2>&1 | tee "$LOGS/$log"
    return "${PIPESTATUS[0]}"
}

# shellcheck disable=SC2086
step_p2p() { bench "$1" tensorwire-gpu-p2p.log gpu_p2p.py ${P2P_ARGS:-}; }
# shellcheck disable=SC2086
step_raw() { bench "$1" tensorwire-gpu-raw.log gpu_ucx_raw.py ${RAW_ARGS:-}; }

# -ra: the short summary names every failure and error, and every skip with its reason (-rs
# alone drops the FAILED lines); a limit per test (T_TEST), so that one hang cannot eat the
# step. -v names each test as it starts (the tests still running when the step ran out are those
# named but never finished; the PASSED lines, and xdist's lines of a test starting, go to the log
# only). At the step's limit pytest gets SIGINT, so it still prints the failures so far and its
# summary. Deprecation and future warnings from the GPU stack (CuPy, torch, pynvml, ...) land in
# the warnings summary instead of failing every test that meets them on this one run;
# STRICT_WARNINGS=1 keeps them errors, as pyproject.toml has it.
# With pytest-xdist (the GPU image has it) the tests run in XDIST processes (default 4) that share
# the GPU: its 16 cores sit idle otherwise, and no test asserts a time (the two tests that take
# most of the device's memory take turns: tests/gpu/_gpu_skip.py's lock). The cache (last-failed)
# lives in /tmp, so that LF=1 on a warm machine reruns only what failed, and FF=1 all of them,
# what failed first: after a step that ran out of time, --lf would skip every test the step never
# reached or finished (pytest counts only the failed ones). pytest-benchmark, where the machine
# has it (the H200 image does), is kept out: with xdist it warns at configure time, which
# pyproject's filterwarnings=error made an INTERNALERROR before any test ran (the first H200
# run); no test here uses its fixture. torch's warning that a
# thread had no current CUDA context (a fresh thread on cuda:0, its first cuBLAS call: torch sets
# the context itself and says so once) is shown, not an error, as the deprecations are.
step_tests() {
    # shellcheck disable=SC2206
    local args=(-m gpu ${TESTS:-tests/} -v -ra -o cache_dir=/tmp/tensorwire-pytest-cache --continue-on-collection-errors
        --durations=10 -p no:benchmark)
    "$PY" -c 'import pytest_timeout' 2>/dev/null && args+=(--timeout="${T_TEST:-60}")
    [ "${STRICT_WARNINGS:-0}" = 1 ] || args+=(-W default::DeprecationWarning -W default::FutureWarning
        -W "default:Attempting to run cuBLAS:UserWarning")
    # (--dist worksteal: test by test; without it tests/conftest.py hands the workers whole files)
    [ "${XDIST:-4}" -gt 1 ] && "$PY" -c 'import xdist' 2>/dev/null && args+=(-n "${XDIST:-4}" --dist worksteal)
    [ "${LF:-0}" = 1 ] && args+=(--lf)
    [ "${FF:-0}" = 1 ] && args+=(--ff)
    echo "== GPU tests: $PY -m pytest ${args[*]} (limit ${1}s)"
    timeout -s INT -k 10 "$1" "$PY" -m pytest "${args[@]}" 2>&1 | tee "$LOGS/tensorwire-gpu-tests.log" \
        | grep --line-buffered -v -E '(^| )PASSED( |$)|^[^ ]*::[^ ]+ $'
    return "${PIPESTATUS[0]}"
}

# tensorwire against raw ucxx, CUDA memory, one transfer after another, then a turn timed phase by
# phase in both processes: where the time that tensorwire adds to each transfer goes. Then two
# A/Bs, each a change measured before any code makes it (docs/gpu.md item 29): ucx at 1 GiB with
# the receiver's credit above it (EAGER_CREDIT, 4 GiB), so that the message goes eager, without
# tensorwire's MSG -> CTS round trip before the payload; and staged tcp's rows of gpu_p2p.py at
# 1 MiB (the size whose goal the first run missed), marked the same way, with the default 4 MiB
# staging chunks (one chunk: its copy down, its send and its copy up one after the other) and with
# SMALL_CHUNK ones (256 KiB: four chunks, the copies of each overlapping the sends of the others)
# shellcheck disable=SC2086
seq_run() { # seq_run LIMIT RUN: one of the step's runs
    case $2 in
        seq) bench "$1" tensorwire-gpu-seq.log ucx_seq.py --memory cuda ${SEQ_ARGS:---sizes 1M,1G --repeat 1} --timeline ;;
        eager) bench "$1" tensorwire-gpu-seq-eager.log ucx_seq.py --memory cuda --sizes 1G --repeat 1 \
            --credit "${EAGER_CREDIT:-4G}" ;;
        timeline) bench "$1" tensorwire-gpu-staged-timeline.log gpu_p2p.py --no-ucx ${STAGED_ARGS:---sizes 1M} --timeline ;;
        small) bench "$1" tensorwire-gpu-staged-small.log gpu_p2p.py --no-ucx ${STAGED_ARGS:---sizes 1M} \
            --chunk "${SMALL_CHUNK:-256K}" --timeline ;;
    esac
}
step_seq() {
    local began=$SECONDS rc=0 left run got
    rm -f "$LOGS"/tensorwire-gpu-staged-*.log "$LOGS/tensorwire-gpu-seq-eager.log"  # (a warm machine's)
    for run in seq eager timeline small; do
        left=$(($1 - (SECONDS - began)))
        if [ "$left" -lt 10 ]; then
            echo "== seq step, run $run: not started, ${left} s of the step left"
            break
        fi
        seq_run "$left" "$run"
        got=$?
        [ "$rc" -eq 0 ] && rc=$got
    done
    return "$rc"
}

# one-sided reads of scattered KV-cache blocks, GPU memory to GPU memory (ucx: cuda_ipc gets; tcp:
# the owner stages them); a small run: two block sizes, 8 in flight and batches
# shellcheck disable=SC2086
step_kv() {
    bench "$1" tensorwire-gpu-kv.log kv_rows.py --memory cuda \
        ${KV_ARGS:---pool-mib 256 --total-mib 32 --block-kib 64 1024 --inflight 8 --batch 16 --repeat 2}
}
# shellcheck disable=SC2086
step_pack() { bench "$1" tensorwire-gpu-bench.log gpu_pack.py ${BENCH_ARGS:---gib 0.5 --repeats 10}; }

for step in $STEPS; do
    if ! declare -F "step_$step" >/dev/null; then
        echo "== unknown step '$step' (steps: p2p raw tests seq kv pack)"
        RC[$step]=unknown
        continue
    fi
    cap=T_${step^^}
    lim=$(limit_for "${!cap}")
    if [ "$lim" -eq 0 ]; then
        echo "== $step: not started: $((BUDGET - SECONDS)) s of the ${BUDGET} s budget left, a step needs $((MIN_STEP + 15))"
        RC[$step]=skipped
        continue
    fi
    began=$SECONDS
    "step_$step" "$lim"
    RC[$step]=$?
    SPENT[$step]=$((SECONDS - began))
done

echo "== summary (${SECONDS} s of the ${BUDGET} s budget)"
unfinished() { # the tests a -v log names as started and never as ended (one per xdist process)
    "$PY" - "$1" <<'EOF'
import re
import sys

log = open(sys.argv[1], errors="replace").read()
ended = r"(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
test = r"\S*::\S+"  # a test's id (a file outside the root dir shows as ::name)
done = set(re.findall(rf"{ended} +({test})", log)) | set(re.findall(rf"^({test}) +{ended}", log, re.M))
running = [t for t in dict.fromkeys(re.findall(rf"^({test})", log, re.M)) if t not in done]
print(" ".join(running) or "(none named)")
EOF
}
ran() { [ -n "${RC[$1]:-}" ] && [ "${RC[$1]}" != skipped ]; }  # the step was started
result() { # a step's outcome in words, with its time
    case "${RC[$1]}" in
        skipped) echo "not run: the budget ran out" ;;
        unknown) echo "no such step" ;;
        124 | 137) echo "ran out of its ${SPENT[$1]} s (exit ${RC[$1]})" ;;  # 137: killed 10 s after
        *) echo "exit ${RC[$1]}, ${SPENT[$1]} s" ;;
    esac
}
if ran p2p; then
    echo "gpu_p2p:   $(grep -m1 '^device:' "$LOGS/tensorwire-gpu-p2p.log" || echo 'no device line') ($(result p2p))"
    # the table, or, when the step ran out before it, each size's numbers as they were measured
    grep -E '^(\||  (tcp|ucx) [0-9]|tcp path|ucx path|ucx used: |.* receipt: |note: |ucx cuda: skipped|.*FAILED)' \
        "$LOGS/tensorwire-gpu-p2p.log"
fi
if ran raw; then
    echo "gpu_ucx_raw: $(grep -m1 '^device:' "$LOGS/tensorwire-gpu-raw.log" || echo 'no device line') ($(result raw))"
    grep -E '^(\||ucx used: |  one-sided get: |.*FAILED|.*Error)' "$LOGS/tensorwire-gpu-raw.log"
fi
if ran tests; then
    echo "tests:     $(grep -E '(passed|failed|skipped|error|no tests ran)' "$LOGS/tensorwire-gpu-tests.log" | tail -1 | sed 's/^=* *//; s/ *=*$//') ($(result tests))"
    grep -E '^(\[gw[0-9]+\] )?(FAILED|ERROR) ' "$LOGS/tensorwire-gpu-tests.log" | head -30
    # the warnings let through above (by kind), and a crash or a test out of time
    sed -n '/warnings summary/,/-- Docs/p' "$LOGS/tensorwire-gpu-tests.log" | grep -E '[A-Za-z]+Warning' | sort | uniq -c | head -15
    grep -E -m5 '^(Fatal Python error|\+* Timeout \+*)' "$LOGS/tensorwire-gpu-tests.log"
    case "${RC[tests]}" in
        124 | 137) echo "tests ran out of time in: $(unfinished "$LOGS/tensorwire-gpu-tests.log")" ;;
    esac
fi
if ran seq; then
    echo "ucx_seq:   ($(result seq))"
    grep -E '^(\||tensorwire.s last receipt|timeline turn|[0-9.]+ [KMG]iB \(|.*counters over|.*FAILED|.*Error)' \
        "$LOGS/tensorwire-gpu-seq.log"
    # ucx at 1 GiB going eager (the receiver's credit above it)
    log="$LOGS/tensorwire-gpu-seq-eager.log"
    if [ -f "$log" ]; then
        echo "ucx_seq eager (credit ${EAGER_CREDIT:-4G}):"
        grep -E '^(\||tensorwire.s last receipt|.*FAILED|Traceback|.*Error)' "$log"
    fi
    # staged tcp, marked: its table (cuda/host), the spans of each row and who waited for device
    # events, with the default staging chunks and then with small ones
    for run in timeline small; do
        log="$LOGS/tensorwire-gpu-staged-$run.log"
        [ -f "$log" ] || continue
        echo "staged tcp ($run): $(grep -m1 -o 'staging [0-9]* x [0-9.]* [KMG]iB pinned chunks' "$log" || echo 'no staging line')"
        grep -E '^(\||timeline|tcp (host|cuda) |.*counters over|.*FAILED|Traceback|.*Error)' "$log"
    done
fi
if ran kv; then
    echo "kv_rows:   $(grep -m1 '^device:' "$LOGS/tensorwire-gpu-kv.log" || echo 'no device line') ($(result kv))"
    grep -E '^(\||(ucx|tcp): path|Traceback|.*Error)' "$LOGS/tensorwire-gpu-kv.log"
fi
if ran pack; then
    echo "gpu_pack:  $(grep -m1 '^device:' "$LOGS/tensorwire-gpu-bench.log" || echo 'no device line') ($(result pack))"
fi
failed=() rerun=()
for step in $STEPS; do
    echo "step $step: $(result "$step")"
    [ "${RC[$step]}" = 0 ] && continue
    failed+=("$step")
    [ "${RC[$step]}" = unknown ] || rerun+=("$step")
done
if [ "$GPUS" = 0 ]; then
    echo "GPU CHECK: FAIL: CuPy finds no CUDA GPU here, so the GPU tests skip and the benchmarks cannot run"
    exit 2
fi
if [ ${#failed[@]} -eq 0 ]; then
    echo "GPU CHECK: PASS"
    exit 0
fi
echo "GPU CHECK: FAIL (steps not passed: ${failed[*]})"
if [ ${#rerun[@]} -gt 0 ]; then
    lf=""  # the tests again: those that failed (LF=1), or all, failed first (FF=1), where the step ran
    # out of time before it reached some (--lf would leave those out)
    if [[ " ${rerun[*]} " == *" tests "* ]]; then
        case "${RC[tests]}" in
            skipped) ;;
            124 | 137) lf=" FF=1" ;;
            *) lf=" LF=1" ;;
        esac
    fi
    echo "rerun on this warm machine: STEPS=\"${rerun[*]}\"$lf bash scripts/gpu_check.sh"
fi
exit 1
