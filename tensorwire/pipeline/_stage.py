"""A stage server: one part of the model on one node, its neighbours reached through peers.

How stages find each other (the control plane does the introductions): every stage is a node
that serves the RPC methods in ``METHODS``. A driver that knows the stages' addresses, in
pipeline order, reserves each (``reserve``, which answers the stage's generation; a stage
running a call of its driver refuses, and the driver then lets go of the others before it has
taken any; a call of that driver waits to start on a reserved stage until the reservation is
taken, and is then refused, or let go), takes a newer generation for itself (the highest it was
told plus one, and a random token that breaks ties between drivers), and calls ``configure`` on
each with its rank, the address of the next stage, the node id of the previous one and that
generation. Configure takes the stage for that driver and builds its part (``build=``), for as
long as the build takes: loading a large model's weights may take minutes, and no deadline of
the driver's own covers it. Once every stage has answered, the driver calls ``link`` on each,
under its connect_timeout: stage s connects to stage s+1 (one peer per link, negotiated like
any other: ucx, tcp, ...), says hello on it with the generation, and waits for the hello of
stage s-1 with the same generation. So a stage that builds fast never waits out its
connect_timeout for a neighbour that is still building. A stage configures for one driver at a
time and refuses (or interrupts) a configure or link older than the newest configure it has
seen, so of two drivers that connect at once the newer one gets every stage and the older one
is refused, never a mixed chain.

After that the driver calls ``step`` on every stage at once; stage 0 gets the microbatches, the
last stage the targets, and activations and gradients flow between neighbours on tags of their
own (``tw.pipeline/<step>/f|b/<microbatch>``), so headers carry every shape and nothing waits for
a shape exchange. A stage that has run its backwards keeps its gradients and answers; only once
every stage has answered does the driver call ``commit`` on each, which steps the optimizer. A
step that fails or is cancelled on any stage therefore updates no stage.

A plan with no backward is a forward-only step (the driver's ``forward``): each microbatch goes
through ``Part.infer``, nothing is kept for a backward, the gradients and the pending update are
left alone, no commit follows, and the last stage answers with its outputs. Given targets too
(the driver's ``evaluate``), the last stage puts each microbatch through ``Part.infer_loss``
instead and answers with the losses.

A driver that dies while its commits are on their way leaves some stages updated and others
holding the finished step. The next driver settles that: each configure reports the finished
step the stage still held from the driver before (its *orphan*, kept with its gradients where
the part outlives configurations, ``part=``) and the last step it committed; a step that any
stage committed is then applied on every stage that holds it as an orphan (``settle``), and one
that no stage committed is dropped. Configure takes the stage from the old driver before it
reports, so no commit of the old driver can land after the report. A commit that reached a
stage lands even if its call is cut short (the driver's connection dropped), and is recorded.

A stage watches the connection of the driver that configured it (the driver names its session
in ``configure``): when it drops (``Pipeline.abort``, a driver that died) the stage drops its
links, as ``release`` would, keeps a finished step for the next driver to settle, and waits.

Failure: a stage whose link breaks (its neighbour died: PeerDisconnected from the transport or
the lease), whose own code raises, whose output cannot be sent, or whose step is cancelled sends
an abort to its neighbours on ``ABORT_TAG``. Every stage listens on that tag and on its links'
health while configured, cancels its step on an abort and passes it on, so every stage fails the
step promptly with an error that names the stage where it started. A failed step breaks the
stages (BrokenResourceError) until a driver configures them again.

The hellos and aborts are tensorwire's own messages, on tags in its reserved range (the metrics
call them "pipeline"), which the transports give message slots of their own. A neighbour may
hold ``Limits.max_unexpected`` unreceived activations from a stage, as the schedule model
allows; an abort in the user's share would wait behind them until that neighbour received one
(after the layer it computes, however long that takes), and a stage gives up sending an abort
after ``_ABORT_SEND_SECONDS``. Activations and gradients stay on string tags, in the user's
share, which ``Schedule.validate(max_unexpected=...)`` models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _metrics
from .._checks import check_arguments, check_bool
from .._loops import check_home, elsewhere
from .._peer import tag_id
from ..errors import (
    BrokenResourceError,
    BusyResourceError,
    ClosedResourceError,
    ConfigurationError,
    ConnectTimeout,
    DeadlineExceeded,
    PeerDisconnected,
    RemoteError,
    TensorWireError,
    UnsupportedTensorError,
    fresh,
)
from ..rpc import current_deadline
from ..rpc._protocol import describe
from ..tensors._device import Device, parse_device
from ._part import Part, as_part, check_loss
from ._schedule import Action, Kind

if TYPE_CHECKING:
    from .._node import Node
    from .._peer import Peer

log = logging.getLogger(__name__)

__all__ = ["ABORT_TAG", "HELLO_TAG", "METHODS", "Stage", "message_tag"]

# the stages' own messages: tensorwire's reserved tags (_peer.RESERVED_TAGS), between the RPC
# and the one-sided ranges, so that they take the slots kept for tensorwire's messages
_BASE = -0x7477_5354_0000_0000  # "twST"
ABORT_TAG = _BASE - 1  # {"origin", "reason", "step"}: a stage failed (module docstring)
HELLO_TAG = _BASE - 2  # {"generation", "key"}: the first message on a link, from the previous stage
_metrics.traffic_tags(range(HELLO_TAG, _BASE), "pipeline")
METHODS = (
    "tw.pipeline.generation",
    "tw.pipeline.reserve",
    "tw.pipeline.unreserve",
    "tw.pipeline.configure",
    "tw.pipeline.link",
    "tw.pipeline.step",
    "tw.pipeline.commit",
    "tw.pipeline.state",
    "tw.pipeline.release",
    "tw.pipeline.settle",
)
_ABORT_SEND_SECONDS = 2.0
_ABORT_REASON_BYTES = 16 * 1024  # the most of a failure's text an abort carries (``_abort_reason``)
_COMMIT_GRACE = 2.0  # how long a new configure waits for the old driver's commit of a finished step
# how long a reservation holds without its driver's configure: the driver sends that configure as
# soon as every stage has answered its reservation, so this only frees a stage whose driver
# hung between the two (one whose connection dropped frees it at once)
_RESERVE_SECONDS = 5.0
# a configure whose build waits behind a cancelled step's layer still running in the compute
# thread says so in the log every this many seconds; under a deadline it answers this long
# before the deadline (at most a quarter of what is left), so that its word, which names the
# layer, reaches the driver before the driver's own timer cuts the call short (0.2 s was too
# little for the answer's way back on a loaded machine: the caller got a bare TimeoutError)
_LEFTOVER_NOTICE_SECONDS = 10.0
_LEFTOVER_ANSWER_MARGIN = 0.5

_Ticket = tuple[int, str]  # (generation, driver token): which driver's configure, ordered


def message_tag(step: int, direction: str, microbatch: int) -> str:
    """The tag of one activation (``f``) or gradient (``b``) between two neighbours."""
    return f"tw.pipeline/{step}/{direction}/{microbatch}"


def ticket_key(generation: int, token: str) -> str:
    """How a driver names its configuration in ``step``, ``commit`` and ``release`` calls."""
    return f"{generation}/{token}"


def _loss_of(part: Part, x: Any, target: Any) -> float:
    """``part.infer_loss`` as a float (a Part of one's own may return a numpy or torch scalar)."""
    return float(part.infer_loss(x, target))


def _abort_reason(reason: str, max_header_bytes: int) -> str:
    """``reason`` as an abort carries it to a neighbour that takes headers of at most
    ``max_header_bytes``: as it is where it fits with room to spare, else its start and its end
    in ASCII, within that room. (A part's error message went whole: one past the neighbour's
    limit failed the abort's send, which nobody heard, and the neighbours waited for the
    driver's abort_grace.)"""
    room = max(256, min(_ABORT_REASON_BYTES, max_header_bytes // 2 - 256))  # the rest: the abort's own
    if len(reason.encode("utf-8", "surrogatepass")) <= room:
        return reason
    text = reason.encode("ascii", "backslashreplace").decode("ascii")
    half = (room - 64) // 2
    return f"{text[:half]} ... ({len(reason)} characters in all) ... {text[-half:]}"


async def close_all(peers: list[Peer]) -> None:
    """Close ``peers`` together; one that fails to close says so in its own log, not here."""
    await asyncio.gather(*[peer.aclose() for peer in peers], return_exceptions=True)


def _receive_on(part: Part | None) -> Device | None:
    """Where a stage receives its part's activations and gradients: on the part's CUDA device
    (``Part.device``). Without ``device=`` a recv allocates on the event loop thread's current
    device (cuda:0), not the one the part's compute thread computes on, so a stage on cuda:1
    would hold memory and a CUDA context on GPU 0 and copy every message across. None (the
    sender's memory kind) for a part on the host or on a device a recv cannot allocate on
    (torch's mps, say): the part moves what arrives, as before."""
    device = getattr(part, "device", None)
    if device is None:
        return None
    try:
        want = parse_device(device)
    except ConfigurationError:
        return None
    return want if want is not None and want.kind == "cuda" else None


@dataclass(slots=True)
class _Link:
    rank: int  # the neighbour's rank
    peer: Peer
    address: str  # the neighbour's node, as the driver knows it
    watcher: asyncio.Task[None] | None = None
    # the last send to this neighbour: (done once it has called Peer.send, its tag); the next send
    # enters the channel only after it (_send_later)
    last_send: tuple[asyncio.Future[None], str] | None = None

    def __str__(self) -> str:
        return f"stage {self.rank} ({self.address})"


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a driver's configure told the stage to link to, kept for that driver's ``link``."""

    ticket: _Ticket
    prev_instance: str | None  # the previous stage's Node.instance_id (node ids may repeat)
    next_address: str | None
    transports: list[str] | None
    connect_seconds: float
    prev_address: str | None


@check_arguments
class Stage:
    """Serve one pipeline stage on ``node``.

    ``part`` is what the stage computes: a torch ``nn.Module`` (with ``optimizer=`` and, on the
    last stage, ``loss=``), an object with ``forward``/``backward`` (``FunctionPart``), or a
    ``Part``. ``build(rank, num_stages) -> Part`` instead makes the part once the driver has said
    which rank this stage is, on every configure; it may take as long as it needs (the driver's
    ``connect_timeout`` bounds the linking that follows, not the build). ``offload`` runs compute
    (the build included) in a worker thread, so the event loop keeps moving other microbatches'
    bytes (and answering leases) while a layer computes.

    One stage per node. ``async with Stage(node, part):`` serves until the block ends; the stage
    never closes the node.
    """

    def __init__(
        self,
        node: Node,
        part: Any = None,
        *,
        build: Callable[[int, int], Any] | None = None,
        optimizer: Any = None,
        loss: Callable[..., Any] | None = None,
        offload: bool = True,
    ) -> None:
        if (part is None) == (build is None):
            raise ConfigurationError("give a Stage either part= or build=, not both or neither")
        if build is not None and not callable(build):  # (it failed at the driver's connect, as a TypeError)
            raise ConfigurationError(f"build= is a function build(rank, num_stages) -> part, not {build!r}")
        check_loss(loss)
        offload = check_bool("offload", offload)
        self.node = node
        self._build = build
        self._options = {"optimizer": optimizer, "loss": loss}
        self.part: Part | None = None if part is None else as_part(part, optimizer=optimizer, loss=loss)
        self.offload = offload
        self.rank = -1
        self.num_stages = 0
        self.prev: _Link | None = None
        self.next: _Link | None = None
        self._broken: TensorWireError | None = None
        self._task: asyncio.Task[dict[str, Any]] | None = None
        self._sends: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._cpu = 0.0
        # which driver's configure the stage is in: a stale driver's calls are refused
        self._ticket: _Ticket = (0, "")
        self._newest: _Ticket = (0, "")  # the newest configure seen; older ones are refused
        self._configuring: asyncio.Task[dict[str, Any]] | None = None  # a configure's build, or a link
        self._plan: _Plan | None = None  # a finished configure, waiting for its driver's link
        self._driver_watch: asyncio.Task[None] | None = None  # ends when the driver's connection does
        try:  # the loop the stage serves on (Stage.abort from another thread hands itself to it)
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._config_lock = asyncio.Lock()
        # drivers' reservations (by token) not yet taken by their configure, each with the timer
        # that lets it lapse: a call of the current driver waits to start while any is held
        self._reservations: dict[str, asyncio.TimerHandle | None] = {}
        self._unreserved = asyncio.Event()  # set while no reservation is held
        self._unreserved.set()
        self._starting = 0  # calls of the current driver waiting for the reservations to go
        self._running: int | None = None  # the step that self._task runs
        self._failed_at: Action | None = None  # the action whose part code raised in this step
        self._settled = asyncio.Event()  # no finished step waits for its commit (see _pending)
        self._applying: asyncio.Task[dict[str, float]] | None = None  # a commit's optimizer step under way
        self._pending = None  # a finished step whose update waits for the driver's commit
        # a finished step of an earlier driver that never committed it here, as (its key, step):
        # its gradients are still in the part until the next step; the new driver settles it
        self._orphan: tuple[str, int] | None = None
        self._last_commit: tuple[str, int] | None = None  # (driver key, step) last applied here
        # one thread runs all of this stage's code (build included; the loop's own thread when not
        # offloading), so thread-local settings such as torch.set_num_threads hold for all of it
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tw-stage")
        # what that thread runs now, and since when (time.monotonic()): a cancelled step leaves
        # its layer running there, and whatever is queued next (a rebuild) waits behind it
        self._in_thread: tuple[str, float] | None = None
        registry = node.methods
        if any(name in registry for name in METHODS):
            raise BusyResourceError(f"node {node.address} already serves a pipeline stage")
        node.method("tw.pipeline.generation")(self._generation)
        node.method("tw.pipeline.reserve")(self._reserve)
        node.method("tw.pipeline.unreserve")(self._unreserve)
        node.method("tw.pipeline.configure")(self._configure)
        node.method("tw.pipeline.link")(self._link_call)
        node.method("tw.pipeline.step")(self._step)
        node.method("tw.pipeline.commit")(self._commit)
        node.method("tw.pipeline.state")(self._state)
        node.method("tw.pipeline.release")(self._release)
        node.method("tw.pipeline.settle")(self._settle)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "ready" if self.rank >= 0 else "waiting"
        return f"<Stage {self.rank}/{self.num_stages} at {self.node.address} {state}>"

    @property
    def links(self) -> list[_Link]:
        """The links to the neighbouring stages this stage has (none, one or two)."""
        return [link for link in (self.prev, self.next) if link is not None]

    # -- configure ------------------------------------------------------------------------------
    async def _generation(self) -> int:
        """The newest generation a driver has configured (or begun to configure) this stage with.
        A connecting driver asks ``_reserve`` instead, which answers the same; this stays for
        drivers that ask without reserving. A stage running a step refuses here too, as there."""
        self._check_busy()
        return self._newest[0]

    def _check_busy(self) -> None:
        """Refuse a driver that would take this stage while a call of its driver runs here (or
        waits to start). In a forward (or evaluation) the upstream stages finish their part
        while the downstream ones still run it, so the connecting driver asks every stage this
        before it takes any: taken, those upstream stages had dropped their links, which broke
        the running call although the takeover failed."""
        self._check_open()
        if self._task is not None or self._starting:
            what = f"running step {self._running}" if self._task is not None else "starting a call"
            raise BusyResourceError(
                f"stage {self.rank} at {self.node.address} is {what} of its driver: "
                "no other driver can take the stages over until that has finished (connect again then)"
            )

    async def _reserve(self, token: str, driver_session: str | None = None) -> int:
        """The first half of a driver's takeover: hold this stage for the driver ``token``
        until its configure takes it; the newest generation configured here (as
        ``_generation``).

        A driver takes the stages only once every one has granted its reservation, and a call
        of the stages' current driver (a step, forward or evaluation) waits to start on a
        reserved stage until the reservation is taken (the call is then refused) or let go.
        A stage where such a call runs, or waits to start, refuses. So of a connect and a call
        that race, exactly one wins: the connect reserved every stage before the call reached
        any, or the call reached one first and the connect is refused before it takes any
        stage. (A connect that asked only for the generations took the stages one by one, and
        a call that started in between reached some stages before the configure and others
        after: both failed, and the stages stayed broken.) Reservations of several connecting
        drivers do not exclude each other: their configures settle which one wins, by
        generation, as before. A reservation lapses after ``_RESERVE_SECONDS`` without its
        configure, or when its driver's connection drops, so a driver that went away between
        the two halves holds no call up for long."""
        self._check_busy()
        loop = asyncio.get_running_loop()
        old = self._reservations.get(token)
        if old is not None:
            old.cancel()
        self._reservations[token] = loop.call_later(_RESERVE_SECONDS, self._let_go, token)
        self._unreserved.clear()
        newest = self._newest[0]  # (as granted, before the wait below)
        driver = await self.node._session_peer_soon(driver_session) if driver_session is not None else None
        if driver is not None:
            driver.channel.add_close_callback(lambda _exc: self._let_go(token))
            if driver.closed:
                self._let_go(token)
        return newest

    async def _unreserve(self, token: str) -> None:
        """The driver ``token`` gives up its takeover (another stage refused it): its waiting
        calls may start. A reservation already taken or lapsed is no matter."""
        self._let_go(token)

    def _let_go(self, token: str) -> None:
        timer = self._reservations.pop(token, None)
        if timer is not None:
            timer.cancel()
        if not self._reservations:
            self._unreserved.set()

    def _hold_for_configure(self, token: str) -> None:
        """The driver's configure has come: its reservation no longer lapses by time. It holds
        until that configure takes the stage or is refused (``_let_go``)."""
        timer = self._reservations.get(token)
        if timer is not None:
            timer.cancel()
            self._reservations[token] = None

    async def _configure(
        self,
        rank: int,
        num_stages: int,
        prev_instance: str | None,
        next_address: str | None,
        transports: list[str] | None = None,
        connect_seconds: float = 10.0,
        prev_address: str | None = None,
        *,
        generation: int,
        token: str,
        driver_session: str | None = None,
    ) -> dict[str, Any]:
        self._check_open()
        self._loop = asyncio.get_running_loop()
        if not 0 <= rank < num_stages:
            raise ConfigurationError(f"rank {rank} is not in 0..{num_stages - 1}")
        if prev_instance is not None and prev_instance == self.node.instance_id:  # (node ids may repeat)
            raise ConfigurationError(
                f"stage {rank} at {self.node.address} would be its own previous stage: "
                "the driver named this node twice in a row"
            )
        ticket = (generation, token)
        self._hold_for_configure(token)  # (a driver that reserved this stage; older ones did not)
        try:
            self._refuse_older(ticket)
            self._newest = ticket
            if self._configuring is not None:  # an older driver's configure, still linking: it loses
                self._configuring.cancel()
            async with self._config_lock:  # one configure at a time; a newer one may have come meanwhile
                self._check_open()
                self._refuse_older(ticket, waited=True)
                if self._task is not None:
                    raise BusyResourceError(f"stage {self.rank} is running a step; a driver cannot reconfigure it now")
                if self._pending is not None:
                    # a finished step waits for its driver's commit, which comes at once from a live
                    # driver: give it that long, so that a step is never applied on some stages only
                    await self._wait_for_commit()
                    self._check_open()
                    self._refuse_older(ticket, waited=True)
                    if self._task is not None:
                        raise BusyResourceError(
                            f"stage {self.rank} is running a step; a driver cannot reconfigure it now"
                        )
                if self._applying is not None and not self._applying.done():
                    # a commit that landed is recorded as applied only once its optimizer step ends:
                    # report it as applied, or the new driver drops that step on the other stages
                    await asyncio.wait([self._applying])
                    self._check_open()
                    self._refuse_older(ticket, waited=True)
                    if self._task is not None or self._pending is not None:
                        raise BusyResourceError(
                            f"stage {self.rank} is running a step or waits for its commit; "
                            "a driver cannot reconfigure it now"
                        )
                # from here the old driver's calls are refused (nothing awaits before this)
                if self._pending is not None:
                    # never committed here; perhaps on other stages, before that driver went away.
                    # A part built afresh (build=) drops it; one that lives on keeps it to be settled
                    self._orphan = None if self._build is not None else (ticket_key(*self._ticket), self._pending)
                elif self._build is not None:
                    self._orphan = None
                self._ticket = ticket
                # taken: a call of the old driver waiting for this reservation is refused now, not
                # once the build is done
                self._let_go(token)
                plan = _Plan(ticket, prev_instance, next_address, transports, connect_seconds, prev_address)
                task = asyncio.get_running_loop().create_task(self._prepare(plan, rank, num_stages, driver_session))
                return await self._configure_by(task, rank)
        finally:
            self._let_go(token)  # refused (one that took the stage let go of it above)

    async def _link_call(self, *, generation: int, token: str) -> dict[str, Any]:
        """The second half of a driver's configure, once every stage has built its part: link
        to the neighbours its configure named, within the connect_seconds it gave."""
        self._check_open()
        ticket = (generation, token)
        self._refuse_older(ticket, waited=True)
        async with self._config_lock:
            self._check_open()
            self._refuse_older(ticket, waited=True)
            plan, self._plan = self._plan, None
            if plan is None or plan.ticket != ticket or self._ticket != ticket:
                why = f": {self._broken}" if self._broken is not None else ""
                raise BrokenResourceError(
                    f"stage at {self.node.address} has no finished configure of this driver to link{why}"
                )
            task = asyncio.get_running_loop().create_task(self._link(plan))
            return await self._configure_by(task, self.rank)

    async def _configure_by(self, task: asyncio.Task[dict[str, Any]], rank: int) -> dict[str, Any]:
        """Await ``task``, a configure's build or its link (held under the config lock), as the
        configure under way that a newer driver or a close interrupts. Cut short or failed, it
        leaves the stage broken until the next configure, and no plan to link."""
        self._configuring = task
        try:
            return await task
        except asyncio.CancelledError:
            self._plan = None
            me = asyncio.current_task()
            self._broken = BrokenResourceError(f"stage at {self.node.address}: its configure was interrupted")
            if me is not None and me.cancelling():
                raise  # our caller gave up
            if self._closed:
                raise ClosedResourceError(
                    f"stage {rank} at {self.node.address} was closed (Stage.aclose or abort) while a driver "
                    "configured it"
                ) from None
            raise BrokenResourceError(
                f"stage at {self.node.address}: a newer driver configured it while this one was configuring it"
            ) from None
        except BaseException as exc:
            self._plan = None
            self._broken = BrokenResourceError(f"stage at {self.node.address}: its configure failed: {describe(exc)}")
            raise
        finally:
            self._configuring = None

    @property
    def _pending(self) -> int | None:
        return self._pending_step

    @_pending.setter
    def _pending(self, step: int | None) -> None:
        self._pending_step = step
        if step is None:
            self._settled.set()
        else:
            self._settled.clear()

    async def _wait_for_commit(self) -> None:
        """Until the pending step is committed (or dropped), for at most _COMMIT_GRACE seconds;
        a driver that died between its stages' answers and its commits never sends them."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_COMMIT_GRACE):
                await self._settled.wait()
        if self._pending is not None:
            log.warning(
                "stage %d: step %d was never committed by its driver; a new driver discards it "
                "(if the old driver died while committing, other stages may have applied it)",
                self.rank,
                self._pending,
            )

    def _refuse_older(self, ticket: _Ticket, *, waited: bool = False) -> None:
        if ticket < self._newest or (ticket == self._newest and not waited):
            raise BrokenResourceError(
                f"stage at {self.node.address} has been configured by a newer driver "
                f"(generation {self._newest[0]}; this driver's is {ticket[0]})"
            )

    async def _prepare(self, plan: _Plan, rank: int, num_stages: int, driver_session: str | None) -> dict[str, Any]:
        """Take the new rank and build the part, for as long as the build takes; what the
        driver needs to know of this stage. The links come with the driver's ``link``, once
        every stage has built."""
        if self._driver_watch is not None:
            self._driver_watch.cancel()
            self._driver_watch = None
        await self._drop_links()
        self._plan = None
        self.rank, self.num_stages, self._pending = rank, num_stages, None
        # what a step that came now would be told (a driver steps only once every stage linked)
        self._broken = BrokenResourceError(
            f"stage {rank} at {self.node.address} is not linked yet: its driver links it next"
        )
        if self._build is not None:
            # the old part goes before the new one is built: a rebuilt model's two copies (its
            # weights, its optimizer state) would otherwise be in memory together
            self.part = None
            await self._wait_for_leftover(rank)
            built, _ = await self._compute(self._build, rank, num_stages, label="its build")
            self.part = as_part(built, **self._options)
        assert self.part is not None
        # from here the stage waits for this driver's link: a driver that goes away meanwhile
        # (or later) leaves it to wait for the next driver
        driver = self.node._session_peer(driver_session) if driver_session is not None else None
        if driver is not None:
            self._driver_watch = asyncio.get_running_loop().create_task(
                self._watch_driver(driver, plan.ticket), name=f"tw.pipeline watch driver {driver.remote_address}"
            )
        self._plan = plan
        step = self.node.methods.get("tw.pipeline.step")
        return {
            "rank": rank,
            "generation": plan.ticket[0],
            "max_unexpected": self.node.config.limits.max_unexpected,
            # a last stage without a loss serves Pipeline.forward only; the driver's step says so
            "has_loss": self.part.has_loss,
            # stage 0's part takes a dict batch as keyword arguments: the driver checks its keys
            "keyword_dicts": self.part.keyword_dicts,
            # the most tensor bytes one step call may carry here (the node's CallLimits)
            "max_arg_bytes": None if step is None else self.node.methods.arg_limit(step),
            # for the driver to settle a step an earlier driver committed on some stages only
            "orphan": list(self._orphan) if self._orphan is not None else None,
            "committed": list(self._last_commit) if self._last_commit is not None else None,
        }

    async def _wait_for_leftover(self, rank: int) -> None:
        """Until the compute thread is free. A step cancelled while its layer computed (its
        caller gave up, a neighbour failed) leaves that layer running in the thread, which no
        one can stop, and the build waits behind it. That wait is never silent: the log names
        the layer now and then, and under the configure's deadline (build_timeout, the
        caller's ``tensorwire.rpc.deadline``) the stage answers just before it runs out with a
        DeadlineExceeded that names the layer, rather than leaving the driver a bare timeout."""
        if self._in_thread is None:
            return
        loop = asyncio.get_running_loop()
        left = current_deadline()
        give_up = None if left is None else loop.time() + left - min(_LEFTOVER_ANSWER_MARGIN, left / 4)
        notice = 0.0
        while (busy := self._in_thread) is not None:
            what, since = busy
            ran = time.monotonic() - since
            if give_up is not None and loop.time() >= give_up:
                raise DeadlineExceeded(
                    f"its build could not start within this configure's deadline: a cancelled step's layer "
                    f"({what}) is still running in the stage's compute thread (for {ran:.1f} s), and the build "
                    "waits for it. Connect again once that layer has returned, with a longer deadline, or "
                    "restart the stage if it never returns"
                )
            if ran >= notice:
                log.warning(
                    "stage %d: a cancelled step's layer (%s) is still running (for %.1f s); "
                    "the build of this configure waits for it",
                    rank,
                    what,
                    ran,
                )
                notice = ran + _LEFTOVER_NOTICE_SECONDS
            await asyncio.sleep(0.02)

    async def _link(self, plan: _Plan) -> dict[str, Any]:
        """Link to both neighbours for this generation, within ``plan.connect_seconds``; the
        links' paths."""
        rank, next_address, prev_instance = self.rank, plan.next_address, plan.prev_instance
        transports, connect_seconds, ticket = plan.transports, plan.connect_seconds, plan.ticket
        key = ticket_key(*ticket)
        try:
            async with asyncio.timeout(connect_seconds):
                if next_address is not None:
                    peer = await self.node.connect(next_address, transports=tuple(transports) if transports else None)
                    if peer.remote_instance == self.node.instance_id:  # (node ids may repeat)
                        await peer.aclose()
                        raise ConfigurationError(
                            f"stage {rank} at {self.node.address} would be its own next stage "
                            f"({next_address}): the driver named this node twice in a row"
                        )
                    self.next = _Link(rank + 1, peer, next_address)
                    await peer._send_own({"generation": ticket[0], "key": key}, tag=HELLO_TAG)
                if prev_instance is not None:
                    peer = await self._wait_for(prev_instance, key, plan.prev_address)
                    self.prev = _Link(rank - 1, peer, plan.prev_address or peer.remote_address)
        except BaseException as exc:
            waiting = (
                f"connecting to the next stage at {next_address}"
                if self.next is None and next_address is not None
                else "waiting for the previous stage to connect"
            )
            # cut short (a timeout, the driver's caller gave up, a newer driver came): a link
            # made so far would hold its connection until the next configure
            await asyncio.shield(self._drop_links())
            if isinstance(exc, TimeoutError):
                raise ConnectTimeout(f"stage {rank}: linking took longer than {connect_seconds} s, {waiting}") from None
            raise
        self._broken = None
        for link in self.links:
            link.watcher = asyncio.get_running_loop().create_task(self._watch(link), name=f"tw.pipeline watch {link}")
        log.info("stage %d/%d at %s: prev %s, next %s", rank, self.num_stages, self.node.address, self.prev, self.next)
        return {
            "prev_path": str(self.prev.peer.path) if self.prev else None,
            "next_path": str(self.next.peer.path) if self.next else None,
        }

    async def _wait_for(self, instance: str, key: str, address: str | None = None) -> Peer:
        """The peer on which the previous stage (its ``Node.instance_id``), configured by the same
        driver (``key``), said hello (it connects; this side accepts). Other peers from that node
        never say this hello: a driver on the same node says none, an older configure's link one
        with another key. ``address``: that stage's, as the driver named it, for the errors (its
        connection's own remote address is the port it dialled from)."""
        loop = asyncio.get_running_loop()
        hellos: dict[Peer, asyncio.Task[Any]] = {}
        # the peers from that node that came meanwhile, as they came: the previous stage may link
        # and close before a poll of the node's peers sees it (its hello stays deliverable), and
        # the stage waited out its connect_timeout for a hello that had come and gone
        came: list[Peer] = []
        try:
            with self.node._watch_adopted(came.append):
                while True:
                    for peer in [*(p for p in self.node.peers if not p.closed), *came]:
                        if peer.remote_instance == instance and peer not in hellos:
                            hellos[peer] = loop.create_task(peer._recv_own(tag=HELLO_TAG))
                    for peer, task in list(hellos.items()):
                        if task.done() and not task.cancelled() and task.exception() is None:
                            hello = task.result()
                            if isinstance(hello, dict) and hello.get("key") == key:
                                if peer.closed:
                                    raise PeerDisconnected(
                                        f"stage {self.rank}: the previous stage ({address or peer.remote_address}) "
                                        "closed its link as it was made"
                                    )
                                return peer
                            if not peer.closed:  # an older configure's hello, left unread: listen on
                                hellos[peer] = loop.create_task(peer._recv_own(tag=HELLO_TAG))
                    await asyncio.sleep(0.005)
        finally:
            for task in hellos.values():
                task.cancel()
            await asyncio.gather(*hellos.values(), return_exceptions=True)

    async def _watch_driver(self, driver: Peer, ticket: _Ticket) -> None:
        """Until the connection of the driver that configured this stage drops (an aborted
        pipeline, or a driver that died): then drop the links, as its release would have, and
        wait for the next driver. A step of that driver still holding its commit keeps it (the
        next driver settles it); a step under way is cut short first (the connection's calls
        are cancelled with it)."""
        gone = asyncio.get_running_loop().create_future()

        def ended(_exc: BaseException | None) -> None:
            if not gone.done():
                gone.set_result(None)

        driver.channel.add_close_callback(ended)
        if driver.closed:
            ended(None)
        await gone
        if self._ticket != ticket or self._closed:
            return
        if self._task is not None:
            await asyncio.wait([self._task])
        if self._ticket != ticket or self._closed or self._configuring is not None:
            return  # a newer driver is configuring the stage: its configure drops the links
        log.info("stage %d: its driver's connection dropped; the stage waits for the next driver", self.rank)
        self.rank, self._plan = -1, None
        self._driver_watch = None
        await self._drop_links()

    async def _drop_links(self) -> None:
        """Forget the links and close their connections, every one, to the end even if the
        caller is cancelled meanwhile (a configure cut short): the links are forgotten at once,
        so one left unclosed stayed open until the node closed."""
        links, self.prev, self.next = self.links, None, None
        for link in links:
            if link.watcher is not None:
                link.watcher.cancel()
        if links:
            await asyncio.shield(self.node._retire(close_all([link.peer for link in links])))

    # -- failure --------------------------------------------------------------------------------
    async def _watch(self, link: _Link) -> None:
        """Wait for an abort from ``link`` or for the link to break; either fails this stage."""
        try:
            msg = await link.peer._recv_own(tag=ABORT_TAG)
        except TensorWireError as exc:
            if link in self.links and not self._closed:
                error = self._link_broke(link, exc)
                self._fail(error, self.rank, str(error), skip=link)
            return
        origin, reason, step = int(msg["origin"]), str(msg["reason"]), msg.get("step")
        aborted = BrokenResourceError(f"stage {self.rank}: aborted because {reason}")
        self._fail(aborted, origin, reason, skip=link, step=step if isinstance(step, int) else None)

    def _fail(
        self, error: TensorWireError, origin: int, reason: str, *, skip: _Link | None = None, step: int | None = None
    ) -> None:
        """Break this stage (once), cancel its step and pass ``reason`` to the other neighbours.
        ``step``: the step whose call this failure fails on some stage (by default the one
        running here, if any), which the driver therefore never commits; it goes with the abort,
        and a stage that had finished that step drops it, so that the next driver's configure
        does not wait for its commit."""
        if step is None and self._task is not None and not self._task.done():
            step = self._running
        if step is not None and step == self._pending:
            self._pending = None  # (even where this stage is broken already)
        if self._broken is not None:
            return
        # kept as a copy without a traceback, and raised as fresh copies of it: the error raised
        # in place took the frames of each step that raised it into its traceback (and so did
        # its cause's), and kept through them the peer of a neighbour or a driver that had gone,
        # with its channel, until the next configure (for good if none came)
        self._broken = fresh(error)
        log.warning("%s", error)
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for task in list(self._sends):
            task.cancel()
        for link in self.links:
            if link is not skip and not link.peer.closed:
                self._spawn(self._send_abort(link, origin, reason, step))

    def _link_broke(self, link: _Link, exc: BaseException) -> PeerDisconnected:
        return PeerDisconnected(f"stage {self.rank}: its link to {link} broke: {type(exc).__name__}: {exc}")

    def _unsendable(self, what: str, exc: Exception) -> TensorWireError:
        """This stage's own output cannot be sent (not a tensor, a layout the wire cannot carry,
        past the neighbour's message limits: MessageRefused): the link is fine, the message is at
        fault. Wrapped in the error tree, its type kept where it is one of ours, the original kept."""
        message = f"stage {self.rank} cannot send {what}: {type(exc).__name__}: {describe(exc)}"
        error: TensorWireError
        if isinstance(exc, TensorWireError) and not isinstance(exc, RemoteError):
            error = type(exc)(message)
        else:
            error = UnsupportedTensorError(message)
        error.__cause__ = exc
        return error

    async def _send_abort(self, link: _Link, origin: int, reason: str, step: int | None) -> None:
        reason = _abort_reason(reason, link.peer.channel.remote_limits.max_header_bytes)
        with contextlib.suppress(TensorWireError, TimeoutError):
            async with asyncio.timeout(_ABORT_SEND_SECONDS):
                await link.peer._send_own({"origin": origin, "reason": reason, "step": step}, tag=ABORT_TAG)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- one step -------------------------------------------------------------------------------
    async def _step(
        self,
        generation: str,
        step: int,
        actions: str,
        inputs: list[Any] | None = None,
        targets: list[Any] | None = None,
        weights: list[float] | None = None,
    ) -> dict[str, Any]:
        self._check_open()
        if self._ticket[0] > 0:
            # a driver another one has replaced is told so, before what the stage does now: a
            # takeover whose connect was cut short after its configures leaves the stage waiting
            # for the next driver (rank -1), and the replaced driver read ClosedResourceError
            # "has not been configured by a driver", which it had been, by that driver
            self._check_generation(generation)
        if self.rank < 0 or self.part is None:
            raise ClosedResourceError(f"stage at {self.node.address} has not been configured by a driver")
        self._check_generation(generation)
        if self._reservations:
            await self._wait_unreserved(generation)
        if self._task is not None:
            if self._running is None or step <= self._running:
                raise BusyResourceError(f"stage {self.rank} is already running a step")
            # a driver runs one step at a time: a later one means it gave up on this one (its
            # cancellation is still on its way here)
            error = BrokenResourceError(f"stage {self.rank}: step {self._running} was cancelled by its caller")
            self._fail(error, self.rank, str(error), step=self._running)
        if self._broken is not None:
            raise BrokenResourceError(
                f"stage {self.rank} is broken by an earlier failure (Pipeline.connect again to configure the "
                f"stages afresh): {self._broken}"
            )
        plan = [Action.parse(tok) for tok in actions.split()]
        self._failed_at = None
        task = asyncio.get_running_loop().create_task(self._run(step, plan, inputs, targets, weights))
        self._task, self._running = task, step
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if self._broken is not None and (me is None or me.cancelling() == 0):
                # an abort cancelled the step, not our caller
                broken = fresh(self._broken)
                raise broken from broken.__cause__
            error = BrokenResourceError(f"stage {self.rank}: step {step} was cancelled by its caller")
            self._fail(error, self.rank, str(error), step=step)
            raise
        except TensorWireError as exc:
            self._name_the_microbatch(exc, step)
            self._fail(exc, self.rank, str(exc), step=step)
            raise
        except GeneratorExit:
            raise  # this coroutine closed unfinished (its loop gone): nothing to abort, no loop to do it
        except BaseException as exc:
            # the part's own exception, an Exception or not (a BaseException of its own, which
            # sent no abort and left this stage unbroken); its str() may raise, which must not
            # stop the abort below
            where = self._name_the_microbatch(exc, step)
            reason = f"stage {self.rank} raised {type(exc).__name__} in {where}: {describe(exc)}"
            self._fail(BrokenResourceError(reason), self.rank, reason, step=step)
            raise
        finally:
            self._task = self._running = None
            for t in list(self._sends):
                t.cancel()

    async def _wait_unreserved(self, generation: str) -> None:
        """A connecting driver has reserved this stage (``_reserve``): wait until its configure
        takes the stage, which refuses this call, or the reservation goes (that driver was
        refused elsewhere, or went away), and the call starts as if nothing had happened."""
        self._starting += 1
        try:
            while self._reservations and not self._closed:
                await self._unreserved.wait()
        finally:
            self._starting -= 1
        self._check_open()
        if generation != ticket_key(*self._ticket):
            raise BrokenResourceError(
                f"stage at {self.node.address}: another driver took the stages over as this call reached "
                "the stage (its Pipeline.connect had reserved them first): this pipeline's stages now serve "
                "that driver; Pipeline.connect again to use them"
            )
        if self.rank < 0 or self.part is None:
            raise ClosedResourceError(f"stage at {self.node.address} has not been configured by a driver")

    def _name_the_microbatch(self, exc: BaseException, step: int) -> str:
        """Where in ``step`` the part's code raised ``exc`` ("step 3, at F2: the forward of
        microbatch 2"); said in a note too, which travels with the error's traceback."""
        at = self._failed_at
        if at is None:  # not the part's code for one microbatch
            return f"step {step}"
        what = "forward" if at.kind is Kind.FORWARD else "backward"
        where = f"step {step}, at {at}: the {what} of microbatch {at.microbatch}"
        # an error that takes no note (a frozen dataclass; __notes__ that is not a list) raised
        # here, in _step's except clause, instead of the part's error: no abort was sent
        with contextlib.suppress(Exception):
            exc.add_note(f"pipeline stage {self.rank} raised this in {where}")
        return where

    async def _part_code(self, action: Action, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """The part's code for ``action`` (``_compute``); an error it raises names the action."""
        try:
            return await self._compute(fn, *args, label=self._layer(action))
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException:
            self._failed_at = action
            raise

    def _layer(self, action: Action) -> str:
        """The part's code for ``action`` of the running step, in words."""
        what = "forward" if action.kind is Kind.FORWARD else "backward"
        return f"step {self._running}, at {action}: the {what} of microbatch {action.microbatch}"

    async def _compute(self, fn: Callable[..., Any], *args: Any, label: str | None = None) -> tuple[Any, float]:
        """Run ``fn`` (in a worker thread when offloading); (its result, wall seconds). The CPU
        seconds of the thread go to ``self._cpu``. ``label`` says what ``fn`` is, for as long as
        it runs (``_in_thread``)."""

        def timed() -> tuple[Any, float]:
            self._in_thread = (label or str(getattr(fn, "__name__", "the part's code")), time.monotonic())
            try:
                c0, t0 = time.thread_time(), time.perf_counter()
                out = fn(*args)
                self._cpu += time.thread_time() - c0
                return out, time.perf_counter() - t0
            finally:
                self._in_thread = None

        return await asyncio.get_running_loop().run_in_executor(self._executor, timed) if self.offload else timed()

    async def _recv(self, link: _Link | None, tag: str) -> Any:
        if link is None:
            raise BrokenResourceError(f"stage {self.rank}: its links were dropped (a driver is configuring it)")
        try:
            return await link.peer.recv(tag=tag, device=_receive_on(self.part))
        except TensorWireError as exc:
            if link.peer.closed or isinstance(exc, (PeerDisconnected, RemoteError)):
                raise self._link_broke(link, exc) from exc
            # the link is fine, the message has no place here: no memory for it on the part's
            # device, or a device this process cannot reach (its type kept, and the message queued)
            raise type(exc)(f"stage {self.rank} cannot receive from {link}: {describe(exc)}") from exc

    def _send_later(self, link: _Link | None, obj: Any, tag: str, what: str) -> None:
        """Send without waiting, so the next microbatch computes while this one moves. A send
        that fails fails the step at once: as a broken link when the link failed, as this
        stage's own error (and every neighbour told) when the message cannot be sent. The link
        failed where it is closed, where the neighbour's node said goodbye (``remote_closing``:
        its close reaches the data connection later, and a send to it raises PeerDisconnected
        meanwhile), or where the send says the peer is gone (PeerDisconnected), as ``_recv``
        takes it. Any other error can leave the link open (the neighbour's limits refused the
        message: MessageRefused), and then that neighbour, which waits for this message, must
        be told too."""
        if link is None:
            raise BrokenResourceError(f"stage {self.rank}: its links were dropped (a driver is configuring it)")

        loop = asyncio.get_running_loop()
        ahead, called = link.last_send, loop.create_future()
        link.last_send = (called, tag)

        async def send() -> None:
            # messages enter the link in the order the stage sends them, as Schedule.validate
            # counts the receiver's message slots. A peer keeps that order per tag only: a
            # message packed in a copy thread (a large strided array) was overtaken by the next
            # microbatch's, which took the receiver's last slot while it waited for this one, for
            # good. Each send waits until the one before it has entered the channel (not until
            # its bytes have gone: a receiver may take a later message first)
            try:
                if ahead is not None:
                    await ahead[0]
                    packing = link.peer._packing.get(tag_id(ahead[1]))
                    if packing is not None:  # still packing: it enters the channel when done
                        await asyncio.wait([packing])
            finally:
                if not called.done():
                    called.set_result(None)  # (Peer.send takes its place before it first awaits)
            try:
                await link.peer.send(obj, tag=tag)
            except Exception as exc:
                if link.peer.closed or link.peer.remote_closing or isinstance(exc, PeerDisconnected):
                    broke = self._link_broke(link, exc)
                    self._fail(broke, self.rank, str(broke), skip=link)
                else:
                    error = self._unsendable(f"{what} to {link}", exc)
                    self._fail(error, self.rank, str(error))

        def ended(_: asyncio.Task[None]) -> None:
            if not called.done():  # (cancelled before it ran, it never ran its finally)
                called.set_result(None)

        task = loop.create_task(send())
        task.add_done_callback(ended)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _run(
        self,
        step: int,
        plan: list[Action],
        inputs: list[Any] | None,
        targets: list[Any] | None,
        weights: list[float] | None,
    ) -> dict[str, Any]:
        part = self.part
        assert part is not None
        first, last = self.rank == 0, self.rank == self.num_stages - 1
        m = sum(a.kind is Kind.FORWARD for a in plan)
        if first and (inputs is None or len(inputs) != m):
            got = 0 if inputs is None else len(inputs)
            raise ConfigurationError(f"stage 0 needs {m} input microbatches, got {got}")
        if not any(a.kind is Kind.BACKWARD for a in plan):
            # a forward-only schedule (the driver's forward, or evaluate with targets): no
            # gradients, no update
            return await self._run_forwards(step, plan, inputs, targets if last else None)
        if last and not part.has_loss:
            raise self._no_loss("training steps")
        if last and (targets is None or weights is None or len(targets) != m or len(weights) != m):
            raise ConfigurationError(f"the last stage needs {m} targets and weights")
        self._pending = None  # an earlier step the driver never committed: its gradients go
        self._orphan = None  # and so do those of an earlier driver's step nobody settled
        t_start = time.perf_counter()
        busy = wait = self._cpu = 0.0
        ctxs: dict[int, Any] = {}
        losses: list[float] = [0.0] * m
        _, dt = await self._compute(part.zero_grad)
        busy += dt
        for action in plan:
            i = action.microbatch
            if action.kind is Kind.FORWARD:
                x, waited = await self._input(step, i, inputs)
                wait += waited
                if last:
                    assert targets is not None and weights is not None
                    (losses[i], ctxs[i]), dt = await self._part_code(
                        action, part.forward_loss, x, targets[i], float(weights[i]), not first
                    )
                else:
                    (y, ctxs[i]), dt = await self._part_code(action, part.forward, x, not first)
                    self._send_later(self.next, y, message_tag(step, "f", i), f"its activation of microbatch {i}")
            else:
                grad = None
                if not last:
                    t0 = time.perf_counter()
                    grad = await self._recv(self.next, message_tag(step, "b", i))
                    wait += time.perf_counter() - t0
                gx, dt = await self._part_code(action, part.backward, ctxs.pop(i), grad)
                if not first:
                    self._send_later(self.prev, gx, message_tag(step, "b", i), f"its gradient of microbatch {i}")
            busy += dt
        t0 = time.perf_counter()
        while self._sends:  # every byte of this step has left before the parameters change
            await asyncio.gather(*list(self._sends))
        if self._broken is not None:
            raise fresh(self._broken)
        send_wait = time.perf_counter() - t0
        self._pending = step  # the update waits until the driver knows every stage got this far
        return {
            "rank": self.rank,
            "losses": losses if last else None,
            "compute_s": busy,
            "cpu_s": self._cpu,
            "recv_wait_s": wait,
            "send_wait_s": send_wait,
            "wall_s": time.perf_counter() - t_start,
        }

    def _no_loss(self, what: str) -> ConfigurationError:
        return ConfigurationError(
            f"stage {self.rank} is the last stage and its part has no loss: it serves Pipeline.forward, "
            f"not {what} (give its part a loss=)"
        )

    async def _input(self, step: int, i: int, inputs: list[Any] | None) -> tuple[Any, float]:
        """Microbatch ``i``'s input: the driver's (first stage), else the previous stage's
        activation; and the seconds spent waiting for it."""
        if self.rank == 0:
            assert inputs is not None
            return inputs[i], 0.0
        t0 = time.perf_counter()
        x = await self._recv(self.prev, message_tag(step, "f", i))
        return x, time.perf_counter() - t0

    async def _run_forwards(
        self, step: int, plan: list[Action], inputs: list[Any] | None, targets: list[Any] | None
    ) -> dict[str, Any]:
        """A forward-only step: each microbatch through ``part.infer``, which keeps nothing for
        a backward; the last stage answers with the outputs, or, given ``targets`` (an
        evaluation), with each microbatch's loss from ``part.infer_loss``. The part's
        gradients, the pending update and the optimizer are left as they are."""
        part = self.part
        assert part is not None
        last = self.rank == self.num_stages - 1
        evaluating = last and targets is not None
        if evaluating:
            assert targets is not None
            if not part.has_loss:
                raise self._no_loss("Pipeline.evaluate")
            if len(targets) != len(plan):
                raise ConfigurationError(f"the last stage needs {len(plan)} targets, got {len(targets)}")
        t_start = time.perf_counter()
        busy = wait = self._cpu = 0.0
        outputs: dict[int, Any] = {}
        losses: dict[int, float] = {}
        for action in plan:
            i = action.microbatch
            x, waited = await self._input(step, i, inputs)
            wait += waited
            if evaluating:
                assert targets is not None
                losses[i], dt = await self._part_code(action, _loss_of, part, x, targets[i])
                busy += dt
                continue
            y, dt = await self._part_code(action, part.infer, x)
            del x
            busy += dt
            if last:
                outputs[i] = y
            else:
                self._send_later(self.next, y, message_tag(step, "f", i), f"its activation of microbatch {i}")
        t0 = time.perf_counter()
        while self._sends:
            await asyncio.gather(*list(self._sends))
        if self._broken is not None:
            raise fresh(self._broken)
        return {
            "rank": self.rank,
            "outputs": [outputs[i] for i in sorted(outputs)] if last and not evaluating else None,
            "losses": [losses[i] for i in sorted(losses)] if evaluating else None,
            "compute_s": busy,
            "cpu_s": self._cpu,
            "recv_wait_s": wait,
            "send_wait_s": time.perf_counter() - t0,
            "wall_s": time.perf_counter() - t_start,
        }

    async def _commit(self, generation: str, step: int) -> dict[str, float]:
        """Every stage finished ``step``: apply its summed gradients (the optimizer step)."""
        self._check_open()
        self._check_generation(generation)
        if self._pending != step or self.part is None:
            why = f": {self._broken}" if self._broken is not None else ""
            raise BrokenResourceError(f"stage {self.rank} has no finished step {step} to apply{why}")
        self._pending = None
        # the driver sent this commit once every stage had finished: it lands even if the call
        # is cut short meanwhile (the driver's connection dropped), and is recorded as applied
        return await self._land(ticket_key(*self._ticket), step)

    async def _land(self, key: str, step: int) -> dict[str, float]:
        """Apply ``step`` of the driver ``key`` (``_apply``) as an update that lands whatever
        happens to the call that asked for it: cut short (its caller gave up, its driver's
        connection dropped), it runs on; a close (``_close``) and the next configure wait for
        it (``_applying``), rather than cancel its optimizer step still queued for the compute
        thread."""
        applying = asyncio.get_running_loop().create_task(self._apply(key, step))
        applying.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._applying = applying
        return await asyncio.shield(applying)

    async def _apply(self, key: str, step: int) -> dict[str, float]:
        """The optimizer step for the gradients of ``step`` of the driver ``key``."""
        assert self.part is not None
        cpu = self._cpu
        try:
            _, dt = await self._compute(self.part.step)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as exc:  # (one that is no Exception too: the stage must not step on)
            reason = f"stage {self.rank} raised {type(exc).__name__} applying step {step}: {describe(exc)}"
            self._fail(BrokenResourceError(reason), self.rank, reason)
            raise
        self._last_commit = (key, step)
        return {"compute_s": dt, "cpu_s": self._cpu - cpu}

    async def _settle(self, generation: str, key: str, step: int, apply: bool) -> bool:
        """The new driver's word on the orphan ``(key, step)`` its configure reported: apply it
        (another stage committed it before that driver went away) or drop it. True if applied."""
        self._check_open()
        self._check_generation(generation)
        if self._orphan != (key, step):
            raise BrokenResourceError(f"stage {self.rank} holds no finished step {step} of driver {key} to settle")
        if self._task is not None:
            raise BusyResourceError(f"stage {self.rank} is running a step")
        self._orphan = None
        if not apply:
            log.warning("stage %d: dropped step %d of an earlier driver, which no stage applied", self.rank, step)
            return False
        # as a commit: another stage applied this step, so it lands here even if this call is cut
        # short (the connect's deadline, its driver's connection dropped) or the stage closes
        # meanwhile. Cancelled in the call, its optimizer step still queued for the compute
        # thread was cancelled with it, and the orphan was gone: this stage stayed a step behind
        await self._land(key, step)
        log.warning(
            "stage %d: applied step %d of an earlier driver, which had applied it on other stages before it went away",
            self.rank,
            step,
        )
        return True

    # -- the rest -------------------------------------------------------------------------------
    async def _state(self, generation: str | None = None) -> dict[str, Any]:
        """The part's parameters. ``generation``: the asking driver's configuration; a driver
        replaced since is refused, as its other calls are (it read the newer driver's model)."""
        self._check_open()
        if generation is not None:
            self._check_generation(generation)
        if self.part is None:
            raise ClosedResourceError("this stage has no part yet: a driver has not configured it")
        if not self.offload:
            # the part's code runs on the loop (``_compute``), and so does this: in the worker
            # thread it ran beside a step's optimizer update on the loop, and read some of the
            # parameters from before that update and the rest from after
            return self.part.state()
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.part.state)

    def _check_generation(self, generation: str) -> None:
        if generation != ticket_key(*self._ticket):
            raise BrokenResourceError(f"stage at {self.node.address} has been configured by another driver since")

    async def _release(self, generation: str, close: bool = True) -> None:
        """The driver is done. It first calls this with ``close=False`` on every stage, which
        stops watching the links (so that no stage takes its neighbour's leaving for a failure),
        then with ``close=True``, which drops them. A later driver configures them again."""
        self._check_generation(generation)
        if self._task is not None:
            if not self._task.done() and self._broken is None:
                # what the step's caller is told. A bare cancel read "CancelledError" in every
                # stage's account, and each stage logged, as stage -1, that its caller had
                # cancelled the step and aborted its neighbours, which are being released too
                self._broken = ClosedResourceError(
                    f"stage {self.rank}: its driver closed the pipeline (Pipeline.aclose) "
                    f"while step {self._running} ran"
                )
            self._task.cancel()
        self.rank, self._pending, self._plan = -1, None, None
        for link in self.links:
            if link.watcher is not None:
                link.watcher.cancel()
        if close:
            if self._driver_watch is not None:
                self._driver_watch.cancel()
                self._driver_watch = None
            await self._drop_links()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("stage is closed")

    async def aclose(self) -> None:
        """Stop serving: cancel a running step, let a commit under way land, close the links;
        idempotent. The node stays open.
        The closing runs to its end even if the caller is cancelled meanwhile, and every call
        waits for it."""
        check_home(self.node._loop, "stage.aclose", closing=True)
        if self._closing is None:
            self._begin_close(asyncio.get_running_loop())
        assert self._closing is not None
        await asyncio.shield(self._closing)

    def abort(self) -> None:
        """Forceful stop: the links to the neighbours drop at once (they see this stage gone and
        fail a step under way, naming it), a running step is cancelled, and the stage closes in
        the background (its methods leave the node). ``aclose()`` waits for that to finish.

        Safe from any thread: called where the stage's loop is not running (another thread), it
        hands itself to that loop, and the links drop on the loop's next turn."""
        if elsewhere(self._loop, self.abort):
            self._closed = True  # refused from now on; its loop drops the rest
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop known or running: refused from now on, aclose() ends it
            self._closed = True
            return
        for link in self.links:
            link.peer.abort()
        if self._closing is None:
            self._begin_close(loop)

    def _begin_close(self, loop: asyncio.AbstractEventLoop) -> None:
        self._closed = True
        for token in list(self._reservations):
            self._let_go(token)  # a call waiting for one is refused: the stage is closed
        if self._task is not None:
            if not self._task.done() and self._broken is None:
                # what the step's caller is told (it said "raised CancelledError")
                self._broken = ClosedResourceError(
                    f"stage {self.rank} was closed (Stage.aclose or abort) while step {self._running} ran"
                )
            self._task.cancel()
        if self._configuring is not None:
            self._configuring.cancel()
        if self._driver_watch is not None:
            self._driver_watch.cancel()
        for task in list(self._background):
            task.cancel()
        self._closing = loop.create_task(self._close(), name="tensorwire-stage-close")

    async def _close(self) -> None:
        try:
            await self._drop_links()
            if self._applying is not None:
                # a commit (or settle) under way lands, as it does when the driver's connection drops (the
                # driver sent it once every stage had finished the step): the executor's shutdown
                # below cancelled its optimizer step still queued for the compute thread, and the
                # step failed with a bare CancelledError, applied on the other stages only
                await asyncio.wait([self._applying])
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            registry = self.node.methods
            for name in METHODS:
                with contextlib.suppress(Exception):
                    registry.unregister(name)

    async def __aenter__(self) -> Stage:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
