"""A running sandbox's output on its way to the control plane (no Django: runner hosts).

A reader thread feeds what the engine streams; the runner's watcher takes a chunk every second
or so (sooner when much is waiting) and sends it with its offset, the number of bytes of UTF-8
the control plane already has. The whole log still goes once the sandbox has ended and
replaces what was sent live, so nothing here must be perfect, only in order: when the control
plane says it has another amount, the output goes on from there, or stops being sent live.
"""

import codecs
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from runners.host.client import ControlPlaneError, OutputBehind, OutputClosed
from runners.host.containers.engine import Engine, EngineError, LogStream
from runners.host.identity import Identity
from runners.protocol import cut_at_character, printable

logger = logging.getLogger(__name__)

SHIP_EVERY_SECONDS = 1.0
MAX_CHUNK_BYTES = 64 * 1024
MAX_PENDING_BYTES = 4 * 1024 * 1024  # a control plane that does not take it: stop, not grow


class LiveOutput:
    """The output of one run not yet confirmed by the control plane."""

    def __init__(
        self,
        skip: int = 0,
        *,
        every: float = SHIP_EVERY_SECONDS,
        max_chunk: int = MAX_CHUNK_BYTES,
        max_pending: int = MAX_PENDING_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sent = skip  # bytes the control plane has
        # A follower that restarted reads what Docker kept, which may lack the start.
        self._followed_from_start = skip == 0
        self._skip = skip  # bytes of the stream it has already (a follower that restarted)
        self._every = every
        self._max_chunk = max_chunk
        self._max_pending = max_pending
        self._clock = clock
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = b""
        self._seen = 0  # bytes of the stream so far, as the control plane counts them
        self._lock = threading.Lock()
        self._last = clock()
        self.ended = False  # the stream has ended: what is pending is all there will be
        self.given_up = ""  # why it is no longer sent live ('' while it is)

    def feed(self, data: bytes, *, final: bool = False) -> None:
        """What the sandbox wrote next (``final``: the stream has ended)."""
        encoded = printable(self._decoder.decode(data, final)).encode()
        with self._lock:
            self._seen += len(encoded)
            if self._skip:
                dropped = min(self._skip, len(encoded))
                encoded, self._skip = encoded[dropped:], self._skip - dropped
            if not self.given_up:
                self._pending += encoded
                if len(self._pending) > self._max_pending:
                    self._give_up("the control plane is not taking it fast enough")
            if final:
                self.ended = True

    def due(self) -> bool:
        """Whether a chunk should go now: some waits a second, or much waits, or the end."""
        with self._lock:
            if not self._pending or self.given_up:
                return False
            return (
                self.ended
                or len(self._pending) >= self._max_chunk
                or self._clock() - self._last >= self._every
            )

    def take(self) -> tuple[int, str] | None:
        """The next chunk and its offset (whole characters, at most ``max_chunk`` bytes); it
        stays pending until :meth:`confirm`."""
        with self._lock:
            if not self._pending or self.given_up:
                return None
            cut = cut_at_character(self._pending, self._max_chunk)
            return self.sent, self._pending[:cut].decode(errors="replace")

    def confirm(self, size: int) -> None:
        """The control plane has ``size`` bytes now (the answer to a chunk, or a conflict)."""
        with self._lock:
            self._last = self._clock()
            if size <= self.sent or size > self.sent + len(self._pending):
                # Behind, ahead of what was sent, or it took nothing: resending cannot help.
                self._give_up(f"the control plane has {size} bytes, this runner {self.sent}")
                return
            self._pending = self._pending[size - self.sent :]
            self.sent = size

    def failed(self) -> None:
        """A chunk did not get there (the control plane is unreachable): try again later."""
        with self._lock:
            self._last = self._clock()

    def give_up(self, why: str) -> None:
        """Send nothing more live (the stream is still counted)."""
        with self._lock:
            self._give_up(why)

    def _give_up(self, why: str) -> None:
        self.given_up = why
        self._pending = b""

    @property
    def total(self) -> int | None:
        """Bytes the sandbox wrote in all, once the stream has ended and was followed from
        its first byte; else None."""
        with self._lock:
            return self._seen if self.ended and self._followed_from_start else None

    @property
    def done(self) -> bool:
        """Nothing more will be sent: the stream ended and all of it went (or it gave up)."""
        with self._lock:
            return self.ended and (not self._pending or bool(self.given_up))


@dataclass(frozen=True)
class Followed:
    """A running sandbox whose output is sent live: the stream and the thread that reads it."""

    runner_id: int
    live: LiveOutput
    stream: LogStream
    reader: threading.Thread


class Outputs:
    """The running sandboxes of this host whose output goes live."""

    def __init__(self) -> None:
        self._live: dict[str, Followed | None] = {}  # None: being set up
        self._lock = threading.Lock()

    def live(self, run_id: str) -> Followed | None:
        with self._lock:
            return self._live.get(run_id)

    def follow(self, identity: Identity, engine: Engine, run_id: str, skip: int = 0) -> None:
        """Start sending a running sandbox's output live (``skip``: bytes the control plane
        has already); a second call for the same run does nothing."""
        with self._lock:
            if run_id in self._live:
                return
            self._live[run_id] = None  # taken: the engine is asked outside the lock
        try:
            stream = engine.follow_logs(run_id)
        except EngineError as exc:
            logger.info("covey runner: cannot follow the output of run %s: %s", run_id, exc)
            with self._lock:
                self._live.pop(run_id, None)
            return
        live = LiveOutput(skip)

        def read() -> None:
            for chunk in stream:
                live.feed(chunk)
            live.feed(b"", final=True)

        reader = threading.Thread(target=read, name=f"covey-output-{run_id}", daemon=True)
        reader.start()  # before it is listed: whoever finds it may join it
        with self._lock:
            stopped = run_id not in self._live  # it ended (and was stopped) meanwhile
            if not stopped:
                self._live[run_id] = Followed(identity.id, live, stream, reader)
        if stopped:
            stream.close()  # the reader ends with it

    def ship(self, identity: Identity) -> None:
        """Send every due chunk of this runner's running sandboxes (one each per call)."""
        with self._lock:
            mine = [
                (run_id, followed.live)
                for run_id, followed in self._live.items()
                if followed is not None and followed.runner_id == identity.id
            ]
        for run_id, live in mine:
            if live.done or not live.due() or (chunk := live.take()) is None:
                continue  # nothing to send; the stream and its count stay until the end
            offset, text = chunk
            try:
                live.confirm(identity.client.put_output(run_id, offset, text))
            except OutputBehind as exc:
                live.confirm(exc.size)
            except OutputClosed as exc:
                live.give_up(str(exc))
            except ControlPlaneError as exc:
                if exc.status is not None and 400 <= exc.status < 500:
                    live.give_up(str(exc))  # not ours any more, or refused: no point resending
                else:
                    live.failed()  # unreachable: try again in a second
                    logger.debug("covey runner: output of run %s: %s", run_id, exc)
                    continue
            if live.given_up:
                logger.info(
                    "covey runner: run %s: output no longer sent live: %s", run_id, live.given_up
                )

    def stop(self, run_id: str, wait: float = 0.0) -> int | None:
        """Stop following a run's output; the number of bytes the sandbox wrote in all when
        it was followed from its first byte to its end (waiting up to ``wait`` seconds for the
        stream to end), else None."""
        with self._lock:
            followed = self._live.pop(run_id, None)
        if followed is None:
            return None
        if wait:
            followed.reader.join(wait)
        followed.stream.close()
        return followed.live.total
