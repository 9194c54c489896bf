"""The proxy's status listener (COVEY_EGRESS_STATUS_LISTEN, :mod:`status`): /healthz, /readyz
and /metrics on an address of its own, apart from the port agents use, in a thread beside
mitmproxy's loop.

/readyz: 200 while it listens with a policy it may trust (one confirmed by its source within
the grace period); 503 saying which is missing. /metrics: what this proxy decided and holds.
"""

import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from status import StatusServer

if TYPE_CHECKING:
    from egress.proxy.addon import CoveyEgress
    from egress.proxy.feed import DecisionLog

logger = logging.getLogger(__name__)


class ProxyCollector(Collector):
    """The proxy's own state, read at each scrape (nothing is added to the connection path but
    a count in the addon's dict)."""

    def __init__(self, addon: "CoveyEgress", log: "DecisionLog") -> None:
        self.addon, self.log = addon, log

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "covey_egress_decisions",
            "Tunnels and plain requests decided, by kind and reason ('allowed' or the deny code).",
            labels=["kind", "reason"],
        )
        for (kind, reason), n in sorted(self.addon.decisions.copy().items()):
            decisions.add_metric([kind, reason], n)
        yield decisions
        yield GaugeMetricFamily(
            "covey_egress_open_tunnels", "Tunnels open now.", value=self.addon.open_tunnels
        )
        age = self.addon.feed.age()
        yield GaugeMetricFamily(
            "covey_egress_policy_age_seconds",
            "Since the policy source last answered (NaN: never); past the grace period the"
            " proxy refuses everything.",
            value=math.nan if age is None else age,
        )
        policy = self.addon.feed.current()
        yield GaugeMetricFamily(
            "covey_egress_policy_agents",
            "Agents in the policy in force (0: none in force).",
            value=len(policy.agents) if policy else 0,
        )
        yield GaugeMetricFamily(
            "covey_egress_policy_failures",
            "Failed policy refreshes in a row (0: the source answers).",
            value=self.addon.feed.failures,
        )
        yield GaugeMetricFamily(
            "covey_egress_policy_streaming",
            "1 while the proxy follows the policy stream, 0 while it polls.",
            value=int(self.addon.feed.streaming),
        )
        yield CounterMetricFamily(
            "covey_egress_slow_clients_closed",
            "Connections closed because their request head did not come within"
            " COVEY_EGRESS_HEAD_TIMEOUT.",
            value=self.addon.slow_closed,
        )
        yield CounterMetricFamily(
            "covey_egress_decisions_written",
            "Decisions written to the decision log.",
            value=self.log.written,
        )
        yield CounterMetricFamily(
            "covey_egress_decisions_dropped",
            "Events dropped unwritten: the log's buffer was full while its sink failed, or the"
            " control plane refused them as malformed.",
            value=self.log.dropped,
        )
        yield GaugeMetricFamily(
            "covey_egress_decisions_unwritten",
            "Decisions waiting to be written.",
            value=self.log.waiting,
        )


class ProxyStatus(StatusServer):
    """The status listener, ready while the proxy listens with a policy it may trust."""

    def __init__(
        self,
        address: tuple[str, int],
        addon: "CoveyEgress",
        log: "DecisionLog",
        *,
        token: str,
        grace: float,
    ) -> None:
        self.addon, self.grace = addon, grace
        self.listening = False  # the proxy's own port: set once mitmproxy listens
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ProxyCollector(addon, log))
        super().__init__(address, self._ready, registry, token=token)

    def _ready(self) -> tuple[bool, dict[str, Any]]:
        age = self.addon.feed.age()
        checks = {
            "listening": "ok" if self.listening else "not yet",
            "policy": (
                "none yet"
                if age is None
                else "ok"
                if self.addon.feed.current() is not None
                else f"stale: its source last answered {age:.0f} s ago (grace {self.grace:g} s)"
            ),
        }
        body: dict[str, Any] = {"checks": checks}
        if age is not None:
            body["policy_age_seconds"] = round(age, 3)
        return all(answer == "ok" for answer in checks.values()), body
