"""The gateway's API route: a sandbox calls a git host's HTTP API at
``/api/<host>/repos/<owner>/<name>/…`` with its run's token, and the gateway makes the call at
the connection's API URL with the connection's credential, when the agent's grant allows it
(docs/credentials.md).

Per request: the path is read strictly (:func:`connections.apicalls.route`; 400 otherwise) →
exactly one ``Authorization: Bearer <run token>`` (403 otherwise) → the broker says which
connection and grant cover the repository (a repository not granted is 404, as GitHub answers
for a private repository one cannot see) → the method and path must be a call the grant names
(403 otherwise, the rule named) → the call goes upstream with only the request's own content
headers and the connection's credential, and the answer streams back. Every refusal is JSON,
``{"message": …, "rule": …}``, as GitHub's own errors carry a message. Every request is
recorded through the broker. No Django.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from functools import partial

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from connections import apicalls
from connections.broker import (
    CHUNK,
    UNAVAILABLE,
    Broker,
    GitAccess,
    GitEvent,
    Note,
    NotGranted,
    Unauthenticated,
    credential,
    record,
    stream_back,
    token_of,
)
from connections.github import GitHubRefused, InstallationTokens
from connections.smarthttp import Malformed

logger = logging.getLogger(__name__)

SERVICE = "api"  # what the record says of an API call
BODY_SECONDS = 60.0  # a request's body must have gone upstream whole this long after the answer
METHODS = ("GET", "HEAD", "POST", "PATCH", "PUT", "DELETE")  # what an API call may be
FORWARDED = (
    "accept", "content-type", "user-agent", "x-github-api-version", "if-none-match",
    "if-modified-since",
)  # fmt: skip
# Not Location: a redirect may lead off the connection (a download URL with a token of its own).
RETURNED = (
    "content-type", "etag", "last-modified", "cache-control", "retry-after",
    "x-github-request-id", "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset",
    "x-ratelimit-used", "x-ratelimit-resource",
)  # fmt: skip


class TooLarge(Exception):
    """The request's body is larger than the route takes."""


@dataclass
class ApiRoute:
    """The ``/api/`` route of the gateway."""

    broker: Broker
    session: Callable[[], ClientSession]  # the gateway's client to upstreams (TLS verified)
    tokens: InstallationTokens
    max_body_bytes: int = 25 * 1024 * 1024

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one request under /api/."""
        try:
            call = apicalls.route(request.rel_url.raw_path)
        except Malformed as exc:
            return refused(400, str(exc), "path")
        token = token_of(request)
        if token is None:
            return refused(
                403, "present the run's token, once (Authorization: Bearer <token>)", "token"
            )
        try:
            access = await asyncio.to_thread(
                self.broker.api_access, token, call.host, call.repository
            )
        except Unauthenticated:
            return refused(403, "this token is no running agent's (a run's ends with it)", "token")
        except NotGranted:
            await self._record(token, None, call, request, 404, refused="not granted")
            return refused(404, f"repository {call.repository} not found", "not granted")
        except Exception:
            logger.exception("covey: the broker failed")
            return refused(503, UNAVAILABLE, "unavailable")
        if access.repository:  # the repository as the grant spells it (hosts may mind case)
            owner, _, name = access.repository.partition("/")
            call = replace(call, owner=owner, name=name)
        if request.method not in METHODS:
            why = f"{request.method[:20]} is no method of an API call covey makes"
            await self._record(token, access, call, request, 405, refused=why)
            return refused(405, why, "call")
        if said := apicalls.refusal(access.api, request.method, call):
            await self._record(token, access, call, request, 403, refused=said)
            return refused(403, said, "call")
        why = ""
        if request.headers.get("Content-Encoding", "identity") != "identity":
            status, why = 415, "send the body unencoded (no Content-Encoding)"
        elif (request.content_length or 0) > self.max_body_bytes:
            status, why = 413, f"the body is larger than {self.max_body_bytes} bytes"
        if why:
            await self._record(token, access, call, request, status, refused=why)
            return refused(status, why, "body")
        try:
            access = await credential(self.tokens, access, call.repository, api=True)
        except GitHubRefused as exc:
            await self._record(token, access, call, request, 502, problem=str(exc))
            return refused(502, str(exc), "upstream")

        return await self._forward(
            request, call, access, partial(self._record, token, access, call, request)
        )

    async def _forward(
        self,
        request: web.Request,
        call: apicalls.Call,
        access: GitAccess,
        note: Note,
    ) -> web.StreamResponse:
        """The API's answer, or covey's in its place (a refused credential, no answer, a
        redirect), recorded (``note``) before any of it is sent."""
        url = access.base_url.rstrip("/") + call.path
        if query := request.rel_url.raw_query_string:
            url += f"?{query}"
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        headers.update(access.headers)
        headers["Accept-Encoding"] = "identity"  # what is streamed back is what was sent
        body = _Body(request, self.max_body_bytes) if request.body_exists else None
        try:
            upstream = await self.session().request(
                request.method,
                url,
                headers=headers,
                data=body.chunks() if body else None,
                timeout=ClientTimeout(total=None, sock_connect=10, sock_read=300),
                allow_redirects=False,
            )
        except (ClientError, TimeoutError, TooLarge) as exc:
            if body is not None and body.too_large:  # however the client said it
                return await self._too_large(note)
            problem = f"{call.host} did not answer ({type(exc).__name__})"
            await note(502, problem=problem)
            return refused(502, problem, "upstream")
        async with upstream:
            if body is not None:
                # The API may answer before it has read the whole body: its answer is passed
                # on only once the body has gone whole (one cut at the limit is refused).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(body.ended.wait(), BODY_SECONDS)
                if body.too_large:
                    return await self._too_large(note)
                if not body.ended.is_set():
                    why = f"the body did not end within {BODY_SECONDS:g} s"
                    await note(408, refused=why)
                    return refused(408, why, "body")
            if upstream.status == 401:
                if access.github is not None:  # a token it minted and then refused: mint anew
                    self.tokens.forget(access.github)
                problem = f"{call.host} refused the connection's credential (401)"
                await note(502, problem=problem)
                return refused(502, problem, "upstream")
            if 300 <= upstream.status < 400 and upstream.status != 304:
                why = f"{call.host} answered {upstream.status}, a redirect covey does not pass on"
                await note(502, refused=why)  # the credential is fine
                return refused(502, why, "redirect")
            return await stream_back(request, upstream, RETURNED, note)

    async def _too_large(self, note: Note) -> web.Response:
        told = f"the body is larger than {self.max_body_bytes} bytes"
        await note(413, refused=told)
        return refused(413, told, "body")

    async def _record(
        self,
        token: str,
        access: GitAccess | None,
        call: apicalls.Call,
        request: web.Request,
        status: int,
        *,
        refused: str = "",
        problem: str = "",
    ) -> None:
        event = GitEvent(
            connection_id=access.connection_id if access else None,
            credential_at=access.credential_at if access else "",
            host=call.host,
            repository=call.repository,
            service=SERVICE,
            method=request.method,
            status=status,
            refused=refused,
            problem=problem,
            path=call.path,
        )
        await record(self.broker, token, event)


class _Body:
    """A request's body streamed upstream, stopped at ``limit`` bytes."""

    def __init__(self, request: web.Request, limit: int) -> None:
        self.request, self.limit, self.too_large = request, limit, False
        self.ended = asyncio.Event()  # all of it sent, or stopped

    async def chunks(self) -> AsyncIterator[bytes]:
        size = 0
        try:
            async for chunk in self.request.content.iter_chunked(CHUNK):
                size += len(chunk)
                if size > self.limit:
                    self.too_large = True
                    raise TooLarge
                yield chunk
        finally:
            self.ended.set()


def refused(status: int, message: str, rule: str) -> web.Response:
    """covey's JSON refusal: what is wrong, and which rule said so."""
    return web.json_response({"message": f"covey: {message}", "rule": rule}, status=status)
