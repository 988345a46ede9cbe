"""The driver: introduces the stages to each other, splits batches into microbatches, runs steps.

    async with tensorwire.start() as node:
        pipe = await Pipeline.connect(node, ["10.0.0.1:5000", "10.0.0.2:5000", ...])
        result = await pipe.step(x, y, microbatches=8, schedule="1f1b")
        print(result.loss, result.bubble)
        print((await pipe.evaluate(x_val, y_val, microbatches=8)).loss)    # no gradient, no update

The driver is any node that knows the stages' addresses in pipeline order. It takes a generation
newer than any the stages have seen and calls each stage's ``tw.pipeline.configure`` (tensor RPC
over the data plane) with it, which builds each stage's part, then, once every stage has built,
``tw.pipeline.link``, which links the stages into a chain; each step is one
``tw.pipeline.step`` call per stage, all at once, carrying that stage's actions from the schedule
(and the microbatches to stage 0, the targets to the last stage), then, once every stage has
finished, one ``tw.pipeline.commit`` call per stage, which applies its optimizer update.
``forward`` is the same call with a forward-only schedule and no targets: no commit follows, and
the last stage's answer carries its outputs, which the driver joins back into one batch.
``evaluate`` is a forward-only call with targets: the last stage answers with each microbatch's
loss instead, and the driver weights them as a step's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import uuid
import warnings
import weakref
from collections.abc import Collection, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._checks import check_arguments, check_seconds
from .._loops import check_home, elsewhere
from ..errors import (
    BrokenResourceError,
    BusyResourceError,
    ClosedResourceError,
    ConfigurationError,
    ConnectError,
    DeadlineExceeded,
    InvalidArguments,
    MessageRefused,
    MethodNotFound,
    PeerDisconnected,
    RemoteError,
    ShapeMismatchError,
    TensorError,
    TensorWireError,
    UnsupportedTensorError,
)
from ..rpc import current_deadline
from ..rpc._deadline import served_under
from ..tensors import wire_nbytes
from ._batch import join, num_samples, split
from ._schedule import DEFAULT_MAX_UNEXPECTED, Schedule, _check_sizes, make_schedule
from ._stage import close_all, ticket_key

if TYPE_CHECKING:
    from .._node import Node
    from .._peer import Peer

__all__ = ["EvalResult", "Pipeline", "StepResult"]


@dataclass(frozen=True, slots=True)
class _Result:
    loss: float
    losses: list[float]
    seconds: float
    schedule: Schedule
    stages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Measured idle fraction: 1 - (compute summed over stages) / (stages x wall time)."""
        return _bubble(self.stages, self.seconds)


@dataclass(frozen=True, slots=True)
class StepResult(_Result):
    """What one training step gave.

    loss: the batch's loss (the microbatch losses weighted by their share of the batch).
    losses: each microbatch's own loss.
    seconds: the step's wall time at the driver.
    stages: per stage (seconds): ``compute_s`` (wall time in its part's code, the optimizer
        step included), ``cpu_s`` (CPU time of that code), ``recv_wait_s`` (waiting for a
        neighbour), ``send_wait_s`` (the step's last sends), ``wall_s`` (forward and backward
        until the stage answered), ``commit_s`` (its optimizer step, after every stage answered).
    """


@dataclass(frozen=True, slots=True)
class EvalResult(_Result):
    """What one evaluation (``Pipeline.evaluate``) gave: no gradient, no update.

    loss: the batch's loss, the microbatch losses weighted by their share of the batch exactly
        as a step's are (the batch mean when the loss is a mean over its microbatch).
    losses: each microbatch's own loss.
    seconds: the evaluation's wall time at the driver.
    stages: per stage (seconds): ``compute_s``, ``cpu_s``, ``recv_wait_s``, ``send_wait_s`` and
        ``wall_s``, as in ``StepResult`` (there is no commit).
    """


def _bubble(stages: list[dict[str, Any]], seconds: float) -> float:
    busy = sum(s["compute_s"] for s in stages)
    return max(0.0, 1 - busy / (len(stages) * seconds)) if seconds > 0 and stages else 0.0


class Pipeline:
    """A driver's handle on a chain of configured stages. Make one with ``Pipeline.connect``
    and close it (``async with``, ``aclose``): one collected with its connections open says so
    (ResourceWarning) and they drop as ``abort`` drops them."""

    def __init__(self, node: Node, peers: list[Peer], links: list[dict[str, Any]], generation: str) -> None:
        self.node = node
        self.peers = peers
        self._links = links
        self._generation = generation  # what the stages know this driver's configuration by
        #: per stage, how many unreceived messages it holds from a neighbour (its node's limits)
        self.max_unexpected = [int(info.get("max_unexpected", DEFAULT_MAX_UNEXPECTED)) for info in links]
        # per stage, the most tensor bytes its node's CallLimits let one step call carry
        self._max_arg_bytes = [info.get("max_arg_bytes") for info in links]
        self._steps = itertools.count()
        self._stepping = False
        # a call that failed at the driver (or was refused by its stage's node) while the other
        # stages ran theirs: what they sent stays unreceived on their links, so this pipeline
        # runs nothing more (``_run``); Pipeline.connect links the stages afresh
        self._broken: BrokenResourceError | None = None
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()  # where the peers live (abort from another thread)
        #: how long to wait, after one stage failed a step, for the others to report their error
        self.abort_grace = max(5.0, 2 * node.config.lease_seconds)
        # catches a leak, never the way to close: a pipeline dropped with its connections open
        # says so, and they drop as abort() drops them. Nothing the finalizer holds refers back
        # to the pipeline (that would keep it alive); the peers are let go on aclose or abort.
        self._leak = weakref.finalize(self, _dropped_unclosed, repr(self), self._loop, tuple(peers))
        self._leak.atexit = False  # at exit the loop is gone: nothing to drop, nobody to tell

    def __repr__(self) -> str:
        return f"<Pipeline {len(self.peers)} stages: {' -> '.join(p.remote_address for p in self.peers)}>"

    @property
    def num_stages(self) -> int:
        """How many stages the pipeline has (one peer each)."""
        return len(self.peers)

    @property
    def paths(self) -> list[str]:
        """The negotiated path of each link, stage s -> s+1, as stage s sees it."""
        return [str(info["next_path"]) for info in self._links[:-1]]

    @classmethod
    @check_arguments
    async def connect(
        cls,
        node: Node,
        addresses: Sequence[str],
        *,
        transports: Sequence[str] | None = None,
        connect_timeout: float | None = None,
        build_timeout: float | None = None,
    ) -> Pipeline:
        """Connect to the stages at ``addresses`` (in pipeline order) and link them into a chain.
        ``transports`` is the preference order for the links between stages; ``connect_timeout``
        bounds each stage's linking (default: the node's), which begins once every stage has
        built its part. The builds (``Stage(build=...)``: loading a model's weights, say) take
        as long as they take, unless ``build_timeout`` (seconds) bounds each stage's configure,
        its build included: past it, DeadlineExceeded names the stage. A build that raises fails
        the connect at once with its error, and a stage that dies meanwhile with
        PeerDisconnected. A connect cut short (a deadline, the caller's ``asyncio.timeout``)
        leaves no stage linked or half-built for this driver, and closes every connection it
        made, to the end even if its caller is cancelled again meanwhile.

        Each stage is a node of its own: an address given twice, or two addresses of one node,
        is a ConfigurationError. The stages take this driver's configuration over any earlier
        one's (whose later calls they refuse); of two drivers that connect at once, one gets
        every stage and the other is refused (BrokenResourceError). The stages are first
        reserved, every one, and only then taken: while another driver's step, forward or
        evaluation runs on any stage, this is refused (BusyResourceError) before any stage is
        taken, and that driver runs on undisturbed; a call of that driver that starts once
        every stage is reserved is refused on every stage (BrokenResourceError, "another driver
        took the stages over"), so one of the two wins whole."""
        if isinstance(addresses, str) or not isinstance(addresses, Iterable):  # a str: a stage per character
            raise ConfigurationError(
                f"the stage addresses are a list of 'host:port' strings in pipeline order, not {addresses!r}"
            )
        addresses = list(addresses)  # read once: a generator would be spent by the checks below
        if not addresses:
            raise ConfigurationError("a pipeline needs at least one stage address")
        twice = [a for a, n in collections.Counter(addresses).items() if n > 1]
        if twice:
            raise ConfigurationError(f"stage address {twice[0]} is given twice: each stage is a node of its own")
        if isinstance(transports, str):  # (its letters were taken for transport names)
            raise ConfigurationError(f"transports is a sequence of names, e.g. ('tcp',), not {transports!r}")
        if connect_timeout is not None:  # (a wrong one failed on the stages, as a RemoteError)
            connect_timeout = check_seconds("connect_timeout", connect_timeout)
        wait = connect_timeout if connect_timeout is not None else node.config.connect_timeout
        if build_timeout is not None:
            build_timeout = check_seconds("build_timeout", build_timeout)
        peers: list[Peer] = []
        token = uuid.uuid4().hex
        reserving = False
        try:
            for s, address in enumerate(addresses):
                try:
                    peers.append(await node.connect(address, transports=tuple(transports) if transports else None))
                except PeerDisconnected as exc:  # (it died as the driver connected: a bare PeerEOF)
                    raise _gone(address, s, exc, "Pipeline.connect") from exc
                except ConnectError as exc:  # ("tcp data connection to 127.0.0.1:P failed": its data port)
                    raise ConnectError(f"Pipeline.connect: stage {s} ({address}): {exc}") from exc
            # one node is one instance id, whatever its addresses: node ids may repeat (stages
            # named after the hostname, in containers), and two such stages are two nodes
            seen: dict[str, str] = {}
            for address, peer in zip(addresses, peers, strict=True):
                if peer.remote_instance in seen:
                    raise ConfigurationError(
                        f"stage addresses {seen[peer.remote_instance]} and {address} reach the same node "
                        f"({peer.remote_node[:12]}): each stage is a node of its own"
                    )
                seen[peer.remote_instance] = address
            loop = asyncio.get_running_loop()
            # every stage is reserved before any is taken (configure): a stage running a call of
            # its driver refuses, and a reserved one holds that driver's next call back until it is
            # taken, so of a call and this connect that race, one wins whole (taken one by one, some
            # stages went to the connect and others to the call, and both failed). The generation
            # is newer than any configuration the stages have seen; the token orders drivers that
            # pick the same number at once (the stages refuse the older of the two)
            reserving = True
            generation = 1 + max(
                await _each_stage(peers, [loop.create_task(_reserve(peer, s, token)) for s, peer in enumerate(peers)])
            )
            p = len(peers)
            # first every stage builds its part, for as long as it takes (or build_timeout) ...
            reports = await _each_stage(
                peers,
                [
                    loop.create_task(
                        _configure(
                            peer,
                            s,
                            build_timeout,
                            p,
                            peers[s - 1].remote_instance if s > 0 else None,
                            addresses[s + 1] if s + 1 < p else None,
                            list(transports) if transports else None,
                            wait,
                            addresses[s - 1] if s > 0 else None,
                            generation=generation,
                            token=token,
                            # the stage drops its links when this connection drops (abort, a dead driver)
                            driver_session=peer.session.id if peer.session is not None else None,
                        )
                    )
                    for s, peer in enumerate(peers)
                ],
            )
            # ... then they link, every one at once, so that none waits out its connect_timeout
            # for a neighbour that is still building
            paths = await _each_stage(
                peers,
                [
                    loop.create_task(_link(peer, s, wait, generation=generation, token=token))
                    for s, peer in enumerate(peers)
                ],
            )
            links = [{**report, **path} for report, path in zip(reports, paths, strict=True)]
            await _settle(peers, links, ticket_key(generation, token))
        except BaseException as exc:
            # let go of the stages and close every connection made, to the end even if the
            # caller cancels again meanwhile: cut short there, the connections stayed open (and
            # the stages reserved and configured for this driver) until the node closed
            giving_up = node._retire(_give_up(peers, token if reserving else None))
            left = current_deadline()
            if left is None or isinstance(exc, asyncio.CancelledError):
                await asyncio.shield(giving_up)
            else:
                # an error to hand the caller (a stage's DeadlineExceeded answered just before
                # the deadline): the giving up goes on past the deadline rather than let it
                # fire meanwhile, which replaced the error with a bare TimeoutError
                await asyncio.wait([giving_up], timeout=max(0.0, left - _ERROR_MARGIN))
            raise
        return cls(node, peers, links, ticket_key(generation, token))

    @check_arguments
    async def step(
        self,
        inputs: Any,
        targets: Any,
        *,
        microbatches: int,
        schedule: str | Schedule | Sequence[Sequence[str]] = "1f1b",
    ) -> StepResult:
        """One training step: split ``inputs`` and ``targets`` into microbatches, run them through
        the stages as ``schedule`` says, and have every stage step its optimizer. Shapes may change
        from step to step. If any stage fails, every stage fails this step and this raises the
        first stage's error, with every stage's account attached as a note.

        A step is all or nothing: each stage applies its optimizer update only once every stage
        has finished the step, so a step that fails, or that the caller cancels, changes no
        stage's parameters. Steps run one at a time (BusyResourceError otherwise); one under way
        when the pipeline closes raises ClosedResourceError. A pipeline whose last stage has no
        loss serves ``forward`` only: ``step`` (and ``evaluate``) raise ConfigurationError before
        any stage runs."""
        result: StepResult = await self._one_at_a_time(
            "pipeline.step", self._step(inputs, targets, microbatches, schedule)
        )
        return result

    @check_arguments
    async def forward(
        self, inputs: Any, *, microbatches: int, schedule: str | Schedule | Sequence[Sequence[str]] = "gpipe"
    ) -> Any:
        """Forward only (inference, evaluation): split ``inputs`` into microbatches, run them
        through the stages' forwards and return the last stage's outputs for the whole batch,
        the microbatches' outputs joined along the first dimension (tensors concatenated, tuples
        and dicts element by element; see ``join``). No stage keeps anything for a backward,
        computes a loss, or touches its gradients or optimizer (a ``TorchPart`` runs its module
        under ``torch.no_grad()`` in eval mode).

        ``schedule`` runs its forwards only: a name (every named schedule runs the same
        forwards, microbatch after microbatch), a Schedule, or one list of actions per stage.
        A stage that fails fails the call on every stage, as a ``step`` does (this raises the
        first stage's error with every stage's account as a note), and the stages stay broken
        until the next ``Pipeline.connect``. Runs one at a time with ``step``."""
        return await self._one_at_a_time("pipeline.forward", self._forward(inputs, microbatches, schedule))

    @check_arguments
    async def evaluate(
        self,
        inputs: Any,
        targets: Any,
        *,
        microbatches: int,
        schedule: str | Schedule | Sequence[Sequence[str]] = "gpipe",
    ) -> EvalResult:
        """The loss of a batch without training on it (validation): split ``inputs`` and
        ``targets`` into microbatches as ``step`` does, run the forwards alone, and have the last
        stage compute each microbatch's loss (``Part.infer_loss``: a ``TorchPart`` under
        ``torch.no_grad()`` in eval mode, as ``forward``). ``loss`` weights the microbatch
        losses by their share of the batch, exactly as ``step``'s does. No stage keeps
        anything for a backward or touches its gradients, its pending update or its optimizer;
        no commit follows.

        ``schedule`` runs its forwards only, as in ``forward``. The batch is checked as a step's
        is (the same number of samples in ``inputs`` and ``targets``; both counted against the
        stages' message and call limits) before any stage runs, and a pipeline whose last stage
        has no loss raises ConfigurationError then. A stage that fails fails the call on every
        stage, as a ``step`` does, and the stages stay broken until the next
        ``Pipeline.connect``. Runs one at a time with ``step`` and ``forward``."""
        result: EvalResult = await self._one_at_a_time(
            "pipeline.evaluate", self._evaluate(inputs, targets, microbatches, schedule)
        )
        return result

    async def _one_at_a_time(self, what: str, run: Coroutine[Any, Any, Any]) -> Any:
        try:
            self._check_open(what)
            if self._stepping:
                raise BusyResourceError("this pipeline is already running a step; steps run one at a time")
            if self._broken is not None:
                raise BrokenResourceError(str(self._broken))
        except BaseException:
            run.close()
            raise
        self._stepping = True
        try:
            return await run
        except TensorWireError as exc:
            if self._closed:  # aclose() released the stages, which cut the step short
                closed = ClosedResourceError(f"this pipeline was closed while its step ran ({exc})")
                for note in getattr(exc, "__notes__", ()):  # every stage's account, what was applied
                    closed.add_note(note)
                raise closed from exc
            raise
        finally:
            self._stepping = False

    async def _step(
        self, inputs: Any, targets: Any, microbatches: int, schedule: str | Schedule | Sequence[Sequence[str]]
    ) -> StepResult:
        self._check_loss("training steps")
        xs, ys, weights = self._batch(inputs, targets, microbatches)
        sched = make_schedule(schedule, self.num_stages, microbatches, max_unexpected=self.max_unexpected)
        step = next(self._steps)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stats = await self._run(step, sched, xs, ys, weights, ok="finished, update not applied")
        # every stage finished: now every one applies its update, even if our caller gives up
        # meanwhile (the commits are on their way; half of them would be a half-updated model).
        # They carry none of the caller's tensorwire.rpc.deadline: with it, one made just after
        # it ran out was never sent, or its stage refused it unrun, while the others landed
        with served_under(None):
            commits = [loop.create_task(peer.call("tw.pipeline.commit", self._generation, step)) for peer in self.peers]
        applied = await asyncio.shield(asyncio.gather(*commits, return_exceptions=True))
        seconds = loop.time() - t0
        if any(isinstance(o, BaseException) for o in applied):
            error = self._failure(step, list(applied), ok="applied its update")
            if self._closed:  # aborted while the commits were on their way
                error.add_note(
                    "the pipeline was closed while its commits were on their way: the stages they reached "
                    "applied this step; the next Pipeline.connect applies it on the others too (or drops it "
                    "everywhere if no stage applied it)"
                )
            else:
                error.add_note("the model is no longer consistent: reconfigure, and restore the parameters")
            raise error
        for stat, commit in zip(stats, applied, strict=True):
            assert isinstance(commit, dict)
            stat["commit_s"] = commit["compute_s"]
            stat["compute_s"] += commit["compute_s"]
            stat["cpu_s"] += commit["cpu_s"]
        losses = [float(v) for v in stats[-1]["losses"]]
        loss = float(sum(w * v for w, v in zip(weights, losses, strict=True)))
        return StepResult(loss, losses, seconds, sched, stats)

    def _check_loss(self, what: str) -> None:
        """Refuse here, before any stage runs, a call that needs a loss on the last stage."""
        last = self.num_stages - 1
        if not self._links[last].get("has_loss", True):
            raise ConfigurationError(
                f"stage {last} ({self.peers[last].remote_address}) is the last stage and its part has no loss: "
                f"this pipeline serves Pipeline.forward, not {what} (give that part a loss=)"
            )

    def _batch(self, inputs: Any, targets: Any, microbatches: int) -> tuple[list[Any], list[Any], list[float]]:
        """(input microbatches, target microbatches, each one's share of the batch), checked as
        far as the driver can before any stage runs (``_check_keywords``, ``_check_sendable``)."""
        # the batch before the schedule: building and validating a schedule for a count no batch
        # could be split into (10**6 for 64 samples, say) would hold the loop for minutes
        _check_sizes(self.num_stages, microbatches)  # a count that is no count: ScheduleError, as ever
        self._check_keywords(inputs)
        # the counts before the split: split first, 6 inputs and 2 targets in 3 microbatches said
        # only "a batch of 2 cannot be split into 3 microbatches"
        n_inputs, n_targets = num_samples(inputs), num_samples(targets)
        if n_inputs is not None and n_targets is not None and n_inputs != n_targets:
            raise ShapeMismatchError(f"inputs have {n_inputs} samples but targets {n_targets}")
        xs, ys = split(inputs, microbatches), split(targets, microbatches)
        sizes = [num_samples(x) or 0 for x in xs]
        if sizes != [num_samples(y) or 0 for y in ys]:
            raise ShapeMismatchError(f"inputs have {num_samples(inputs)} samples but targets {num_samples(targets)}")
        total = sum(sizes)
        self._check_sendable([(0, "input", xs), (self.num_stages - 1, "target", ys)])
        return xs, ys, [n / total for n in sizes]

    async def _evaluate(
        self, inputs: Any, targets: Any, microbatches: int, schedule: str | Schedule | Sequence[Sequence[str]]
    ) -> EvalResult:
        self._check_loss("Pipeline.evaluate")
        xs, ys, weights = self._batch(inputs, targets, microbatches)
        sched = make_schedule(
            schedule, self.num_stages, microbatches, max_unexpected=self.max_unexpected, forward_only=True
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stats = await self._run(next(self._steps), sched, xs, ys, None, ok="finished")
        seconds = loop.time() - t0
        losses = stats[-1].get("losses")
        if not isinstance(losses, list) or len(losses) != microbatches:
            raise BrokenResourceError(f"the last stage answered an evaluation without its {microbatches} losses")
        values = [float(v) for v in losses]
        loss = float(sum(w * v for w, v in zip(weights, values, strict=True)))
        return EvalResult(loss, values, seconds, sched, stats)

    async def _forward(self, inputs: Any, microbatches: int, schedule: str | Schedule | Sequence[Sequence[str]]) -> Any:
        _check_sizes(self.num_stages, microbatches)  # the batch before the schedule, as in _batch
        self._check_keywords(inputs)
        xs = split(inputs, microbatches)
        self._check_sendable([(0, "input", xs)])
        sched = make_schedule(
            schedule, self.num_stages, microbatches, max_unexpected=self.max_unexpected, forward_only=True
        )
        stats = await self._run(next(self._steps), sched, xs, None, None, ok="finished")
        outputs = stats[-1].get("outputs")
        if not isinstance(outputs, list) or len(outputs) != microbatches:
            raise BrokenResourceError(f"the last stage answered a forward-only step without its {microbatches} outputs")
        return join(outputs)

    async def _run(
        self,
        step: int,
        sched: Schedule,
        xs: list[Any],
        ys: list[Any] | None,
        weights: list[float] | None,
        *,
        ok: str,
    ) -> list[dict[str, Any]]:
        """One ``tw.pipeline.step`` call per stage, all at once; every stage's answer, or the
        error that started a failure with every stage's account (``ok``: what a stage that
        finished says in it)."""
        p = self.num_stages
        loop = asyncio.get_running_loop()
        calls = [
            loop.create_task(
                peer.call(
                    "tw.pipeline.step",
                    self._generation,
                    step,
                    " ".join(map(str, sched.stages[s])),
                    xs if s == 0 else None,
                    ys if s == p - 1 else None,
                    weights if s == p - 1 else None,
                )
            )
            for s, peer in enumerate(self.peers)
        ]
        ended: list[asyncio.Task[Any]] = []  # the calls in the order they ended
        for task in calls:
            task.add_done_callback(ended.append)
        local: int | None = None  # a stage whose call failed here, at the driver
        try:
            _, pending = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            first = next((calls.index(t) for t in ended if _error(t) is not None), None)
            if first is not None and _never_ran(_error(calls[first])):
                # the call failed here, at the driver, most likely before it reached its stage,
                # or its stage's node refused it before the stage ran it: then no neighbour of
                # that stage aborts the others, which wait for it, and waiting abort_grace for
                # them is no use
                local = first
            elif pending:  # one failed: the others fail soon (their neighbours abort them)
                _, pending = await asyncio.wait(pending, timeout=self.abort_grace)
        finally:
            for task in calls:
                task.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
        outcomes: list[BaseException | dict[str, Any]] = []
        cut: set[int] = set()  # stages whose calls the driver cancelled: what they say is the driver's
        for s, task in enumerate(calls):
            if task.cancelled():
                cut.add(s)
                if local is not None:
                    outcomes.append(
                        BrokenResourceError(f"cancelled at once: the call to stage {local} failed before it ran there")
                    )
                else:
                    outcomes.append(DeadlineExceeded(f"no answer within {self.abort_grace} s of the first failure"))
            else:
                exc = task.exception()
                outcomes.append(exc if exc is not None else task.result())
        if local is not None:
            # the other stages ran (or began) this call without that stage: a stage that finished
            # its part left its activations unreceived on its link, holding the next stage's
            # message slots, and no stage aborted it. A next call on these links could wait for
            # those slots for good, so none runs: they are dropped by the next Pipeline.connect
            self._broken = BrokenResourceError(
                f"pipeline step {step} failed at the driver, or was refused by stage {local}'s node, while the "
                "other stages ran it: the stages are broken until the next Pipeline.connect"
            )
        if any(isinstance(o, BaseException) for o in outcomes):
            error = self._failure(step, outcomes, ok, order=[calls.index(t) for t in ended], cut=cut)
            if local is not None and cut:
                error.add_note(
                    "the driver cancelled the other stages' calls at once, which breaks those stages: "
                    "Pipeline.connect again before the next step"
                )
            raise error  # no stage applies anything
        return [o for o in outcomes if isinstance(o, dict)]

    def _check_keywords(self, inputs: Any) -> None:
        """Refuse here, before any stage runs, a dict batch whose keys stage 0's part cannot take:
        a TorchPart calls its module with it as keyword arguments, whose names are str."""
        if isinstance(inputs, dict) and self._links[0].get("keyword_dicts"):
            for key in inputs:
                if not isinstance(key, str):
                    raise UnsupportedTensorError(
                        f"the batch is a dict with the key {key!r} ({type(key).__name__}): stage 0 "
                        f"({self.peers[0].remote_address}) calls its module with a dict as keyword arguments, "
                        "whose names are str"
                    )

    def _check_sendable(self, parts: list[tuple[int, str, list[Any]]]) -> None:
        """Refuse here, before any stage starts the step, microbatches that the call to their
        stage could not carry (``parts``: (stage, what, microbatches)): not a tensor the wire
        takes, or past that stage's message limit. Such a call would fail at the driver while
        the other stages, already in the step, wait for that stage, and cancelling them breaks
        every stage until the next ``Pipeline.connect``."""
        nbytes: dict[int, int] = {}
        for s, what, batch in parts:
            for i, x in enumerate(batch):
                try:
                    nbytes[s] = nbytes.get(s, 0) + _nbytes(x)
                except TensorError as exc:
                    raise type(exc)(f"the {what} of microbatch {i} cannot be sent to stage {s}: {exc}") from exc
        for s, n in nbytes.items():
            peer = self.peers[s]
            limit, name = peer.channel.remote_limits.max_message_bytes, "Limits.max_message_bytes"
            args = self._max_arg_bytes[s]
            if args is not None and int(args) < limit:  # that node serves calls with less
                limit, name = int(args), "CallLimits.max_inflight_bytes or max_arg_bytes"
            if n > limit:
                raise MessageRefused(
                    f"this step's call to stage {s} ({peer.remote_address}) carries {n} bytes of "
                    f"microbatches, past the {limit}-byte limit of that stage's node (its "
                    f"{name}): take smaller batches"
                )

    def _failure(
        self,
        step: int,
        outcomes: list[BaseException | dict[str, Any]],
        ok: str = "finished, update not applied",
        *,
        order: list[int] | None = None,
        cut: Collection[int] = (),
    ) -> BaseException:
        """The error that started it, with every stage's account as a note. ``order``: the
        stages in the order their calls ended (default: stage order); ``cut``: the stages whose
        calls the driver cancelled, whose outcomes say only that."""
        lines = []
        ranked: list[tuple[int, int, BaseException]] = []
        when = {s: n for n, s in enumerate(order if order is not None else range(len(outcomes)))}
        for s, o in enumerate(outcomes):
            where = f"stage {s} ({self.peers[s].remote_address})"
            if not isinstance(o, BaseException):
                if self.peers[s].closed:
                    # it answered, then the driver lost it (its process died): its neighbours
                    # failed for that, and their RemoteError ("its link to stage s broke") was
                    # the root, where a stage lost before it answered is PeerDisconnected
                    lines.append(f"  {where}: {ok}, then its connection dropped")
                    ranked.append(
                        (
                            0,
                            when.get(s, len(outcomes) + s),
                            _gone(self.peers[s].remote_address, s, None, f"pipeline step {step}"),
                        )
                    )
                    continue
                lines.append(f"  {where}: {ok}")
                continue
            kind = o.remote_type if isinstance(o, RemoteError) else type(o).__name__
            text = o.remote_message if isinstance(o, RemoteError) else str(o)
            lines.append(f"  {where}: {kind}: {text}")
            # the root is the error that ended first, of the most telling kind: the driver lost
            # the stage itself; then a stage's own error; then "aborted because" (which names
            # the stage it came from); never the driver's cancel unless there is nothing else
            if s in cut:
                rank = 3
            elif isinstance(o, PeerDisconnected):  # the driver lost this stage itself: it is gone
                o = PeerDisconnected(f"pipeline step {step}: {where} is gone: {o}")
                rank = 0
            elif isinstance(o, MethodNotFound):
                o, rank = _no_stage(self.peers[s], s, o, f"pipeline step {step}"), 1
            elif isinstance(o, RemoteError) and o.remote_type == "BrokenResourceError":
                rank = 2
            else:
                rank = 1
            ranked.append((rank, when.get(s, len(outcomes) + s), o))
        root = min(ranked, key=lambda r: r[:2])[2]
        root.add_note(f"pipeline step {step}, every stage:\n" + "\n".join(lines))
        return root

    async def state(self) -> list[dict[str, Any]]:
        """Every stage's parameters, by name, in stage order. Refused (BrokenResourceError) by a
        stage another driver has configured since: what it holds is that driver's model."""
        self._check_open("pipeline.state")
        got = await asyncio.gather(
            *[peer.call("tw.pipeline.state", self._generation) for peer in self.peers], return_exceptions=True
        )
        states: list[dict[str, Any]] = []
        for s, o in enumerate(got):
            if isinstance(o, MethodNotFound):
                raise _no_stage(self.peers[s], s, o, "pipeline.state") from o
            if isinstance(o, BaseException):
                raise o
            states.append(o)
        return states

    def _check_open(self, what: str) -> None:
        """Refused on a closed pipeline, and anywhere but its loop: a call from another loop
        failed only at its first stage call, after the other stages had begun, which broke the
        pipeline for its own loop's later calls."""
        check_home(self._loop, what)
        if self._closed:
            raise ClosedResourceError("this pipeline is closed (Pipeline.connect again to use its stages)")

    async def aclose(self) -> None:
        """Tell the stages this driver is done (they drop their links), then disconnect;
        idempotent. The closing runs to its end even if the caller is cancelled meanwhile (the
        peers are closed all the same), and every call waits for it."""
        check_home(self._loop, "pipeline.aclose", closing=True)
        self._leak.detach()
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.get_running_loop().create_task(self._close(), name="tensorwire-pipeline-close")
        await asyncio.shield(self._closing)

    def abort(self) -> None:
        """Forceful close: every stage's connection drops at once, without a word to the stages,
        and the pipeline closes in the background; ``aclose()`` waits for that to finish. A step
        under way raises ClosedResourceError. Each stage sees its driver gone: it cuts a step
        under way short, applying nothing of it, drops its links to its neighbours and serves
        the next driver. A step whose commits were already on their way (every stage had
        finished it) is applied on the stages they reached, and the next ``Pipeline.connect``
        applies it on the others (the error's note says so), as for a driver that died there.

        Safe from any thread: called where the pipeline's loop is not running (another thread),
        it refuses the pipeline at once and hands the rest to that loop, where the connections
        drop on its next turn."""
        self._leak.detach()
        if elsewhere(self._loop, self.abort):
            self._closed = True
            return
        for peer in self.peers:
            peer.abort()
        if self._closing is None:
            self._closed = True
            self._closing = self._loop.create_task(self._close(), name="tensorwire-pipeline-close")

    async def _close(self) -> None:
        try:
            with contextlib.suppress(TensorWireError, TimeoutError):
                async with asyncio.timeout(5):
                    for close in (False, True):  # first every stage stops watching, then they unlink
                        await asyncio.gather(
                            *[
                                peer.call("tw.pipeline.release", self._generation, close)
                                for peer in self.peers
                                if not peer.closed
                            ],
                            return_exceptions=True,
                        )
        finally:
            await asyncio.gather(*[peer.aclose() for peer in self.peers], return_exceptions=True)

    async def __aenter__(self) -> Pipeline:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _dropped_unclosed(shown: str, loop: asyncio.AbstractEventLoop, peers: tuple[Peer, ...]) -> None:
    """A Pipeline collected unclosed. A finalizer runs wherever the collection happens (any
    thread, in the middle of anything), so this only hands the peers' abort to the pipeline's
    loop, and raises nothing of its own. Where every connection is closed already (the node
    closed them, or the stages went) nothing leaked, and it says nothing; else the warning
    comes last, so that a filter that turns it into an error (reported as unraisable) still
    leaves the connections to drop."""
    still_open = [peer for peer in peers if not peer.closed]
    if not still_open:
        return
    if not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            for peer in still_open:
                loop.call_soon_threadsafe(peer.abort)
    warnings.warn(f"unclosed {shown}: use 'async with' or aclose()", ResourceWarning, stacklevel=1)


# a microbatch's depth in its stage's call: the call's message (meta, name, args, kwargs), its
# args, and their list of microbatches hold it
_MICROBATCH_DEPTH = 3


def _nbytes(obj: Any) -> int:
    """The tensor bytes a microbatch puts on the wire, every leaf counted by its view (no copy,
    no device work), checked as its stage's call will flatten it: its dict keys as keys, and
    its depth in that call."""
    return wire_nbytes(obj, _MICROBATCH_DEPTH)


def _never_ran(error: BaseException | None) -> bool:
    """Whether a failed step call never ran on its stage: it failed at the driver, or the
    stage's node refused it before running it (its arguments past that node's CallLimits, say)."""
    if error is None:
        return False
    if isinstance(error, (InvalidArguments, MethodNotFound)):
        return True  # the server's refusal; an error the stage itself raised is a plain RemoteError
    return not isinstance(error, (RemoteError, PeerDisconnected))


def _error(task: asyncio.Task[Any]) -> BaseException | None:
    """The error a finished call raised (None: it answered, or it was cancelled)."""
    return None if task.cancelled() else task.exception()


async def _reserve(peer: Peer, s: int, token: str) -> int:
    """Reserve stage ``s`` for the driver ``token`` (the stage's ``_reserve``); the newest
    configuration it has seen. A node that serves no stage is named as such (the bare
    MethodNotFound said only that the method was not offered)."""
    session = peer.session.id if peer.session is not None else None
    try:
        generation: int = await peer.call("tw.pipeline.reserve", token, session)
    except MethodNotFound as exc:
        raise ConfigurationError(
            f"stage {s} ({peer.remote_address}) is a tensorwire node but not a pipeline stage: serve one there "
            "with `tensorwire stage --part FILE.py:FUNCTION` or pipeline.Stage(node, ...), or check the address"
        ) from exc
    return generation


def _no_stage(peer: Peer, s: int, error: MethodNotFound, what: str) -> ClosedResourceError:
    """Stage ``s``'s node serves on, its Stage does not (closed): the node's own word,
    ``error``, named no stage ("no method named 'tw.pipeline.step'; this node offers: none")."""
    closed = ClosedResourceError(
        f"{what}: stage {s} ({peer.remote_address}) serves no pipeline stage any more (its Stage "
        "was closed): Pipeline.connect again to stages that serve"
    )
    closed.__cause__ = error
    return closed


async def _link(peer: Peer, s: int, wait: float, **kwargs: Any) -> dict[str, Any]:
    """Stage ``s``'s ``tw.pipeline.link``: its links to its neighbours, within ``wait`` seconds
    (and 5 s for the answer). A stage closed since it was configured is named as closed."""
    try:
        paths: dict[str, Any] = await peer.call("tw.pipeline.link", _deadline=wait + 5, **kwargs)
    except MethodNotFound as exc:
        raise _no_stage(peer, s, exc, "Pipeline.connect") from exc
    return paths


# what of the caller's deadline a failed connect leaves for its error to reach the caller
_ERROR_MARGIN = 0.05


async def _give_up(peers: list[Peer], token: str | None) -> None:
    """A connect that failed or was cut short: let go of the stages it reserved (``token``,
    None if it reserved none), then close its connections, every one."""
    try:
        if token is not None:
            await _unreserve(peers, token)
    finally:
        await close_all(peers)


async def _unreserve(peers: list[Peer], token: str) -> None:
    """A connect that failed lets go of the stages it reserved at once, so that the running
    driver's call waiting on them starts (a stage lets go of one by itself after a while, or
    when this connection drops). A stage never reserved, or already taken, ignores this."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(2):
            await asyncio.gather(
                *[peer.call("tw.pipeline.unreserve", token) for peer in peers if not peer.closed],
                return_exceptions=True,
            )


async def _configure(peer: Peer, s: int, build_timeout: float | None, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Stage ``s``'s ``tw.pipeline.configure`` (its build), within ``build_timeout`` if given."""
    left = current_deadline()  # an enclosing tensorwire.rpc.deadline() is the caller's own
    ours = build_timeout is not None and (left is None or build_timeout <= left)
    within = f" within build_timeout={build_timeout:g} s" if ours else ""
    try:
        report: dict[str, Any] = await peer.call("tw.pipeline.configure", s, *args, _deadline=build_timeout, **kwargs)
    except MethodNotFound as exc:  # (reserved, then closed: the stage's node serves on)
        raise _no_stage(peer, s, exc, "Pipeline.connect") from exc
    except RemoteError as exc:
        if exc.remote_type != "DeadlineExceeded":
            raise
        # the stage answered before the deadline ran out, saying what held its build up (a
        # cancelled step's layer still running there): that goes to the caller, naming the stage
        raise DeadlineExceeded(
            f"stage {s} ({peer.remote_address}) was not configured{within}: {exc.remote_message}"
        ) from exc
    except DeadlineExceeded as exc:
        if not ours:
            raise
        raise DeadlineExceeded(
            f"stage {s} ({peer.remote_address}) was not configured{within}: "
            "building its part (Stage build=) took longer; give Pipeline.connect a larger build_timeout, or "
            "None to wait as long as the build takes"
        ) from exc
    return report


async def _settle(peers: list[Peer], links: list[dict[str, Any]], key: str) -> None:
    """A driver before this one died while its commits were on their way: every stage is now
    taken from it (configure did that first), so what each reports is final. A step that some
    stage applied is applied on every stage that still holds it; one that none applied is
    dropped everywhere. So no stage is left a step ahead of the others."""
    orphans = {s: (str(o[0]), int(o[1])) for s, info in enumerate(links) if (o := info.get("orphan"))}
    if not orphans:
        return
    applied = {(str(c[0]), int(c[1])) for info in links if (c := info.get("committed"))}
    await asyncio.gather(
        *[peers[s].call("tw.pipeline.settle", key, *orphan, orphan in applied) for s, orphan in orphans.items()]
    )


def _gone(address: str, s: int, error: BaseException | None, what: str) -> PeerDisconnected:
    """The driver lost stage ``s`` itself (its process died, its connection dropped): said
    as a step says it, naming the stage (the transport's own error, a bare PeerEOF
    "connection failed: [Errno 104] Connection reset by peer", named none)."""
    why = f": {error}" if error is not None else ": its connection dropped"
    gone = PeerDisconnected(f"{what}: stage {s} ({address}) is gone{why}")
    gone.__cause__ = error
    return gone


async def _each_stage(peers: list[Peer], calls: list[asyncio.Task[Any]]) -> list[Any]:
    """``_all_or_none`` over one call per stage of a connect: a stage the driver lost fails it
    as that stage gone (PeerDisconnected naming it), even where a neighbour's error came first
    (its link to the dead stage failed: a RemoteError that named only an address)."""
    try:
        return await _all_or_none(calls)
    except TensorWireError as exc:
        error: TensorWireError = exc
        for s, task in enumerate(calls):
            lost = None if task.cancelled() else task.exception()
            if isinstance(lost, PeerDisconnected) or (lost is None and peers[s].closed):
                error = _gone(peers[s].remote_address, s, lost, "Pipeline.connect")
                break
        if error is exc:
            raise
        error.add_note(f"the first error of the stages: {type(exc).__name__}: {exc}")
        raise error from exc


async def _all_or_none(calls: list[asyncio.Task[Any]]) -> list[Any]:
    """The results of every call, or the first error (in stage order) as soon as one fails, the
    others cancelled: a stage that refuses must not leave the rest waiting for it to link."""
    try:
        await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    for task in calls:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            raise exc
    return [task.result() for task in calls]
