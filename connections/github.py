"""A GitHub App's installation access tokens, minted on demand for one repository and the
permissions a grant allows, cached until shortly before they expire, and never written
anywhere: the gateway's credential for a ``github-app`` connection.

GitHub's flow: the app signs a JSON Web Token with its private key (RS256, issued by its app
id, valid ten minutes at most), and trades it at ``POST {api}/app/installations/{id}/
access_tokens`` for a token narrowed to the repositories and permissions asked for (an hour).
A refusal is said in words the agent and the person can act on (:class:`GitHubRefused`). No
Django: the gateway calls it.
"""

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jwt
from aiohttp import ClientError, ClientSession, ClientTimeout

MARGIN_SECONDS = 300  # a cached token is renewed this long before it expires
REFUSED_SECONDS = 30  # a refusal is said again, without asking, for this long
JWT_SECONDS = 540  # GitHub takes at most ten minutes; the clock may be a little off
API_VERSION = "2022-11-28"


class GitHubRefused(Exception):
    """GitHub would not mint the token; the text says why, for the agent and the person."""


@dataclass(frozen=True)
class GitHubApp:
    """A GitHub App's installation, as a connection holds it."""

    app_id: str
    installation_id: str
    private_key: str = field(repr=False)  # PEM
    api_url: str = "https://api.github.com"


def git_permissions(push: bool) -> dict[str, str]:
    """An installation token's permissions for git, for a grant that may ``push`` or not."""
    return {"metadata": "read", "contents": "write" if push else "read"}


def api_permissions(api: frozenset[str]) -> dict[str, str]:
    """An installation token's permissions for the ``api`` calls a grant names
    (connections.apicalls.CALLS): no more than those need. Review comments on a pull request
    need ``pull_requests: write``, and comments on its conversation ``issues: write``."""
    permissions = {"metadata": "read"}
    if "read" in api:
        permissions |= {"contents": "read", "pull_requests": "read", "issues": "read"}
    if api & {"pulls", "comments"}:
        permissions["pull_requests"] = "write"
    if api & {"comments", "issues"}:
        permissions["issues"] = "write"
    return permissions


@dataclass
class _Minted:
    token: str = field(repr=False)
    renew_at: float


class InstallationTokens:
    """Mints and caches installation tokens; one at a time per (installation, repository,
    permissions), so that a burst of requests mints once. ``clock`` says when a cached token
    is due for renewal (the tests move it)."""

    def __init__(
        self, session: Callable[[], ClientSession], clock: Callable[[], float] = time.time
    ) -> None:
        self.session = session
        self.clock = clock
        self._cache: dict[tuple[Any, ...], _Minted] = {}
        self._refused: dict[tuple[Any, ...], tuple[float, str]] = {}  # until, what was said
        self._locks: dict[tuple[Any, ...], asyncio.Lock] = {}

    async def token(self, app: GitHubApp, repository: str, permissions: Mapping[str, str]) -> str:
        """A token for ``repository`` (``owner/name``) with ``permissions``."""
        # The key's digest too: a rotated key mints anew (and the old one's tokens are not used).
        key = (app.api_url, app.app_id, app.installation_id, repository.lower(),
               tuple(sorted(permissions.items())),
               hashlib.sha256(app.private_key.encode()).hexdigest())  # fmt: skip
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._cache.get(key)
            if cached is not None and self.clock() < cached.renew_at:
                return cached.token
            # A repository the installation lacks, asked for again and again, asks GitHub once
            # a while: the app's rate limit is the whole organisation's.
            refused = self._refused.get(key)
            if refused is not None and self.clock() < refused[0]:
                raise GitHubRefused(refused[1])
            try:
                minted = await self._mint(app, repository, permissions)
            except GitHubRefused as exc:
                self._refused[key] = (self.clock() + REFUSED_SECONDS, str(exc))
                raise
            self._refused.pop(key, None)
            self._cache[key] = minted
            return minted.token

    def forget(self, app: GitHubApp) -> None:
        """Drop every token of the app (its key was rotated, or GitHub refused one)."""
        for key in [
            k for k in self._cache if k[:3] == (app.api_url, app.app_id, app.installation_id)
        ]:
            del self._cache[key]
        self._refused.clear()

    async def _mint(
        self, app: GitHubApp, repository: str, permissions: Mapping[str, str]
    ) -> _Minted:
        now = int(time.time())  # GitHub's clock, whatever the cache's
        try:
            signed = jwt.encode(
                {"iat": now - 60, "exp": now + JWT_SECONDS, "iss": app.app_id},
                app.private_key,
                algorithm="RS256",
            )
        except (ValueError, TypeError) as exc:
            raise GitHubRefused(
                f"the GitHub App's key cannot sign ({type(exc).__name__})"
            ) from None
        url = f"{app.api_url.rstrip('/')}/app/installations/{app.installation_id}/access_tokens"
        body = {"repositories": [repository.split("/", 1)[1]], "permissions": dict(permissions)}
        headers = {
            "Authorization": f"Bearer {signed}",
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": API_VERSION,
        }
        host = app.api_url.split("//", 1)[-1].split("/", 1)[0]
        try:
            async with self.session().post(
                url,
                json=body,
                headers=headers,
                timeout=ClientTimeout(total=30),
                allow_redirects=False,
            ) as answer:
                status = answer.status
                data = await answer.json(content_type=None) if status < 500 else {}
        except (ClientError, TimeoutError, ValueError) as exc:
            raise GitHubRefused(f"{host} did not answer ({type(exc).__name__})") from None
        if status != 201 or not isinstance(data, dict) or not isinstance(data.get("token"), str):
            raise GitHubRefused(_refusal(status, data, app, repository, host))
        try:
            expires = datetime.fromisoformat(str(data["expires_at"]).replace("Z", "+00:00"))
        except (KeyError, ValueError):
            raise GitHubRefused(f"{host} gave a token without a time it expires") from None
        return _Minted(data["token"], expires.timestamp() - MARGIN_SECONDS)


def _refusal(status: int, data: Any, app: GitHubApp, repository: str, host: str) -> str:
    said = data.get("message", "") if isinstance(data, dict) else ""
    if status == 401:
        return f"{host} refused the GitHub App's key (app {app.app_id}): {said}".rstrip(": ")
    if status == 404:
        return f"{host} knows no installation {app.installation_id} of app {app.app_id}"
    if status == 422:
        return f"the GitHub App's installation {app.installation_id} lacks {repository}"
    if status == 403:
        return f"{host} refused the token for {repository} (403): {said}".rstrip(": ")
    return f"{host} did not mint a token ({status})"
