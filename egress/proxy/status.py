"""The proxy's status listener (COVEY_EGRESS_STATUS_LISTEN): /healthz, /readyz and /metrics on
an address of its own, apart from the port agents use, in a thread beside mitmproxy's loop.

/healthz: the process answers. /readyz: 200 while it listens with a policy it may trust (one
confirmed by its source within the grace period); 503 saying which is missing. /metrics: what
this proxy decided and holds, in Prometheus's text format, to a bearer of COVEY_METRICS_TOKEN
only (without one, to nobody), as the numbers say who is busy.
"""

import hmac
import json
import logging
import math
import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

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
        yield CounterMetricFamily(
            "covey_egress_decisions_written",
            "Decisions written to the decision log.",
            value=self.log.written,
        )
        yield CounterMetricFamily(
            "covey_egress_decisions_dropped",
            "Decisions dropped unwritten (the log's buffer was full while its sink failed).",
            value=self.log.dropped,
        )
        yield GaugeMetricFamily(
            "covey_egress_decisions_unwritten",
            "Decisions waiting to be written.",
            value=self.log.waiting,
        )


class StatusServer:
    """Serves /healthz, /readyz and /metrics on ``(host, port)`` until :meth:`stop`."""

    def __init__(
        self,
        address: tuple[str, int],
        addon: "CoveyEgress",
        log: "DecisionLog",
        *,
        token: str,
        grace: float,
    ) -> None:
        self.addon, self.token, self.grace = addon, token, grace
        self.listening = False  # the proxy's own port: set once mitmproxy listens
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ProxyCollector(addon, log))
        status = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self, with_body: bool = True) -> None:
                code, content_type, body = status.answer(self.path, self.headers)
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self.do_GET(with_body=False)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a probe every few seconds is not news

        self.server = ThreadingHTTPServer(address, Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="covey-status", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, headers: Any) -> tuple[int, str, bytes]:
        """The status, content type and body for a GET of ``path``."""
        route = path.split("?", 1)[0]
        if route == "/healthz":
            return _json(HTTPStatus.OK, {"status": "ok"})
        if route == "/readyz":
            return self._ready()
        if route == "/metrics":
            return self._metrics(headers.get("Authorization", ""))
        return _json(HTTPStatus.NOT_FOUND, {"detail": "this is /healthz, /readyz and /metrics"})

    def _ready(self) -> tuple[int, str, bytes]:
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
        ready = all(answer == "ok" for answer in checks.values())
        body: dict[str, Any] = {"status": "ready" if ready else "not ready", "checks": checks}
        if age is not None:
            body["policy_age_seconds"] = round(age, 3)
        return _json(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE, body)

    def _metrics(self, authorization: str) -> tuple[int, str, bytes]:
        if not self.token:
            return _json(
                HTTPStatus.FORBIDDEN,
                {"detail": "Metrics are off: set COVEY_METRICS_TOKEN and scrape with it."},
            )
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.encode(), self.token.encode()
        ):
            return _json(
                HTTPStatus.UNAUTHORIZED,
                {"detail": "Send the metrics token as 'Authorization: Bearer <token>'."},
            )
        return HTTPStatus.OK, CONTENT_TYPE_LATEST, generate_latest(self.registry)


def _json(code: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    return code, "application/json", json.dumps(body).encode()
