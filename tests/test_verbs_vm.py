"""The verbs transport on a real verbs stack: Soft-RoCE (rdma_rxe) guests under qemu.

This host's kernel has no RDMA, so ``scripts/rxe-vm.sh`` boots a Debian guest whose kernel does
(Debian's pyverbs, rdma-core 44); the repository is mounted into it. Two guests on one L2 link
run ``tests/verbs/two_node.py`` against each other; then each of them runs half of ``tests/verbs``
(the conformance suite over verbs and the verbs unit tests; ``TW_GUEST_SHARD``, in
``tests/verbs/conftest.py``) once per session, in the same boots. The guest image
is built on first use (about 2-3 minutes, root and network to the Debian mirror and PyPI
needed) and cached in ``~/.cache/tensorwire-rxe-vm``; where it cannot be built these tests skip
and say why.

The same boots then run the conformance suite with PyPI's ``pyverbs`` 59.0 (the ``verbs``
extra) and rdma-core 59's libraries instead of Debian's 44, built from the PyPI sdist by
``scripts/pyverbs-pypi.sh`` and cached in ``~/.cache/tensorwire-pyverbs-pypi``. That build takes
about 6-7 minutes on two cores, so these tests use it where it is cached and build it only
when TW_PYVERBS_BUILD=1; otherwise they skip, naming the command that builds it.

The guests' runs start in a thread as soon as collection shows these tests will run
(``GuestRuns``), so their emulated minutes overlap the rest of the suite.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "rxe-vm.sh"
PYPI_SCRIPT = ROOT / "scripts" / "pyverbs-pypi.sh"
PYPI_PREFIX = "/opt/rdma-core-59"
GUEST_TESTS = "tests/verbs"
PYTEST = "python3 -m pytest -p no:cacheprovider -q -rA --timeout=300"
# SIGINT at the limit, not SIGTERM: pytest then stops as at ^C and still prints its failures and
# -rA summary (a CI run whose guest suite ran out of time under load showed two F and no names)
DEBIAN_CMD = f"timeout -s INT -k 60 1200 {PYTEST} {GUEST_TESTS}"
PYPI_CMD = (
    f"timeout -s INT -k 60 900 {PYTEST} {GUEST_TESTS}/test_conformance_verbs.py "
    f"{GUEST_TESTS}/test_verbs_guest.py::test_the_verbs_stack_in_use"
)
_SPLIT = "== tensorwire: Debian pyverbs run exited with"
_PAIR_SPLIT = "== tensorwire: two-node run exited with"
PAIR_CMD = "timeout 600 python3 -m tests.verbs.two_node"
# what the guest needs to import tensorwire and run its tests, at the versions this host runs
GUEST_DEPS = (
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "numpy",
    "ml_dtypes",
    "crc32c",
    "pytest",
    "pytest-asyncio",
    "pytest-timeout",
    "hypothesis",
)

# the first test waits for the guests' runs (and any build): bounded by the subprocess limits
pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]


# the guests' whole output, kept for a failure whose tail is not enough
GUEST_LOG = Path(tempfile.gettempdir()) / f"tensorwire-guest-{os.getpid()}.log"


def _tail(text: str, n: int = 15) -> str:
    kept = f"\n(the guests' whole output: {GUEST_LOG})" if GUEST_LOG.exists() else ""
    return "\n".join(text.strip().splitlines()[-n:]) + kept


def _failures(output: str, limit: int = 400) -> str:
    """The guest pytest's FAILURES and ERRORS sections (the tracebacks; each half of the suite
    has its own), at most ``limit`` lines: the tail alone is the -rA summary, which names a
    failed test but not why it failed."""
    lines, kept = output.splitlines(), []
    heading = re.compile(r"\[guest\] =+ (FAILURES|ERRORS) =+$")
    for start in (i for i, line in enumerate(lines) if heading.match(line)):
        end = next((i for i in range(start, len(lines)) if "short test summary info" in lines[i]), len(lines))
        kept += lines[start:end]
    return "\n".join(kept[:limit]) + "\n" if kept else ""


def _env() -> dict[str, str]:
    """PYDEPS pinned to this interpreter's versions (the image is rebuilt when they change)."""
    try:
        pins = " ".join(f"{name}=={metadata.version(name)}" for name in GUEST_DEPS)
    except metadata.PackageNotFoundError:
        return dict(os.environ)
    return dict(os.environ, PYDEPS=pins)


class _Skip(Exception):
    """A step that cannot run here, and why: the tests that need it skip with the reason."""


class GuestRuns:
    """The guests' work, in one thread of its own: the image (built if missing), PyPI's
    pyverbs (where built), then two guests talking RDMA, which run half of ``tests/verbs`` each
    afterwards, and half of the run on PyPI's pyverbs where it is built (``single`` and ``pair``
    are the two parts of that one run).

    The emulated guests take 2.5 minutes and more (under load) of the suite, so
    ``tests/conftest.py`` starts this as soon as collection says these tests will run
    (``start``), and the tests, last in the suite, find the results ready. Where nothing started
    it early (this file run alone, an xdist worker), the first fixture that asks starts it. The
    guests run at the lowest priority (nice 19, their session's scheduling group too), so they
    take only the CPU the host's own tests leave. Each run is a session of its own, all of it
    killed when it outlives its limit or the pytest session ends first (``stop``)."""

    STEPS = ("image", "pypi", "guests")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._procs: set[subprocess.Popen[str]] = set()
        self._futures: dict[str, Future[Any]] = {step: Future() for step in (*self.STEPS, "single", "pair")}

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._work, name="rxe-guests", daemon=True)
                self._thread.start()

    def result(self, step: str) -> Any:
        """The step's result (waiting for it); skips the calling test where it cannot run."""
        self.start()
        try:
            return self._futures[step].result()
        except _Skip as exc:
            pytest.skip(str(exc))

    def stop(self) -> None:
        """Kill what still runs (the session is ending); idempotent."""
        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        for proc in procs:
            _kill_session(proc)

    def _work(self) -> None:
        for name in self.STEPS:  # each step's method is named after it
            try:
                self._futures[name].set_result(getattr(self, f"_{name}")())
            except BaseException as exc:  # handed to the test that asks for this step
                self._futures[name].set_exception(exc)
        guests = self._futures["guests"]
        for part in ("single", "pair"):  # the two results of the one run
            if guests.exception() is not None:
                self._futures[part].set_exception(guests.exception())
            else:
                self._futures[part].set_result(guests.result()[part])

    def _run(self, args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        """Run ``args`` (at nice 19, in a session of its own): (exit code, stdout, stderr)."""
        with self._lock:
            if self._stopped:
                raise _Skip("the session ended before the guests ran")
            proc = subprocess.Popen(
                ["nice", "-n", "19", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            self._procs.add(proc)
        # A new session is a scheduling group of its own where the kernel groups tasks by
        # session (sched_autogroup_enabled): the groups share the CPU evenly whatever nice
        # their processes have, so the guests took a whole core from the host's tests (two
        # ucx tests with 1 s leases failed in 2 of 4 CI runs). The group's own nice fixes that.
        with contextlib.suppress(OSError):
            Path(f"/proc/{proc.pid}/autogroup").write_text("19")
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            out, err = proc.communicate()
            err += f"\n(killed after {timeout:.0f} s)"
        finally:
            with self._lock:
                self._procs.discard(proc)
        return proc.returncode, out, err

    def _image(self) -> Path:
        if shutil.which("bash") is None:
            raise _Skip("bash is not available to run scripts/rxe-vm.sh")
        rc, out, _ = self._run(["bash", str(SCRIPT), "check"], 60, _env())
        if rc == 0:
            return SCRIPT
        if os.geteuid() != 0 and shutil.which("qemu-system-x86_64") is None:
            raise _Skip(f"no Soft-RoCE guest: {out.strip()}; building one needs root (apt-get, debootstrap)")
        rc, out, err = self._run(["bash", str(SCRIPT), "setup"], 1700, _env())
        if rc != 0:
            raise _Skip(f"the Soft-RoCE guest could not be built:\n{_tail(out + err)}")
        return SCRIPT

    def _pypi(self) -> str:
        """'' where PyPI's pyverbs 59 and rdma-core 59 are built for the guest (cached by
        pyverbs-pypi.sh, or built now with TW_PYVERBS_BUILD=1), else why they are not."""
        self._futures["image"].result()
        rc, out, _ = self._run(["bash", str(PYPI_SCRIPT), "check"], 60)
        if rc == 0:
            return ""
        if os.environ.get("TW_PYVERBS_BUILD") != "1":
            return (
                f"{out.strip()}; it takes about 6-7 minutes on two cores, so the tests build it "
                "only with TW_PYVERBS_BUILD=1"
            )
        rc, out, err = self._run(["bash", str(PYPI_SCRIPT), "build"], 2400)
        if rc != 0:
            return f"PyPI pyverbs could not be built:\n{_tail(out + err)}"
        return ""

    def _guests(self) -> dict[str, Any]:
        """Boot two guests on one L2 link once: both run tests/verbs/two_node.py against each
        other, then each runs half of tests/verbs on Debian's pyverbs 44 (``TW_GUEST_SHARD``) and,
        where PyPI's pyverbs is built, half of the conformance suite and the stack report on it
        in a process of its own (one boot for all of it saves half a minute of emulated guest each
        time; two halves at once use both of the host's cores once its own tests are done).
        {"single": stack -> (exit code, output), "pair": (exit code, output)}."""
        vm = self._futures["image"].result()
        pypi_build = self._futures["pypi"].result()
        env, pypi_env = dict(_env(), RUN_TIMEOUT="2400"), None
        if not pypi_build:
            _, mount, _ = self._run(["bash", str(PYPI_SCRIPT), "mount"], 60)
            _, guest_env, _ = self._run(["bash", str(PYPI_SCRIPT), "env"], 60)
            env["EXTRA_MOUNT"] = mount.strip()  # (both guests mount it)
            pypi_env = guest_env.strip()
        args = ["bash", str(vm), "run2", str(ROOT), "--", _guest_cmd("a", pypi_env), "--", _guest_cmd("b", pypi_env)]
        rc, out, err = self._run(args, 2500, env)
        GUEST_LOG.write_text(out + err)
        return parse_guests(rc, out + err, bool(pypi_build))


def _guest_cmd(role: str, pypi_env: str | None = None) -> str:
    """What guest ``role`` runs: its side of the exchange, then its half of tests/verbs, then,
    where ``pypi_env`` (the shell lines that put PyPI's pyverbs in use) is given, its half of
    the run on PyPI's pyverbs."""
    shard = f"TW_GUEST_SHARD={'ab'.index(role)}/2"
    pypi = "" if pypi_env is None else f"; ({pypi_env}; {shard} {PYPI_CMD})"
    return f'{PAIR_CMD} {role}; echo "{_PAIR_SPLIT} $?"; {shard} {DEBIAN_CMD}; echo "{_SPLIT} $?"{pypi}'


def _index(lines: list[str], prefix: str) -> int | None:
    return next((i for i, line in enumerate(lines) if line.startswith(prefix)), None)


def _code(line: str) -> int:
    return int(line.rsplit(" ", 1)[1])


def parse_guests(rc: int, output: str, debian_only: bool) -> dict[str, Any]:
    """run2's output (the first guest's lines as "[a] ...", then the second's as "[b] ...", then
    what the host added, such as "(killed after N s)") as the two-guest exchange's result and
    the suite's per verbs stack: {"pair": (exit code, output), "single": stack -> (exit code,
    output)}. The suite's output is both halves' lines as "[guest] ...", as one guest printed them."""
    lines = output.splitlines()
    host = [line for line in lines if not line.startswith(("[a] ", "[b] "))]
    sides = {role: [line[4:] for line in lines if line.startswith(f"[{role}] ")] for role in "ab"}
    a_at, b_at = (_index(sides[role], f"{_PAIR_SPLIT} ") for role in "ab")
    if a_at is None or b_at is None:  # a guest did not get past the exchange: nothing ran after it
        failed = (rc or 99, output)
        return {"single": {"debian": failed} if debian_only else {"debian": failed, "pypi": failed}, "pair": failed}
    at = {"a": a_at, "b": b_at}
    pair_rc = _code(sides["a"][at["a"]]) or _code(sides["b"][at["b"]])
    pair = [f"[{role}] {line}" for role in "ab" for line in sides[role][: at[role] + 1]]
    debian: list[str] = []
    pypi: list[str] = []
    debian_rc = pypi_rc = 0
    for role in "ab":
        rest = sides[role][at[role] + 1 :]
        split = _index(rest, f"{_SPLIT} ")
        debian += [f"[guest] {line}" for line in (rest if split is None else rest[:split])]
        debian_rc = debian_rc or (99 if split is None else _code(rest[split]))
        # each half on PyPI's pyverbs comes after the guest's half on Debian's; its exit code is
        # the guest's (the last command it ran), which run2 prints last
        after = [] if split is None else rest[split + 1 :]
        pypi += [f"[guest] {line}" for line in after]
        pypi_rc = pypi_rc or next((_code(line) for line in after if re.fullmatch(r"exit code \d+", line)), 99)
    single = {"debian": (debian_rc, "\n".join(debian + host))}
    if not debian_only:
        single["pypi"] = (pypi_rc, "\n".join(pypi + host))
    return {"single": single, "pair": (pair_rc, "\n".join(pair + host))}


def _kill_session(proc: subprocess.Popen[str]) -> None:
    """SIGKILL every process of ``proc``'s session: qemu runs under coreutils' ``timeout``,
    which makes a process group of its own, so killing ``proc``'s group would miss it."""
    with contextlib.suppress(OSError):
        proc.kill()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])  # field 6
        except (OSError, ValueError, IndexError):
            continue
        if session == proc.pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)


GUESTS = GuestRuns()


def start_in_background() -> None:
    """Called by tests/conftest.py once collection shows that tests of this file will run."""
    GUESTS.start()


def stop_in_background() -> None:
    """Called by tests/conftest.py when the session ends."""
    GUESTS.stop()


@pytest.fixture(scope="session")
def pypi_build() -> str:
    """'' where PyPI's pyverbs 59 and rdma-core 59 are built for the guest, else why not."""
    reason: str = GUESTS.result("pypi")
    return reason


@pytest.fixture(scope="session")
def guest_runs() -> dict[str, tuple[int, str]]:
    """tests/verbs in one guest boot, per verbs stack: (exit code, output); each step skips
    with the image's reason where there is no guest image."""
    runs: dict[str, tuple[int, str]] = GUESTS.result("single")
    return runs


@pytest.fixture(scope="session")
def guest_run(guest_runs: dict[str, tuple[int, str]]) -> tuple[int, str]:
    """tests/verbs on Debian's pyverbs 44 in the guest: (exit code, output)."""
    return guest_runs["debian"]


@pytest.fixture(scope="session")
def pypi_guest_run(guest_runs: dict[str, tuple[int, str]], pypi_build: str) -> tuple[int, str]:
    """The conformance suite and the stack report on PyPI's pyverbs 59: (exit code, output)."""
    if pypi_build:
        pytest.skip(pypi_build)
    return guest_runs["pypi"]


def _results(output: str) -> dict[str, str]:
    """test id -> PASSED/FAILED/SKIPPED/ERROR, from pytest's -rA summary."""
    out = {}
    for m in re.finditer(r"^\[guest\] (PASSED|FAILED|SKIPPED|ERROR)(?: \[\d+\])? (\S+)", output, re.M):
        out[m.group(2)] = m.group(1)
    return out


def test_conformance_suite_passes_over_verbs_in_the_guest(guest_run: tuple[int, str]) -> None:
    _, output = guest_run
    results = {k: v for k, v in _results(output).items() if "test_conformance_verbs" in k}
    from tensorwire.testing import CHECKS

    assert len(results) == len(CHECKS), f"expected {len(CHECKS)} conformance results:\n{_tail(output, 60)}"
    failed = {k: v for k, v in results.items() if v != "PASSED"}
    assert not failed, f"{failed}\n{_failures(output)}{_tail(output, 80)}"


def test_verbs_unit_tests_pass_in_the_guest(guest_run: tuple[int, str]) -> None:
    rc, output = guest_run
    results = {k: v for k, v in _results(output).items() if "test_verbs_guest" in k}
    assert len(results) >= 7, _tail(output, 60)
    failed = {k: v for k, v in results.items() if v not in ("PASSED", "SKIPPED")}
    assert not failed, f"{failed}\n{_failures(output)}{_tail(output, 80)}"
    assert rc == 0, _failures(output) + _tail(output, 60)
    # the only skip allowed in the guest is the GPU one (no GPU there)
    skips = re.findall(r"^\[guest\] SKIPPED .*$", output, re.M)
    assert all("dma-buf" in line for line in skips), skips


def test_the_guest_runs_debian_pyverbs_44(guest_run: tuple[int, str]) -> None:
    _, output = guest_run
    stack = dict(re.findall(r"^\[guest\] VERBS_STACK (\w+) (.*)$", output, re.M))
    assert stack.get("pyverbs", "").endswith(" /usr/lib/python3/dist-packages/pyverbs/__init__.py"), stack
    assert re.search(r"/libibverbs\.so\.1\.\d+\.44\.\d+$", stack.get("libibverbs", "")), stack
    assert "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav" in stack.get("provider", ""), stack


def test_two_guests_exchange_tensors_over_rdma() -> None:
    rc, output = GUESTS.result("pair")
    assert rc == 0, _failures(output) + _tail(output, 60)
    assert "[a] TWO_NODE_OK" in output and "[b] TWO_NODE_OK" in output, _tail(output, 60)
    assert re.search(r"\[b\] round trip of 4194304 bytes: eager", output), _tail(output, 60)


def test_the_guest_runs_pypi_pyverbs_and_rdma_core_59(pypi_guest_run: tuple[int, str]) -> None:
    _, output = pypi_guest_run
    stack = dict(re.findall(r"^\[guest\] VERBS_STACK (\w+) (.*)$", output, re.M))
    assert _results(output).get("tests/verbs/test_verbs_guest.py::test_the_verbs_stack_in_use") == "PASSED", _tail(
        output, 60
    )
    assert re.fullmatch(rf"59\.0 {PYPI_PREFIX}/python/pyverbs/__init__\.py", stack.get("pyverbs", "")), stack
    assert re.fullmatch(rf"{PYPI_PREFIX}/lib/libibverbs\.so\.1\.\d+\.59\.0", stack.get("libibverbs", "")), stack
    assert re.fullmatch(rf"{PYPI_PREFIX}/lib/libibverbs/librxe-rdmav\d+\.so", stack.get("provider", "")), stack


def test_conformance_suite_passes_over_verbs_with_pypi_pyverbs(pypi_guest_run: tuple[int, str]) -> None:
    rc, output = pypi_guest_run
    results = {k: v for k, v in _results(output).items() if "test_conformance_verbs" in k}
    from tensorwire.testing import CHECKS

    assert len(results) == len(CHECKS), f"expected {len(CHECKS)} conformance results:\n{_tail(output, 60)}"
    failed = {k: v for k, v in results.items() if v != "PASSED"}
    assert not failed, f"{failed}\n{_failures(output)}{_tail(output, 80)}"
    assert rc == 0, _failures(output) + _tail(output, 60)
