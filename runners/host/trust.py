"""Whether each runner this host serves may take work.

Under hard isolation, only once its latest egress probe passed (:mod:`runners.probe.host`): it
is probed when it starts, on order, and again while its last probe failed. At the cooperative
level, only while its sandboxes reach the proxy they are told of (COVEY_RUNNER_PROXY): that is
checked from a container on the sandbox network at start, again every few minutes, and soon
after a failed check. Until then its launches fail with a status that says why.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from runners.host.client import ControlPlaneError
from runners.host.config import HostSettings
from runners.host.containers import isolation
from runners.host.containers.engine import Engine, EngineError
from runners.host.containers.isolation import IsolationError
from runners.host.identity import Identity, runner_name
from runners.host.shapes import Shapes
from runners.probe import host as probing

logger = logging.getLogger(__name__)

# A probe that could not run or be reported proves nothing: it is tried again this soon.
UNREPORTED_RETRY_SECONDS = 30.0
# The proxy sandboxes are told of is checked again this long after a failed check, and this
# long after one that passed (on the heartbeat thread, so launches seldom wait for it).
PROXY_RECHECK_SECONDS = 10.0
PROXY_CHECK_EVERY_SECONDS = 300.0
# A launch that finds the proxy not answering checks again this often, for at most the host's
# proxy_wait, before it is refused: a proxy started beside the runner (make run) may still be
# starting.
PROXY_WAIT_STEP_SECONDS = 1.0


class UntrustedError(Exception):
    """The runner may not take work: its egress probe has not passed (hard isolation), or its
    sandboxes do not reach their proxy (cooperative)."""


@dataclass(frozen=True)
class ProbeState:
    """A runner's latest egress probe on this host."""

    passed: bool
    at: float  # the host's clock (monotonic)
    summary: str
    retry: float | None = None  # seconds until the next try while it has not passed (None:
    # HostSettings.probe_retry)


@dataclass(frozen=True)
class ProxyCheck:
    """Whether the proxy sandboxes are told of answered from the sandbox network, last time."""

    problem: str  # "" when it answered
    at: float  # the host's clock (monotonic)
    said: bool = False  # the problem was logged (so its end is news too)


class Trust:
    """Probes and proxy checks of the runners this host serves, and what they allow."""

    def __init__(
        self,
        settings: HostSettings,
        shapes: Shapes,
        *,
        engine_of: Callable[[Identity], Engine],
        make_engine: Callable[[str, str, str], Engine],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.shapes = shapes
        self.engine_of = engine_of  # the runner's own engine (its network's gateway)
        self.make_engine = make_engine
        self.clock = clock
        self._probes: dict[int, ProbeState] = {}
        self._probe_locks: dict[int, threading.Lock] = {}  # one probe at a time per runner
        self._probe_engines: dict[int, Engine] = {}
        self._locks_lock = threading.Lock()  # makes the per-runner locks and engines
        self._proxy_checks: dict[int, ProxyCheck] = {}
        # Runners whose proof this host no longer holds (the Docker engine restarted): why,
        # until a new probe passes (hard isolation) or their proxy answers (cooperative).
        self._distrusted: dict[int, str] = {}
        # How often each was distrusted: a proof begun before the latest distrust proves
        # nothing of what came after it (the engine went while it ran).
        self._distrusts: dict[int, int] = {}
        self._distrust_lock = threading.Lock()
        self._proxy_check_locks: dict[int, threading.Lock] = {}

    def require(self, identity: Identity, *, proxied: bool) -> None:
        """UntrustedError unless the runner may launch now (``proxied``: its sandbox is to be
        told of the proxy)."""
        if self.settings.hard:
            if problem := self._probe_problem(identity):
                raise UntrustedError(problem)
        elif proxied and (problem := self._proxy_for_launch(identity)):
            raise UntrustedError(problem)

    def problem(self, identity: Identity) -> str:
        """'' when the runner may take work as far as this host last saw, else why not; from
        what the last probe or proxy check found, without checking anew (readiness)."""
        if self.settings.hard:
            return self._probe_problem(identity)
        if not self.settings.proxy:
            return ""  # nothing to check: the runner host said so at start
        if why := self._distrusted.get(identity.id):
            return why
        check = self._proxy_checks.get(identity.id)
        if check is None:
            return f"the egress proxy at {self.settings.proxy} has not been checked yet"
        return check.problem

    def probe_state(self, identity: Identity) -> ProbeState | None:
        """The runner's latest egress probe on this host (None: none yet)."""
        return self._probes.get(identity.id)

    def distrust(self, identity: Identity, why: str) -> None:
        """Forget what this host proved of the runner's egress (its Docker engine restarted,
        and with it the proxy, the networks, the firewall's place): no work until a new probe
        passes (hard isolation) or its proxy answers again (cooperative)."""
        with self._distrust_lock:
            self._distrusts[identity.id] = self._distrusts.get(identity.id, 0) + 1
            self._distrusted[identity.id] = why
        with self._proxy_check_lock(identity):
            if identity.id in self._proxy_checks:  # the next check is made afresh
                self._proxy_checks[identity.id] = ProxyCheck(why, float("-inf"), said=True)

    def prove_again(self, identity: Identity, reason: str) -> None:
        """After :meth:`distrust`: probe the runner (hard isolation) or check its proxy."""
        if self.settings.hard:
            self._probe_safely(identity, None, reason)
        elif self.settings.proxy:
            self.check_proxy(identity, fresh=True)
        else:
            with self._distrust_lock:  # nothing to prove: no proxy to reach
                self._distrusted.pop(identity.id, None)

    def _proved(self, identity: Identity, since: int) -> None:
        """A proof begun when the runner had been distrusted ``since`` times passed: trusted
        again, unless it was distrusted meanwhile."""
        with self._distrust_lock:
            if self._distrusts.get(identity.id, 0) == since:
                self._distrusted.pop(identity.id, None)

    def _probe_problem(self, identity: Identity) -> str:
        if why := self._distrusted.get(identity.id):
            return why
        state = self._probes.get(identity.id)
        if state is None:
            return "this runner has not passed an egress probe yet"
        if not state.passed:
            return f"this runner's last egress probe failed: {state.summary}"
        return ""

    def _proxy_for_launch(self, identity: Identity) -> str:
        """The proxy check for a launch (and at start), made afresh: a failure kept from
        before (a check made while the proxy was still starting beside the runner, as under
        make run) is no answer for a launch. One that fails is tried again every
        PROXY_WAIT_STEP_SECONDS until the host's proxy_wait has passed (the checks' own time
        included); only then is the launch refused, saying how long it waited. Only a problem
        still there then is logged: a proxy a moment from listening is no news."""
        wait = self.settings.proxy_wait
        deadline = time.monotonic() + wait  # checks' own time counts
        problem = self.check_proxy(identity, fresh=True, warn=False)
        while problem and time.monotonic() + PROXY_WAIT_STEP_SECONDS <= deadline:
            time.sleep(PROXY_WAIT_STEP_SECONDS)
            problem = self.check_proxy(identity, fresh=True, warn=False)
        if problem:
            if wait > 0:
                problem = f"no answer in {wait:g} s (COVEY_RUNNER_PROXY_WAIT_SECONDS): {problem}"
            tell = False
            # Under the lock checks write with: a check made meanwhile is not overwritten.
            with self._proxy_check_lock(identity):
                check = self._proxy_checks.get(identity.id)
                if check is not None and check.problem and not check.said:
                    self._proxy_checks[identity.id] = replace(check, said=True)
                    tell = True
            if tell:  # once, not for each launch it refuses
                logger.warning("covey runner %s: %s", identity.name, problem)
        return problem

    # --- the egress probe (hard isolation) ---------------------------------------------------

    def start_probes(self, identities: list[Identity]) -> dict[int, probing.Report | None]:
        """At start: probe every runner before it takes work."""
        if not self.settings.hard:
            return {}
        return {
            identity.id: self._probe_safely(identity, None, "runner start")
            for identity in identities
        }

    def probe_if_due(self, identity: Identity) -> None:
        """Probe a runner never probed here, or whose last probe failed long enough ago."""
        if not self.due(identity):
            return
        first = identity.id not in self._probes
        self._probe_safely(identity, None, "runner start" if first else "retry")

    def due(self, identity: Identity) -> bool:
        if not self.settings.hard:
            return False
        state = self._probes.get(identity.id)
        if state is None:
            return True
        retry = self.settings.probe_retry if state.retry is None else state.retry
        return not state.passed and self.clock() - state.at >= retry

    def probe(
        self, identity: Identity, probe_id: str | None = None, reason: str = "ordered"
    ) -> probing.Report | None:
        """Run an egress probe (the one the control plane ordered, or a new one) in the
        runner's real shape and report it; None when the order is no longer ours."""
        with self._probe_lock(identity):
            since = self._distrusts.get(identity.id, 0)
            client = identity.client
            order = client.begin_probe(probe_id, self.settings.isolation, reason)
            if order is None:
                logger.info("covey runner %s: probe %s is not ours to run", identity.name, probe_id)
                return None
            if order.error:  # the control plane finished it already
                report = probing.failed(order.error)
            else:
                try:
                    report = probing.run(
                        self.probe_engine(identity),
                        order,
                        self.settings.probe_targets,
                        self._where(identity),
                        self.settings.homes / str(identity.id),
                    )
                except (probing.ProbeError, EngineError, IsolationError, ValueError) as exc:
                    report = probing.failed(str(exc))
                client.report_probe(order.probe, report.results, report.detail)
            summary = report.summary
            self._probes[identity.id] = ProbeState(report.passed, self.clock(), summary)
            if report.passed:
                self._proved(identity, since)
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
            return self.probe(identity, probe_id, reason)
        except ControlPlaneError as exc:
            # Not run, or not reported: it proves nothing, and is tried again soon (not at
            # every poll). A probe that had passed before still counts meanwhile.
            logger.warning("covey runner %s: egress probe: %s", identity.name, exc)
            with self._probe_lock(identity):
                state = self._probes.get(identity.id)
                if state is None or not state.passed or identity.id in self._distrusted:
                    summary = f"the probe could not run: {exc}"
                    self._probes[identity.id] = ProbeState(
                        False, self.clock(), summary, retry=UNREPORTED_RETRY_SECONDS
                    )
            return None

    def _where(self, identity: Identity) -> probing.Where:
        """The shape a sandbox of this runner would get right now."""
        if self.settings.hard:
            shape = self.shapes.checked(identity)
            return probing.Where(
                network=isolation.sandbox_network_options(shape),
                proxy=isolation.proxy_address(shape),
                gateway=shape.gateway,
            )
        network = self.settings.network
        return probing.Where(
            network={"network": network},
            proxy=self.settings.proxy,
            gateway=self.engine_of(identity).gateway(network),
        )

    def _proxy_check_lock(self, identity: Identity) -> threading.Lock:
        """One proxy check of a runner at a time; its answer is written under it."""
        with self._locks_lock:
            return self._proxy_check_locks.setdefault(identity.id, threading.Lock())

    def _probe_lock(self, identity: Identity) -> threading.Lock:
        with self._locks_lock:
            return self._probe_locks.setdefault(identity.id, threading.Lock())

    def probe_engine(self, identity: Identity) -> Engine:
        """The engine of the runner's probe and proxy-check containers (a name of their own)."""
        with self._locks_lock:
            if identity.id not in self._probe_engines:
                # Another name than the runner's: its sweep never takes a probe for a run.
                self._probe_engines[identity.id] = self.make_engine(
                    f"{runner_name(identity)}.probe", identity.installation, ""
                )
            return self._probe_engines[identity.id]

    # --- the proxy sandboxes are told of (cooperative) ---------------------------------------

    def start_proxy_checks(self, identities: list[Identity]) -> dict[int, str]:
        """At start: does each runner's proxy answer its sandboxes? Runner id → '' or what is
        wrong."""
        if self.settings.hard or not self.settings.proxy:
            return {}
        # Waited for, as a launch does: the proxy may be starting beside the runner.
        return {identity.id: self._proxy_for_launch(identity) for identity in identities}

    def recheck_proxy(self, identity: Identity) -> None:
        """At each heartbeat: check again when the last answer is old, and at once when the
        runner was never checked (one the host took on after it started, such as a new
        organisation's built-in runner, said "not checked yet" until its first launch)."""
        self.check_proxy(identity)

    def check_proxy(self, identity: Identity, *, fresh: bool = False, warn: bool = True) -> str:
        """'' when the proxy sandboxes are told of answered from a container on the sandbox
        network, else what is wrong (logged, unless ``warn`` is False). The answer is kept
        PROXY_RECHECK_SECONDS when it failed, PROXY_CHECK_EVERY_SECONDS when it passed."""
        if self.settings.hard or not self.settings.proxy:
            return ""
        with self._proxy_check_lock(identity):
            last = self._proxy_checks.get(identity.id)
            again = PROXY_RECHECK_SECONDS if last and last.problem else PROXY_CHECK_EVERY_SECONDS
            # Launches waiting together share each fresh check (made under this lock).
            again = PROXY_WAIT_STEP_SECONDS if fresh else again
            if last is not None and self.clock() - last.at < again:
                return last.problem
            since = self._distrusts.get(identity.id, 0)
            try:
                problem = probing.check_proxy(
                    self.probe_engine(identity),
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
            said = bool(problem) and (warn or bool(last and last.said and last.problem))
            self._proxy_checks[identity.id] = ProxyCheck(problem, self.clock(), said)
            if not problem:
                self._proved(identity, since)
        if problem:
            if warn:
                logger.warning("covey runner %s: %s", identity.name, problem)
        elif last is None or last.problem:
            logger.info(
                "covey runner %s: sandboxes reach the egress proxy at %s%s",
                identity.name,
                self.settings.proxy,
                " again" if last is not None and last.said else "",  # after a failure said
            )
        return problem
