"""The Docker engine of a runner host, watched: a stream of its events is held open, and when
it ends the engine stopped, and what was proved of each runner went with it. No runner takes
work until the engine is back, its shape is rebuilt and a new probe passed (or, at the
cooperative level, its proxy answered); sandboxes the engine took with it are reported as such.
Part of :class:`RunnerHost`, as :class:`Shapes`, :class:`Trust` and :class:`Outputs` are."""

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from runners.host.containers.engine import Engine, EngineError, Sandbox
from runners.host.identity import Identity
from runners.host.shapes import Shapes
from runners.host.trust import Trust

logger = logging.getLogger(__name__)

# The name of the engine that only asks Docker whether it answers (it owns no container).
HOST_ENGINE_NAME = "covey-host"
ENGINE_RETRY_SECONDS = 1.0  # while the Docker engine is gone: how often to ask for it again
# A sandbox that ended this long before the engine was seen gone, or after (until it was back),
# ended with the engine: an engine stops its containers before and after it closes its API.
ENGINE_STOP_SECONDS = 30.0


@dataclass
class EngineWatch:
    """Whether this host's Docker engine answers, and its outages: when it goes, every runner
    is distrusted; when it is back, each runner's shape is rebuilt and proved again."""

    make_engine: Callable[[str, str, str], Engine]  # the Docker seam (tests/fakes.py: a fake)
    identities: Callable[[], list[Identity]]  # the runners this host serves now
    shapes: Shapes
    trust: Trust
    isolation: bool  # hard isolation: proved by a probe, else by a proxy check
    wake: Callable[[], None]  # a heartbeat at once, so the control plane hears of it
    # The outages seen here (UTC; the end None while it lasts), the last few, and the event
    # stream held open to see the next (closed at stop).
    outages: list[tuple[datetime, datetime | None]] = field(default_factory=list)
    _docker: Engine | None = None
    _held: Any = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        """Until :meth:`stop`: hold a stream of the Docker engine's events open. It ends when
        the engine stops (or restarts): :meth:`lost`; once the engine answers again,
        :meth:`back`, before the runners take work again."""
        gone = False
        while not self._stop.is_set():
            try:
                gone = self._watch_once(gone)
            except Exception:
                # A defect (back's rebuild, say): said, and tried again; the runners
                # stay distrusted meanwhile, so no work is taken on what was not proved.
                logger.exception("covey runner: watching the Docker engine failed")
                gone = True
            # After a stream that ended or an engine that did not answer: not at once again
            # (an engine going down may answer a moment more, or refuse the stream).
            self._stop.wait(ENGINE_RETRY_SECONDS)

    def _watch_once(self, gone: bool) -> bool:
        """Hold the engine's event stream until it ends; whether the engine is gone after."""
        try:
            if self._docker is None:
                self._docker = self.make_engine(HOST_ENGINE_NAME, "", "")
            self._held = self._docker.open_events()  # an error answer too is an EngineError
        except EngineError as exc:
            if not gone:
                self.lost(str(exc))
            return True
        if gone:
            try:
                self.back()
            except Exception:
                with contextlib.suppress(Exception):
                    self._held.close()
                raise
        with contextlib.suppress(Exception):  # ended, or broken: the engine went either way
            for _ in self._held:
                pass
        if self._stop.is_set():
            return False
        self.lost("its event stream ended")
        return True

    def lost(self, why: str) -> None:
        """The Docker engine went away: whatever this host proved of its runners' egress went
        with it (the proxy, the networks, the firewall's place in the chains may come back
        otherwise). No runner takes work until the engine is back and proved again."""
        now = datetime.now(UTC)
        self.outages = [*self.outages[-9:], (now, None)]
        logger.warning(
            "covey runner: the Docker engine went away (%s): no launches until it is back, its"
            " isolation rebuilt and proved again",
            why,
        )
        when = f"{now:%Y-%m-%d %H:%M:%S} UTC"
        for identity in self.identities():
            level = "a new egress probe passes" if self.isolation else "its proxy answers"
            self.trust.distrust(
                identity,
                f"the Docker engine went away at {when}: no work until it is back and {level}",
            )
        self.wake()  # the control plane places no run here meanwhile

    def back(self) -> None:
        """The Docker engine answers again: rebuild each runner's shape (hard isolation), then
        prove it: a probe (hard isolation) or a proxy check (cooperative)."""
        if self.outages and self.outages[-1][1] is None:
            self.outages[-1] = (self.outages[-1][0], datetime.now(UTC))
        logger.info("covey runner: the Docker engine is back; rebuilding isolation, proving it")
        for identity in self.identities():
            self.shapes.ensure(identity)
            self.trust.prove_again(identity, "the Docker engine restarted")
        self.wake()  # work again, as soon as the control plane hears it

    def ended_with_it(self, sandbox: Sandbox) -> bool:
        """Did the sandbox end while the engine was going away (stopped with it)?"""
        began, ended = sandbox.started_at, sandbox.finished_at
        if ended is None:
            return False
        slack = timedelta(seconds=ENGINE_STOP_SECONDS)
        return any(
            gone - slack <= ended <= (back or datetime.now(UTC)) + slack
            and (began is None or began < gone)  # a sandbox started after cannot have been
            for gone, back in self.outages
        )

    def problem(self) -> str:
        """'' when this host's Docker engine answers, else why not."""
        try:
            if self._docker is None:
                self._docker = self.make_engine(HOST_ENGINE_NAME, "", "")
            return self._docker.problem()
        except EngineError as exc:
            return str(exc)

    def stop(self) -> None:
        """End :meth:`watch`: the stream it holds is closed."""
        self._stop.set()
        held = self._held
        if held is not None:
            with contextlib.suppress(Exception):
                held.close()
