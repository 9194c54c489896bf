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
without it. Each runner is also probed (probing.py) when it starts, on order, and again while
its last probe failed; until one passes it refuses every launch.
"""

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from allowlists.entries import split_host_port
from egress.environment import proxy_environment
from egress.policy import hash_token
from runners.host import probing
from runners.host.client import ControlPlaneError, OutputBehind, OutputClosed
from runners.host.containers import isolation
from runners.host.containers.engine import Engine, EngineError, LogStream, Sandbox, SandboxSpec
from runners.host.containers.isolation import IsolationError, Shape
from runners.host.identity import Identity, runner_name
from runners.host.output import LiveOutput
from runners.host.sealing import unseal
from runners.protocol import (
    ISOLATION_COOPERATIVE,
    ISOLATION_NETWORK,
    LaunchSpec,
    ReportState,
    RunReport,
)

logger = logging.getLogger(__name__)


class UntrustedError(Exception):
    """The runner may not take work: its egress probe has not passed (hard isolation)."""


RECONCILE_SECONDS = 30.0
# A run placed this long ago with no sandbox lost its order (a worker died holding it): the
# runner launches it itself. Sooner, the order may still be on its way.
RELAUNCH_AFTER_SECONDS = 60.0
STOP_GRACE_SECONDS = 10
WARN_EVERY_SECONDS = 60.0  # the same trouble comes back every poll: say it once a minute


@dataclass
class HostSettings:
    homes: Path  # <homes>/<runner id>/<agent id> is an agent's home
    proxy: str = ""  # host:port of the egress proxy as sandboxes reach it
    network: str | None = None
    poll: float = 0.5
    # Hard isolation: the proxy container's image (pinned to its ID at the first build), the
    # control plane's URL as that container reaches it ("": the runner's own), and more
    # variables for it (its resolvers, the private ranges it may reach).
    isolation: bool = False
    proxy_image: str = "covey-egress:latest"
    proxy_control_plane_url: str = ""
    proxy_environment: Mapping[str, str] = field(default_factory=dict)
    # The egress probe: what stands for the outside world, and how long a runner whose probe
    # failed waits before it probes again on its own.
    probe_targets: probing.Targets = field(default_factory=probing.Targets)
    probe_retry: float = 300.0
    # The image the proxy check runs in (it needs python3): the default sandbox image.
    check_image: str = "covey-base:trixie"

    @property
    def isolation_mode(self) -> str:
        return ISOLATION_NETWORK if self.isolation else ISOLATION_COOPERATIVE


@dataclass(frozen=True)
class ProbeState:
    """A runner's latest egress probe on this host."""

    passed: bool
    at: float  # time.monotonic()
    summary: str
    retry: float | None = None  # seconds until the next try while it has not passed (None:
    # HostSettings.probe_retry)


@dataclass(frozen=True)
class ProxyCheck:
    """Whether the proxy sandboxes are told of answered from the sandbox network, last time."""

    problem: str  # "" when it answered
    at: float  # time.monotonic()


# The proxy sandboxes are told of is checked again this long after a failed check, and this
# long after one that passed (by the watcher, so launches seldom wait for it).
PROXY_RECHECK_SECONDS = 10.0
PROXY_CHECK_EVERY_SECONDS = 300.0


@dataclass(frozen=True)
class Followed:
    """A running sandbox whose output is sent live: the stream and the thread that reads it."""

    runner_id: int
    live: LiveOutput
    stream: LogStream
    reader: threading.Thread


def docker_engine(name: str, installation: str, legacy: str) -> Engine:
    """The engine of a runner (or of its probes) on this host's Docker."""
    return Engine(name, installation=installation, legacy_runner=legacy)


@dataclass
class RunnerHost:
    """The runners this process serves, and what it does for them."""

    identities: dict[int, Identity]
    settings: HostSettings
    builtin_dir: Path | None = None  # where built-in identities appear (control-plane host)
    url: str = ""
    # The Docker seam: (name on the engine, installation key, name before keys) → engine. The
    # fast tests give an in-memory one (tests/fakes.py).
    make_engine: Callable[[str, str, str], Engine] = docker_engine
    _engines: dict[int, Engine] = field(default_factory=dict)
    _timed_out: set[str] = field(default_factory=set)  # stopped for their time: stop once
    _stop: threading.Event = field(default_factory=threading.Event)
    _last_reconcile: dict[int, float] = field(default_factory=dict)
    # Runs being launched right now: the reconcile leaves them alone.
    _launching: set[str] = field(default_factory=set)
    _launching_lock: threading.Lock = field(default_factory=threading.Lock)
    # Per runner: the shape last built (its image_id is the pin) and the token last tried.
    _shapes: dict[int, Shape] = field(default_factory=dict)
    _shape_tokens: dict[int, str] = field(default_factory=dict)
    _isolation_warned: dict[int, float] = field(default_factory=dict)
    # Builds one at a time: workers and the watcher must not make one runner's shape twice.
    _isolation_lock: threading.Lock = field(default_factory=threading.Lock)
    # Per runner: its latest egress probe, and one probe at a time.
    _probes: dict[int, ProbeState] = field(default_factory=dict)
    _probe_locks: dict[int, threading.Lock] = field(default_factory=dict)
    _probe_engines: dict[int, Engine] = field(default_factory=dict)
    # Per runner (cooperative level): the last check that its sandboxes reach their proxy.
    _proxy_checks: dict[int, ProxyCheck] = field(default_factory=dict)
    _proxy_check_locks: dict[int, threading.Lock] = field(default_factory=dict)
    # Running sandboxes whose output is being sent live (None: being set up).
    _live: dict[str, "Followed | None"] = field(default_factory=dict)
    _live_lock: threading.Lock = field(default_factory=threading.Lock)

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
        try:
            if self.settings.isolation:
                self._check_probe(identity)
            elif spec.egress.enforce and (problem := self.check_proxy(identity)):
                raise UntrustedError(problem)
            shape = self._checked_shape(identity) if self.settings.isolation else None
            sandbox = self.engine(identity).launch(self._sandbox_spec(identity, spec, shape))
        except (EngineError, IsolationError, UntrustedError, ValueError) as exc:
            logger.warning("covey runner: run %s could not be built: %s", run_id, exc)
            client.report(run_id, RunReport(ReportState.BUILT, detail=str(exc)[:400]))
            return
        client.report(run_id, RunReport(ReportState.RUNNING, started_at=sandbox.started_at))
        if sandbox.status in ("exited", "dead"):
            self._finish(identity, sandbox)  # it was done before this order came back
        else:
            self.follow_output(identity, run_id)

    def cancel(self, runner_id: int, run_id: str) -> None:
        """Stop a run's sandbox; the watcher reports how it ended."""
        identity = self.identity(runner_id)
        self.engine(identity).stop(run_id, timeout=STOP_GRACE_SECONDS)

    def renew_token(self, runner_id: int, sealed: str) -> None:
        """Apply a token the control plane renewed (sealed with the current one)."""
        identity = self.identity(runner_id)
        identity.replace_token(unseal(hash_token(identity.token), sealed))
        logger.info("covey runner: runner %s has a renewed token", identity.name)

    def _sandbox_spec(
        self, identity: Identity, spec: LaunchSpec, shape: Shape | None = None
    ) -> SandboxSpec:
        egress = spec.egress
        environment: dict[str, str] = {"COVEY_RUN": spec.run}
        network: dict[str, Any] = {"network": self.settings.network}
        if shape is not None:
            # The proxy is the only way out, so the sandbox is told where it is whatever the
            # control plane's COVEY_EGRESS_ENFORCE says.
            environment.update(
                proxy_environment(shape.proxy_ip, isolation.PROXY_PORT, egress.credentials)
            )
            network = isolation.sandbox_network_options(shape)
        elif egress.enforce:
            if not self.settings.proxy:
                raise ValueError(
                    "egress enforcement is on and this runner has no proxy (COVEY_RUNNER_PROXY)"
                )
            host, port = split_host_port(self.settings.proxy)
            environment.update(proxy_environment(host, port, egress.credentials))
        return SandboxSpec(
            run_id=spec.run,
            agent_id=spec.agent,
            image=spec.image,
            command=list(spec.command),
            task=spec.task,
            environment=environment,
            home=self.settings.homes / str(identity.id) / str(spec.agent),
            cpus=spec.cpus,
            memory_mb=spec.memory_mb,
            pids=spec.pids,
            timeout=spec.timeout,
            **network,
        )

    # --- isolation -------------------------------------------------------------------------

    def start_isolation(self) -> dict[int, Shape | None]:
        """At start, under hard isolation: build every runner's shape, resolving the proxy image
        anew (the pin). Empty at the cooperative level."""
        if not self.settings.isolation:
            return {}
        return {
            identity.id: self.ensure_isolation(identity, repin=True)
            for identity in list(self.identities.values())
        }

    def ensure_isolation(self, identity: Identity, *, repin: bool = False) -> Shape | None:
        """Build or repair the runner's shape (at start, at every reconcile, after a token
        renewal). Trouble is logged once a minute and the runner carries on; its launches are
        refused meanwhile (each tries to repair once itself). None: no shape."""
        if not self.settings.isolation:
            return None
        try:
            shape = self._build_shape(identity, repin=repin)
        except IsolationError as exc:
            last = self._isolation_warned.get(identity.id, -WARN_EVERY_SECONDS)
            if time.monotonic() - last >= WARN_EVERY_SECONDS:
                self._isolation_warned[identity.id] = time.monotonic()
                logger.warning("covey runner %s: isolation: %s", identity.name, exc)
            return None
        if self._isolation_warned.pop(identity.id, None) is not None:
            logger.info("covey runner %s: isolation is in place again", identity.name)
        return shape

    def _build_shape(self, identity: Identity, *, repin: bool = False) -> Shape:
        with self._isolation_lock:
            built = self._shapes.get(identity.id)
            # The pinned ID, once there is one: a rebuilt image under the same tag reaches this
            # runner only when it restarts.
            image = self.settings.proxy_image if repin or built is None else built.image_id
            token = self._shape_tokens[identity.id] = identity.token
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
            self._shapes[identity.id] = shape
            return shape

    def _checked_shape(self, identity: Identity) -> Shape:
        """The runner's shape, checked just before a sandbox goes in; IsolationError (with the
        run's status detail) when it cannot be vouched for, even after one repair."""
        shape = self._shapes.get(identity.id)
        problems = ["it was never built"] if shape is None else self._preflight(identity, shape)
        if problems:
            logger.warning(
                "covey runner %s: isolation preflight: %s; repairing",
                identity.name,
                "; ".join(problems),
            )
            try:
                shape = self._build_shape(identity)
            except IsolationError as exc:
                problems = [str(exc)]
            else:
                problems = self._preflight(identity, shape)
        if problems or shape is None:
            raise IsolationError(f"isolation preflight failed: {'; '.join(problems)}")
        return shape

    def _preflight(self, identity: Identity, shape: Shape) -> list[str]:
        try:
            return isolation.preflight(shape, shape.image_id, runner_name(identity))
        except Exception as exc:  # whatever it is, the shape is not vouched for
            return [f"{type(exc).__name__}: {exc}"]

    # --- the egress probe ---------------------------------------------------------------------

    def start_probes(self) -> dict[int, probing.Report | None]:
        """At start, under hard isolation: probe every runner before it takes work."""
        if not self.settings.isolation:
            return {}
        return {
            identity.id: self._probe_safely(identity, None, "runner start")
            for identity in list(self.identities.values())
        }

    def probe(
        self, runner_id: int, probe_id: str | None = None, reason: str = "ordered"
    ) -> probing.Report | None:
        """Run an egress probe (the one the control plane ordered, or a new one) in the
        runner's real shape and report it; None when the order is no longer ours."""
        identity = self.identity(runner_id)
        lock = self._probe_locks.setdefault(identity.id, threading.Lock())
        with lock:
            client = identity.client
            order = client.begin_probe(probe_id, self.settings.isolation_mode, reason)
            if order is None:
                logger.info("covey runner %s: probe %s is not ours to run", identity.name, probe_id)
                return None
            if order.error:  # the control plane finished it already
                report = probing.failed(order.error)
            else:
                try:
                    report = probing.run(
                        self._probe_engine(identity),
                        order,
                        self.settings.probe_targets,
                        self._probe_where(identity),
                        self.settings.homes / str(identity.id),
                    )
                except (probing.ProbeError, EngineError, IsolationError, ValueError) as exc:
                    report = probing.failed(str(exc))
                client.report_probe(
                    order.probe, [r.as_dict() for r in report.results], report.detail
                )
            summary = report.summary
            self._probes[identity.id] = ProbeState(report.passed, time.monotonic(), summary)
        level = logging.INFO if report.passed else logging.WARNING
        logger.log(
            level,
            "covey runner %s: egress probe %s: %s\n%s",
            identity.name,
            "passed" if report.passed else "FAILED",
            summary,
            "\n".join(report.lines),
        )
        return report

    def _probe_safely(
        self, identity: Identity, probe_id: str | None, reason: str
    ) -> probing.Report | None:
        try:
            return self.probe(identity.id, probe_id, reason)
        except ControlPlaneError as exc:
            # Not run, or not reported: it proves nothing, and is tried again soon (not at
            # every poll). A probe that had passed before still counts meanwhile.
            logger.warning("covey runner %s: egress probe: %s", identity.name, exc)
            state = self._probes.get(identity.id)
            if state is None or not state.passed:
                summary = f"the probe could not run: {exc}"
                self._probes[identity.id] = ProbeState(
                    False, time.monotonic(), summary, retry=RECONCILE_SECONDS
                )
            return None

    # --- the cooperative proxy ---------------------------------------------------------------

    def start_proxy_checks(self) -> dict[int, str]:
        """At start, at the cooperative level: does each runner's proxy answer its sandboxes?
        Runner id → '' or what is wrong."""
        if self.settings.isolation or not self.settings.proxy:
            return {}
        return {
            identity.id: self.check_proxy(identity) for identity in list(self.identities.values())
        }

    def check_proxy(self, identity: Identity) -> str:
        """'' when the proxy sandboxes are told of (COVEY_RUNNER_PROXY) answered from a
        container on the sandbox network, else what is wrong: launches are refused meanwhile.
        The answer is kept PROXY_RECHECK_SECONDS when it failed, PROXY_CHECK_EVERY_SECONDS
        when it passed."""
        if self.settings.isolation or not self.settings.proxy:
            return ""
        lock = self._proxy_check_locks.setdefault(identity.id, threading.Lock())
        with lock:
            last = self._proxy_checks.get(identity.id)
            again = PROXY_RECHECK_SECONDS if last and last.problem else PROXY_CHECK_EVERY_SECONDS
            if last is not None and time.monotonic() - last.at < again:
                return last.problem
            try:
                problem = probing.check_proxy(
                    self._probe_engine(identity),
                    self.settings.check_image,
                    # Where sandboxes go; the proxy check needs no gateway (the probe does).
                    probing.Where(
                        network={"network": self.settings.network},
                        proxy=self.settings.proxy,
                        gateway="",
                    ),
                    self.settings.homes / str(identity.id),
                )
            except (EngineError, OSError) as exc:
                problem = f"the egress proxy at {self.settings.proxy} could not be checked: {exc}"
            self._proxy_checks[identity.id] = ProxyCheck(problem, time.monotonic())
        if problem:
            logger.warning("covey runner %s: %s", identity.name, problem)
        elif last is None or last.problem:
            logger.info(
                "covey runner %s: sandboxes reach the egress proxy at %s%s",
                identity.name,
                self.settings.proxy,
                " again" if last is not None else "",  # after a failed check
            )
        return problem

    def _probe_engine(self, identity: Identity) -> Engine:
        if identity.id not in self._probe_engines:
            # Another name than the runner's: its sweep never takes a probe for a run.
            self._probe_engines[identity.id] = self.make_engine(
                f"{runner_name(identity)}.probe", identity.installation, ""
            )
        return self._probe_engines[identity.id]

    def _probe_where(self, identity: Identity) -> probing.Where:
        """The shape a sandbox of this runner would get right now."""
        if self.settings.isolation:
            shape = self._checked_shape(identity)
            return probing.Where(
                network=isolation.sandbox_network_options(shape),
                proxy=isolation.proxy_address(shape),
                gateway=shape.gateway,
            )
        network = self.settings.network
        return probing.Where(
            network={"network": network},
            proxy=self.settings.proxy,
            gateway=self.engine(identity).gateway(network),
        )

    def _check_probe(self, identity: Identity) -> None:
        """UntrustedError unless the runner's latest probe passed (hard isolation)."""
        state = self._probes.get(identity.id)
        if state is None:
            raise UntrustedError("this runner has not passed an egress probe yet")
        if not state.passed:
            raise UntrustedError(f"this runner's last egress probe failed: {state.summary}")

    def _probe_due(self, identity: Identity) -> bool:
        if not self.settings.isolation:
            return False
        state = self._probes.get(identity.id)
        if state is None:
            return True
        retry = self.settings.probe_retry if state.retry is None else state.retry
        return not state.passed and time.monotonic() - state.at >= retry

    # --- watching --------------------------------------------------------------------------

    def watch(self) -> None:
        """Until :meth:`stop`: finish exited sandboxes, stop overdue ones, reconcile."""
        warned: dict[int, float] = {}
        while not self._stop.is_set():
            self.rescan()
            for identity in list(self.identities.values()):
                try:
                    self.sweep(identity)
                except (ControlPlaneError, EngineError, OSError) as exc:
                    # Once a minute: the same trouble comes back every poll.
                    if time.monotonic() - warned.get(identity.id, -60.0) >= 60:
                        warned[identity.id] = time.monotonic()
                        logger.warning("covey runner %s: %s", identity.name, exc)
                except Exception:
                    # A defect: said with its traceback, once a minute; the watcher goes on, as
                    # every run of this host depends on it.
                    if time.monotonic() - warned.get(identity.id, -60.0) >= 60:
                        warned[identity.id] = time.monotonic()
                        logger.exception("covey runner %s: the watcher failed", identity.name)
                else:
                    warned.pop(identity.id, None)
            self._stop.wait(self.settings.poll)

    def heartbeats(self, interval: float) -> None:
        """Until :meth:`stop`: tell the control plane each runner is alive."""
        while not self._stop.is_set():
            self.rescan()
            for identity in list(self.identities.values()):
                try:
                    identity.client.heartbeat(self.settings.isolation_mode)
                except ControlPlaneError as exc:
                    logger.warning("covey runner %s: heartbeat: %s", identity.name, exc)
                if identity.id in self._proxy_checks:
                    # Checked once: keep checking while it serves (here, not in the watcher:
                    # a check runs a container, and the watcher must not wait for it).
                    self.check_proxy(identity)
            self._stop.wait(interval)

    def stop(self) -> None:
        self._stop.set()

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
        self.ship_output(identity)
        if self._probe_due(identity):
            first = identity.id not in self._probes
            self._probe_safely(identity, None, "runner start" if first else "retry")
        built_with = self._shape_tokens.get(identity.id)
        if built_with is not None and built_with != identity.token:
            # A renewed token (an order, or a rewritten built-in identity): the proxy polls
            # policy with the old one, which no longer works; give it the new one now (once:
            # if that fails, the reconcile tries again).
            self.ensure_isolation(identity)
        last = self._last_reconcile.get(identity.id, 0.0)
        if time.monotonic() - last >= RECONCILE_SECONDS:
            self.reconcile(identity, sandboxes)
            self._last_reconcile[identity.id] = time.monotonic()

    def reconcile(self, identity: Identity, sandboxes: list[Sandbox] | None = None) -> None:
        """Make Docker and the control plane agree: sandboxes without a live run go, runs
        whose sandbox vanished are reported, cancellations that were missed are carried out."""
        self.ensure_isolation(identity)  # before any relaunch below: it needs the shape
        engine = self.engine(identity)
        client = identity.client
        sandboxes = engine.sandboxes() if sandboxes is None else sandboxes
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
                self._stop_output(run_id)
                engine.remove(run_id)
            elif run.cancel and sandbox.status == "running":
                engine.stop(run_id, timeout=STOP_GRACE_SECONDS)
            elif run.status != "running" and sandbox.status == "running":
                # Launched, but the report was lost.
                client.report(run_id, RunReport(ReportState.RUNNING, started_at=sandbox.started_at))
            if run is not None and sandbox.status == "running" and not run.cancel:
                # After a restart of this runner: go on from what the control plane has.
                self.follow_output(identity, run_id, run.output_size)
        for run_id, run in active.items():
            if run_id in held or run_id in self._launching:
                continue
            if run.status == "running":
                # The list of sandboxes came first: one launched since is not in it. Ask again.
                if engine.get(run_id) is None:
                    gone = RunReport(ReportState.VANISHED, detail=f"no sandbox on {identity.name}")
                    client.report(run_id, gone)
            elif run.waited >= RELAUNCH_AFTER_SECONDS and not run.cancel:
                logger.info("covey runner: run %s lost its order; launching it", run_id)
                self.launch(identity.id, run_id)

    # --- output while it runs --------------------------------------------------------------

    def follow_output(self, identity: Identity, run_id: str, skip: int = 0) -> None:
        """Start sending a running sandbox's output live (``skip``: bytes the control plane
        has already); a second call for the same run does nothing."""
        with self._live_lock:
            if run_id in self._live:
                return
            self._live[run_id] = None  # taken: the engine is asked outside the lock
        try:
            stream = self.engine(identity).follow_logs(run_id)
        except EngineError as exc:
            logger.info("covey runner: cannot follow the output of run %s: %s", run_id, exc)
            with self._live_lock:
                self._live.pop(run_id, None)
            return
        live = LiveOutput(skip)

        def read() -> None:
            for chunk in stream:
                live.feed(chunk)
            live.feed(b"", final=True)

        reader = threading.Thread(target=read, name=f"covey-output-{run_id}", daemon=True)
        reader.start()  # before it is listed: whoever finds it may join it
        with self._live_lock:
            self._live[run_id] = Followed(identity.id, live, stream, reader)

    def ship_output(self, identity: Identity) -> None:
        """Send every due chunk of this runner's running sandboxes (one each per call)."""
        with self._live_lock:
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

    def _stop_output(self, run_id: str, wait: float = 0.0) -> int | None:
        """Stop following a run's output; the number of bytes the sandbox wrote in all when
        it was followed from its first byte to its end (waiting up to ``wait`` seconds for the
        stream to end), else None."""
        with self._live_lock:
            followed = self._live.pop(run_id, None)
        if followed is None:
            return None
        if wait:
            followed.reader.join(wait)
        followed.stream.close()
        return followed.live.total

    def _finish(self, identity: Identity, sandbox: Sandbox) -> None:
        """Report an exited sandbox with its output, then remove it."""
        engine = self.engine(identity)
        client = identity.client
        run_id = sandbox.run_id
        # The whole log replaces what went live; the count says whether Docker kept all of it.
        total = self._stop_output(run_id, wait=5.0)
        try:
            client.put_log(run_id, engine.logs(run_id), total)  # the tail is kept there too
            ended = RunReport(
                ReportState.EXITED,
                exit_code=sandbox.exit_code,
                detail="timeout" if _ran_out(sandbox) else "",
                started_at=sandbox.started_at,
                finished_at=sandbox.finished_at,
            )
            client.report(run_id, ended)
        except ControlPlaneError as exc:
            if exc.status != 404:  # 404: not a run of ours (any more): just clean up
                raise  # keep the sandbox: the next sweep reports it again
            if sandbox.legacy:
                return  # from before installation keys and not ours: another installation's
        engine.remove(run_id)
        self._timed_out.discard(run_id)


def _overdue(sandbox: Sandbox, now: datetime) -> bool:
    if sandbox.timeout is None or sandbox.started_at is None:
        return False
    return (now - sandbox.started_at).total_seconds() > sandbox.timeout


def _ran_out(sandbox: Sandbox) -> bool:
    """It ran for its whole time: stopped for it, by this runner or one before a restart."""
    if sandbox.timeout is None or sandbox.started_at is None or sandbox.finished_at is None:
        return False
    return (sandbox.finished_at - sandbox.started_at).total_seconds() >= sandbox.timeout


_current: RunnerHost | None = None


def set_current(host: RunnerHost | None) -> None:
    """Make ``host`` the one this process's runner tasks act for."""
    global _current
    _current = host


def current() -> RunnerHost:
    if _current is None:
        raise RuntimeError("this process is not a runner host (start it with manage.py runner)")
    return _current
