"""The model gateway: agents call their model through it without holding a key, and every
request is metered against its budgets. No Django: the ledger it is given (:class:`Ledger`)
knows tokens, keys and budgets.

Per request (POST /v1/messages): authenticate the run's token (``x-api-key``, or
``Authorization: Bearer``) → refuse a request whose cost the gateway cannot bound (server tools,
content it would fetch, the 1M-token context) → reserve its worst case (its size in bytes bounds
its input tokens; ``max_tokens``, set from the configuration when the request has none, its
output) → send it to the vendor with every credential the sandbox sent removed and the
organisation's key in their place, verifying the vendor's certificate → stream the answer back
as it comes, reading its usage on the way (:class:`budgets.usage.StreamMeter`) → settle the
reservation to what was used (released when the vendor refused the request). A ledger that
cannot be written refuses the request (503): nothing is ever forwarded unmetered. Token counting
(POST /v1/messages/count_tokens) is free, and forwarded after authentication only; every other
path is refused.
"""

import asyncio
import json
import logging
import ssl
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from budgets.usage import StreamMeter, Usage, from_message

logger = logging.getLogger(__name__)

T = TypeVar("T")

COMPLETE, ERROR, CUT_OFF = "complete", "error", "cut-off"  # outcomes (budgets.models.Outcome)
BUDGET_EXHAUSTED = "budget-exhausted"  # X-Covey-Deny-Reason
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
    "content-length",
    "accept-encoding",
    "x-api-key",
    "authorization",
    "cookie",
    "forwarded",
    "x-forwarded-for",
}
NOT_RETURNED = HOP_BY_HOP | {"content-length", "content-encoding", "set-cookie"}
# Tools the client runs itself (their results come back in the next request, in its size);
# every other kind runs at the vendor, at costs the gateway cannot bound, and is refused.
CLIENT_TOOLS = ("custom", "bash_", "text_editor_", "computer_", "memory_")


class Refused(Exception):
    """A request the gateway answers itself, in the Messages API's error shape."""

    def __init__(self, status: int, kind: str, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.reason = status, kind, message, reason


@dataclass(frozen=True)
class Caller:
    """Who a token belongs to, and the key to send for it."""

    agent_id: int
    organisation_id: int
    run_id: str | None
    name: str  # organisation/agent, for logs
    key: str = field(repr=False)


@dataclass(frozen=True)
class Hold:
    """A reservation the ledger made for one request."""

    reservation_id: int
    request_id: str


class Ledger(Protocol):
    """Tokens, keys and budgets. Called in worker threads (but :meth:`known`); raises Refused
    to refuse."""

    def known(self, token: str) -> Caller | None:
        """The caller of a token the ledger vouched for moments ago, without any I/O (called
        on the event loop); None: ask :meth:`authenticate`."""
        ...

    def authenticate(self, token: str) -> Caller: ...

    def reserve(
        self, caller: Caller, *, model: str, input_bound: int, max_tokens: int, request_id: str
    ) -> Hold: ...

    def settle(self, hold: Hold, usage: Usage, *, model: str, outcome: str) -> None: ...

    def release(self, hold: Hold) -> None: ...


@dataclass(frozen=True)
class GatewayConfig:
    upstream: str = "https://api.anthropic.com"  # COVEY_MODEL_UPSTREAM
    ca_bundle: str = ""  # COVEY_MODEL_CA_BUNDLE: the CAs to trust for it (empty: the system's)
    default_max_tokens: int = 32000  # COVEY_GATEWAY_DEFAULT_MAX_TOKENS
    max_request_bytes: int = 32 * 1024 * 1024  # the Messages API's own limit
    threads: int = 8  # COVEY_GATEWAY_LEDGER_THREADS: ledger calls at once
    connect_timeout: float = 10.0
    read_timeout: float = 600.0  # between two chunks of an answer
    total_timeout: float = 3600.0  # COVEY_GATEWAY_MAX_REQUEST_SECONDS: answer included


def _error(refused: Refused, request_id: str) -> web.Response:
    response = web.json_response(
        {"type": "error", "error": {"type": refused.kind, "message": refused.message}},
        status=refused.status,
    )
    response.headers["X-Covey-Request-Id"] = request_id
    if refused.reason:
        response.headers["X-Covey-Deny-Reason"] = refused.reason
    return response


def token_of(headers: Mapping[str, str]) -> str:
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
            "send the run's token (ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN) as x-api-key or"
            " as Authorization: Bearer" + (" (two different tokens were sent)" if sent else ""),
        )
    return sent.pop()


def check_bounded(body: dict[str, Any], beta: str) -> None:
    """Refuse what would cost more than the request's size and max_tokens can bound."""
    if "context-1m" in beta:
        raise Refused(
            400,
            "invalid_request_error",
            "the 1M-token context (anthropic-beta context-1m) is priced differently and is not"
            " metered by covey's gateway",
        )
    for name in ("mcp_servers", "container"):
        if body.get(name):
            raise Refused(
                400,
                "invalid_request_error",
                f"{name!r} runs at the vendor at a cost covey's gateway cannot bound",
            )
    for tool in body.get("tools") or []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and not kind.startswith(CLIENT_TOOLS):
            raise Refused(
                400,
                "invalid_request_error",
                f"the server tool {kind!r} runs at the vendor at a cost covey's gateway cannot"
                " bound: only tools the client runs itself are allowed",
            )
    stack: list[Any] = [body.get("messages"), body.get("system")]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            source = item.get("source")
            if isinstance(source, dict) and source.get("type") in ("url", "file"):
                raise Refused(
                    400,
                    "invalid_request_error",
                    f"content by {source['type']} is fetched by the vendor, at a size covey's"
                    " gateway cannot bound: send it in the request",
                )
            stack.extend(v for v in item.values() if isinstance(v, list | dict))


def _parse(raw: bytes, default_max_tokens: int) -> tuple[dict[str, Any], str, int, bytes]:
    """The request, its model and max_tokens, and the bytes to send (with max_tokens set)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise Refused(400, "invalid_request_error", f"the request is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Refused(400, "invalid_request_error", "the request is not a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Refused(400, "invalid_request_error", "model: the request names no model")
    if "max_tokens" not in body:
        body["max_tokens"] = default_max_tokens
        raw = json.dumps(body, separators=(",", ":")).encode()
    max_tokens = body["max_tokens"]
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise Refused(400, "invalid_request_error", "max_tokens: a whole number of at least 1")
    return body, model, max_tokens, raw


class Gateway:
    """The gateway's aiohttp application (:meth:`app`), over ``ledger``."""

    def __init__(self, ledger: Ledger, config: GatewayConfig) -> None:
        self.ledger = ledger
        self.config = config
        self.upstream = config.upstream.rstrip("/")
        self.pool = ThreadPoolExecutor(config.threads, thread_name_prefix="covey-ledger")
        self.session: ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_bytes)
        app.router.add_get("/healthz", self.health)
        app.router.add_post("/v1/messages", partial(self.handle, metered=True))
        app.router.add_post("/v1/messages/count_tokens", partial(self.handle, metered=False))
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

    async def _stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def unknown(self, request: web.Request) -> web.Response:
        return _error(
            Refused(
                404,
                "not_found_error",
                f"covey's model gateway forwards the Messages API only (POST /v1/messages and"
                f" /v1/messages/count_tokens), not {request.method} {request.path}",
            ),
            uuid.uuid4().hex,
        )

    async def _ledger(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, partial(call, *args, **kwargs))
        except Refused:
            raise
        except Exception:
            logger.exception("covey: the ledger failed")
            raise Refused(
                503,
                "api_error",
                "covey's model gateway cannot write its ledger, so it forwards nothing: try"
                " again shortly",
                "ledger-unavailable",
            ) from None

    async def handle(self, request: web.Request, *, metered: bool) -> web.StreamResponse:
        request_id = uuid.uuid4().hex
        try:
            token = token_of(request.headers)
            caller = self.ledger.known(token)  # vouched for moments ago: no thread, no I/O
            if caller is None:
                caller = await self._ledger(self.ledger.authenticate, token)
            raw = await self._read(request)
            hold, max_tokens = None, 0
            if metered:
                body, model, max_tokens, raw = _parse(raw, self.config.default_max_tokens)
                check_bounded(body, request.headers.get("anthropic-beta", ""))
                hold = await self._ledger(
                    self.ledger.reserve,
                    caller,
                    model=model,
                    input_bound=len(raw),
                    max_tokens=max_tokens,
                    request_id=request_id,
                )
        except Refused as refused:
            level = logging.WARNING if refused.status >= 500 else logging.INFO
            logger.log(level, "covey: refused request %s: %s", request_id, refused.message)
            return _error(refused, request_id)
        return await self._forward(request, caller, raw, hold, max_tokens, request_id)

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
        caller: Caller,
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
        headers += [("x-api-key", caller.key), ("Accept-Encoding", "identity")]
        try:
            upstream = await self.session.request(
                request.method, self.upstream + request.path_qs, data=raw, headers=headers
            )
        except (ClientError, TimeoutError, OSError) as exc:
            if hold is not None:
                await self._quietly(self.ledger.release, hold)
            logger.warning("covey: request %s did not reach the vendor: %r", request_id, exc)
            return _error(
                Refused(
                    502, "api_error", f"covey's model gateway could not reach the vendor ({exc})"
                ),
                request_id,
            )
        ok = hold is not None and upstream.status == 200
        streamed = "text/event-stream" in upstream.headers.get("Content-Type", "")
        meter = StreamMeter() if ok and streamed else None
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
            if hold is not None:  # before the answer ends: the caller's next request sees it
                settled = True
                await asyncio.shield(
                    self._settle(hold, upstream.status, meter, kept, True, raw, max_tokens)
                )
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
                await asyncio.shield(
                    self._settle(hold, upstream.status, meter, kept, ended, raw, max_tokens)
                )
        return response

    async def _settle(
        self,
        hold: Hold,
        status: int,
        meter: StreamMeter | None,
        kept: bytearray | None,
        ended: bool,
        raw: bytes,
        max_tokens: int,
    ) -> None:
        if status != 200:  # refused by the vendor: nothing was used
            await self._quietly(self.ledger.release, hold)
            return
        worst = Usage(cache_write_1h=len(raw), output=max_tokens)
        if meter is not None:
            meter.close()
            outcome = ERROR if meter.error else COMPLETE if meter.finished else CUT_OFF
            usage, model = meter.charged(max_tokens), meter.model
        elif kept is not None and ended:
            try:
                usage, model = from_message(bytes(kept))
                outcome = COMPLETE
            except ValueError:
                usage, model, outcome = worst, "", CUT_OFF
        else:
            usage, model, outcome = worst, "", CUT_OFF
        await self._quietly(self.ledger.settle, hold, usage, model=model, outcome=outcome)

    async def _quietly(self, call: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        try:
            await self._ledger(call, *args, **kwargs)
        except Refused:
            logger.error(
                "covey: the reservation of request %s stays held: the ledger failed",
                args[0].request_id,
            )
