"""Background work of the proxy, kept off the connection path: policy refresh (a stream of
changes followed, or polls) and log flush.

No Django and no mitmproxy here: the sources and sinks are plain callables, so the same feed
serves a proxy that reads the database and one that asks the control plane over HTTP.
"""

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from typing import Protocol

from egress.policy import Policy
from egress.protocol import (
    STREAM_KEEPALIVE,
    Current,
    DecisionEvent,
    PolicyDelta,
    PolicySnapshot,
    ProxyEvent,
    StartEvent,
    StopEvent,
    StreamLine,
)

logger = logging.getLogger(__name__)

MIN_ROUND_SECONDS = 0.02

# fetch(known_generation) -> a new snapshot, or None when the generation has not changed.
PolicySource = Callable[[str | None], PolicySnapshot | None]
DecisionSink = Callable[[list[ProxyEvent]], None]


class Refused(Exception):
    """A sink's receiver answered that it will never take these events (a malformed batch, or
    a control plane of before the events' kind), as opposed to that it cannot take them now:
    they are dropped, not retried, so that they never hold up the events behind them."""


class PolicyStream(Protocol):
    """A stream of the policy's changes (egress/proxy/control_plane.py follows the control
    plane's)."""

    def follow(self, known_generation: str | None) -> Iterator[StreamLine] | None:
        """The lines from ``known_generation`` on, until the stream ends or fails (it raises
        then); None when there is no stream to follow now."""
        ...

    def sync(self) -> str:
        """The generation that holds every change committed before this call (the stream's
        barrier); raises when it cannot say."""
        ...

    def interrupt(self) -> None:
        """End a ``follow`` in progress, from another thread."""
        ...


def reaches(held: str, target: str) -> bool:
    """Whether the stream's generation ``held`` is ``target`` or later. A generation is
    ``<load>.<number>``; one of another load is later (a load reads everything anew, and a
    proxy only ever moves to a newer one)."""
    held_load, _, held_number = held.rpartition(".")
    target_load, _, target_number = target.rpartition(".")
    if held_load != target_load:
        return True
    return (
        held_number.isdigit() and target_number.isdigit() and int(held_number) >= int(target_number)
    )


class PolicyFeed:
    """Keeps the current :class:`Policy` fresh: by following a stream of its changes where there
    is one, else by polling a source, in a thread.

    ``current()`` answers from memory. Once the last good answer from the source (or line of
    the stream) is older than ``grace`` seconds it returns None, and the proxy refuses
    everything (fail closed). While a stream is followed, the source is not polled; when the
    stream fails the feed polls at once and then every ``poll`` seconds, and tries the stream
    again every ``stream_retry`` seconds.
    """

    def __init__(
        self,
        source: PolicySource,
        *,
        poll: float,
        grace: float,
        stream: PolicyStream | None = None,
        stream_retry: float = 5.0,
        on_change: Callable[[Policy], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._poll = poll
        self._grace = grace
        if stream is not None and grace < 2 * STREAM_KEEPALIVE:
            # A quiet stream says so every STREAM_KEEPALIVE seconds: a shorter grace would
            # refuse everything between its lines.
            logger.warning(
                "covey: COVEY_EGRESS_POLICY_GRACE (%g s) is shorter than twice the policy"
                " stream's keepalive (%g s): this proxy polls, and does not follow the stream",
                grace,
                STREAM_KEEPALIVE,
            )
            stream = None
        self._stream = stream
        self._stream_retry = stream_retry
        self._stream_after = float("inf")  # when to try the stream: after the first poll
        self._on_change = on_change
        self._clock = clock
        self._policy: Policy | None = None
        self._confirmed_at = float("-inf")
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._wake = threading.Event()  # ask now, not at the next poll
        # What callers of refresh_soon() wait for: the end of the next round (one that starts
        # after they asked), or the next line of the stream, shared by all who ask before it.
        self._rounds = threading.Lock()
        self._next_round: Future[bool] | None = None
        # While a stream is followed, refresh_soon asks its barrier (a thread each, shared by
        # who asks before it starts) and waits for the generation it names.
        self._next_sync: Future[bool] | None = None
        self._reaching: list[tuple[str, Future[bool]]] = []
        self._thread = threading.Thread(target=self._run, name="covey-policy", daemon=True)
        self.failures = 0
        self.streaming = False  # following the stream now

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (or following) and wait for the thread."""
        self._stop.set()
        self._wake.set()
        if self._stream is not None and self.streaming:
            self._stream.interrupt()
        self._thread.join(timeout=10)
        self._answer_waiting(False)  # nobody will ask the source for them now

    def wait_ready(self, timeout: float) -> bool:
        """Wait until a first policy is loaded."""
        return self._ready.wait(timeout)

    def age(self) -> float | None:
        """Seconds since the source last answered (None: it never has)."""
        if self._confirmed_at == float("-inf"):
            return None
        return max(0.0, self._clock() - self._confirmed_at)

    def current(self) -> Policy | None:
        """The policy to decide with, or None when it is too old to trust."""
        if self._clock() - self._confirmed_at > self._grace:
            return None
        return self._policy

    def refresh_soon(self) -> "Future[bool]":
        """Have the polling thread ask the source at once. The future is done when a round that
        started after this call has ended: True when the source answered, False when it did
        not. Callers that come before that round starts share it: the source is asked once for
        all of them. While a stream is followed, the round is the stream's barrier: True once
        the policy holds every change committed before the barrier was asked."""
        if not self._thread.is_alive():
            # Never started (a feed driven by hand, as in tests): ask here. Stopped: nobody
            # will ask, and the caller refuses (no source I/O on the caller's thread).
            done: Future[bool] = Future()
            done.set_result(self._refresh_safely() if self._thread.ident is None else False)
            return done
        with self._rounds:
            if self.streaming:
                if self._next_sync is None:
                    self._next_sync = Future()
                    threading.Thread(
                        target=self._sync, name="covey-policy-sync", daemon=True
                    ).start()
                return self._next_sync
            if self._next_round is None:
                self._next_round = Future()
            self._wake.set()
            return self._next_round

    def _sync(self) -> None:
        """Ask the stream's barrier, then wait for the generation it names (in ``take``)."""
        assert self._stream is not None  # noqa: S101
        with self._rounds:  # who asks from now on waits for the next barrier
            waiting, self._next_sync = self._next_sync, None
        assert waiting is not None  # noqa: S101
        try:
            target = self._stream.sync()
        except Exception as exc:
            logger.warning("covey: the policy stream's barrier did not answer: %s", exc)
            waiting.set_result(False)
            return
        with self._rounds:
            held = self._policy.generation if self._policy else ""
            if not self.streaming:
                waiting.set_result(False)
            elif reaches(held, target):
                waiting.set_result(True)
            else:
                self._reaching.append((target, waiting))

    def _reached(self, *, ended: bool = False) -> None:
        """Answer who waits for a generation the policy now reaches (False for all: the stream
        ended)."""
        held = self._policy.generation if self._policy else ""
        with self._rounds:
            waiting = self._reaching
            self._reaching = [] if ended else [w for w in waiting if not reaches(held, w[0])]
        for target, future in waiting:
            if not future.done() and (ended or reaches(held, target)):
                future.set_result(not ended)

    def _refresh_safely(self) -> bool:
        try:
            self.refresh()
        except Exception as exc:
            logger.warning("covey: could not refresh the egress policy: %s", exc)
            return False
        return True

    def refresh(self) -> None:
        """Ask the source once; a new snapshot replaces the policy atomically."""
        known = self._policy.generation if self._policy else None
        snapshot = self._source(known)
        if snapshot is not None:
            self._replace(Policy.from_snapshot(snapshot))
        self._confirmed()

    def take(self, line: StreamLine) -> None:
        """Take one line of the stream: a snapshot or a delta replaces the policy atomically;
        each line confirms it. ValueError when the line does not follow what is held."""
        match line:
            case PolicySnapshot():
                self._replace(Policy.from_snapshot(line))
            case PolicyDelta():
                if self._policy is None:
                    raise ValueError("a delta, and no policy to apply it to")
                self._replace(self._policy.apply(line))
            case Current():
                held = self._policy.generation if self._policy else None
                if line.generation != held:
                    raise ValueError(f"the stream is at {line.generation}, this proxy at {held}")
        self._confirmed()
        self._answer_waiting(True)
        self._reached()

    def _replace(self, policy: Policy) -> None:
        self._policy = policy
        logger.info(
            "covey: egress policy %s loaded (%d agents)", policy.generation, len(policy.agents)
        )
        if self._on_change is not None:
            self._on_change(policy)

    def _confirmed(self) -> None:
        self._confirmed_at = self._clock()
        self._ready.set()

    def _answer_waiting(self, answered: bool) -> None:
        with self._rounds:
            waiting, self._next_round = self._next_round, None
        if waiting is not None and not waiting.done():
            waiting.set_result(answered)

    def _run(self) -> None:
        next_poll = self._clock()
        while not self._stop.is_set():
            if self._stream is not None and self._clock() >= self._stream_after:
                if self._follow():
                    next_poll = self._clock()  # the stream followed is away: poll at once
                if self._stop.is_set():
                    break
            if self._clock() >= next_poll or self._wake.is_set():
                self._round()
                next_poll = self._clock() + self._poll
                if self._stream is not None and self._stream_after == float("inf"):
                    self._stream_after = self._clock()  # the poll may have named a stream
                # Rounds asked for come at most every MIN_ROUND_SECONDS, however many ask.
                self._stop.wait(MIN_ROUND_SECONDS)
            # Without a stream, only the next poll (a time to try one would be past, always).
            until = next_poll if self._stream is None else min(next_poll, self._stream_after)
            self._wake.wait(max(0.0, until - self._clock()))

    def _round(self) -> None:
        """Poll the source once (the answer to whoever asked before it started)."""
        with self._rounds:
            self._wake.clear()
            waiting, self._next_round = self._next_round, None
        answered = False
        try:
            self.refresh()
            answered = True
        except Exception as exc:
            self.failures += 1
            # Once when it starts failing, then every 30 s: the poll runs many times a second.
            if self._clock() - self._last_warning >= 30:
                self._last_warning = self._clock()
                logger.warning("covey: could not refresh the egress policy: %s", exc)
            logger.debug("policy refresh failure", exc_info=True)
        else:
            if self.failures:
                logger.warning("covey: egress policy source answers again")
                self.failures = 0
                self._last_warning = float("-inf")
        finally:
            if waiting is not None and not waiting.done():
                waiting.set_result(answered)

    _last_warning = float("-inf")
    _stream_warning = float("-inf")

    def _follow(self) -> bool:
        """Follow the stream until it ends; True when it was followed (a line came, whether
        or not it was good), False when there is none to follow now, or it failed before its
        first line (a refused connection: the feed polls on its schedule meanwhile)."""
        assert self._stream is not None  # noqa: S101
        known = self._policy.generation if self._policy else None
        followed = False
        try:
            lines = self._stream.follow(known)
            if lines is None:
                self._stream_after = float("inf")  # asked again after the next poll
                return False
            self.streaming = True
            for line in lines:
                came_before, followed = followed, True
                self.take(line)
                if not came_before:
                    logger.info("covey: following the egress policy stream")
                    self._stream_warning = float("-inf")
                if self._stop.is_set():
                    break
            else:
                raise ConnectionError("the stream ended")
        except Exception as exc:
            if not self._stop.is_set() and self._clock() - self._stream_warning >= 30:
                self._stream_warning = self._clock()
                logger.warning(
                    "covey: the egress policy stream is away (%s): polling every %g s, and"
                    " trying it again every %g s",
                    exc,
                    self._poll,
                    self._stream_retry,
                )
            logger.debug("policy stream failure", exc_info=True)
        finally:
            self.streaming = False
            self._reached(ended=True)
        self._stream_after = self._clock() + self._stream_retry
        return followed


class DecisionLog:
    """Buffers decision events in memory and writes them in batches from a thread.

    The connection path only appends to a deque. When the sink fails, events are kept and
    retried; past ``max_buffer`` the oldest are dropped and counted.

    Each decision is numbered within this log's ``boot`` (a random id of the process's life),
    between a ``start`` event and, once everything before it is written, a ``stop`` event that
    says how many there were: the control plane tells from them what its log is missing
    (egress.models.ProxySession), whether dropped here or lost with a killed process.
    """

    def __init__(
        self, sink: DecisionSink, *, interval: float = 0.5, max_buffer: int = 200_000
    ) -> None:
        self._sink = sink
        self._interval = interval
        self._events: deque[ProxyEvent] = deque(maxlen=max_buffer)
        self._max_buffer = max_buffer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="covey-decisions", daemon=True)
        self.dropped = 0
        self.written = 0
        self.boot = uuid.uuid4().hex
        # The ids: a random high half with uuid4's version, then the RFC 4122 variant and a count.
        self._id_base = (uuid.uuid4().int >> 64) << 64 | 0b10 << 62
        self._ids = 0
        self.made = 0  # decisions numbered so far
        self._started_at = time.time()
        self._start_owed = True
        self._start_warned = float("-inf")

    def new_id(self) -> str:
        """A decision's id: unique without a system call each (uuid4 reads the kernel's random
        source every time): this log's random 64 bits, then a count, as a UUID (version 4)."""
        self._ids += 1
        return str(uuid.UUID(int=self._id_base | self._ids))

    def number(self) -> int:
        """The next decision's number in this log's ``boot`` (for one made with both already:
        :meth:`add` numbers one that has none)."""
        self.made += 1
        return self.made

    def add(self, event: ProxyEvent) -> None:
        """Queue one event (never blocks, never does I/O); a decision gets its number."""
        if isinstance(event, DecisionEvent) and event.boot != self.boot:
            event = replace(event, boot=self.boot, seq=self.number())
        if len(self._events) == self._max_buffer:
            self.dropped += 1
        self._events.append(event)

    @property
    def waiting(self) -> int:
        """Events queued and not yet written."""
        return len(self._events)

    def start(self) -> None:
        """Say this proxy started (at once, so that even a life too short for one batch is
        known), and start flushing."""
        self._started_at = time.time()
        with contextlib.suppress(Exception):  # said; written before the first batch
            self._say_started()
        self._thread.start()

    def stop(self) -> None:
        """Flush what is left and stop: the stop event goes last, and only when all before it
        is written (else the control plane admits the gap when this proxy starts again)."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._say_started()
            while self._events:
                self.flush()
            self._mark(StopEvent(boot=self.boot, seq=self.made, at=time.time()))
        except Exception:
            if self._events:
                logger.warning("covey: %d egress decisions were not written", len(self._events))
            else:  # all were; the stop event was not: the control plane will admit a gap
                logger.warning("covey: the control plane was not told this proxy stopped")

    def _say_started(self) -> None:
        """Write the start event, once; it is owed (kept apart from the buffer, which may drop
        events) until written or refused."""
        if not self._start_owed:
            return
        try:
            self._mark(StartEvent(boot=self.boot, at=self._started_at))
        except Exception as exc:  # said once, then every 30 s: tried again each round
            if time.monotonic() - self._start_warned >= 30:
                self._start_warned = time.monotonic()
                logger.warning("covey: could not write the egress proxy's start: %s", exc)
            raise
        self._start_owed = False

    def _mark(self, event: StartEvent | StopEvent) -> None:
        """Write a start or stop event on its own: a control plane of before sessions refuses
        them, and then the decisions go on without (it keeps no session to write them in)."""
        try:
            self._sink([event])
        except Refused as exc:
            logger.warning(
                "covey: the control plane refused this proxy's %s (%s): it keeps no record of "
                "the proxy's sessions, so a gap in its decision log will not be admitted",
                event.event,
                exc,
            )

    def flush(self) -> None:
        """Write everything queued so far; on failure the events not written go back to the
        front. Events the receiver refuses for good are found by halving the batch, and only
        they are dropped (and counted): one malformed event never costs the others."""
        self._say_started()
        batch: list[ProxyEvent] = []
        while self._events and len(batch) < 5000:
            batch.append(self._events.popleft())
        parts = [batch] if batch else []
        while parts:
            part = parts.pop(0)
            try:
                self._sink(part)
            except Refused as exc:
                if len(part) > 1:
                    parts[:0] = [part[: len(part) // 2], part[len(part) // 2 :]]
                    continue
                self.dropped += 1
                logger.error("covey: an egress event was refused and dropped: %s", exc)
                continue
            except Exception as exc:
                rest = [event for unwritten in (part, *parts) for event in unwritten]
                logger.warning("covey: could not write %d egress decisions: %s", len(rest), exc)
                self._events.extendleft(reversed(rest))
                raise
            self.written += len(part)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._say_started()
                while self._events:
                    self.flush()
            except Exception:  # logged in flush; retried next round
                logger.debug("decision log write failure", exc_info=True)
