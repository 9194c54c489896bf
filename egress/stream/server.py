"""The stream's HTTP side (aiohttp): ``GET /api/v1/egress/policy/stream/`` with the runner's
token, ``GET …/stream/sync/`` (a barrier: the generation that holds every change committed
before it), and the process's health.

The request asks for the policy with shared lists (``?v=2``; a proxy of before them is
refused, and polls) and says the generation the proxy holds (``If-None-Match``, as a poll
does). The answer is ``application/x-ndjson``, a line of JSON each (egress/protocol.py,
``StreamLine``): first what brings the proxy up to date (that it is current, what changed
since, or the whole snapshot), then a delta for each change, and a ``current`` line whenever
nothing has been sent for ``STREAM_KEEPALIVE`` seconds.

The stream ends when the runner's token stops being valid or
the process stops hearing the database; the proxy polls then, and comes back.
"""

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from egress.protocol import POLICY_FORM, STREAM_KEEPALIVE
from egress.stream.hub import Hub, Notices, Unauthorized, Unavailable
from status import metrics_refusal

logger = logging.getLogger(__name__)

PATH = "/api/v1/egress/policy/stream/"
SYNC_PATH = PATH + "sync/"
HUB: web.AppKey[Hub] = web.AppKey("hub", Hub)


class _Meters:
    """The stream's metrics, read from the hub when scraped (a prometheus_client collector)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        hub = self.hub
        yield GaugeMetricFamily(
            "covey_stream_followers", "Proxies following the stream now.", value=hub.followers
        )
        yield GaugeMetricFamily(
            "covey_stream_organisations",
            "Organisations whose policy is held.",
            value=len(hub.organisations),
        )
        yield GaugeMetricFamily(
            "covey_stream_listening",
            "1 while the stream hears the database's notices (else it refuses every stream).",
            value=int(hub.listening),
        )
        yield CounterMetricFamily(
            "covey_stream_changes", "Policy changes sent, one delta each.", value=hub.changes
        )


def _problem(status: int, detail: str) -> web.Response:
    return web.json_response({"detail": detail}, status=status)


def _token(request: web.Request) -> str | None:
    keyword, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() or None if keyword == "Runner" else None


def _generation(request: web.Request) -> str | None:
    value = request.headers.get("If-None-Match", "").strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"') or None


async def stream(request: web.Request) -> web.StreamResponse:
    """A runner's proxy follows its organisation's policy."""
    hub = request.app[HUB]
    token = _token(request)
    if token is None:
        return _problem(401, "give the runner token: Authorization: Runner <token>")
    if request.query.get("v") != POLICY_FORM:  # a proxy of before shared lists polls instead
        return _problem(400, f"the stream sends the policy with shared lists: ask ?v={POLICY_FORM}")
    try:
        follower, first = await hub.follow(token, _generation(request))
    except Unauthorized:
        return _problem(401, "unknown runner token")
    except Unavailable as exc:
        return _problem(503, str(exc))
    try:
        response = web.StreamResponse(
            headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store"}
        )
        await response.prepare(request)
        await response.write(first)
        while True:
            try:
                line = await asyncio.wait_for(follower.lines.get(), STREAM_KEEPALIVE)
            except TimeoutError:
                # A line queued as the wait ran out goes first: the keepalive names the
                # generation after it. None: the hub cannot vouch now, and the stream ends.
                empty = follower.lines.empty()
                line = hub.keepalive(follower) if empty else follower.lines.get_nowait()
            if line is None:
                break
            await response.write(line)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    except ConnectionError:  # the proxy went away
        pass
    finally:
        hub.unfollow(follower)
    return response


async def sync(request: web.Request) -> web.Response:
    """The generation a runner's proxy must reach to hold every change committed before this
    request: it asks before it says a token is unknown (a run's token is issued moments before
    its sandbox's first request)."""
    hub = request.app[HUB]
    token = _token(request)
    if token is None:
        return _problem(401, "give the runner token: Authorization: Runner <token>")
    try:
        return web.json_response({"generation": await hub.sync(token)})
    except Unauthorized:
        return _problem(401, "unknown runner token")
    except Unavailable as exc:
        return _problem(503, str(exc))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when it hears the database's notices (else it refuses every stream)."""
    hub = request.app[HUB]
    if not hub.listening:
        return _problem(503, "the policy stream does not hear of the policy's changes now")
    return web.json_response(
        {"status": "ok", "followers": hub.followers, "organisations": len(hub.organisations)}
    )


def make_app(hub: Hub, notices: Notices, *, metrics_token: str = "") -> web.Application:
    """The stream's application; the hub runs as long as it does."""
    app = web.Application()
    app[HUB] = hub
    registry = CollectorRegistry()
    registry.register(_Meters(hub))

    async def metrics(request: web.Request) -> web.Response:
        """The stream's metrics, for a bearer of COVEY_METRICS_TOKEN."""
        if refusal := metrics_refusal(request.headers.get("Authorization", ""), metrics_token):
            return _problem(*refusal)
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_get(PATH, stream)
    app.router.add_get(SYNC_PATH, sync)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)

    async def run_hub(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(hub.run(notices))
        task.add_done_callback(_hub_ended)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _hub_ended(task: "asyncio.Task[None]") -> None:
        """A hub that failed holds nothing, and the process stops (its supervisor starts it
        again): a server without its hub must not go on answering."""
        if task.cancelled():
            return
        hub.failed = task.exception()
        logger.critical("covey: the policy stream's hub failed: %r", hub.failed)
        hub.listening = False
        for organisation in hub.organisations.values():
            organisation.drop()
        os.kill(os.getpid(), signal.SIGTERM)  # aiohttp's run_app shuts down on it

    async def end_streams(app: web.Application) -> None:  # before handlers are waited for
        for organisation in hub.organisations.values():
            organisation.drop()

    app.cleanup_ctx.append(run_hub)
    app.on_shutdown.append(end_streams)
    return app
