"""The model gateway's Prometheus metrics, counted in its process (one registry per gateway)
and served at its /metrics to a bearer of COVEY_METRICS_TOKEN. No Django."""

from collections.abc import Awaitable, Callable
from dataclasses import fields

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from budgets.usage import Usage
from status import metrics_refusal

# From a request sent to the vendor to its answer's headers (the first token of a stream).
UPSTREAM_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))


class Meters:
    """What one gateway counted since it started."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "covey_gateway_requests",
            "Requests answered, by route and status code (refusals included).",
            ["route", "code"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "covey_gateway_requests_in_flight",
            "Requests being answered now (a stream until its end).",
            registry=self.registry,
        )
        self.upstream = Histogram(
            "covey_gateway_upstream_seconds",
            "From sending a request to the vendor to its answer's headers, by vendor.",
            ["vendor"],
            buckets=UPSTREAM_BUCKETS,
            registry=self.registry,
        )
        self.settled = Counter(
            "covey_gateway_settled",
            "Metered requests settled, by vendor and outcome (complete, error, cut-off, or"
            " released: the vendor refused it or was not reached, and nothing was charged).",
            ["vendor", "outcome"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "covey_gateway_tokens",
            "Tokens charged, by vendor and kind (a cut-off request's worst case included).",
            ["vendor", "kind"],
            registry=self.registry,
        )
        self.ledger_failures = Counter(
            "covey_gateway_ledger_failures",
            "Ledger calls that failed (each refuses its request with 503, or leaves a"
            " reservation for the worker to charge).",
            registry=self.registry,
        )

    def charged(self, vendor: str, usage: Usage, outcome: str) -> None:
        self.settled.labels(vendor, outcome).inc()
        for kind in fields(Usage):
            count = getattr(usage, kind.name)
            if count:
                self.tokens.labels(vendor, kind.name).inc(count)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unrouted"
        if route == "/metrics":  # a scrape is not counted in what it reads
            return await handler(request)
        code = 500
        self.in_flight.inc()
        try:
            response = await handler(request)
            code = response.status
            return response
        except web.HTTPException as exc:
            code = exc.status
            raise
        finally:
            self.in_flight.dec()
            self.requests.labels(route, str(code)).inc()

    async def serve(self, request: web.Request) -> web.Response:
        if refusal := metrics_refusal(request.headers.get("Authorization", ""), self.token):
            code, detail = refusal
            return web.json_response({"detail": detail}, status=code)
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
