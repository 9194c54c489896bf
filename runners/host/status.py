"""A runner host's status listener (COVEY_RUNNER_STATUS_LISTEN, :mod:`status`): /healthz,
/readyz and /metrics of the runners this process serves.

/readyz: 200 while every runner can take work: Docker answers, its isolation shape stands
(hard isolation), its last egress probe passed (hard isolation) or its sandboxes reached their
proxy at the last check (cooperative), and the control plane answers its heartbeats. 503 says,
per runner, which does not. Each heartbeat tells the control plane the same (the admin shows
it), bar the heartbeat itself. /metrics: the same as figures, with sandboxes and launches.
Everything is read from what the host last saw, so a scrape or a probe never waits on a
container; only Docker is asked (once).
"""

import logging
import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runners.host.runner import RunnerHost
from status import StatusServer

logger = logging.getLogger(__name__)


def readiness(host: RunnerHost) -> tuple[bool, dict[str, Any]]:
    """Whether every runner of ``host`` can take work, and per runner what was checked."""
    docker = host.docker_problem()
    runners: dict[str, Any] = {}
    for identity in sorted(host.identities.values(), key=lambda i: i.id):
        problems = {
            **host.problems(identity, docker),
            "heartbeat": host.heartbeat_problem(identity),
        }
        checks = {
            name: problem or "ok"
            for name, problem in problems.items()
            if name != "isolation" or host.settings.hard
        }
        entry: dict[str, Any] = {
            "name": identity.name,
            "isolation": host.settings.isolation,
            "ready": all(answer == "ok" for answer in checks.values()),
            "checks": checks,
        }
        if (age := host.heartbeat_age(identity)) is not None:
            entry["heartbeat_age_seconds"] = round(age, 3)
        if (probe := host.trust.probe_state(identity)) is not None:
            entry["last_probe"] = {
                "passed": probe.passed,
                "age_seconds": round(host.clock() - probe.at, 3),
                "summary": probe.summary,
            }
        runners[str(identity.id)] = entry
    ready = not docker and all(entry["ready"] for entry in runners.values())
    return ready, {"checks": {"docker": docker or "ok"}, "runners": runners}


class HostCollector(Collector):
    """The runners' state, read at each scrape."""

    def __init__(self, host: RunnerHost) -> None:
        self.host = host

    def collect(self) -> Iterator[Metric]:
        host = self.host
        docker = host.docker_problem()
        yield GaugeMetricFamily(
            "covey_runner_host_docker_up",
            "Whether this host's Docker engine answers.",
            value=not docker,
        )
        ready = GaugeMetricFamily(
            "covey_runner_host_ready",
            "Whether the runner can take work (see /readyz).",
            labels=["runner"],
        )
        heartbeat = GaugeMetricFamily(
            "covey_runner_host_heartbeat_age_seconds",
            "Since the control plane last answered the runner's heartbeat (NaN: never).",
            labels=["runner"],
        )
        probe_passed = GaugeMetricFamily(
            "covey_runner_host_probe_passed",
            "Whether the runner's latest egress probe on this host passed (hard isolation;"
            " NaN: none yet).",
            labels=["runner"],
        )
        probe_age = GaugeMetricFamily(
            "covey_runner_host_probe_age_seconds",
            "Since the runner's latest egress probe on this host (NaN: none yet).",
            labels=["runner"],
        )
        sandboxes = GaugeMetricFamily(
            "covey_runner_host_sandboxes",
            "The runner's sandboxes on this host, by Docker's state.",
            labels=["runner", "state"],
        )
        launches = CounterMetricFamily(
            "covey_runner_host_launches",
            "Launch orders carried out since the host started, by outcome (started; refused:"
            " the sandbox could not be built, its status says why).",
            labels=["runner", "outcome"],
        )
        for identity in sorted(host.identities.values(), key=lambda i: i.id):
            name = identity.name
            problems = [*host.problems(identity, docker).values(), host.heartbeat_problem(identity)]
            ready.add_metric([name], not any(problems))
            age = host.heartbeat_age(identity)
            heartbeat.add_metric([name], math.nan if age is None else age)
            probe = host.trust.probe_state(identity)
            probe_passed.add_metric([name], math.nan if probe is None else probe.passed)
            probe_age.add_metric([name], math.nan if probe is None else host.clock() - probe.at)
            if not docker:
                states: dict[str, int] = {}
                try:
                    for sandbox in host.engine(identity).sandboxes():
                        states[sandbox.status] = states.get(sandbox.status, 0) + 1
                except Exception as exc:  # the SDK's errors too: a scrape answers regardless
                    logger.warning("covey runner %s: metrics: no sandboxes listed: %s", name, exc)
                for state, n in sorted(states.items()):
                    sandboxes.add_metric([name, state], n)
            for outcome in ("started", "refused"):
                launches.add_metric([name, outcome], host.launches[identity.id, outcome])
        yield from (ready, heartbeat, probe_passed, probe_age, sandboxes, launches)


def status_server(host: RunnerHost, address: tuple[str, int], token: str) -> StatusServer:
    """The host's status listener on ``(host, port)`` (OSError when it cannot listen)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HostCollector(host))
    return StatusServer(address, lambda: readiness(host), registry, token=token)
