"""The gateway's registry route: a sandbox reads a private package index or registry at
``/registry/<connection>/<path>`` with its run's token, and the gateway reads
``<index URL>/<path>`` with the connection's user name and password (docs/credentials.md).

Registries are read only: GET and HEAD, under the connection's paths (405 and 403 otherwise,
the rule named in JSON). The run's token comes as a bearer token or, as pip and npm send the
credential of an index URL, as the password of basic authentication (``covey:<token>``). The
path is read as strictly as the API route's. No Django: the broker knows the connection.
"""

import asyncio
import base64
import binascii
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from connections.apibroker import refused
from connections.apicalls import check_path
from connections.broker import (
    UNAVAILABLE,
    Broker,
    GitEvent,
    Note,
    NotGranted,
    RegistryAccess,
    Unauthenticated,
    record,
    stream_back,
)
from connections.smarthttp import Malformed, check_segment

logger = logging.getLogger(__name__)

SERVICE = "registry"  # what the record says of a registry's read
METHODS = ("GET", "HEAD")
FORWARDED = ("accept", "user-agent", "if-none-match", "if-modified-since", "range")
RETURNED = (
    "content-type", "content-length", "etag", "last-modified", "cache-control",
    "accept-ranges", "content-range",
)  # fmt: skip


@dataclass
class RegistryRoute:
    """The ``/registry/`` route of the gateway."""

    broker: Broker
    session: Callable[[], ClientSession]  # the gateway's client to upstreams (TLS verified)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one request under /registry/."""
        try:
            name, path, decoded = _route(request.rel_url.raw_path)
        except Malformed as exc:
            return refused(400, str(exc), "path")
        token = run_token(request)
        if token is None:
            return refused(
                403,
                "present the run's token, once (Authorization: Bearer <token>, or as the"
                " password of the index URL you were given)",
                "token",
            )
        try:
            access = await asyncio.to_thread(self.broker.registry_access, token, name)
        except Unauthenticated:
            return refused(403, "this token is no running agent's (a run's ends with it)", "token")
        except NotGranted:
            await self._record(token, None, name, path, request, 404, refused="not granted")
            return refused(404, f"no registry {name} is granted to this agent", "not granted")
        except Exception:
            logger.exception("covey: the broker failed")
            return refused(503, UNAVAILABLE, "unavailable")
        if request.method not in METHODS:
            why = f"registries are read only: {request.method[:20]} is refused"
            await self._record(token, access, name, path, request, 405, refused=why)
            return refused(405, why, "read")
        if not any(under(decoded, allowed) for allowed in access.paths):
            why = f"{path} is under none of the paths of {name} ({', '.join(access.paths)})"
            await self._record(token, access, name, path, request, 403, refused=why)
            return refused(403, why, "paths")
        if access.problem:
            await self._record(token, access, name, path, request, 502, problem=access.problem)
            return refused(502, access.problem, "upstream")

        note = partial(self._record, token, access, name, path, request)
        return await self._forward(request, access, name, path, note)

    async def _forward(
        self,
        request: web.Request,
        access: RegistryAccess,
        name: str,
        path: str,
        note: Note,
    ) -> web.StreamResponse:
        """The registry's answer, or covey's in its place (a refused credential, no answer, a
        redirect), recorded (``note``) before any of it is sent."""
        url = access.base_url.rstrip("/") + path
        if query := request.rel_url.raw_query_string:
            url += f"?{query}"
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        headers.update(access.headers)
        headers["Accept-Encoding"] = "identity"  # what is streamed back is what was sent
        try:
            upstream = await self.session().request(
                request.method,
                url,
                headers=headers,
                timeout=ClientTimeout(total=None, sock_connect=10, sock_read=300),
                allow_redirects=False,
            )
        except (ClientError, TimeoutError) as exc:
            problem = f"registry {name} did not answer ({type(exc).__name__})"
            await note(502, problem=problem)
            return refused(502, problem, "upstream")
        async with upstream:
            if upstream.status == 401:  # (a 403 may be a path it forbids: passed on as it is)
                problem = f"registry {name} refused the connection's credential (401)"
                await note(502, problem=problem)
                return refused(502, problem, "upstream")
            if 300 <= upstream.status < 400 and upstream.status != 304:
                why = (
                    f"registry {name} answered {upstream.status}, a redirect covey does not pass on"
                )
                await note(502, refused=why)  # the credential is fine
                return refused(502, why, "redirect")
            return await stream_back(request, upstream, RETURNED, note)

    async def _record(
        self,
        token: str,
        access: RegistryAccess | None,
        name: str,
        path: str,
        request: web.Request,
        status: int,
        *,
        refused: str = "",
        problem: str = "",
    ) -> None:
        event = GitEvent(
            connection_id=access.connection_id if access else None,
            credential_at=access.credential_at if access else "",
            host=name,
            repository="",
            service=SERVICE,
            method=request.method,
            status=status,
            refused=refused,
            problem=problem,
            path=path,
        )
        await record(self.broker, token, event)


def _route(path: str) -> tuple[str, str, str]:
    """The connection's name, and the path under its index URL as sent and decoded."""
    decoded = check_path(path, encoded_slash=True)
    parts = path.split("/")
    if len(parts) < 4 or parts[:2] != ["", "registry"]:
        raise Malformed("covey's registry route serves /registry/<connection>/<path> only")
    check_segment("connection", parts[2])
    prefix = f"/registry/{parts[2]}"
    return parts[2], path.removeprefix(prefix), decoded.removeprefix(prefix)


def under(path: str, allowed: str) -> bool:
    """Whether ``path`` (decoded) is ``allowed`` or below it, segment by segment."""
    if allowed.endswith("/"):
        return path.startswith(allowed)
    return path == allowed or path.startswith(allowed + "/")


def run_token(request: web.Request) -> str | None:
    """The run's token: exactly one Authorization header, a bearer one or a basic one whose
    password it is (the user name is not read)."""
    given = request.headers.getall("Authorization", [])
    if len(given) != 1:
        return None
    if given[0].startswith("Basic "):
        try:
            pair = base64.b64decode(given[0].removeprefix("Basic "), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        token = pair.partition(":")[2]
    elif given[0].startswith("Bearer "):
        token = given[0].removeprefix("Bearer ").strip()
    else:
        return None
    return token or None
