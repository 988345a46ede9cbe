"""tensorwire's command line: demo, serve, bench, doctor, stage.

tensorwire demo                 two processes on loopback, a verified 256 MiB pytree
tensorwire serve --echo 0       a node that echoes what it receives on tag 0
tensorwire bench [ADDR]         tensorwire's throughput to a node against plain TCP, same run
tensorwire doctor [ADDR] [--json]  what this machine offers and which path a connect takes
tensorwire stage --part MOD:FN  a pipeline stage server (see tensorwire.pipeline)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import json
import logging
import os
import re
import secrets
import signal
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import numpy as np

from . import __version__, start
from ._entry import Terminated, release_interrupts, while_held
from .errors import ConfigurationError, PeerDisconnected, ResourceError, TensorWireError

MiB = 1 << 20
_T = TypeVar("_T")


# -- demo -----------------------------------------------------------------------------------
def _demo_payload(size_mib: int) -> dict[str, Any]:
    """A deterministic pytree: a large tensor, a non-contiguous one, odd dtypes and scalars."""
    import ml_dtypes

    n = size_mib * MiB // 4
    try:
        big = (np.arange(n, dtype=np.uint32) * np.uint32(2654435761)).view(np.float32)
    except ValueError as exc:  # numpy cannot even size it ("Maximum allowed size exceeded")
        raise MemoryError(str(exc)) from exc
    grid = np.arange(1536 * 1024, dtype=np.float64).reshape(1536, 1024)
    return {
        "activations": big,
        "grad_t": grid.T[::2],  # transposed and strided: packed on the way out
        "mask": (np.arange(4096) % 3 == 0),
        "bf16": np.linspace(-4, 4, 1000).astype(ml_dtypes.bfloat16),
        "step": 7,
        "note": "tensorwire demo",
    }


def _verify(got: Any, want: Any, path: str = "") -> list[str]:
    if isinstance(want, np.ndarray):
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
            return [f"{path}: expected {want.dtype}{list(want.shape)}, got {type(got).__name__}"]
        a = np.ascontiguousarray(want).view(np.uint8)
        b = np.ascontiguousarray(got).view(np.uint8)
        bad = np.count_nonzero(a != b)
        return [f"{path}: {bad} bytes differ"] if bad else []
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys differ"]
        return [e for k in want for e in _verify(got[k], want[k], f"{path}/{k}")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


async def _demo_child(address: str, size_mib: int) -> int:
    want = _demo_payload(size_mib)
    async with start("127.0.0.1:0") as node:
        peer = await node.connect(address)
        got, receipt = await peer.recv_with_receipt(tag="demo")
        errors = _verify(got, want)
        nbytes = sum(v.nbytes for v in want.values() if isinstance(v, np.ndarray))
        await peer.send(
            {"errors": errors, "bytes": nbytes, "path": str(peer.path), "protocol": receipt.protocol}, tag="verdict"
        )
        out = np.empty_like(want["activations"])
        while True:
            cmd = await peer.recv(tag="ctl")
            if cmd == "bw":
                await peer.recv(tag="bw", out=out)
                await peer.send(True, tag="ack")
            elif cmd == "back":
                await peer.send(out, tag="back")
            else:
                break
        await peer.aclose()
    return 0


_DEMO_PEER = "_demo-peer"  # the command line of the demo's second process (hidden from --help)
_DEMO_STEP_S = 120.0  # no step of the demo (starting B, one transfer) may take longer
_GRACE_S = 3.0  # how long B gets to exit after SIGTERM before it is killed


class _ChildFailed(Exception):
    """The demo or bench could not run to its end because of the process it started; the
    message says why (printed without a traceback)."""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


async def _spawn_child(*argv: str, **options: Any) -> asyncio.subprocess.Process:
    """Start the demo's node B or the bench's node with SIGINT blocked. A Ctrl-C at a terminal
    goes to every process of its foreground job, and a child still loading numpy and gRPC
    printed the import machinery's KeyboardInterrupt traceback (2 of 8 Ctrl-Cs 0.7-1.4 s into
    a demo). The child is this process's to stop (``_stop_child``; ``--parent`` if this one
    dies): it starts with the signal mask of the thread that starts it, and keeps SIGINT
    blocked. Here a Ctrl-C meanwhile is not lost: another thread takes it, or it waits until
    the mask is back."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return await asyncio.create_subprocess_exec(*argv, **options)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


async def _stop_child(child: asyncio.subprocess.Process) -> None:
    """Terminate the demo's second process; kill it when it is still there after a short grace."""
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            child.terminate()
    try:
        async with asyncio.timeout(_GRACE_S):
            await child.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


async def _unless_child_exits(
    child: asyncio.subprocess.Process, work: Coroutine[Any, Any, _T], who: str = "node B", what: str = "the demo"
) -> _T:
    """Run ``work``, but fail at once, naming B's exit, when B exits before ``work`` is done."""
    task = asyncio.ensure_future(work)
    exited = asyncio.ensure_future(child.wait())
    try:
        await asyncio.wait({task, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and child.returncode == 0:  # B exits 0 only once told "done": let A finish too
            await asyncio.wait({task}, timeout=_GRACE_S)
        if not task.done():
            raise _ChildFailed(f"{who} (pid {child.pid}) {_exit_text(child.returncode)} before {what} finished")
        try:
            return task.result()
        except TensorWireError as exc:  # the peer went away: say so when it is because B died
            await asyncio.wait({exited}, timeout=_GRACE_S)
            if child.returncode:
                raise _ChildFailed(f"{who} (pid {child.pid}) {_exit_text(child.returncode)}: {exc}") from exc
            raise
    finally:
        task.cancel()
        exited.cancel()
        await asyncio.gather(task, exited, return_exceptions=True)


async def _demo_exchange(node: Any, child: asyncio.subprocess.Process, want: dict[str, Any], repeat: int) -> bool:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(_DEMO_STEP_S) as deadline:
            peer = await node.accept()
            print(f"node A {node.address} <- node B (pid {child.pid})")
            print(f"path: {peer.path}")
            t0 = time.perf_counter()
            receipt = await peer.send(want, tag="demo")
            verdict = await peer.recv(tag="verdict")
            t_first = time.perf_counter() - t0
            nbytes = verdict["bytes"]
            print(
                f"sent a pytree of {len(want)} leaves, {nbytes / MiB:.1f} MiB "
                f"({receipt.protocol}, packed={receipt.packed}); B verified it in {t_first:.2f} s: "
                f"{'every byte matches' if not verdict['errors'] else verdict['errors']}",
                flush=True,
            )
            print(f"B sees the path as: {verdict['path']}", flush=True)
            big = want["activations"]
            times, receipts = [], []
            for _ in range(repeat):
                deadline.reschedule(loop.time() + _DEMO_STEP_S)
                t0 = time.perf_counter()
                await peer.send("bw", tag="ctl")
                receipts.append(await peer.send(big, tag="bw"))
                await peer.recv(tag="ack")
                times.append(time.perf_counter() - t0)
            deadline.reschedule(loop.time() + _DEMO_STEP_S)
            await peer.send("back", tag="ctl")
            back = await peer.recv(tag="back")
            back_ok = _verify(back, big) == []
            await peer.send("done", tag="ctl")
    except TimeoutError as exc:
        raise _ChildFailed(f"a step of the demo took longer than {_DEMO_STEP_S:g} s") from exc
    best, med = min(times), statistics.median(times)
    print(
        f"bandwidth A->B, {big.nbytes / MiB:.0f} MiB tensor x{repeat}: "
        f"best {big.nbytes / best / 1e9:.2f} GB/s, median {big.nbytes / med / 1e9:.2f} GB/s"
    )
    # what the transport below said it did with the tensor (Receipt.route: ucx, 4 MiB or more);
    # the pytree above has small leaves, so its send names none
    routes = collections.Counter((r.transport, r.route, r.lanes) for r in receipts if r.route)
    for (transport, route, lanes), n in routes.most_common():
        share = "" if n == repeat else f" ({n} of {repeat} sends)"
        print(f"{transport} route of the {big.nbytes / MiB:.0f} MiB tensor{share}: {route} over {', '.join(lanes)}")
    print(f"B->A echo of the {big.nbytes / MiB:.0f} MiB tensor: {'verified' if back_ok else 'CORRUPTED'}")
    return not verdict["errors"] and back_ok


async def _demo(size_mib: int, repeat: int) -> int:
    t_start = time.perf_counter()
    want = _demo_payload(size_mib)
    async with start("127.0.0.1:0") as node:
        child = await _spawn_child(
            *(sys.executable, "-m", "tensorwire.cli", _DEMO_PEER, node.address, str(size_mib)),
            *("--parent", str(os.getpid())),  # B goes even if this process is SIGKILLed
        )
        try:
            ok = await _unless_child_exits(child, _demo_exchange(node, child, want, repeat))
        except BaseException:  # failed, Ctrl-C or SIGTERM: B is not left behind, nor waited for
            await _stop_child(child)
            raise
        try:
            async with asyncio.timeout(20):
                await child.wait()
        except TimeoutError:
            await _stop_child(child)
    print(f"demo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t_start:.1f} s")
    if child.returncode != 0:
        print(f"tensorwire demo: node B (pid {child.pid}) {_exit_text(child.returncode)}", file=sys.stderr)
    return 0 if ok and child.returncode == 0 else 1


def _run_until_signal(work: Coroutine[Any, Any, int]) -> int:
    """``asyncio.run(work)`` that takes SIGTERM like Ctrl-C: ``work`` is cancelled and cleans up."""

    async def run() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, lambda: task.cancelling() or task.cancel())  # once: cleanup runs
        try:
            return await work
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(run())
    except asyncio.CancelledError:  # only SIGTERM cancels this task (Ctrl-C raises KeyboardInterrupt)
        return 128 + signal.SIGTERM


_PR_SET_PDEATHSIG = 1


def _exit_with_parent(pid: int) -> None:
    """Take SIGTERM when process ``pid``, which must be this one's parent, exits, even if it is
    SIGKILLed and cannot stop its children. A thread polls the parent every half second. On
    Linux the kernel also signals at once (PR_SET_PDEATHSIG, SIGUSR2 here); it does so when the
    *thread* that started this process ends, so the handler checks that the parent process is
    really gone and otherwise leaves it to the poll. A parent already gone is refused."""

    def gone() -> bool:
        return os.getppid() != pid

    def on_death_signal(signum: int, frame: object) -> None:
        if gone():
            os.kill(os.getpid(), signal.SIGTERM)

    if sys.platform.startswith("linux"):
        signal.signal(signal.SIGUSR2, on_death_signal)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR2, 0, 0, 0)
    # checked after the signal is armed: a parent that died before then is seen here
    if gone():
        raise ConfigurationError(f"--parent {pid}: that process is not this one's parent (it may have exited)")

    def watch() -> None:
        while not gone():
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tensorwire-parent-watch", daemon=True).start()


# -- serve ----------------------------------------------------------------------------------
def _wire_tag(text: str) -> int | str:
    """A tag given on the command line: an int where it is written as one (ASCII digits only:
    ``str.isdigit`` is also true of '²', which int() refuses), else the string."""
    return int(text) if re.fullmatch(r"-?[0-9]+", text) else text


def _echo_tag(text: str) -> str:
    """An argparse type: ``--echo TAG``, refused at once when no peer could ever use it (an int
    past 64 bits, a string with no UTF-8 form) or when it is one of tensorwire's own tags (an
    echo there would take the bench's or rpc's messages), as peer.recv would refuse it for
    every peer that connected."""
    from ._peer import tag_id

    try:
        tag_id(_wire_tag(text))
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@contextlib.asynccontextmanager
async def _metrics_served(address: str | None) -> AsyncIterator[None]:
    """``--metrics ADDR``: serve the process's metrics at http://ADDR/metrics meanwhile, and say
    where on stdout (before the serving line)."""
    if address is None:
        yield
        return
    from . import metrics

    # (serve resolves the host and binds: in a thread, not on the loop)
    async with await asyncio.to_thread(metrics.serve, address) as server:
        print(f"tensorwire metrics at http://{server.address}/metrics", flush=True)
        yield


async def _serve(
    address: str,
    echo: list[str],
    token: str | None,
    transports: list[str] | None,
    bench: bool = False,
    metrics: str | None = None,
) -> int:
    from ._bench import offer_bench, serve_bench

    options: dict[str, Any] = {"auth_token": token}
    if transports:
        options["transports"] = tuple(transports)
    async with _metrics_served(metrics), start(address, **options) as node:
        offer_bench(node)  # before it says it serves: a client's first bench call finds it
        print(f"tensorwire node {node.node_id} serving at {node.address}", flush=True)

        async def echo_loop(peer: Any, tag: str) -> None:
            wire_tag = _wire_tag(tag)
            try:
                while True:
                    await peer.send(await peer.recv(tag=wire_tag), tag=wire_tag)
            except (PeerDisconnected, ResourceError):
                return  # the peer went, or the node closes
            except TensorWireError as exc:
                # the peer would wait for this echo for ever (a message its own limits refuse
                # back): say so, and close the peer, so that its recv fails instead
                print(
                    f"tensorwire serve: echo on tag {tag!r} to {peer.remote_address} failed "
                    f"({type(exc).__name__}: {exc}); closing that peer",
                    file=sys.stderr,
                    flush=True,
                )
                await peer.aclose()

        async with asyncio.TaskGroup() as tg:
            async for peer in node:
                for tag in echo:
                    tg.create_task(echo_loop(peer, tag))
                tg.create_task(serve_bench(peer, enabled=bench))  # without --bench: refuses, so a client is told
    return 0


# -- bench ----------------------------------------------------------------------------------
async def _bench(args: argparse.Namespace, json_out: list[dict[str, Any]]) -> int:
    """``tensorwire bench``: against ``args.address``, or a ``serve --bench`` started here."""
    from ._bench import Report, Row, bench_device, run_bench

    device = bench_device(args.device)  # no CUDA here: said before anything starts
    # the node started here serves this run and nothing else: a token of its own, never the
    # user's (--token and TENSORWIRE_TOKEN are for ADDRESS)
    token = args.token if args.address is not None else secrets.token_hex(16)
    options: dict[str, Any] = {"auth_token": token}
    if args.transports:
        options["transports"] = tuple(args.transports)

    def progress(report: Report, row: Row | None) -> None:
        if args.json:
            return
        if row is None:
            print(report.head_text(), "", report.table_head(), sep="\n", flush=True)
        else:
            print(report.row_text(row), flush=True)

    async def measure(node: Any, address: str, local_peer: int | None) -> Report:
        peer = await node.connect(address, require=args.require)
        try:
            return await run_bench(
                peer, args.sizes, seconds=args.seconds, device=device, local_peer=local_peer, on_progress=progress
            )
        finally:
            await peer.aclose()

    starting = start("127.0.0.1:0", **options)  # a bad option is refused here, before a child starts
    if args.address is not None:
        async with starting as node:
            report = await measure(node, args.address, None)
    else:  # the child starts (imports, binds) while this node does
        child = await _spawn_child(
            *(sys.executable, "-m", "tensorwire.cli", "serve", "--bench", "--address", "127.0.0.1:0"),
            *(("--transports", *args.transports) if args.transports else ()),
            *("--parent", str(os.getpid())),  # it goes even if this process is SIGKILLed
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "TENSORWIRE_TOKEN": token},  # not on its command line
        )
        try:
            async with starting as node:
                report = await _unless_child_exits(
                    child, _bench_local(child, lambda address: measure(node, address, child.pid)),
                    who="the node this bench started", what="the bench",
                )  # fmt: skip
        finally:  # done, failed, Ctrl-C or SIGTERM: the node started here goes
            await _stop_child(child)
    if args.json:
        json_out.append(report.to_json())
    else:
        print("", report.foot_text(), sep="\n")
    return 0


async def _bench_local(child: asyncio.subprocess.Process, measure: Callable[[str], Coroutine[Any, Any, _T]]) -> _T:
    """Wait for the ``serve --bench`` child to say where it serves, then ``measure(address)``;
    what it prints before and after that goes to stderr (stdout may have to hold JSON alone).
    Native libraries print on its stdout too (UCX's log: ``UCX_LOG_LEVEL=info``, warnings about
    ``UCX_TLS``), before that line or, unflushed, in front of it on the same line."""
    assert child.stdout is not None
    try:
        async with asyncio.timeout(_DEMO_STEP_S):
            while True:
                line = (await child.stdout.readline()).decode(errors="replace")
                if not line:  # it closed its stdout: it is exiting
                    raise _ChildFailed(
                        f"the node this bench started (pid {child.pid}) {_exit_text(await child.wait())}"
                    )
                if found := re.search(r"tensorwire node \S+ serving at (\S+)$", line.rstrip("\n")):
                    address = found[1]
                    break
                sys.stderr.write(line)
    except TimeoutError as exc:
        raise _ChildFailed(f"the node this bench started did not serve within {_DEMO_STEP_S:g} s") from exc

    async def forward(stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            sys.stderr.write(line.decode(errors="replace"))

    rest = asyncio.ensure_future(forward(child.stdout))
    try:
        return await measure(address)
    finally:
        rest.cancel()
        await asyncio.gather(rest, return_exceptions=True)


# -- stage ----------------------------------------------------------------------------------
async def _stage(
    address: str, part: str, token: str | None, transports: list[str] | None, offload: bool, metrics: str | None
) -> int:
    from .pipeline._serve import serve_stage

    def ready(bound: str) -> None:
        print(f"tensorwire stage serving at {bound}", flush=True)

    async with _metrics_served(metrics):
        await serve_stage(address, part, ready=ready, offload=offload, transports=transports, auth_token=token)
    return 0


# -- doctor ---------------------------------------------------------------------------------
def _doctor_report(address: str | None = None, token: str | None = None) -> dict[str, Any]:
    from ._doctor import report

    return report(address, token)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what is written to file descriptor 1 to descriptor 2 for a while.

    Native libraries (UCX's warnings) write to descriptor 1 directly, past ``sys.stdout``; while the
    doctor probes them, that goes to stderr so that stdout holds nothing but the report. Without
    a stdout (``>&-``: Python sets ``sys.stdout`` to None) nothing is redirected: descriptor 1 may
    since belong to a file or socket this process opened.
    """
    if sys.stdout is None:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        with contextlib.suppress(Exception):  # flush C stdio, which may hold native output
            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM while the doctor runs: end at once with 143. Unwinding instead (an exception
    from here, or its connect probe's tasks cancelled) left gRPC's and UCX's threads running
    as the interpreter finalized, and the process died of SIGSEGV; the doctor holds nothing
    that needs closing (its probe node and sockets go with the process), and starts no child."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)


def _doctor(as_json: bool, address: str | None = None, token: str | None = None) -> int:
    from ._doctor import render

    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with _stdout_to_stderr() if as_json else contextlib.nullcontext():
            rep = _doctor_report(address, token)
        print(json.dumps(rep, indent=2) if as_json else render(rep))
    finally:
        signal.signal(signal.SIGTERM, previous)
    conn = rep.get("connect")
    return 1 if conn is not None and "error" in conn else 0


_METRICS_HELP = "serve Prometheus metrics at http://HOST:PORT/metrics (needs prometheus-client; port 0 picks one)"


def _address(text: str, lowest_port: int = 0) -> str:
    """An argparse type: HOST:PORT, checked by the library's own rule (``split_address``), so
    that a bad one is a usage error that names its flag (``argument --metrics: address
    'foo:bar': ...``) before anything starts; the library's later error named no flag, and
    serve has two addresses."""
    from ._checks import split_address

    try:
        split_address(text, lowest_port=lowest_port)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _node_address(text: str) -> str:
    """An argparse type: the HOST:PORT of a node to connect to, whose port is 1 or more (as
    ``connect`` requires): port 0 was refused only once a node had started here, and by the
    doctor after its whole report."""
    return _address(text, lowest_port=1)


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int no smaller than ``low`` (anything else is a usage error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, not {value}")
        return value

    return parse


def _sizes(text: str) -> list[int]:
    """An argparse type: ``--sizes 4K,1M,64M``."""
    from ._bench import parse_sizes

    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0, at most an hour."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 3600:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 3600, not {text}")
    return value


def _device(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N`` (whether it exists is checked later)."""
    from .tensors._device import parse_device

    try:
        parse_device(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _token(text: str) -> str:
    """An argparse type: ``--token T``; an empty one is refused, never taken for "no token"."""
    if not text:
        raise argparse.ArgumentTypeError("empty: give a token, or leave --token out")
    return text


def _uses_token(args: argparse.Namespace) -> bool:
    """Whether the command takes a token: serve and stage, and bench and doctor with ADDRESS
    (a local bench gives the node it starts a token of its own)."""
    return args.cmd in ("serve", "stage") or (args.cmd in ("bench", "doctor") and args.address is not None)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a word that starts with '-' and a digit (or '-.' and a
    digit) is always a value, never an option: no option of ours looks like that. argparse
    takes only a plain negative number (``-5``, ``-.5``) for a value, so ``--sizes -1K`` and
    ``--seconds -1e3`` were "expected one argument" instead of their own errors. (Later
    versions of argparse use this rule; add_subparsers makes the commands' parsers of this class.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?[0-9]")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    from .transports import DEFAULT_PREFERENCE

    parser = _Parser(prog="tensorwire", description="Move tensors between processes, honestly.")
    parser.add_argument("--version", action="version", version=f"tensorwire {__version__}")
    sub = parser.add_subparsers(dest="cmd")  # none given: said below, naming the commands
    transports_help = (
        f"the transports to offer, most preferred first (default: {' '.join(DEFAULT_PREFERENCE)}, those usable here)"
    )
    here = "where to listen (default 127.0.0.1:0: loopback, a free port)"

    def command(name: str, what: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=what, description=what)

    p = command("demo", "two processes on loopback exchange a verified pytree")
    p.add_argument(
        "--size-mib", type=_at_least(1), default=256, metavar="MIB", help="size of the large tensor (default 256)"
    )
    p.add_argument(
        "--repeat", type=_at_least(1), default=3, metavar="N", help="timed sends of the large tensor (default 3)"
    )
    p = command("serve", "run a node")
    p.add_argument("--address", type=_address, default="127.0.0.1:0", metavar="HOST:PORT", help=here)
    p.add_argument(
        "--echo", action="append", type=_echo_tag, default=[], metavar="TAG",
        help="send every message received on TAG back to its sender, on TAG (a TAG written as an integer is an int); "
        "give it again for more tags",
    )  # fmt: skip
    p.add_argument("--token", type=_token, help="require this auth token (default: $TENSORWIRE_TOKEN)")
    p.add_argument("--transports", nargs="+", default=None, metavar="NAME", help=transports_help)
    p.add_argument("--bench", action="store_true", help="answer `tensorwire bench` requests (else they are refused)")
    p.add_argument("--metrics", type=_address, default=None, metavar="HOST:PORT", help=_METRICS_HELP)
    p = command("bench", "tensorwire's throughput to a node, against plain TCP in the same run")
    p.add_argument(
        "address", nargs="?", type=_node_address, metavar="ADDRESS",
        help="a node started with `tensorwire serve --bench` (default: start one here, measure over loopback)",
    )  # fmt: skip
    p.add_argument(
        "--sizes", type=_sizes, default="4K,1M,64M", metavar="LIST",
        help="message sizes, comma-separated; K, M, G are binary units (default 4K,1M,64M)",
    )  # fmt: skip
    p.add_argument(
        "--seconds", type=_seconds, default=1.0, metavar="S",
        help="seconds per size, tensorwire and raw TCP (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--device", type=_device, default="cpu", help="where the tensors live: cpu, cuda or cuda:N (default cpu)"
    )
    p.add_argument("--transports", nargs="+", default=None, metavar="NAME", help=transports_help)
    p.add_argument(
        "--require", choices=("any", "rdma", "gpudirect"), default="any",
        help="fail unless the path gives this: rdma, bytes moved by RDMA; gpudirect, GPU memory moved by RDMA "
        "to and from the NIC (default any)",
    )  # fmt: skip
    p.add_argument("--token", type=_token, help="auth token for ADDRESS (default: $TENSORWIRE_TOKEN)")
    p.add_argument("--json", action="store_true", help="print only a JSON report on stdout")
    p = command("doctor", "what this machine offers and which path a connect would take")
    p.add_argument("--json", action="store_true", help="print only the report, as one JSON object, on stdout")
    p.add_argument(
        "address", nargs="?", type=_node_address, metavar="ADDRESS",
        help="also connect to the node at ADDRESS and show the path it negotiates",
    )  # fmt: skip
    p.add_argument("--token", type=_token, help="auth token for ADDRESS (default: $TENSORWIRE_TOKEN)")
    p = command("stage", "serve a pipeline stage; a driver links the stages and runs steps")
    p.add_argument(
        "--part", required=True, metavar="MODULE:FN",
        help="the stage's part: FN(rank, num_stages) from MODULE:FN or FILE.py:FN",
    )  # fmt: skip
    p.add_argument("--address", type=_address, default="127.0.0.1:0", metavar="HOST:PORT", help=here)
    p.add_argument("--token", type=_token, help="require this auth token (default: $TENSORWIRE_TOKEN)")
    p.add_argument("--transports", nargs="+", default=None, metavar="NAME", help=transports_help)
    p.add_argument("--no-offload", action="store_true", help="run the part on the event loop, not in a thread")
    p.add_argument("--metrics", type=_address, default=None, metavar="HOST:PORT", help=_METRICS_HELP)
    # the demo's second process: no command anyone types, so not one of the parser's (its
    # --help and its "invalid choice" message would list it)
    hidden = argparse.ArgumentParser(prog=f"tensorwire {_DEMO_PEER}")
    hidden.set_defaults(cmd=_DEMO_PEER)
    hidden.add_argument("address")
    hidden.add_argument("size_mib", type=int)
    for p in (sub.choices["serve"], sub.choices["stage"], hidden):
        p.add_argument(
            "--parent", type=_at_least(1), default=None, metavar="PID",
            help="exit (as on SIGTERM) when process PID, the one that started this one, exits, even by SIGKILL",
        )  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    args = hidden.parse_args(argv[1:]) if argv[:1] == [_DEMO_PEER] else parser.parse_args(argv)
    if args.cmd is None:  # (argparse's own "required: cmd" named no command)
        parser.error(f"choose a command: {', '.join(sub.choices)} (tensorwire --help says what each does)")
    # TENSORWIRE_TOKEN is read by the commands that take a token, and only by them
    if _uses_token(args) and args.token is None:
        args.token = os.environ.get("TENSORWIRE_TOKEN")
        if args.token == "":  # refused, never taken for "no token"
            parser.error("TENSORWIRE_TOKEN is empty: set a token in it, or unset it")
    return args


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:  # started with stdout closed (>&-): hold descriptor 1, so that no
        # socket or epoll descriptor of ours takes it and gets what native libraries print there
        with contextlib.suppress(OSError):
            fd = os.open(os.devnull, os.O_WRONLY)
            if fd != 1:
                os.dup2(fd, 1)
                os.close(fd)
    # a Ctrl-C or SIGTERM while the arguments are read (their types load _bench, _node and
    # gRPC) is taken once they say what runs, and ends the command as a later one would
    args = while_held(lambda: _parse_args(argv))
    if args is None:  # a second Ctrl-C meanwhile: at once
        return 130
    try:
        release_interrupts()
        # the command line is an application: it may configure logging (the library never does)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if getattr(args, "parent", None) is not None:
            _exit_with_parent(args.parent)
        if args.cmd == "demo":
            return _run_until_signal(_demo(args.size_mib, args.repeat))
        if args.cmd == "serve":
            return _ended(
                _run_until_signal(
                    _serve(args.address, args.echo, args.token, args.transports, args.bench, args.metrics)
                )
            )
        if args.cmd == "bench":
            report: list[dict[str, Any]] = []
            with _stdout_to_stderr() if args.json else contextlib.nullcontext():  # UCX writes to fd 1
                code = _run_until_signal(_bench(args, report))
            if report:
                print(json.dumps(report[0], indent=2))
            elif code == 128 + signal.SIGTERM:
                return _failed(args, "terminated (SIGTERM)", code=code)
            return code
        if args.cmd == "doctor":
            return _doctor(args.json, args.address, args.token)
        if args.cmd == "stage":
            return _ended(
                _run_until_signal(
                    _stage(args.address, args.part, args.token, args.transports, not args.no_offload, args.metrics)
                )
            )
        if args.cmd == _DEMO_PEER:
            return _run_until_signal(_demo_child(args.address, args.size_mib))
    except KeyboardInterrupt:
        return _failed(args, "interrupted (SIGINT)", code=130)
    except Terminated:  # while the command line loaded: as a later SIGTERM ends the command
        return _failed(args, "terminated (SIGTERM)", code=128 + signal.SIGTERM)
    except BrokenPipeError:  # stdout closed early (`tensorwire demo | head -1`): end as a SIGPIPE would
        _drop_stdout()
        return 128 + signal.SIGPIPE
    except TensorWireError as exc:
        return _failed(args, f"{type(exc).__name__}: {exc}", say="tensorwire")
    except _ChildFailed as exc:
        return _failed(args, str(exc), say=f"tensorwire {args.cmd}")
    except MemoryError:  # the demo's or bench's tensors do not fit in this machine's memory
        if args.cmd == "bench":
            from ._bench import fmt_size

            flag = "--sizes " + ",".join(fmt_size(n).replace(" ", "") for n in args.sizes)
        else:
            flag = f"--size-mib {getattr(args, 'size_mib', '?')}"
        return _failed(args, f"out of memory ({flag})", say=f"tensorwire {args.cmd}")
    return 2


def _ended(code: int) -> int:
    """A server (serve, stage) stopped by SIGTERM has closed its node and everything it held:
    end the process now, with ``code``, once stdout, stderr and logging are flushed. The
    interpreter's own shutdown (its garbage collection of torch's and gRPC's objects) took
    another 1.3-5.5 s of a torch stage's exit, and holds nothing of ours. Any other end
    returns ``code`` to the usual exit."""
    if code != 128 + signal.SIGTERM:
        return code
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or its reader gone
            if stream is not None:
                stream.flush()
    with contextlib.suppress(Exception):  # C stdio, which may hold native output (UCX's)
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


def _failed(args: argparse.Namespace, why: str, *, say: str | None = None, code: int = 1) -> int:
    """End a command that failed with ``code``: ``why`` goes to stderr after ``say`` (where
    given), and ``bench --json`` also puts it on stdout, as ``{"address": ..., "error": why}``:
    a script that parses stdout gets JSON either way (doctor's failed connect is its "error")."""
    if say is not None:
        print(f"{say}: {why}", file=sys.stderr)
    if args.cmd == "bench" and args.json:
        try:
            print(json.dumps({"address": args.address, "error": why}, indent=2), flush=True)
        except BrokenPipeError:
            _drop_stdout()
    return code


def _drop_stdout() -> None:
    """Stdout's reader is gone: let nothing at exit try to flush into the pipe again."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
