"""The command line as a user runs it: bad arguments, a dying or interrupted demo, doctor --json.

Every command runs in a subprocess with a timeout; the demo's second process is found through
/proc (the demo prints its pid only once it has connected)."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
from _loopbacks import has_ipv6_loopback

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc"),
]

CLI = [sys.executable, "-m", "tensorwire.cli"]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _demo_peer_of(parent: int, timeout: float = 30.0, marker: bytes = b"_demo-peer") -> int:
    """The pid of the `_demo-peer` process a demo started (or the child of ``parent`` whose command
    line holds ``marker``), as soon as it exists."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None and st[1] == parent:
                try:
                    if marker in (entry / "cmdline").read_bytes():
                        return int(entry.name)
                except OSError:
                    pass
        time.sleep(0.01)
    raise AssertionError(f"process {parent} started no {marker.decode()} within {timeout:g} s")


def _kill(*pids: int) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--size-mib", "1", "--repeat", "0"], "argument --repeat: must be 1 or more, not 0"),
        (["--size-mib", "1", "--repeat", "-2"], "argument --repeat: must be 1 or more, not -2"),
        (["--size-mib", "-5", "--repeat", "1"], "argument --size-mib: must be 1 or more, not -5"),
        (["--size-mib", "many"], "argument --size-mib: not an integer: 'many'"),
    ],
)
def test_demo_rejects_bad_numbers_with_a_usage_error(
    args: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # (in this process: the parser refuses them before anything runs; a process per case cost
    # 0.3 CPU-s each, and the command line as a process is what the other tests here run)
    out, err = _usage_error(["demo", *args], capsys)
    assert complaint in err, err
    assert out == "", out


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """What ``tensorwire ARGV`` prints (stdout, stderr), run in this process, where it must end
    as a usage error does (exit 2) before it runs anything. A command it would run instead fails
    the test at once (it does not run here), as does anything else it raises (a traceback)."""
    from tensorwire import cli

    def ran(*args: object) -> NoReturn:
        for arg in args:
            if inspect.iscoroutine(arg):
                arg.close()
        raise AssertionError(f"tensorwire {' '.join(argv)} ran its command: no usage error")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "_run_until_signal", ran)
        patch.setattr(cli, "_doctor", ran)
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
    out, err = capsys.readouterr()
    assert done.value.code == 2, (done.value.code, out, err)
    return out, err


def test_demo_says_at_once_that_its_second_process_died() -> None:
    demo = subprocess.Popen([*CLI, "demo", "--size-mib", "1", "--repeat", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    child = 0
    try:
        child = _demo_peer_of(demo.pid)
        os.kill(child, signal.SIGKILL)  # before it connects: node A is waiting in accept()
        _, err = demo.communicate(timeout=60)  # the old demo waited 120 s, then raised TimeoutError
    finally:
        _kill(demo.pid, child)
        demo.communicate()
    assert demo.returncode == 1, err
    assert f"node B (pid {child}) was killed by SIGKILL" in err
    assert "Traceback" not in err


def _read_until(proc: subprocess.Popen[str], prefix: str, what: str) -> list[str]:
    """``proc``'s stdout lines up to the first that starts with ``prefix``."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"{what} ended early: {''.join(lines)}{proc.communicate()[1][-2000:]}")


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_demo_stops_its_second_process(signum: signal.Signals, code: int) -> None:
    # many repetitions: the demo is in its bandwidth loop, over whichever transport it picked
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    demo = subprocess.Popen([*CLI, "demo", "--size-mib", "4", "--repeat", "1000000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert demo.stdout is not None
    child = 0
    try:
        child = _demo_peer_of(demo.pid)
        _read_until(demo, "B sees the path as:", "the demo")
        os.kill(demo.pid, signum)  # the parent alone, as `kill` or a supervisor sends it
        # promptly: the old demo waited 20 s for its child after a SIGINT (and left it on SIGTERM)
        _, err = demo.communicate(timeout=15)
    finally:
        _kill(demo.pid, child)
        demo.communicate()
    assert demo.returncode == code, err
    assert "Traceback" not in err
    assert not _alive(child), "the demo left its second process running"


def _sigint_in(pid: int, field: str) -> bool:
    """Whether SIGINT is in a signal set of process ``pid`` as /proc shows it: "SigCgt" (it has
    a handler: Python sets its own as it starts), "ShdPnd" (sent to it, not yet taken: blocked,
    or the process has not run since), "SigBlk" (its main thread blocks it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    found = re.search(rf"^{field}:\s*([0-9a-f]+)$", status, re.MULTILINE)
    return found is not None and bool(int(found[1], 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.parametrize(
    ("command", "marker"),
    [(["demo", "--size-mib", "4"], b"_demo-peer"), (["bench", "--sizes", "4K", "--transports", "tcp"], b"--bench")],
)
def test_ctrl_c_at_a_terminal_while_the_child_loads_prints_no_traceback(command: list[str], marker: bytes) -> None:
    """A terminal sends Ctrl-C to every process of the foreground job, so to the demo's node B
    or the bench's node too. One still loading (numpy, gRPC: half a second or more) printed the
    import machinery's KeyboardInterrupt traceback (or "Fatal Python error" in site's import)
    and died; the child now leaves SIGINT to its parent, which stops it."""
    proc = subprocess.Popen([*CLI, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    child = 0
    try:
        child = _demo_peer_of(proc.pid, marker=marker)
        end = time.monotonic() + 30
        while not _sigint_in(child, "SigCgt") and _alive(child) and time.monotonic() < end:
            time.sleep(0.005)  # the child's interpreter is up: it loads tensorwire now
        # the Ctrl-C reaches the child first (the order among the job is not set): it must not
        # end it; then the whole job gets it, as a terminal sends it
        os.kill(child, signal.SIGINT)
        while _alive(child) and time.monotonic() < end:  # until it ends, or holds the signal
            if _sigint_in(child, "ShdPnd") and _sigint_in(child, "SigBlk"):
                break
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        _kill(proc.pid, child)
        proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert _gone_within(child, 10), "the child was left running"


def _gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


# a parent that starts `serve --parent <its pid>` (from a thread that then ends, with "thread"),
# prints the server's pid once it serves (its --parent armed), and lives on
_PARENT = """
import os, subprocess, sys, threading, time
box = []
def launch():
    child = subprocess.Popen([sys.executable, "-m", "tensorwire.cli", "serve", "--transports", "tcp",
                              "--parent", str(os.getpid())], stdout=subprocess.PIPE, text=True)
    box.append((child, child.stdout.readline()))
if sys.argv[1] == "thread":
    t = threading.Thread(target=launch); t.start(); t.join()
else:
    launch()
child, line = box[0]
print(child.pid, line.strip(), flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def _server_of_a_parent(how: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """(the parent process, its serving server's pid); both are killed afterwards."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, how], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    server = 0
    try:
        pid, ready = parent.stdout.readline().split(" ", 1)
        server = int(pid)
        assert "serving at" in ready, ready
        yield parent, server
    finally:
        _kill(parent.pid, server)
        parent.communicate()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_server_started_with_parent_exits_when_its_parent_dies(signum: signal.Signals) -> None:
    with _server_of_a_parent("main") as (parent, server):
        assert _alive(server)
        os.kill(parent.pid, signum)  # SIGKILL: the parent can do nothing for its child
        parent.wait(10)
        # the old CLI had no --parent (a usage error) and a server left by its parent ran on
        assert _gone_within(server, 15), "the server outlived its parent"


def test_a_server_outlives_the_thread_that_started_it_but_not_its_parent() -> None:
    """PR_SET_PDEATHSIG fires when the launching *thread* ends: the first --parent stopped the
    server 0 s after that thread ended although its parent process lived on."""
    with _server_of_a_parent("thread") as (parent, server):
        # (a server SIGTERMed is gone in 0.2-0.3 s here, both cores busy or not)
        assert not _gone_within(server, 1), "the server stopped when the thread that started it ended"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _gone_within(server, 15), "the server outlived its parent"


def test_parent_that_is_not_the_parent_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    out = subprocess.run([*CLI, "serve", "--parent", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "--parent 1: that process is not this one's parent" in out.stderr
    assert "Traceback" not in out.stderr
    _, err = _usage_error(["stage", "--part", "x:y", "--parent", "0"], capsys)
    assert "argument --parent: must be 1 or more, not 0" in err, err


def test_serve_closes_its_node_on_sigterm() -> None:
    server = subprocess.Popen([*CLI, "serve", "--transports", "tcp"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _read_until(server, "tensorwire node", "serve")
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
    finally:
        _kill(server.pid)
        server.communicate()
    assert server.returncode == 128 + signal.SIGTERM, err  # it used to die of the signal (-15)
    assert "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
def test_doctor_json_stdout_is_only_json_when_ucx_warns() -> None:
    # a transport UCX does not know makes it print warnings on file descriptor 1 while it is probed
    env = {**os.environ, "UCX_TLS": "bogus"}
    out = subprocess.run([*CLI, "doctor", "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["transports"]["tcp"]["usable"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGKILL, -9)])
def test_pipeline_example_stops_its_stage_processes_when_signalled(signum: signal.Signals, code: int) -> None:
    if importlib.util.find_spec("torch") is None:  # (not importorskip: importing torch here cost 1.5 CPU-s)
        pytest.skip("torch is not installed")
    root = Path(__file__).resolve().parents[1]
    example = root / "examples" / "pipeline_mlp.py"
    # a script's sys.path starts at its own folder: make it import this checkout's tensorwire
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    # two stages, not the example's four: each is a process importing torch (about 6 s of CPU here)
    driver = subprocess.Popen([sys.executable, str(example), "--steps", "1000000", "--stages", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert driver.stdout is not None
    stages: list[int] = []
    try:
        lines = _read_until(driver, "step 0:", "the example")
        stages = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _ppid(int(e.name)) == driver.pid]
        assert len(stages) == 2, lines
        os.kill(driver.pid, signum)  # the driver alone, as `kill` or a supervisor sends it
        _, err = driver.communicate(timeout=60)
        # SIGKILL: the driver can do nothing; the stages go because they were started with --parent
        left = [pid for pid in stages if not _gone_within(pid, 15)]
    finally:
        _kill(driver.pid, *stages)
        driver.communicate()
    assert driver.returncode == code, err
    assert "Traceback" not in err
    assert not left, "the example left stage processes running"


def _ppid(pid: int) -> int | None:
    st = _stat(pid)
    return None if st is None else st[1]


def test_an_echo_the_client_refuses_closes_that_client_instead_of_leaving_it_waiting() -> None:
    """A client whose own limits refuse the echo of what it sent (MessageRefused at the server):
    the echo loop used to end silently, and the client's recv waited for ever. The server now
    says why on stderr and closes that peer: the recv fails at once. Other clients go on."""
    import asyncio

    import tensorwire
    from tensorwire.transports import Limits  # (tensorwire.transports is there once imported)

    async def clients(address: str) -> None:
        small = Limits(max_message_bytes=1 << 20)
        async with (
            tensorwire.start("127.0.0.1:0", transports=("tcp",), limits=small) as a,
            tensorwire.start("127.0.0.1:0", transports=("tcp",)) as b,
        ):
            pa, pb = await a.connect(address), await b.connect(address)
            await pa.send(np.zeros(2 << 20, np.uint8), tag=0)  # the server takes it; its echo is too big for a
            with pytest.raises(tensorwire.PeerDisconnected):
                async with asyncio.timeout(20):
                    await pa.recv(tag=0)
            await pb.send(np.arange(10), tag=0)
            async with asyncio.timeout(20):
                assert np.array_equal(await pb.recv(tag=0), np.arange(10))

    server = subprocess.Popen([*CLI, "serve", "--transports", "tcp", "--echo", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        asyncio.run(clients(_read_until(server, "tensorwire node", "serve")[-1].split()[-1]))
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
    finally:
        _kill(server.pid)
        server.communicate()
    assert "echo on tag '0'" in err and "MessageRefused" in err and "closing that peer" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["serve", "stage --part m:f", "doctor 127.0.0.1:1", "bench 127.0.0.1:1"])
def test_an_empty_token_from_the_environment_is_named(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORWIRE_TOKEN", "")
    _, err = _usage_error(command.split(), capsys)
    assert "TENSORWIRE_TOKEN is empty" in err, err


@pytest.mark.parametrize(
    "command", ["doctor --json", "bench --json --sizes 4K --seconds 0.1 --transports tcp", "--version"]
)
def test_an_empty_token_in_the_environment_does_not_stop_a_command_that_takes_none(command: str) -> None:
    """doctor without ADDRESS connects nowhere, a local bench gives its node a token of its
    own, --version runs nothing: TENSORWIRE_TOKEN="" made the first two usage errors."""
    env = {**os.environ, "TENSORWIRE_TOKEN": ""}
    out = subprocess.run([*CLI, *command.split()], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 0, out.stderr
    assert "TENSORWIRE_TOKEN" not in out.stderr
    if "--json" in command:
        assert "error" not in json.loads(out.stdout), out.stdout


@pytest.mark.parametrize("command", ["doctor", "serve", "bench 127.0.0.1:1"])
def test_an_empty_token_given_on_the_command_line_is_a_usage_error(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out, err = _usage_error([*command.split(), "--token", ""], capsys)
    assert "argument --token: empty: give a token, or leave --token out" in err, err
    assert out == ""


def _busy_port() -> socket.socket:
    """A socket listening on a port of 127.0.0.1, as another server would."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_busy_port_is_refused_with_our_error_alone(tmp_path: Path) -> None:
    """gRPC logged its own line ("... add_port.cc:83] Failed to add port to server: ...
    Address already in use") before the ConfigurationError: now the port is refused before gRPC
    tries it, and the error is all stderr holds."""
    (tmp_path / "part.py").write_text("def build(rank, num_stages):\n    return rank\n")
    with _busy_port() as busy:
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        want = f"tensorwire: ConfigurationError: cannot bind the control plane to {address}: Address already in use\n"
        for command in (["serve"], ["stage", "--part", f"{tmp_path / 'part.py'}:build"]):
            out = subprocess.run([*CLI, *command, "--address", address, "--transports", "tcp"],
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
            assert out.returncode == 1, out.stdout + out.stderr
            assert out.stderr == want, (command, out.stderr)


def test_localhost_with_its_port_busy_on_one_loopback_is_refused() -> None:
    """gRPC binds "localhost" on both loopbacks and is content with one, and `serve` did serve
    localhost:P with P another server's on 127.0.0.1: it said "serving at localhost:P" while a
    client that dialled that name on 127.0.0.1 reached the other server. Now a port must be free
    on every loopback (as asyncio's create_server binds a name), and the error names the one
    where it is not, alone on stderr."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        out = subprocess.run([*CLI, "serve", "--address", f"localhost:{port}", "--transports", "tcp"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 1, out.stdout + out.stderr
        want = (
            f"tensorwire: ConfigurationError: cannot bind the control plane to localhost:{port}: "
            f"127.0.0.1:{port}: Address already in use\n"
        )
        assert out.stderr == want, out.stderr


def test_serve_reads_a_tag_of_digits_as_an_int_and_anything_else_as_a_string() -> None:
    from tensorwire.cli import _wire_tag

    assert _wire_tag("0") == 0 and _wire_tag("-3") == -3
    assert _wire_tag("²") == "²"  # str.isdigit says yes; int() would refuse it and end the server
    assert _wire_tag("grads") == "grads" and _wire_tag("-") == "-"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("tag", "complaint"),
    [
        (str(1 << 64), "does not fit in 64 bits"),
        (str(-0x7477_424E_0000_0001), "is one of tensorwire's own"),  # the bench's request tag
    ],
)
def test_serve_refuses_an_echo_tag_no_peer_could_use_before_it_serves(
    tag: str, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # it served, then cut off every peer that connected (a tag past 64 bits), or its echo took
    # the bench's requests so that `tensorwire bench` waited 10 s and blamed the node
    out, err = _usage_error(["serve", "--bench", f"--echo={tag}"], capsys)
    assert out == "", out
    assert f"error: argument --echo: tag {tag} {complaint}" in err, err


@pytest.mark.timeout(60)
def test_doctor_json_with_stdout_closed_ends_without_a_traceback() -> None:
    # `tensorwire doctor --json >&-`: Python sets sys.stdout to None; moving descriptor 1 aside
    # for the probe raised AttributeError (a traceback, exit 1)
    out = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *CLI, "doctor", "--json"],
                         stderr=subprocess.PIPE, text=True, timeout=45)  # fmt: skip
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


def test_a_demo_too_big_for_memory_says_so_without_a_traceback() -> None:
    out = subprocess.run([*CLI, "demo", "--size-mib", "100000000"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "out of memory (--size-mib 100000000)" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("size", ["99999999999999", str(10**24)])
def test_a_demo_numpy_cannot_even_size_says_out_of_memory(size: str) -> None:
    # past numpy's largest array the demo's payload raised ValueError: a traceback, not a message
    out = subprocess.run([*CLI, "demo", "--size-mib", size], capture_output=True, text=True, timeout=90)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"out of memory (--size-mib {size})" in out.stderr and "Traceback" not in out.stderr


async def test_a_node_cancelled_while_it_starts_raises_only_cancelled_error() -> None:
    """Ctrl-C or SIGTERM while `tensorwire demo` or `serve` starts its node cancels start(); a
    cancel that reached gRPC's server start half-way left a server whose stop raised
    asyncio.InvalidStateError (a traceback, exit 1). The cancel lands at each turn of the loop."""
    import asyncio

    import tensorwire

    for turns in range(12):
        starting = asyncio.ensure_future(tensorwire.start("127.0.0.1:0", transports=("tcp",)).__aenter__())
        for _ in range(turns):
            await asyncio.sleep(0)
        starting.cancel()
        try:
            node = await starting
        except asyncio.CancelledError:
            continue
        await node.aclose()  # it had started before the cancel came


def test_stage_part_with_a_relative_module_name_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorwire.errors import ConfigurationError
    from tensorwire.pipeline._serve import load_factory

    (tmp_path / "mypart.py").write_text("def build(rank, num_stages):\n    return rank\n")
    monkeypatch.chdir(tmp_path)
    # a file named without its .py: importlib raised TypeError (a traceback from `tensorwire stage`)
    for spec in ("./mypart:build", ".mypart:build"):
        with pytest.raises(ConfigurationError, match=r"is not MODULE:FUNCTION or FILE\.py:FUNCTION"):
            load_factory(spec)
    assert load_factory("./mypart.py:build")(3, 4) == 3
    out = subprocess.run([*CLI, "stage", "--part", "./mypart:build"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "ConfigurationError: --part './mypart:build' is not MODULE:FUNCTION" in out.stderr


def test_stage_part_is_found_as_python_finds_a_module_or_a_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `tensorwire` script's sys.path starts with its own bin directory, not the current
    one: `tensorwire stage --part mymodel:build` (mymodel.py here) failed with "No module named
    'mymodel'" while `python -m tensorwire.cli` found it, and a FILE.py part could not import
    the module beside it. Now MODULE is looked up in the current directory (as `python -m`
    does) and FILE.py's directory is searched (as `python FILE.py` does)."""
    from tensorwire.pipeline._serve import load_factory

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", os.getcwd(), str(tmp_path))])
    for name in ("tw_cwd_part", "tw_sibling_helper"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "tw_cwd_part.py").write_text("def build(rank, num_stages):\n    return rank * 10\n")
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "tw_sibling_helper.py").write_text("WIDTH = 7\n")
    (tmp_path / "parts" / "model.py").write_text(
        "import tw_sibling_helper\n\ndef build(rank, num_stages):\n    return tw_sibling_helper.WIDTH\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_factory("tw_cwd_part:build")(2, 4) == 20
    monkeypatch.delitem(sys.modules, "tw_cwd_part")
    assert load_factory(str(tmp_path / "parts" / "model.py") + ":build")(0, 2) == 7


def test_a_part_that_fails_while_it_loads_is_a_configuration_error_naming_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part file with a syntax error, or one raising at import, printed the import machinery's
    traceback from `tensorwire stage`; now it is a ConfigurationError naming the error and the
    line of the user's file, and a fixed file loads on the next try."""
    from tensorwire.errors import ConfigurationError
    from tensorwire.pipeline._serve import load_factory

    monkeypatch.chdir(tmp_path)
    part = tmp_path / "broken.py"
    part.write_text("def build(rank, num_stages)\n    return rank\n")
    with pytest.raises(ConfigurationError, match=r"loading \./broken\.py raised SyntaxError: .*line 1"):
        load_factory("./broken.py:build")
    part.write_text("import math\n\nWIDTH = math.sqrt(-1)\n")
    with pytest.raises(ConfigurationError, match=r"raised ValueError: math domain error \(.*broken\.py, line 3\)"):
        load_factory("./broken.py:build")
    part.write_text('import json\n\nCONFIG = json.loads("{bad")\n')  # raised inside json: name the part's line
    with pytest.raises(ConfigurationError, match=r"raised JSONDecodeError: .*\(.*broken\.py, line 3\)"):
        load_factory("./broken.py:build")
    part.write_text("def build(rank, num_stages):\n    return rank + 1\n")
    assert load_factory("./broken.py:build")(1, 2) == 2
    out = subprocess.run([*CLI, "stage", "--part", "./broken.py:nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    part.write_text("raise RuntimeError('no GPU for this part')\n")
    out = subprocess.run([*CLI, "stage", "--part", "./broken.py:build"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "raised RuntimeError: no GPU for this part" in out.stderr, out.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'tensorwire[ucx]')"
)
@pytest.mark.parametrize("size_mib", [8, 1])
def test_the_demo_says_the_route_ucx_named_for_its_large_tensor(size_mib: int) -> None:
    # a ucx send of 4 MiB or more says in its receipt the protocol UCX selected and the lanes
    # it used (Receipt.route); the demo's timed sends of its tensor said only the path's lanes
    out = subprocess.run([*CLI, "demo", "--size-mib", str(size_mib), "--repeat", "2"],
                         capture_output=True, text=True, timeout=90)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    path = next(line for line in out.stdout.splitlines() if line.startswith("path: "))
    assert path.startswith("path: ucx ["), out.stdout  # the demo picks ucx where it is installed
    routes = [line for line in out.stdout.splitlines() if "route" in line]
    if size_mib < 4:  # UCX is not asked: nothing is made up
        assert routes == [], out.stdout
        return
    endpoint = path.removeprefix("path: ucx [").split("]")[0].split(", ")
    assert len(routes) >= 1, out.stdout
    for line in routes:
        said = re.fullmatch(r"ucx route of the 8 MiB tensor(?: \(\d of 2 sends\))?: (.+) over (\S.*)", line)
        assert said and set(said[2].split(", ")) <= set(endpoint), out.stdout
        if "cma/memory" in endpoint:  # processes may read each other's memory here
            assert said[2] == "cma/memory" and "zero-copy" in said[1], out.stdout


def test_a_demo_whose_stdout_closes_ends_quietly_and_stops_its_second_process() -> None:
    # `tensorwire demo | head -1`: the next print raised BrokenPipeError, a traceback on stderr
    demo = subprocess.Popen([*CLI, "demo", "--size-mib", "1", "--repeat", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert demo.stdout is not None and demo.stderr is not None
    child = 0
    try:
        child = _demo_peer_of(demo.pid)
        assert demo.stdout.readline().startswith("node A ")
        demo.stdout.close()  # as head does once it has its line
        demo.wait(60)
        err = demo.stderr.read()
    finally:
        _kill(demo.pid, child)
        demo.wait()
        demo.stderr.close()
    assert demo.returncode == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert _gone_within(child, 15), "the demo left its second process running"


@pytest.mark.parametrize(
    "argv", [["serve", "--address", "[::1]"], ["stage", "--part", "m:f", "--address", "[::1]"], ["bench", "[::1]"],
             ["doctor", "[fe80::1%eth0]"]],
)  # fmt: skip
def test_an_ipv6_address_without_a_port_is_said_to_lack_the_port(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # it said "write an IPv6 host in brackets, as in '[::1]:5000'" of a host in brackets
    from tensorwire.cli import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    host = argv[-1]
    assert done.value.code == 2
    assert f"{host!r} has no port: write HOST:PORT, as in '{host}:5000'" in capsys.readouterr().err


def test_the_demos_second_process_is_no_command_of_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    from tensorwire.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "{demo,serve,bench,doctor,stage}" in out and "_demo-peer" not in out, out
    with pytest.raises(SystemExit) as done:
        main(["demo-peer"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "invalid choice: 'demo-peer'" in err and "_demo-peer" not in err, err
    with pytest.raises(SystemExit) as done:  # still there for the demo, which starts it
        main(["_demo-peer", "--help"])
    assert done.value.code == 0
    assert "usage: tensorwire _demo-peer [-h] [--parent PID] address size_mib" in capsys.readouterr().out


def test_no_command_names_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    # it said "the following arguments are required: cmd"
    from tensorwire.cli import main

    with pytest.raises(SystemExit) as done:
        main([])
    err = capsys.readouterr().err
    assert done.value.code == 2
    said = "choose a command: demo, serve, bench, doctor, stage (tensorwire --help says what each does)"
    assert err.endswith(f"tensorwire: error: {said}\n"), err


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["serve", "--metrics", "foo:bar"], "argument --metrics: address 'foo:bar': the port must be a number"),
        (["stage", "--part", "m:f", "--metrics", "foo"], "argument --metrics: address 'foo' is not host:port"),
        (["serve", "--address", "a b:1"], "argument --address: address 'a b:1' holds a control character or a space"),
        (["bench", "::1:5000"], "argument ADDRESS: address '::1:5000': write an IPv6 host in brackets"),
        # an address to connect to has a port from 1: port 0 was taken, and the connect's
        # ConfigurationError came after a node started (doctor: after its whole report, exit 1)
        (["bench", "127.0.0.1:0"], "argument ADDRESS: address '127.0.0.1:0': the port must be a number from 1 to"),
        (["doctor", "127.0.0.1:0"], "argument ADDRESS: address '127.0.0.1:0': the port must be a number from 1 to"),
    ],
)
def test_a_bad_address_is_a_usage_error_that_names_its_flag(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a bad --metrics said "ConfigurationError: address 'foo:bar': ..." once the command ran,
    # naming no flag (serve has two addresses)
    from tensorwire.cli import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == ""
    assert complaint in err, err


def _undocumented(help_text: str) -> list[str]:
    """The options and arguments a --help lists with no text beside or below them. An entry
    starts two spaces in; its text follows two or more spaces, or on lines indented further."""
    missing = []
    for line, after in itertools.pairwise([*help_text.splitlines(), ""]):
        entry = re.fullmatch(r"  (\S.*?)(\s{2,}\S.*)?", line)
        if entry is not None and entry[2] is None and not after.startswith("   "):
            missing.append(entry[1])
    return missing


@pytest.mark.parametrize("command", ["demo", "serve", "bench", "doctor", "stage"])
def test_every_option_has_help_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # doctor's --json and the --address of serve and stage had none
    from tensorwire.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0
    assert re.search(r"^options:$", text, re.M) and _undocumented(text) == [], text


def test_doctor_ends_with_143_on_sigterm() -> None:
    # the doctor died of the signal (-15 to its parent), where every other command ends with 143
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes the connection, never answers
        silent.settimeout(60)
        doctor = subprocess.Popen([*CLI, "doctor", f"127.0.0.1:{silent.getsockname()[1]}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            conn, _ = silent.accept()  # the doctor is connecting (for up to 10 s): its handler is set
            with conn:
                doctor.send_signal(signal.SIGTERM)
                _, err = doctor.communicate(timeout=30)
        finally:
            _kill(doctor.pid)
            doctor.communicate()
    assert doctor.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err


@pytest.mark.timeout(60)
def test_a_command_started_with_stdout_closed_holds_descriptor_1_on_dev_null() -> None:
    # with descriptor 1 free, the next file the process opened took it (an epoll or a socket of
    # the node), and whatever a native library printed "to stdout" went into that
    proc = subprocess.Popen(["sh", "-c", 'exec "$@" >&-', "sh", *CLI, "serve", "--transports", "tcp"],
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        seen = ""
        for _ in range(200):
            with contextlib.suppress(OSError):
                seen = os.readlink(f"/proc/{proc.pid}/fd/1")
                if seen == "/dev/null" or len(list(Path(f"/proc/{proc.pid}/fd").iterdir())) > 8:
                    break  # (it holds descriptor 1 from the start, or the node has opened files by now)
            time.sleep(0.05)
        assert seen == "/dev/null", seen
    finally:
        proc.kill()
        proc.wait()


_INTERRUPTED_IMPORT = """
import builtins, sys
real = builtins.__import__

def interrupting(name, *args, **kwargs):  # Ctrl-C while the command line loads numpy
    if name == "numpy":
        raise KeyboardInterrupt
    return real(name, *args, **kwargs)

builtins.__import__ = interrupting
from tensorwire._entry import main  # what the `tensorwire` script runs (pyproject.toml)
sys.exit(main())
"""


def test_ctrl_c_while_the_command_line_loads_ends_quietly_with_130() -> None:
    """A Ctrl-C in the first half second of `tensorwire ...` (while tensorwire and numpy load)
    printed the import machinery's KeyboardInterrupt traceback: ``import tensorwire`` loaded
    the whole API, before any code of ours could catch it."""
    out = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 130, out.stderr
    assert out.stderr == "tensorwire: interrupted (SIGINT)\n", out.stderr


_SIGNALLED_IMPORT = """
import builtins, os, signal, sys
real, target, times = builtins.__import__, sys.argv[1], int(sys.argv[2])
signum = signal.Signals[os.environ.get("SIGNAL", "SIGINT")]

def interrupting(name, *args, **kwargs):  # a real Ctrl-C (or two) as the command line loads TARGET
    global times
    if name == target and times:
        for _ in range(times):
            os.kill(os.getpid(), signum)
        times = 0
    return real(name, *args, **kwargs)

builtins.__import__ = interrupting
sys.argv[1:] = sys.argv[3:]
from tensorwire._entry import main  # what the `tensorwire` script runs (pyproject.toml)
sys.exit(main())
"""


# numpy loads with the command line, crc32c as --sizes is read
@pytest.mark.parametrize("target", ["numpy", "crc32c"])
def test_ctrl_c_while_bench_json_loads_still_prints_the_json_report(target: str) -> None:
    """`tensorwire bench --json` interrupted while it loads said "tensorwire: interrupted" (or
    printed a traceback, or an ImportError) and nothing on stdout; interrupted later it prints
    {"address": ..., "error": "interrupted (SIGINT)"}. Now a Ctrl-C while it loads is held, then
    taken as a later one is."""
    bench = ["bench", "--json", "--sizes", "4K", "--seconds", "0.1", "--transports", "tcp"]
    out = subprocess.run([sys.executable, "-c", _SIGNALLED_IMPORT, target, "1", *bench],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 130, out.stdout + out.stderr
    assert json.loads(out.stdout) == {"address": None, "error": "interrupted (SIGINT)"}, out.stdout
    assert "Traceback" not in out.stderr and "KeyboardInterrupt" not in out.stderr, out.stderr


def test_a_second_ctrl_c_while_the_command_line_loads_ends_it_at_once() -> None:
    out = subprocess.run([sys.executable, "-c", _SIGNALLED_IMPORT, "numpy", "2", "bench", "--json"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 130, out.stdout + out.stderr
    assert out.stderr == "tensorwire: interrupted (SIGINT)\n" and out.stdout == "", out.stdout + out.stderr


@pytest.mark.parametrize("target", ["numpy", "crc32c"])
def test_sigterm_while_bench_json_loads_still_prints_the_json_report(target: str) -> None:
    """A SIGTERM while `tensorwire bench --json` loaded (its first half second) killed it with
    nothing on stdout; now it is held as a Ctrl-C is, and taken as a later one is: exit 143
    and {"address": ..., "error": "terminated (SIGTERM)"}."""
    bench = ["bench", "--json", "--sizes", "4K", "--seconds", "0.1", "--transports", "tcp"]
    out = subprocess.run([sys.executable, "-c", _SIGNALLED_IMPORT, target, "1", *bench], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "SIGNAL": "SIGTERM"})  # fmt: skip
    assert out.returncode == 128 + signal.SIGTERM, out.stdout + out.stderr
    assert json.loads(out.stdout) == {"address": None, "error": "terminated (SIGTERM)"}, out.stdout
    assert "Traceback" not in out.stderr, out.stderr


def test_a_second_sigterm_while_the_command_line_loads_ends_it_at_once() -> None:
    """The first is held; the second ends the process at once, by the signal itself."""
    env = {**os.environ, "SIGNAL": "SIGTERM"}
    out = subprocess.run([sys.executable, "-c", _SIGNALLED_IMPORT, "numpy", "2", "bench", "--json"],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert out.returncode == -signal.SIGTERM and out.stdout == "", out.stdout + out.stderr


def test_import_tensorwire_loads_the_api_on_first_use() -> None:
    code = (
        "import sys, tensorwire\n"
        "print(sorted(m for m in ('numpy', 'grpc', 'tensorwire._node') if m in sys.modules))\n"
        "from tensorwire import start, Peer\n"
        "print(tensorwire.Node.__module__, start is tensorwire.start, 'Receipt' in dir(tensorwire))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "tensorwire._node True True"], out.stdout


def test_a_stage_ended_by_sigterm_flushes_what_it_wrote_last_and_exits_143(tmp_path: Path) -> None:
    """A stage stopped by SIGTERM ends at once after its cleanup (``os._exit``, past the
    interpreter's slow shutdown): what is written as logging shuts down (a handler's close)
    still comes out, into stdout (a pipe: block-buffered, PYTHONUNBUFFERED unset), through C
    stdio (buffered too) and into stderr, and the code is 143."""
    (tmp_path / "part.py").write_text(
        "import ctypes, logging, sys\n"
        "class Last(logging.Handler):\n"
        "    def emit(self, record): pass\n"
        "    def close(self):\n"
        "        print('stdout at the end')\n"
        "        ctypes.CDLL(None).printf(b'C stdio at the end\\n')\n"
        "        sys.stderr.write('stderr at the end')\n"
        "        super().close()\n"
        "logging.getLogger().addHandler(Last())\n"
        "def build(rank, num_stages):\n    return rank\n"
    )
    stage = subprocess.Popen([*CLI, "stage", "--part", f"{tmp_path / 'part.py'}:build", "--address", "127.0.0.1:0",
                              "--transports", "tcp"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})  # fmt: skip
    try:
        _read_until(stage, "tensorwire stage serving at", "stage")
        stage.send_signal(signal.SIGTERM)
        out, err = stage.communicate(timeout=60)
    finally:
        _kill(stage.pid)
        stage.communicate()
    assert stage.returncode == 128 + signal.SIGTERM, (stage.returncode, out, err)
    assert "stdout at the end" in out and "C stdio at the end" in out, out
    assert err.endswith("stderr at the end"), err
