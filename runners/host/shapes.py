"""Each runner's isolation shape on this host, under hard isolation (COVEY_EGRESS_ISOLATION=
network): its internal network and proxy container (containers/isolation.py). Built at start,
repaired at every reconcile and after a token renewal, and checked just before every launch; a
launch it cannot vouch for is refused (fail closed), never run without it."""

import logging
import threading
import time

from runners.host.config import HostSettings
from runners.host.containers import isolation
from runners.host.containers.isolation import IsolationError, Shape
from runners.host.identity import Identity, runner_name

logger = logging.getLogger(__name__)

WARN_EVERY_SECONDS = 60.0  # the same trouble comes back every poll: say it once a minute


class Shapes:
    """The shapes of the runners this host serves (none at the cooperative level)."""

    def __init__(self, settings: HostSettings) -> None:
        self.settings = settings
        # Per runner: the shape last built (its image_id is the pin) and the token it was
        # built with.
        self._built: dict[int, Shape] = {}
        self._tokens: dict[int, str] = {}
        self._warned: dict[int, float] = {}
        self._problems: dict[int, str] = {}  # why the last build or check failed
        self._unready: dict[int, str] = {}  # what its proxy said at the last look (/readyz)
        # One build at a time: workers and the watcher must not make one runner's shape twice.
        self._lock = threading.Lock()

    def start(self, identities: list[Identity]) -> dict[int, Shape | None]:
        """At start: build every runner's shape, resolving the proxy image anew (the pin)."""
        if not self.settings.hard:
            return {}
        return {identity.id: self.ensure(identity, repin=True) for identity in identities}

    def ensure(self, identity: Identity, *, repin: bool = False) -> Shape | None:
        """Build or repair the runner's shape. Trouble is logged once a minute and the runner
        carries on; its launches are refused meanwhile (each tries to repair once itself).
        None: no shape."""
        if not self.settings.hard:
            return None
        try:
            shape = self._build(identity, repin=repin)
        except IsolationError as exc:
            self._problems[identity.id] = str(exc)
            last = self._warned.get(identity.id, -WARN_EVERY_SECONDS)
            if time.monotonic() - last >= WARN_EVERY_SECONDS:
                self._warned[identity.id] = time.monotonic()
                logger.warning("covey runner %s: isolation: %s", identity.name, exc)
            return None
        self._problems.pop(identity.id, None)
        if self._warned.pop(identity.id, None) is not None:
            logger.info("covey runner %s: isolation is in place again", identity.name)
        return shape

    def problem(self, identity: Identity) -> str:
        """'' when the runner's shape stood at its last build or check, else what was wrong
        (readiness: from what was last seen, without checking anew)."""
        if not self.settings.hard:
            return ""
        if identity.id not in self._built:
            return self._problems.get(identity.id, "its isolation has not been built yet")
        return self._problems.get(identity.id, "") or self._unready.get(identity.id, "")

    def look(self, identity: Identity) -> None:
        """Ask the runner's proxy whether it is ready (each heartbeat: a proxy whose policy
        went stale shows in the runner's readiness, and so in the admin, before a launch
        finds out); a change is logged once."""
        shape = self._built.get(identity.id)
        if not self.settings.hard or shape is None:
            return
        try:
            problem = isolation.proxy_readiness(shape)
        except Exception as exc:  # the SDK's errors too: the look says so, the runner goes on
            problem = f"the proxy could not be asked: {type(exc).__name__}: {exc}"
        before = self._unready.get(identity.id, "")
        if problem and not before:
            logger.warning("covey runner %s: %s", identity.name, problem)
        elif before and not problem:
            logger.info("covey runner %s: the proxy is ready again", identity.name)
        self._unready[identity.id] = problem

    def stale(self, identity: Identity) -> bool:
        """Built with a token the runner no longer has (renewed): its proxy polls policy with
        one that no longer works."""
        built_with = self._tokens.get(identity.id)
        return built_with is not None and built_with != identity.token

    def checked(self, identity: Identity) -> Shape:
        """The runner's shape, checked just before a sandbox goes in; IsolationError (with the
        run's status detail) when it cannot be vouched for, even after one repair."""
        shape = self._built.get(identity.id)
        problems = ["it was never built"] if shape is None else self._preflight(identity, shape)
        if problems:
            logger.warning(
                "covey runner %s: isolation preflight: %s; repairing",
                identity.name,
                "; ".join(problems),
            )
            try:
                shape = self._build(identity)
            except IsolationError as exc:
                problems = [str(exc)]
            else:
                problems = self._preflight(identity, shape)
        if problems or shape is None:
            self._problems[identity.id] = f"isolation preflight failed: {'; '.join(problems)}"
            raise IsolationError(self._problems[identity.id])
        self._problems.pop(identity.id, None)
        return shape

    def _build(self, identity: Identity, *, repin: bool = False) -> Shape:
        with self._lock:
            built = self._built.get(identity.id)
            # The pinned ID, once there is one: a rebuilt image under the same tag reaches this
            # runner only when it restarts.
            image = self.settings.proxy_image if repin or built is None else built.image_id
            token = self._tokens[identity.id] = identity.token
            try:
                shape = isolation.ensure_shape(
                    runner_name(identity),
                    image,
                    self.settings.proxy_control_plane_url or identity.url,
                    token,  # a renewed one changes the proxy's config hash: it is recreated
                    environment=self.settings.proxy_environment,
                )
            except IsolationError:
                raise
            except Exception as exc:
                # The docker SDK's own errors too (this module does not import docker): the
                # runner stays up and refuses launches instead (fail closed).
                raise IsolationError(f"{type(exc).__name__}: {exc}") from exc
            self._built[identity.id] = shape
            return shape

    def _preflight(self, identity: Identity, shape: Shape) -> list[str]:
        try:
            return isolation.preflight(shape, shape.image_id, runner_name(identity))
        except Exception as exc:  # whatever it is, the shape is not vouched for
            return [f"{type(exc).__name__}: {exc}"]
