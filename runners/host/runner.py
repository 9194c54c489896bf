"""A runner host: builds sandboxes on orders from its Celery queue, watches them, reports.

It never touches the database. Everything it knows comes from its identities (runner id and
token, in files) and the control-plane API; everything it does to Docker goes through the
Docker seam (runners/host/containers). One host serves one remote runner, or, on the
control-plane host, the built-in runners of every organisation (identity files the control
plane writes).

Launching is short (ask for the spec, create and start, report): the order is acknowledged
only once it is done, so a worker killed mid-launch gets the order again, and launching is
idempotent per run. Completion is seen by polling the engine, never by holding an order open.

Under hard isolation (``HostSettings.isolation``, COVEY_EGRESS_ISOLATION=network) each runner's
sandboxes go on its internal network, whose only exit is its proxy container
(containers/isolation.py). The shape is built at start and repaired at every reconcile, and
checked before every launch; a launch it cannot vouch for is refused (fail closed), never run
without it. Each runner is also probed (runners/probe/host.py) when it starts, on order, and
again while its last probe failed; until one passes it refuses every launch.

The host is made of parts, each in a module of its own: each runner's isolation shape
(shapes.py), whether it may take work (trust.py), the live output of running sandboxes
(output.py), the homes of runs launched here and their quotas (quotas.py), and the Docker
engine's event stream, held open to see it go and come back (engine_watch.py).
"""

import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import logs
from allowlists.entries import split_host_port
from egress.environment import proxy_environment
from egress.policy import hash_token
from runners.host.client import ControlPlaneError
from runners.host.config import HostSettings
from runners.host.containers import isolation
from runners.host.containers.builds import BuildFailed, ImageBuilder
from runners.host.containers.engine import (
    Engine,
    EngineError,
    Sandbox,
    SandboxSpec,
    ServiceNotReady,
    sandbox_owner,
)
from runners.host.containers.isolation import IsolationError, Shape
from runners.host.engine_watch import EngineWatch
from runners.host.identity import Identity, runner_name
from runners.host.output import Outputs
from runners.host.quotas import OverQuota, Quotas
from runners.host.sealing import unseal
from runners.host.serving import HomeLocks, HomeServer
from runners.host.shapes import Shapes
from runners.host.trust import Trust, UntrustedError
from runners.probe import host as probing
from runners.protocol import (
    DISK_FULL,
    ENGINE_RESTARTED,
    OVER_QUOTA,
    ActiveStatus,
    GitRemote,
    HomeUsage,
    LaunchSpec,
    Registry,
    ReportState,
    RunReport,
    ServiceRecord,
)

__all__ = ["HostSettings", "RunnerHost", "UntrustedError"]

logger = logging.getLogger(__name__)

RECONCILE_SECONDS = 30.0
ENDED = frozenset({"exited", "dead", "removing"})  # Docker's states of a sandbox that has ended
# A run placed this long ago with no sandbox lost its order (a worker died holding it): the
# runner launches it itself. Sooner, the order may still be on its way.
RELAUNCH_AFTER_SECONDS = 60.0
STOP_GRACE_SECONDS = 10
WARN_EVERY_SECONDS = 60.0  # the same trouble comes back every poll: say it once a minute
# A runner whose heartbeats go unanswered this long (and this many intervals) is not ready.
HEARTBEAT_SILENCE_SECONDS = 30.0
HEARTBEAT_SILENCE_TIMES = 3


def docker_engine(name: str, installation: str, legacy: str) -> Engine:
    """The engine of a runner (or of its probes) on this host's Docker."""
    return Engine(name, installation=installation, legacy_runner=legacy)


def docker_builder(settings: HostSettings) -> ImageBuilder:
    """What builds workplace images on this host's Docker."""
    return ImageBuilder(
        apt_sources=settings.apt_sources,
        network=settings.build_network,
        pip_index_url=settings.pip_index_url,
        npm_registry=settings.npm_registry,
    )


@dataclass
class RunnerHost:
    """The runners this process serves: it takes their orders and watches their sandboxes;
    their isolation shapes (:class:`Shapes`), whether they may take work (:class:`Trust`) and
    their live output (:class:`Outputs`) are kept by the parts it is made of."""

    identities: dict[int, Identity]
    settings: HostSettings
    builtin_dir: Path | None = None  # where built-in identities appear (control-plane host)
    url: str = ""
    # The Docker seam: (name on the engine, installation key, name before keys) → engine. The
    # fast tests give an in-memory one (tests/fakes.py).
    make_engine: Callable[[str, str, str], Engine] = docker_engine
    make_builder: Callable[[HostSettings], ImageBuilder] = docker_builder
    clock: Callable[[], float] = time.monotonic  # what probes and proxy checks are timed by
    shapes: Shapes = field(init=False)
    trust: Trust = field(init=False)
    quotas: Quotas = field(init=False)  # the homes of runs launched here, and their quotas
    docker: EngineWatch = field(init=False)  # whether the Docker engine answers; its outages
    outputs: Outputs = field(init=False, default_factory=Outputs)
    serving: HomeServer = field(init=False)  # homes to people outside
    _engines: dict[int, Engine] = field(default_factory=dict)
    _timed_out: set[str] = field(default_factory=set)  # stopped for their time: stop once
    # Runs whose sandboxes remove_sandboxes() took away (run id -> when, as UTC text): the
    # next start says so of them, rather than that their sandbox vanished.
    removed_at_exit: dict[str, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _last_reconcile: dict[int, float] = field(default_factory=dict)
    # Runs being launched right now: the reconcile leaves them alone.
    _launching: set[str] = field(default_factory=set)
    _launching_lock: threading.Lock = field(default_factory=threading.Lock)
    _home_locks: HomeLocks = field(default_factory=HomeLocks)
    _builder: ImageBuilder | None = None
    # Readiness: when the control plane last answered each runner's heartbeat (the clock's
    # time), why it did not since, and how often they are sent.
    _heard: dict[int, float] = field(default_factory=dict)
    _unheard: dict[int, str] = field(default_factory=dict)
    heartbeat_every: float = 0.0
    _beat_now: threading.Event = field(default_factory=threading.Event)  # a heartbeat at once
    # Launches by runner and outcome (started, refused), for the host's /metrics.
    launches: Counter[tuple[int, str]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.serving = HomeServer(
            self._home_of,
            self._home_busy,
            self._home_locks,
            owner=sandbox_owner(),  # what people upload is the agent's to change
        )
        self.shapes = Shapes(self.settings)
        self.quotas = Quotas(
            self.serving.ledger, self._home_locks, self._stop_run, clock=self.clock
        )
        self.trust = Trust(
            self.settings,
            self.shapes,
            engine_of=self.engine,
            make_engine=self.make_engine,
            clock=self.clock,
        )
        self.docker = EngineWatch(
            self.make_engine,
            lambda: list(self.identities.values()),
            self.shapes,
            self.trust,
            self.settings.hard,
            self._beat_now.set,
        )

    # --- identities ------------------------------------------------------------------------

    @classmethod
    def builtin(cls, directory: Path, url: str, settings: HostSettings) -> "RunnerHost":
        host = cls({}, settings, builtin_dir=directory, url=url)
        host.rescan()
        return host

    def rescan(self) -> None:
        """Pick up built-in identities the control plane has written since, and forget those
        it removed (their organisation was deleted)."""
        if self.builtin_dir is None or not self.builtin_dir.is_dir():
            return
        for runner_id, identity in list(self.identities.items()):
            if identity.path.parent == self.builtin_dir and not identity.path.exists():
                logger.info("covey runner: %s is gone; no longer serving it", identity.name)
                del self.identities[runner_id]
        known = {identity.path for identity in self.identities.values()}
        for path in sorted(self.builtin_dir.glob("*.json")):
            if path in known:
                continue  # its token is re-read from the file when it changes
            try:
                identity = Identity(path, self.url)
            except (OSError, ValueError, KeyError) as exc:
                logger.warning("covey runner: cannot read %s: %s", path, exc)
                continue
            self.identities.setdefault(identity.id, identity)

    def identity(self, runner_id: int) -> Identity:
        if runner_id not in self.identities:
            self.rescan()
        try:
            return self.identities[runner_id]
        except KeyError:
            raise LookupError(f"this host does not serve runner {runner_id}") from None

    def engine(self, identity: Identity) -> Engine:
        if identity.id not in self._engines:
            self._engines[identity.id] = self.make_engine(
                runner_name(identity),
                identity.installation,
                f"runner-{identity.id}",  # its name before installation keys
            )
        return self._engines[identity.id]

    # --- orders ----------------------------------------------------------------------------

    def launch(self, runner_id: int, run_id: str) -> None:
        """Build and start a run's sandbox; report it running (or why it could not be)."""
        identity = self.identity(runner_id)
        with self._launching_lock:
            if run_id in self._launching:
                return  # the same order twice, or the reconcile's relaunch: one is enough
            self._launching.add(run_id)
        try:
            with logs.bound(run_id=run_id, runner_id=runner_id):
                self._launch(identity, run_id)
        finally:
            with self._launching_lock:
                self._launching.discard(run_id)

    def _launch(self, identity: Identity, run_id: str) -> None:
        client = identity.client
        spec = client.start_run(run_id)
        if spec is None:
            logger.info("covey runner: run %s is no longer ours to start", run_id)
            return
        with logs.bound(agent_id=spec.agent):
            self._launch_spec(identity, run_id, spec)

    def _launch_spec(self, identity: Identity, run_id: str, spec: LaunchSpec) -> None:
        client = identity.client
        usage: HomeUsage | None = None
        services: tuple[ServiceRecord, ...] = ()
        try:
            if docker := self.docker_problem():  # say so at once, not what it stops first
                raise EngineError(f"no sandbox can start on this host: {docker}")
            self.trust.require(identity, proxied=spec.egress.enforce)
            shape = self.shapes.checked(identity) if self.settings.hard else None
            image = spec.image
            if any(group.specs for group in spec.packages):
                image = self.builder.image(image, spec.packages, spec.workplace or image)
            sandbox_spec = self._sandbox_spec(identity, spec, shape, image)
            # Not while a change from outside is being made; from here on they are refused.
            with self._home_locks.of(sandbox_spec.home):
                usage = self.quotas.note(
                    identity.id, run_id, sandbox_spec.home, spec.home_quota_bytes
                )
            sandbox = self.engine(identity).launch(sandbox_spec)
        except (EngineError, IsolationError, UntrustedError, OverQuota, ValueError) as exc:
            if isinstance(exc, OverQuota):
                usage = exc.usage
            if isinstance(exc, ServiceNotReady):
                services = (exc.record,)
            logger.warning("covey runner: run %s could not be built: %s", run_id, exc)
            self._count(identity, "refused")
            self._forget(run_id)
            if isinstance(exc, BuildFailed) and exc.log:
                client.put_log(run_id, f"covey: the workplace image could not be built\n{exc.log}")
            refused = RunReport(
                ReportState.BUILT, detail=str(exc)[:400], usage=usage, services=services
            )
            client.report(run_id, refused)
            return
        running = RunReport(
            ReportState.RUNNING,
            started_at=sandbox.started_at,
            usage=usage,
            image_id=sandbox.image_id,
            services=tuple(self.engine(identity).services(run_id)) if spec.services else (),
        )
        client.report(run_id, running)
        self._count(identity, "started")
        if sandbox.status in ("exited", "dead"):
            self._finish(identity, sandbox)  # it was done before this order came back
        else:
            self.outputs.follow(identity, self.engine(identity), run_id)

    def _stop_run(self, runner_id: int, run_id: str, grace: int) -> None:
        self.engine(self.identity(runner_id)).stop(run_id, timeout=grace)

    def cancel(self, runner_id: int, run_id: str) -> None:
        """Stop a run's sandbox; the watcher reports how it ended."""
        identity = self.identity(runner_id)
        with logs.bound(run_id=run_id, runner_id=runner_id):
            self.engine(identity).stop(run_id, timeout=STOP_GRACE_SECONDS)

    def home(self, runner_id: int, operation: str) -> None:
        """Serve an operation on a home this host holds (on a pool of its own: a transfer never
        holds up a launch). A paused runner serves its homes too."""
        identity = self.identity(runner_id)
        self.serving.submit(runner_id, identity.client, operation)

    def _home_busy(self, runner_id: int, agent_id: int) -> str:
        """Why the agent's home here may not be changed from outside now ('' when it may): a
        sandbox of the agent is being launched or runs."""
        if run_id := self.quotas.active_run(self._home_of(runner_id, agent_id)):
            return f"run {run_id} of this agent is active"
        identity = self.identity(runner_id)
        try:
            sandboxes = self.engine(identity).sandboxes()
        except EngineError as exc:
            return f"whether a run of this agent is active cannot be told ({exc})"
        for sandbox in sandboxes:
            # A sandbox being removed has ended (Docker says "removing" meanwhile).
            if sandbox.agent_id == agent_id and sandbox.status not in ENDED:
                return f"run {sandbox.run_id} of this agent is active"
        return ""

    def renew_token(self, runner_id: int, sealed: str) -> None:
        """Apply a token the control plane renewed (sealed with the current one)."""
        identity = self.identity(runner_id)
        identity.replace_token(unseal(hash_token(identity.token), sealed))
        logger.info("covey runner: runner %s has a renewed token", identity.name)

    @property
    def builder(self) -> ImageBuilder:
        """What builds workplace images (made when first needed)."""
        if self._builder is None:
            self._builder = self.make_builder(self.settings)
        return self._builder

    def _sandbox_spec(
        self, identity: Identity, spec: LaunchSpec, shape: Shape | None = None, image: str = ""
    ) -> SandboxSpec:
        egress = spec.egress
        services = [service.name for service in spec.services]  # reached directly, not proxied
        environment: dict[str, str] = {"COVEY_RUN": spec.run}
        network: dict[str, Any] = {"network": self.settings.network}
        direct = list(services)
        if spec.model is not None:
            # What the Claude runtime and the Anthropic SDKs read (either token variable).
            environment.update(
                ANTHROPIC_BASE_URL=spec.model.base_url,
                ANTHROPIC_API_KEY=spec.model.token,
                ANTHROPIC_AUTH_TOKEN=spec.model.token,
            )
            if "openai" in spec.model.vendors:  # what the OpenAI SDKs and Codex read
                environment.update(
                    OPENAI_BASE_URL=spec.model.base_url.rstrip("/") + "/openai/v1",
                    OPENAI_API_KEY=spec.model.token,
                )
            if spec.git or spec.registries:  # for the run only: the home is not touched
                environment.update(
                    brokered_environment(
                        spec.model.base_url, spec.model.token, spec.git, spec.registries
                    )
                )
            if shape is None:  # on the host's network, the gateway is reached directly
                direct.append(urlsplit(spec.model.base_url).hostname or "")
        if shape is not None:
            # The proxy is the only way out, so the sandbox is told where it is whatever the
            # control plane's COVEY_EGRESS_ENFORCE says.
            environment.update(
                proxy_environment(
                    shape.proxy_ip, isolation.PROXY_PORT, egress.credentials, services
                )
            )
            network = isolation.sandbox_network_options(shape)
        elif egress.enforce:
            if not self.settings.proxy:
                raise ValueError(
                    "egress enforcement is on and this runner has no proxy (COVEY_RUNNER_PROXY)"
                )
            host, port = split_host_port(self.settings.proxy)
            if host.lower() in services:
                # The holder's /etc/hosts names every service: the proxy's name would lead
                # to the service, which would get the run's egress credential.
                raise ValueError(
                    f"a service of this workplace is named {host}, as this runner's proxy"
                    " (COVEY_RUNNER_PROXY) is: rename the service"
                )
            environment.update(proxy_environment(host, port, egress.credentials, direct))
        return SandboxSpec(
            run_id=spec.run,
            agent_id=spec.agent,
            image=image or spec.image,
            command=list(spec.command),
            task=spec.task,
            environment=environment,
            home=self._home_of(identity.id, spec.agent),
            cpus=spec.cpus,
            memory_mb=spec.memory_mb,
            pids=spec.pids,
            timeout=spec.timeout,
            services=spec.services,
            **network,
        )

    # --- at start, and on order ----------------------------------------------------------

    def start_isolation(self) -> dict[int, Shape | None]:
        """Under hard isolation: build every runner's shape (empty at the cooperative level)."""
        return self.shapes.start(list(self.identities.values()))

    def start_probes(self) -> dict[int, probing.Report | None]:
        """Under hard isolation: probe every runner before it takes work."""
        return self.trust.start_probes(list(self.identities.values()))

    def start_proxy_checks(self) -> dict[int, str]:
        """At the cooperative level: does each runner's proxy answer its sandboxes?"""
        return self.trust.start_proxy_checks(list(self.identities.values()))

    def probe(
        self, runner_id: int, probe_id: str | None = None, reason: str = "ordered"
    ) -> probing.Report | None:
        """Run the egress probe the control plane ordered (or a new one) and report it."""
        return self.trust.probe(self.identity(runner_id), probe_id, reason)

    # --- watching --------------------------------------------------------------------------

    def watch(self) -> None:
        """Until :meth:`stop`: finish exited sandboxes, stop overdue ones, reconcile."""
        warned: dict[int, float] = {}

        def once_a_minute(runner_id: int) -> bool:  # the same trouble comes back every poll
            if time.monotonic() - warned.get(runner_id, -WARN_EVERY_SECONDS) < WARN_EVERY_SECONDS:
                return False
            warned[runner_id] = time.monotonic()
            return True

        while not self._stop.is_set():
            self.rescan()
            for identity in list(self.identities.values()):
                try:
                    self.sweep(identity)
                except (ControlPlaneError, EngineError, OSError) as exc:
                    if once_a_minute(identity.id):
                        logger.warning("covey runner %s: %s", identity.name, exc)
                except Exception:
                    # A defect: said with its traceback; the watcher goes on, as every run of
                    # this host depends on it.
                    if once_a_minute(identity.id):
                        logger.exception("covey runner %s: the watcher failed", identity.name)
                else:
                    warned.pop(identity.id, None)
            self._stop.wait(self.settings.poll)

    def heartbeats(self, interval: float) -> None:
        """Until :meth:`stop`: tell the control plane each runner is alive, and whether it can
        take work (what stops it, if anything)."""
        self.heartbeat_every = interval
        while not self._stop.is_set():
            self.beat()
            self._beat_now.wait(interval)
            self._beat_now.clear()  # after: a wake during the beat, or stop(), is not missed

    def beat(self) -> None:
        """One heartbeat of each runner, then the proxy checks that are due."""
        self.rescan()
        docker = self.docker_problem()  # one question for all: they share the engine
        for identity in list(self.identities.values()):
            self.shapes.look(identity)
            problem = "; ".join(p for p in self.problems(identity, docker).values() if p)
            try:
                identity.client.heartbeat(self.settings.isolation, problem)
            except ControlPlaneError as exc:
                self._unheard[identity.id] = str(exc)
                logger.warning("covey runner %s: heartbeat: %s", identity.name, exc)
            else:
                self._heard[identity.id] = self.clock()
                self._unheard.pop(identity.id, None)
            # Here, not in the watcher: a check runs a container, and the watcher must not
            # wait for it.
            self.trust.recheck_proxy(identity)

    def stop(self) -> None:
        self._stop.set()
        self.quotas.stop()
        self._beat_now.set()
        self.serving.close()
        self.docker.stop()

    # --- readiness ---------------------------------------------------------------------------

    def docker_problem(self) -> str:
        """'' when this host's Docker engine answers, else why not."""
        return self.docker.problem()

    def problems(self, identity: Identity, docker: str | None = None) -> dict[str, str]:
        """What stops the runner taking work, by check ('' for each that holds): Docker
        (``docker``: its answer, when just asked), its isolation shape (hard isolation), and
        its egress probe (hard isolation) or proxy check (cooperative), as last seen."""
        return {
            "docker": self.docker_problem() if docker is None else docker,
            "isolation": self.shapes.problem(identity),
            "egress": self.trust.problem(identity),
        }

    def heartbeat_age(self, identity: Identity) -> float | None:
        """Seconds since the control plane last answered the runner's heartbeat (None: never)."""
        heard = self._heard.get(identity.id)
        return None if heard is None else self.clock() - heard

    def heartbeat_problem(self, identity: Identity) -> str:
        """'' while the control plane answers the runner's heartbeats, else since when not."""
        age = self.heartbeat_age(identity)
        unheard = self._unheard.get(identity.id, "")
        if age is None:
            return f"no heartbeat answered yet{': ' + unheard if unheard else ''}"
        if age > max(HEARTBEAT_SILENCE_TIMES * self.heartbeat_every, HEARTBEAT_SILENCE_SECONDS):
            return f"the control plane has not answered a heartbeat for {age:.0f} s: {unheard}"
        return ""

    def _count(self, identity: Identity, outcome: str) -> None:
        with self._launching_lock:
            self.launches[identity.id, outcome] += 1

    def missing_default_image(self, image: str) -> dict[int, str]:
        """At start: runner id → why sandboxes of ``image`` (the default) cannot start here,
        for each runner whose engine lacks it (or cannot be asked)."""
        missing = {}
        for identity in list(self.identities.values()):
            try:
                problem = self.engine(identity).missing_image(image)
            except EngineError as exc:
                problem = str(exc)
            if problem:
                missing[identity.id] = problem
        return missing

    def remove_sandboxes(self) -> int:
        """Remove every sandbox of this host's runners, running or not, with its services, and
        their probe and proxy-check containers (as make run does at Ctrl-C: nothing of it is
        left behind); returns how many. Their runs are found gone at the next start, and fail
        saying so."""
        removed = 0
        for identity in list(self.identities.values()):
            try:
                engines = (self.engine(identity), self.trust.probe_engine(identity))
            except EngineError as exc:  # no Docker engine answers: nothing to remove from it
                logger.warning("covey runner %s: sandboxes not removed: %s", identity.name, exc)
                continue
            removed += self._remove_sandboxes(identity, engines)
        return removed

    def _remove_sandboxes(self, identity: Identity, engines: tuple[Engine, ...]) -> int:
        removed = 0
        for engine in engines:
            try:
                sandboxes = engine.sandboxes()
            except EngineError as exc:
                logger.warning("covey runner %s: sandboxes not removed: %s", identity.name, exc)
                continue
            for sandbox in sandboxes:
                try:
                    engine.remove(sandbox.run_id)
                except EngineError as exc:
                    logger.warning("covey runner: sandbox of run %s: %s", sandbox.run_id, exc)
                    continue
                logger.info("covey runner: removed the sandbox of run %s", sandbox.run_id)
                if engine is engines[0]:  # a run's (the others: probes and proxy checks)
                    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                    self.removed_at_exit[sandbox.run_id] = when
                removed += 1
        return removed

    def sweep(self, identity: Identity) -> None:
        engine = self.engine(identity)
        sandboxes = engine.sandboxes()
        now = datetime.now(UTC)
        for sandbox in sandboxes:
            if sandbox.status in ("exited", "dead"):
                self._finish(identity, sandbox)
            elif _overdue(sandbox, now) and sandbox.run_id not in self._timed_out:
                logger.info("covey runner: run %s ran out of time; stopping", sandbox.run_id)
                self._timed_out.add(sandbox.run_id)
                engine.stop(sandbox.run_id, timeout=STOP_GRACE_SECONDS)
        self.outputs.ship(identity)
        self.trust.probe_if_due(identity)
        if self.shapes.stale(identity):
            # A renewed token (an order, or a rewritten built-in identity): give the proxy the
            # new one now (once: if that fails, the reconcile tries again).
            self.shapes.ensure(identity)
        last = self._last_reconcile.get(identity.id, 0.0)
        if time.monotonic() - last >= RECONCILE_SECONDS:
            self.reconcile(identity, sandboxes)
            self._last_reconcile[identity.id] = time.monotonic()

    def reconcile(self, identity: Identity, sandboxes: list[Sandbox] | None = None) -> None:
        """Make Docker and the control plane agree: sandboxes without a live run go, runs
        whose sandbox vanished are reported, cancellations that were missed are carried out."""
        self.shapes.ensure(identity)  # before any relaunch below: it needs the shape
        engine = self.engine(identity)
        client = identity.client
        sandboxes = engine.sandboxes() if sandboxes is None else sandboxes
        # Before the active runs, like the sandboxes: a run placed since has its parts made
        # after this list, so it is never taken for a leftover.
        with_parts = engine.runs_with_parts()
        active = {run.run: run for run in client.active_runs()}
        held = {sandbox.run_id: sandbox for sandbox in sandboxes}
        for run_id, sandbox in held.items():
            run = active.get(run_id)
            if run is None and run_id in self._launching:
                continue
            if run is None and sandbox.legacy:
                continue  # perhaps another installation's: only a run we know makes it ours
            if run is None:
                if sandbox.status not in ("exited", "dead"):
                    logger.info("covey runner: removing sandbox %s (no live run)", run_id)
                self.outputs.stop(run_id)
                engine.remove(run_id)
                self._forget(run_id)
            elif run.cancel and sandbox.status == "running":
                engine.stop(run_id, timeout=STOP_GRACE_SECONDS)
            elif run.status != ActiveStatus.RUNNING and sandbox.status == "running":
                # Launched, but the report was lost.
                client.report(run_id, RunReport(ReportState.RUNNING, started_at=sandbox.started_at))
            elif (
                sandbox.status == "created"
                and run.status != ActiveStatus.RUNNING
                and not run.cancel
                and run.waited >= RELAUNCH_AFTER_SECONDS
            ):
                # Made, never started: the runner that made it stopped in between (killed), and
                # its order is not coming back. The launch starts the sandbox it finds.
                logger.info("covey runner: run %s was never started; launching it", run_id)
                self._relaunch(identity.id, run_id)
            if run is not None and sandbox.status == "running" and not run.cancel:
                # After a restart of this runner: go on from what the control plane has.
                self.outputs.follow(identity, engine, run_id, run.output_size)
        with self._launching_lock:
            launching = set(self._launching)
        for run_id in with_parts - set(held) - launching - set(active):
            if engine.get(run_id) is None:  # a sandbox made since is a live run's
                logger.info("covey runner: removing the services of run %s (no sandbox)", run_id)
                engine.remove_services(run_id)
        for run_id, run in active.items():
            if run_id in held or run_id in self._launching:
                continue
            if run.status == ActiveStatus.RUNNING:
                # The list of sandboxes came first: one launched since is not in it. Ask again.
                if engine.get(run_id) is None:
                    when = self.removed_at_exit.pop(run_id, "")
                    detail = (
                        f"removed when {identity.name} stopped, {when}"
                        if when
                        else f"no sandbox on {identity.name}"
                    )
                    gone = RunReport(ReportState.VANISHED, detail=detail)
                    client.report(run_id, gone)
                    self._forget(run_id)
            elif run.waited >= RELAUNCH_AFTER_SECONDS and not run.cancel:
                logger.info("covey runner: run %s lost its order; launching it", run_id)
                self._relaunch(identity.id, run_id)

    def _relaunch(self, runner_id: int, run_id: str) -> None:
        """Launch a run again on a thread of its own: a launch may build an image or wait for
        services, and the watcher must go on finishing and stopping the other runs meanwhile."""
        threading.Thread(target=self._launch_again, args=(runner_id, run_id), daemon=True).start()

    def _launch_again(self, runner_id: int, run_id: str) -> None:
        try:
            self.launch(runner_id, run_id)
        except Exception:  # the next reconcile tries again
            logger.exception("covey runner: run %s could not be launched again", run_id)

    def _finish(self, identity: Identity, sandbox: Sandbox) -> None:
        """Report an exited sandbox with its output, then remove it."""
        ids = {"run_id": sandbox.run_id, "agent_id": sandbox.agent_id, "runner_id": identity.id}
        with logs.bound(**ids):
            self._report_end(identity, sandbox)

    def _report_end(self, identity: Identity, sandbox: Sandbox) -> None:
        engine = self.engine(identity)
        client = identity.client
        run_id = sandbox.run_id
        # The whole log replaces what went live; the count says whether Docker kept all of it.
        total = self.outputs.stop(run_id, wait=5.0)
        changed, usage = self.quotas.after(run_id, self._home_of(identity.id, sandbox.agent_id))
        over = self.quotas.stopped_for(run_id)
        detail = "timeout" if _ran_out(sandbox) else f"{OVER_QUOTA}: {over}" if over else ""
        if not detail and sandbox.exit_code:
            full = _disk_full(self._home_of(identity.id, sandbox.agent_id))
            detail = f"{DISK_FULL}: {full}" if full else ""
        if not detail and sandbox.exit_code and self.docker.ended_with_it(sandbox):
            detail = ENGINE_RESTARTED
        try:
            client.put_log(run_id, engine.logs(run_id), total)  # the tail is kept there too
            services = tuple(engine.services(run_id, logs=True))
            ended = RunReport(
                ReportState.EXITED,
                exit_code=sandbox.exit_code,
                detail=detail,
                started_at=sandbox.started_at,
                finished_at=sandbox.finished_at,
                changes=changed,
                usage=usage,
                image_id=sandbox.image_id,
                services=services,
            )
            client.report(run_id, ended)
        except ControlPlaneError as exc:
            if exc.status != 404:  # 404: not a run of ours (any more): just clean up
                raise  # keep the sandbox: the next sweep reports it again
            if sandbox.legacy:
                return  # from before installation keys and not ours: another installation's
        engine.remove(run_id)
        self._timed_out.discard(run_id)
        self._forget(run_id)

    # --- homes ------------------------------------------------------------------------------

    def _home_of(self, runner_id: int, agent_id: int) -> Path:
        """Where an agent's home is on this host (each runner's homes in a folder of their own)."""
        return self.settings.homes / str(runner_id) / str(agent_id)

    def _forget(self, run_id: str) -> None:
        """What this host kept about a run that is over (or was never ours)."""
        self.quotas.forget(run_id)


def brokered_environment(
    gateway: str, token: str, remotes: tuple[GitRemote, ...], registries: tuple[Registry, ...]
) -> dict[str, str]:
    """What a sandbox's tools read to reach its connections through the gateway, for the run
    only (nothing is written to the home), with the run's token in ``COVEY_TOKEN``:

    - git's configuration (GIT_CONFIG_COUNT, git 2.31 and later), so that each remote's URLs
      lead to the gateway's ``/git/<host>/`` and requests there carry the run's token;
    - for each git host with an API, ``COVEY_API_<CONNECTION>``: its base URL at the gateway;
    - for each registry, ``COVEY_REGISTRY_<CONNECTION>``: its URL at the gateway, the token as
      the password in it, and pip told to trust the gateway's plain HTTP. No index is made
      pip's own: an extra index beside the public one invites dependency confusion (pip takes
      the highest version of a name wherever it is), so the agent names the index it means."""
    base = gateway.rstrip("/")
    environment = {"COVEY_TOKEN": token}
    if remotes:
        pairs = [(f"url.{base}/git/{remote.host}/.insteadOf", remote.url.rstrip("/") + "/")
                 for remote in remotes]  # fmt: skip
        pairs.append((f"http.{base}/git/.extraHeader", f"Authorization: Bearer {token}"))
        environment["GIT_CONFIG_COUNT"] = str(len(pairs))
        for number, (key, value) in enumerate(pairs):
            environment[f"GIT_CONFIG_KEY_{number}"] = key
            environment[f"GIT_CONFIG_VALUE_{number}"] = value
    for remote in remotes:
        if remote.api_host and remote.name:
            environment[_variable("COVEY_API_", remote.name)] = f"{base}/api/{remote.api_host}"
    parts = urlsplit(base)
    for registry in registries:
        url = f"{parts.scheme}://covey:{token}@{parts.netloc}{parts.path}/registry/{registry.name}"
        environment[_variable("COVEY_REGISTRY_", registry.name)] = url
    if registries and parts.scheme == "http":  # pip reads plain HTTP only from trusted hosts
        environment["PIP_TRUSTED_HOST"] = parts.netloc
    return environment


def _variable(prefix: str, name: str) -> str:
    return prefix + re.sub(r"[^A-Z0-9]", "_", name.upper())


def _overdue(sandbox: Sandbox, now: datetime) -> bool:
    if sandbox.timeout is None or sandbox.started_at is None:
        return False
    return (now - sandbox.started_at).total_seconds() > sandbox.timeout


def _ran_out(sandbox: Sandbox) -> bool:
    """It ran for its whole time: stopped for it, by this runner or one before a restart."""
    if sandbox.timeout is None or sandbox.started_at is None or sandbox.finished_at is None:
        return False
    return (sandbox.finished_at - sandbox.started_at).total_seconds() >= sandbox.timeout


DISK_FULL_BYTES = 1 << 20  # less room than this under a home that a failed run leaves: full


def _disk_full(home: Path) -> str:
    """Why a run that failed may have failed for its disk: the file system holding its home
    has (almost) no room or no inodes left ('' when it has room, or cannot be asked)."""
    try:
        stats = os.statvfs(home)
    except OSError:
        return ""
    free = stats.f_bavail * stats.f_frsize
    if free < DISK_FULL_BYTES:
        return f"the file system holding its home is full ({free} bytes free)"
    if stats.f_files and not stats.f_favail:  # f_files 0: the file system sets no such limit
        return "the file system holding its home has no inodes left"
    return ""
