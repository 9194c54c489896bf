"""The model gateway: agents call their model through it without holding a key, and every
request is metered against its budgets. No Django: the ledger it is given (:class:`Ledger`)
knows tokens, keys and budgets; what it knows of each vendor's API is in budgets/gateway/api.py
and its neighbours (Anthropic's Messages API at /v1; OpenAI's Chat Completions and Responses
APIs at /openai/v1).

Per metered request: authenticate the run's token (``x-api-key``, or ``Authorization: Bearer``)
→ refuse a request whose cost the gateway cannot bound (:meth:`Api.prepare`) → reserve its worst
case (its size in bytes bounds its input tokens; its output bound, set from the configuration
when the request has none, its output; refused 402 when what was spent leaves too little, 429
with ``retry-after`` while requests under way hold the rest) → send it to the vendor with every
credential the sandbox sent removed and the organisation's key in their place, verifying the
vendor's certificate → stream the answer back as it comes, reading its usage on the way
(:class:`budgets.usage.EventStream`) → settle the reservation to what was used (released when
the vendor refused the request). A ledger that cannot be written refuses the request (503):
nothing is ever forwarded unmetered. Counting tokens and listing models are free, and forwarded
after authentication only; every other path is refused.

With a broker, the gateway also serves connections' git hosts at ``/git/`` (connections/broker.py)
their APIs at ``/api/`` (connections/apibroker.py) and registries at ``/registry/``
(connections/registry.py): the same run's token, the organisation's credential put in its
place, within the agent's grants (docs/credentials.md).
"""

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

import logs
from budgets.gateway.anthropic import Messages
from budgets.gateway.api import Api, Refused
from budgets.gateway.config import GatewayConfig
from budgets.gateway.metrics import Meters
from budgets.gateway.openai import ChatCompletions, Responses
from budgets.usage import EventStream, Usage
from connections.apibroker import ApiRoute
from connections.broker import Broker, GitRoute
from connections.github import InstallationTokens
from connections.registry import RegistryRoute

logger = logging.getLogger(__name__)

T = TypeVar("T")

COMPLETE, ERROR, CUT_OFF = "complete", "error", "cut-off"  # outcomes (budgets.models.Outcome)
BUDGET_EXHAUSTED = "budget-exhausted"  # X-Covey-Deny-Reason: 402, too little left
BUDGET_BUSY = "budget-busy"  # 429: requests under way hold the rest of the budget
BUSY_RETRY_SECONDS = 2  # its retry-after: requests end within seconds, usually
READY_SECONDS = 5.0  # /readyz answers within this, whatever the ledger does
MAX_KEPT = 16 * 1024 * 1024  # a plain answer longer than this is charged its worst case
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
NOT_FORWARDED = HOP_BY_HOP | {
    "host",
    "openai-organization",  # the key alone decides whose account pays
    "openai-project",
    "content-length",
    "accept-encoding",
    "x-api-key",
    "authorization",
    "cookie",
    "forwarded",
    "x-forwarded-for",
}
NOT_RETURNED = HOP_BY_HOP | {"content-length", "content-encoding", "set-cookie"}


@dataclass(frozen=True)
class Caller:
    """Who a token belongs to, and the organisation's key at each vendor that has one."""

    agent_id: int
    organisation_id: int
    run_id: str | None
    name: str  # organisation/agent, for logs
    keys: Mapping[str, str] = field(repr=False)  # vendor → key ("": it cannot be read)


@dataclass(frozen=True)
class Hold:
    """A reservation the ledger made for one request."""

    reservation_id: int
    request_id: str
    spends: tuple[int, ...] | None = None  # the ids of what holds it (None: the ledger reads them)


class Ledger(Protocol):
    """Tokens, keys and budgets. Called in worker threads (but :meth:`known`); raises Refused
    to refuse."""

    def known(self, token: str) -> Caller | None:
        """The caller of a token the ledger vouched for moments ago, without any I/O (called
        on the event loop); None: ask :meth:`authenticate`."""
        ...

    def authenticate(self, token: str) -> Caller: ...

    def reserve(
        self,
        caller: Caller,
        *,
        vendor: str,
        model: str,
        input_bound: int,
        max_tokens: int,
        request_id: str,
    ) -> "Future[Hold]":
        """Ask for the request's worst case to be held against its budgets (called on the
        event loop: it never blocks); the future holds the reservation, or Refused."""
        ...

    def settle(
        self, hold: Hold, usage: Usage, *, model: str, outcome: str, failed: Callable[[], None]
    ) -> None:
        """Queue the reservation's settlement, to what was used (called on the event loop:
        it never blocks; until it is written, the reservation holds its worst case).
        ``failed`` is called, from another thread, if it cannot be written."""
        ...

    def release(self, hold: Hold, *, failed: Callable[[], None]) -> None:
        """Queue the reservation's release without a charge (as :meth:`settle`)."""
        ...

    def close(self) -> None:
        """Write what is queued (called once, in a worker thread, as the gateway stops)."""
        ...

    def problem(self) -> str:
        """'' when the ledger can answer, else why not, naming no address (readiness)."""
        ...


def token_of(headers: Mapping[str, str], api: Api) -> str:
    """The token the caller sent (both headers, when sent, must agree); Refused if none."""
    sent = set()
    if headers.get("x-api-key"):
        sent.add(headers["x-api-key"].strip())
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        sent.add(value.strip())
    if len(sent) != 1:
        raise Refused(
            401,
            "authentication_error",
            f"send the run's token ({api.key_variable}) as x-api-key or as Authorization:"
            " Bearer" + (" (two different tokens were sent)" if sent else ""),
        )
    return sent.pop()


ANTHROPIC, CHAT, RESPONSES = Messages(), ChatCompletions(), Responses()
# (method, path, API, metered): every other path is refused.
ROUTES = [
    ("POST", "/v1/messages", ANTHROPIC, True),
    ("POST", "/v1/messages/count_tokens", ANTHROPIC, False),
    ("GET", "/v1/models", ANTHROPIC, False),
    ("GET", "/v1/models/{model}", ANTHROPIC, False),
    ("POST", CHAT.prefix + "/v1/chat/completions", CHAT, True),
    ("POST", CHAT.prefix + "/v1/responses", RESPONSES, True),
    ("POST", CHAT.prefix + "/v1/responses/input_tokens", RESPONSES, False),
    ("GET", CHAT.prefix + "/v1/models", CHAT, False),
    ("GET", CHAT.prefix + "/v1/models/{model}", CHAT, False),
]


class Gateway:
    """The gateway's aiohttp application (:meth:`app`), over ``ledger``."""

    def __init__(self, ledger: Ledger, config: GatewayConfig, broker: Broker | None = None) -> None:
        self.ledger = ledger
        self.config = config
        self.broker = broker
        self.upstreams = {
            ANTHROPIC.vendor: config.upstream.rstrip("/"),
            CHAT.vendor: config.openai_upstream.rstrip("/"),
        }
        self.pool = ThreadPoolExecutor(config.threads, thread_name_prefix="covey-ledger")
        self.session: ClientSession | None = None  # to the model vendors
        self.connections_session: ClientSession | None = None
        self.meters = Meters(config.metrics_token)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_request_bytes, middlewares=[self.meters.middleware]
        )
        app.router.add_get("/healthz", self.health)
        app.router.add_get("/readyz", self.readiness)
        app.router.add_get("/metrics", self.meters.serve)
        for method, path, api, metered in ROUTES:
            app.router.add_route(method, path, partial(self.handle, api=api, metered=metered))
        if self.broker is not None:  # credentials brokered (connections/broker.py)
            tokens = InstallationTokens(self._upstreams)
            git = GitRoute(self.broker, self._upstreams, tokens)
            app.router.add_route("*", "/git/{tail:.*}", git.handle)
            calls = ApiRoute(self.broker, self._upstreams, tokens)
            app.router.add_route("*", "/api/{tail:.*}", calls.handle)
            registries = RegistryRoute(self.broker, self._upstreams)
            app.router.add_route("*", "/registry/{tail:.*}", registries.handle)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        context = ssl.create_default_context(cafile=self.config.ca_bundle or None)
        self.session = ClientSession(
            connector=TCPConnector(ssl=context, limit=0),
            timeout=ClientTimeout(
                total=self.config.total_timeout,
                sock_connect=self.config.connect_timeout,
                sock_read=self.config.read_timeout,
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        if self.broker is not None:
            # Connections' hosts: the system's CAs, and those the platform adds (a private
            # CA of a GitHub Enterprise Server); never the model vendors' bundle.
            trusted = ssl.create_default_context()
            if self.config.connections_ca_bundle:
                trusted.load_verify_locations(cafile=self.config.connections_ca_bundle)
            self.connections_session = ClientSession(
                connector=TCPConnector(ssl=trusted, limit=0),
                timeout=ClientTimeout(total=None, sock_connect=self.config.connect_timeout),
                auto_decompress=False,
            )

    async def _stop(self, app: web.Application) -> None:
        for session in (self.session, self.connections_session):
            if session is not None:
                await session.close()
        await asyncio.get_running_loop().run_in_executor(self.pool, self.ledger.close)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _upstreams(self) -> ClientSession:
        """The client to connections' hosts."""
        assert self.connections_session is not None  # noqa: S101 - started with the app
        return self.connections_session

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readiness(self, request: web.Request) -> web.Response:
        """200 while the ledger answers (every metered request needs it), else 503."""
        try:
            problem = await asyncio.wait_for(self._ledger(self.ledger.problem), READY_SECONDS)
        except TimeoutError:
            problem = f"no answer in {READY_SECONDS:g} s"
        return web.json_response(
            {"status": "not ready" if problem else "ready", "checks": {"ledger": problem or "ok"}},
            status=503 if problem else 200,
        )

    async def unknown(self, request: web.Request) -> web.Response:
        api = CHAT if request.path.startswith(CHAT.prefix + "/") else ANTHROPIC
        known = ", ".join(f"{method} {path}" for method, path, _, _ in ROUTES)
        return api.error(
            Refused(
                404,
                "not_found_error",
                f"covey's model gateway does not forward {request.method} {request.path}: it"
                f" forwards {known}",
            ),
            uuid.uuid4().hex,
        )

    async def _ledger(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await self._answered(loop.run_in_executor(self.pool, partial(call, *args, **kwargs)))

    async def _answered(self, answer: Awaitable[T]) -> T:
        """What the ledger answered: Refused as it refused, or 503 when it failed."""
        try:
            return await answer
        except Refused:
            raise
        except Exception:
            self.meters.ledger_failures.inc()
            logger.exception("covey: the ledger failed")
            raise Refused(
                503,
                "api_error",
                "covey's model gateway cannot write its ledger, so it forwards nothing: try"
                " again shortly",
                "ledger-unavailable",
            ) from None

    async def _reserved(self, asked: "Future[Hold]") -> Hold:
        """The reservation asked for. Should the request end while it is being made (the
        gateway stopping), it is released once made: nothing was sent."""
        try:
            return await self._answered(asyncio.shield(asyncio.wrap_future(asked)))
        except asyncio.CancelledError:
            asked.add_done_callback(self._release_unused)
            raise

    def _release_unused(self, asked: "Future[Hold]") -> None:
        if not asked.cancelled() and asked.exception() is None:
            self.ledger.release(asked.result(), failed=self.meters.ledger_failures.inc)

    async def handle(self, request: web.Request, *, api: Api, metered: bool) -> web.StreamResponse:
        request_id = uuid.uuid4().hex
        with logs.bound(request_id=request_id):
            try:
                token = token_of(request.headers, api)
                caller = self.ledger.known(token)  # vouched for moments ago: no thread, no I/O
                if caller is None:
                    caller = await self._ledger(self.ledger.authenticate, token)
            except Refused as refused:
                return self._refuse(api, refused, request_id)
            # Every line about this request from here on names its agent and run.
            with logs.bound(agent_id=caller.agent_id, run_id=caller.run_id):
                return await self._handle(request, api, metered, request_id, caller)

    async def _handle(
        self, request: web.Request, api: Api, metered: bool, request_id: str, caller: Caller
    ) -> web.StreamResponse:
        try:
            key = caller.keys.get(api.vendor)
            if key is None:
                raise Refused(
                    403,
                    "permission_error",
                    f"the organisation of {caller.name} has no {api.vendor_name} API key: an"
                    " admin enters one (Budgets → Model keys)",
                )
            if not key:
                raise Refused(
                    503,
                    "api_error",
                    f"the {api.vendor_name} API key of the organisation of {caller.name} cannot"
                    " be read (COVEY_ENCRYPTION_KEYS no longer holds the key it was sealed with):"
                    " an admin enters it again",
                )
            raw = await self._read(request)
            hold, max_tokens = None, 0
            if metered:
                prepared = api.prepare(raw, request.headers, self.config.default_max_tokens)
                raw, max_tokens = prepared.raw, prepared.max_output
                asked = self.ledger.reserve(
                    caller,
                    vendor=api.vendor,
                    model=prepared.model,
                    input_bound=len(raw),
                    max_tokens=max_tokens,
                    request_id=request_id,
                )
                hold = await self._reserved(asked)
        except Refused as refused:
            return self._refuse(api, refused, request_id)
        return await self._forward(request, api, key, raw, hold, max_tokens, request_id)

    def _refuse(self, api: Api, refused: Refused, request_id: str) -> web.Response:
        level = logging.WARNING if refused.status >= 500 else logging.INFO
        logger.log(level, "covey: refused request %s: %s", request_id, refused.message)
        return api.error(refused, request_id)

    async def _read(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise Refused(
                413,
                "request_too_large",
                f"the request is larger than {self.config.max_request_bytes} bytes",
            ) from None

    async def _forward(
        self,
        request: web.Request,
        api: Api,
        key: str,
        raw: bytes,
        hold: Hold | None,
        max_tokens: int,
        request_id: str,
    ) -> web.StreamResponse:
        assert self.session is not None  # noqa: S101 - started with the app
        headers = [
            (name, value)
            for name, value in request.headers.items()
            if name.lower() not in NOT_FORWARDED and not name.lower().startswith("x-covey")
        ]
        headers += [*api.credentials(key), ("Accept-Encoding", "identity")]
        path = request.path_qs.removeprefix(api.prefix)
        sent = time.monotonic()
        try:
            upstream = await self.session.request(
                request.method, self.upstreams[api.vendor] + path, data=raw, headers=headers
            )
        except (ClientError, TimeoutError, OSError) as exc:
            if hold is not None:
                self.meters.settled.labels(api.vendor, "released").inc()
                self.ledger.release(hold, failed=self.meters.ledger_failures.inc)
            logger.warning("covey: request %s did not reach the vendor: %r", request_id, exc)
            return api.error(
                Refused(
                    502, "api_error", f"covey's model gateway could not reach the vendor ({exc})"
                ),
                request_id,
            )
        self.meters.upstream.labels(api.vendor).observe(time.monotonic() - sent)
        ok = hold is not None and upstream.status == 200
        streamed = "text/event-stream" in upstream.headers.get("Content-Type", "")
        meter = api.meter() if ok and streamed else None
        kept: bytearray | None = bytearray() if ok and not streamed else None
        ended = settled = False
        try:
            response = web.StreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers=[
                    (n, v) for n, v in upstream.headers.items() if n.lower() not in NOT_RETURNED
                ],
            )
            response.headers["X-Covey-Request-Id"] = request_id
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                if meter is not None:
                    meter.feed(chunk)
                elif kept is not None:
                    if len(kept) + len(chunk) <= MAX_KEPT:
                        kept += chunk
                    else:
                        kept = None  # cannot be read: charged its worst case below
                await response.write(chunk)
            ended = True
            if hold is not None:  # queued (the ledger writes it): the answer ends at once
                settled = True
                self._settle(api, hold, upstream.status, meter, kept, True, raw, max_tokens)
            await response.write_eof()
        except (ClientError, TimeoutError, OSError) as exc:
            logger.info("covey: request %s was cut off: %r", request_id, exc)
            # The caller must see it cut off too, not a whole answer: drop its connection
            # without ending the response.
            if request.transport is not None:
                request.transport.abort()
        finally:
            upstream.release()
            if hold is not None and not settled:
                self._settle(api, hold, upstream.status, meter, kept, ended, raw, max_tokens)
        return response

    def _settle(
        self,
        api: Api,
        hold: Hold,
        status: int,
        meter: EventStream | None,
        kept: bytearray | None,
        ended: bool,
        raw: bytes,
        max_tokens: int,
    ) -> None:
        if status != 200:  # refused by the vendor: nothing was used
            self.meters.settled.labels(api.vendor, "released").inc()
            self.ledger.release(hold, failed=self.meters.ledger_failures.inc)
            return
        worst = Usage(cache_write_1h=len(raw), output=max_tokens)
        if meter is not None:
            meter.close()
            outcome = ERROR if meter.error else COMPLETE if meter.finished else CUT_OFF
            usage, model = meter.charged(max_tokens, len(raw)), meter.model
        elif kept is not None and ended:
            try:
                usage, model = api.from_answer(bytes(kept))
                outcome = COMPLETE
            except ValueError:
                usage, model, outcome = worst, "", CUT_OFF
        else:
            usage, model, outcome = worst, "", CUT_OFF
        self.meters.charged(api.vendor, usage, outcome)
        self.ledger.settle(
            hold, usage, model=model, outcome=outcome, failed=self.meters.ledger_failures.inc
        )
