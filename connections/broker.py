"""The gateway's git route: a sandbox's git speaks smart HTTP to ``/git/<host>/<owner>/<name>``
with its run's token, and the gateway speaks to the upstream with the connection's credential,
within the agent's grant (docs/credentials.md).

Per request: the path is read strictly (:func:`connections.smarthttp.route`; 400 otherwise) →
exactly one ``Authorization: Bearer <run token>`` (403 otherwise: a 401 would have git ask
for a user name, where only the run's configuration can help) → the broker says which
connection and grant cover the repository (a repository not granted is 404, as if it did not
exist) → the request goes upstream with only git's own headers and the connection's credential
(nothing the sandbox sent that could authenticate), and the answer streams back. A push is read
whole first, its pack spooled to disk while its commits are read (bounded memory): every ref
update is judged by the grant (:func:`connections.rules.judge`) against the upstream's default
branch, and a push with a refused update is answered by covey, per ref, with nothing sent
upstream. Every request is recorded through the broker.

No Django: the broker (:class:`Broker`) knows tokens, connections and grants.
"""

import asyncio
import logging
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import IO, Any, Protocol

from aiohttp import (
    ClientError,
    ClientResponse,
    ClientSession,
    ClientTimeout,
    encode_basic_auth,
    web,
)

from connections import smarthttp
from connections.github import GitHubApp, GitHubRefused, InstallationTokens
from connections.packs import Commits, PackReader
from connections.rules import GitGrant, judge
from connections.smarthttp import Malformed, Push, PushReader, Route, Service

logger = logging.getLogger(__name__)

# A route's record of one request: note(status, refused="", problem="").
Note = Callable[..., Awaitable[None]]

UNAVAILABLE = "covey cannot read its records just now, so it sends nothing: try again shortly"

CHUNK = 64 * 1024
FORWARDED = ("content-type", "content-encoding", "accept", "git-protocol", "user-agent")
RETURNED = ("content-type", "cache-control", "expires", "pragma")
RESULT_TYPE = "application/x-git-receive-pack-result"
PROBE = b"0000"  # the body of git's probe before a large push


class Unauthenticated(Exception):
    """The token is no run's that may use the gateway now."""


class NotGranted(Exception):
    """No grant of the agent covers the repository (or the host)."""


@dataclass(frozen=True)
class GitAccess:
    """What the broker gives for one request: where the repository lives, the credential as
    the upstream takes it (or the GitHub App that mints it, with the permissions to ask for),
    and the grant over it. ``problem``: why the credential cannot be used (nothing is sent)."""

    connection_id: int
    base_url: str  # the git root, e.g. https://github.com (the path /owner/name.git follows)
    headers: Mapping[str, str] = field(repr=False)  # the credential
    grant: GitGrant
    github: GitHubApp | None = None
    permissions: Mapping[str, str] = field(default_factory=dict)
    problem: str = ""
    api: frozenset[str] = frozenset()  # the API calls the grant names (connections.apicalls)
    repository: str = ""  # owner/name as the grant spells it ("": as the request did)
    credential_at: str = ""  # when the credential used was set (what the upstream said is of it)


@dataclass(frozen=True)
class RegistryAccess:
    """A registry connection of the agent's grants: where it is, its credential, its paths."""

    connection_id: int
    base_url: str  # the index URL (the path follows)
    headers: Mapping[str, str] = field(repr=False)  # the credential
    paths: tuple[str, ...]
    problem: str = ""  # why the credential cannot be used (nothing is sent)
    credential_at: str = ""  # when the credential used was set (what the upstream said is of it)


@dataclass(frozen=True)
class RefOutcome:
    """One ref update of a push and what became of it."""

    ref: str
    old: str
    new: str
    refused: str  # why covey refused it ("" when it went upstream)


@dataclass(frozen=True)
class GitEvent:
    """One credentialed request, for the record."""

    connection_id: int | None
    host: str
    repository: str
    service: str
    method: str
    status: int  # what the sandbox was answered
    refused: str = ""  # covey's reason, when covey refused
    refs: tuple[RefOutcome, ...] = ()
    problem: str = ""  # why the upstream could not be used (its credential refused, no answer)
    path: str = ""  # an API call's, at the API's root
    credential_at: str = ""  # the access's: a status is said of that credential only


class Broker(Protocol):
    """Tokens, connections and grants; called in worker threads."""

    def git_access(self, token: str, host: str, repository: str) -> GitAccess:
        """The access for a run's token to ``repository`` (``owner/name``) on ``host``;
        Unauthenticated or NotGranted."""
        ...

    def api_access(self, token: str, host: str, repository: str) -> GitAccess:
        """The same for ``repository`` at the API on ``host`` (its base URL the API's)."""
        ...

    def registry_access(self, token: str, name: str) -> RegistryAccess:
        """The registry connection named ``name`` that the run's agent is granted."""
        ...

    def record(self, token: str, event: GitEvent) -> None: ...


@dataclass
class GitRoute:
    """The ``/git/`` route of the gateway."""

    broker: Broker
    session: Callable[[], ClientSession]  # the gateway's client to upstreams (TLS verified)
    tokens: InstallationTokens  # a GitHub App's, minted with the same client
    max_push_bytes: int = 2 * 1024**3
    spool: str | None = None  # where pushed packs wait while judged (None: the temp folder)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one request under /git/."""
        try:
            route = smarthttp.route(
                request.method, request.rel_url.raw_path, request.rel_url.raw_query_string
            )
        except Malformed as exc:
            return _answer(400, f"covey: {exc}")
        token = token_of(request)
        if token is None:
            return _answer(
                403, "covey: present the run's token, once (Authorization: Bearer <token>)"
            )
        try:
            access = await asyncio.to_thread(
                self.broker.git_access, token, route.host, route.repository
            )
        except Unauthenticated:
            return _answer(403, "covey: this token is no running agent's (a run's ends with it)")
        except NotGranted:
            await self._record(token, None, route, request, 404, refused="not granted")
            return _answer(404, f"covey: repository {route.repository} not found")
        except Exception:
            logger.exception("covey: the broker failed")
            return _answer(503, "covey: " + UNAVAILABLE)
        if access.repository:  # the repository as the grant spells it (hosts may mind case)
            owner, _, name = access.repository.partition("/")
            route = replace(route, owner=owner, name=name)
        try:
            access = await credential(self.tokens, access, route.repository)
        except GitHubRefused as exc:
            await self._record(token, access, route, request, 502, problem=str(exc))
            return _answer(502, f"covey: {exc}")
        if route.service == Service.RECEIVE_PACK and not route.advertisement:
            return await self._push(request, route, access, token)
        body = _chunks(b"", request) if request.method == "POST" else None
        note = partial(self._record, token, access, route, request)
        return await self._forward(request, route, access, body, note)

    async def _push(
        self, request: web.Request, route: Route, access: GitAccess, token: str
    ) -> web.StreamResponse:
        if request.headers.get("Content-Encoding", "identity") != "identity":
            why = "send the push unencoded (no Content-Encoding)"
            await self._record(token, access, route, request, 415, refused=why)
            return _answer(415, f"covey: {why}")
        start = await request.content.read(4)
        if start == PROBE and request.content.at_eof():
            # git's probe before a large push (a flush-pkt alone, no update): the upstream
            # says whether the credential is good, nothing more.
            note = partial(self._record, token, access, route, request)
            return await self._forward(request, route, access, PROBE, note)
        with tempfile.TemporaryFile(dir=self.spool) as spooled:
            try:
                head, push, pack = await self._read_push(start, request, spooled)
            except Malformed as exc:
                await self._record(token, access, route, request, 400, refused=str(exc))
                return _answer(400, f"covey: {exc}")
            branch = await self._default_branch(route, access)
            outcomes = []
            for command in push.commands:
                fast_forward = pack.descends(command.new, command.old) if pack else None
                reason = judge(
                    access.grant, command, default_branch=branch, fast_forward=fast_forward
                )
                outcomes.append(RefOutcome(command.ref, command.old, command.new, reason or ""))
            reasons = {o.ref: o.refused for o in outcomes if o.refused}
            if reasons:
                message = "; ".join(dict.fromkeys(reasons.values()))
                body = smarthttp.refusal(push, reasons, message=message)
                await self._record(
                    token, access, route, request, 200, refused=message, refs=tuple(outcomes)
                )
                return web.Response(body=body, headers={"Content-Type": RESULT_TYPE})
            spooled.seek(0)
            note = partial(self._record, token, access, route, request, refs=tuple(outcomes))
            return await self._forward(request, route, access, _replay(head, spooled), note)

    async def _read_push(
        self, start: bytes, request: web.Request, spooled: IO[bytes]
    ) -> tuple[bytes, Push, Commits | None]:
        """The push's head (as sent), the push, and the commits of its pack (None: no pack),
        the pack written to ``spooled``; ``start``: the body's first bytes, read already."""
        reader, head, push, pack, size = PushReader(), bytearray(), None, None, 0
        async for chunk in _chunks(start, request):
            size += len(chunk)
            if size > self.max_push_bytes:
                raise Malformed(
                    f"the push is larger than covey takes ({self.max_push_bytes} bytes)"
                )
            if push is None:
                head += chunk
                push = reader.feed(chunk)
                if push is None:
                    continue
                del head[len(head) - len(reader.rest) :]
                chunk = reader.rest
                pack = PackReader(id_length=push.id_length, max_bytes=self.max_push_bytes)
            if chunk and pack is not None:
                await asyncio.to_thread(_take, pack, spooled, chunk)
        push = reader.finish() if push is None else push
        if pack is not None and size > len(head):
            return bytes(head), push, pack.finish()
        if any(not command.deletes for command in push.commands):
            raise Malformed("a push that makes or moves a ref carries a pack")
        return bytes(head), push, None

    async def _default_branch(self, route: Route, access: GitAccess) -> str | None:
        """The upstream's default branch, from its fetch advertisement (None: not known)."""
        url = f"{_repository_url(access, route)}/info/refs?service=git-upload-pack"
        try:
            headers = {**access.headers, "Accept-Encoding": "identity"}
            timeout = ClientTimeout(total=60, sock_connect=10)
            async with self.session().get(
                url, headers=headers, timeout=timeout, allow_redirects=False
            ) as answer:
                if answer.status != 200:
                    return None
                # Its first ref line names it; the rest of a large advertisement is not read.
                start = b""
                while len(start) < CHUNK and (more := await answer.content.read(CHUNK)):
                    start += more
                return smarthttp.default_branch(start)
        except (ClientError, TimeoutError) as exc:
            logger.warning("%s: the default branch could not be read: %s", route.host, exc)
            return None

    async def _forward(
        self,
        request: web.Request,
        route: Route,
        access: GitAccess,
        body: Any,
        note: Note,
    ) -> web.StreamResponse:
        """The upstream's answer, streamed back; a refused credential and an upstream that
        does not answer are 502s that name the host. Each is recorded (``note``) before any of
        it is sent, so that what the sandbox has seen is on the record."""
        endpoint = "info/refs" if route.advertisement else route.service.value
        url = f"{_repository_url(access, route)}/{endpoint}"
        if route.advertisement:
            url += f"?service={route.service.value}"
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        headers.update(access.headers)
        headers["Accept-Encoding"] = "identity"  # what is streamed back is what was sent
        try:
            upstream = await self.session().request(
                request.method,
                url,
                headers=headers,
                data=body,
                timeout=ClientTimeout(total=None, sock_connect=10, sock_read=600),
                allow_redirects=False,
            )
        except (ClientError, TimeoutError) as exc:
            problem = f"{route.host} did not answer ({type(exc).__name__})"
            await note(502, problem=problem)
            return _answer(502, f"covey: {problem}")
        async with upstream:
            if upstream.status in (401, 403):
                if access.github is not None:  # a token it minted and then refused: mint anew
                    self.tokens.forget(access.github)
                problem = f"{route.host} refused the connection's credential ({upstream.status})"
                await note(502, problem=problem)
                return _answer(502, f"covey: {problem}")
            return await stream_back(request, upstream, RETURNED, note)

    async def _record(
        self,
        token: str,
        access: GitAccess | None,
        route: Route,
        request: web.Request,
        status: int,
        *,
        refused: str = "",
        problem: str = "",
        refs: tuple[RefOutcome, ...] = (),
    ) -> None:
        event = GitEvent(
            connection_id=access.connection_id if access else None,
            credential_at=access.credential_at if access else "",
            host=route.host,
            repository=route.repository,
            service=route.service.value,
            method=request.method,
            status=status,
            refused=refused,
            refs=refs,
            problem=problem,
        )
        await record(self.broker, token, event)


async def stream_back(
    request: web.Request,
    upstream: ClientResponse,
    returned: tuple[str, ...],
    note: Note,
) -> web.StreamResponse:
    """The upstream's answer to ``request``, recorded (``note``) before any of it is sent
    (so that what the sandbox has seen is on the record), with only the ``returned`` headers,
    its body streamed (none for HEAD)."""
    await note(upstream.status)
    answer = web.StreamResponse(status=upstream.status)
    for name in returned:
        if name in upstream.headers:
            answer.headers[name] = upstream.headers[name]
    await answer.prepare(request)
    if request.method != "HEAD":
        async for chunk in upstream.content.iter_chunked(CHUNK):
            await answer.write(chunk)
    await answer.write_eof()
    return answer


async def record(broker: "Broker", token: str, event: GitEvent) -> None:
    """``event`` on the record, through the broker (a record that cannot be written is
    logged: the answer has gone already, or goes anyway)."""
    try:
        await asyncio.to_thread(broker.record, token, event)
    except Exception:
        logger.exception("a credentialed request could not be recorded")


async def credential(
    tokens: InstallationTokens, access: GitAccess, repository: str, *, api: bool = False
) -> GitAccess:
    """``access`` with the credential in its headers: a GitHub App's installation token for
    the repository is minted (or taken from the cache), for git (basic) or its API (bearer);
    GitHubRefused says why there is none."""
    if access.problem:
        raise GitHubRefused(access.problem)
    if access.github is None:
        return access
    token = await tokens.token(access.github, repository, access.permissions)
    sent = f"Bearer {token}" if api else encode_basic_auth("x-access-token", token)
    return replace(access, headers={"Authorization": sent})


def token_of(request: web.Request) -> str | None:
    """The run's token: exactly one Authorization header, a bearer one."""
    given = request.headers.getall("Authorization", [])
    if len(given) != 1 or not given[0].startswith("Bearer "):
        return None
    token = given[0].removeprefix("Bearer ").strip()
    return token or None


def _take(pack: PackReader, spooled: IO[bytes], chunk: bytes) -> None:
    pack.feed(chunk)
    spooled.write(chunk)


def _repository_url(access: GitAccess, route: Route) -> str:
    return f"{access.base_url.rstrip('/')}/{route.owner}/{route.name}.git"


async def _chunks(start: bytes, request: web.Request) -> AsyncIterator[bytes]:
    if start:
        yield start
    async for chunk in request.content.iter_chunked(CHUNK):
        yield chunk


async def _replay(head: bytes, spooled: IO[bytes]) -> AsyncIterator[bytes]:
    yield head
    while chunk := await asyncio.to_thread(spooled.read, CHUNK):
        yield chunk


def _answer(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text + "\n")
