"""The gateway's broker in covey's database (connections.broker.Broker), for its worker threads:
a run's token is the model gateway's (the ledger authenticates it: a token ends with its run),
the grants are the agent's as they are now (so a grant revoked during a run refuses the run's
next request), and the credential is the connection's as it is now (so a rotation is used by the
next request). What every request would otherwise read again is kept for at most KEPT_SECONDS,
as the ledger keeps callers. Every request is recorded (connections.models.CredentialedRequest);
what an upstream said of a credential it refused is the connection's status.
"""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aiohttp import encode_basic_auth
from django.utils import timezone

from agents.models import Agent
from budgets.gateway.api import Refused
from budgets.gateway.ledger import KEPT_SECONDS, DjangoLedger, database
from budgets.gateway.server import Caller
from connections.broker import (
    GitAccess,
    GitEvent,
    NotGranted,
    RegistryAccess,
    Unauthenticated,
)
from connections.github import GitHubApp, api_permissions, git_permissions
from connections.grants import GIT_KINDS, git_grant
from connections.models import Connection, CredentialedRequest, Kind, Scheme
from covey import crypto

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Granted:
    """An agent's grants, with their connections, as read at one moment."""

    read_at: float
    grants: tuple[tuple[Connection, dict[str, Any]], ...]


class DjangoBroker:
    def __init__(self, ledger: DjangoLedger, clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.clock = clock
        self._lock = threading.Lock()
        self._granted: dict[int, _Granted] = {}

    def git_access(self, token: str, host: str, repository: str) -> GitAccess:
        return self._access(token, host, repository, api=False)

    def api_access(self, token: str, host: str, repository: str) -> GitAccess:
        return self._access(token, host, repository, api=True)

    def _access(self, token: str, host: str, repository: str, *, api: bool) -> GitAccess:
        caller = self._caller(token)
        for connection, grant in self._grants(caller.agent_id):
            if connection.kind not in GIT_KINDS:
                continue
            rules = git_grant(grant)
            at = connection.api_host if api else connection.host
            spelled = rules.spelled(repository)
            if not at or at != host or spelled is None:
                continue
            secret = self._secret(connection)
            github = None
            if connection.kind == Kind.GITHUB_APP:
                github = GitHubApp(
                    app_id=connection.app_id,
                    installation_id=connection.installation_id,
                    private_key=secret,
                    api_url=connection.api_url,
                )
            return GitAccess(
                connection_id=connection.pk,
                base_url=connection.api_url if api else connection.git_url,
                headers={} if github or not secret else credential_headers(connection, secret),
                grant=rules,
                github=github,
                permissions=api_permissions(frozenset(grant["api"]))
                if api
                else git_permissions(bool(rules.push)),
                problem="" if secret else f"covey cannot read the credential of {connection.name}",
                api=frozenset(grant["api"]),
                repository=spelled,
                credential_at=connection.secret_set_at.isoformat(),
            )
        raise NotGranted

    def registry_access(self, token: str, name: str) -> RegistryAccess:
        caller = self._caller(token)
        for connection, _ in self._grants(caller.agent_id):
            if connection.kind != Kind.BASIC or connection.name != name:
                continue
            secret = self._secret(connection)
            return RegistryAccess(
                connection_id=connection.pk,
                base_url=connection.index_url,
                headers=credential_headers(connection, secret) if secret else {},
                paths=tuple(connection.paths),
                problem="" if secret else f"covey cannot read the credential of {connection.name}",
                credential_at=connection.secret_set_at.isoformat(),
            )
        raise NotGranted

    def _secret(self, connection: Connection) -> str:
        """The connection's credential ('' when no key of COVEY_ENCRYPTION_KEYS opens it)."""
        try:
            return crypto.decrypt(connection.secret)
        except crypto.Undecryptable as exc:
            logger.error("covey: the credential of connection %s cannot be read (%s)",
                         connection.name, exc)  # fmt: skip
            return ""

    def record(self, token: str, event: GitEvent) -> None:
        caller = self._caller(token)
        now = timezone.now()
        with database():
            CredentialedRequest.objects.create(
                organisation_id=caller.organisation_id,
                agent_id=caller.agent_id,
                run_id=caller.run_id,
                connection_id=event.connection_id,
                at=now,
                method=event.method[:10],
                host=event.host[:300],
                repository=event.repository[:201],
                service=event.service,
                path=event.path[:1000],
                status=event.status,
                refused=(event.refused or event.problem)[:1000],
                refs=[
                    {"ref": r.ref, "old": r.old, "new": r.new, "refused": r.refused}
                    for r in event.refs
                ],
            )
            if event.connection_id is None:
                return
            said = Connection.objects.filter(pk=event.connection_id)
            if event.credential_at:  # a rotation since: the new credential has said nothing yet
                said = said.filter(secret_set_at=datetime.fromisoformat(event.credential_at))
            if event.problem:  # what the person sees on the connection's page
                said.update(status=event.problem[:300], status_at=now)
            elif event.status < 400 and not event.refused:  # it went upstream and passed
                said.exclude(status="").update(status="", status_at=now)

    def _caller(self, token: str) -> Caller:
        """The run a token is of: only a run's token is brokered (a grant is for runs)."""
        try:
            caller = self.ledger.authenticate(token)
        except Refused:
            raise Unauthenticated from None
        if caller.run_id is None:
            raise Unauthenticated
        return caller

    def _grants(self, agent_id: int) -> tuple[tuple[Connection, dict[str, Any]], ...]:
        kept = self._granted.get(agent_id)
        now = self.clock()
        if kept is not None and now - kept.read_at < KEPT_SECONDS:
            return kept.grants
        with database():
            agent = Agent.objects.only("credential_grants", "organisation_id").get(pk=agent_id)
            named = {
                c.name: c for c in Connection.objects.filter(organisation_id=agent.organisation_id)
            }
        grants = tuple(
            (named[grant["connection"]], grant)
            for grant in agent.credential_grants
            if grant.get("connection") in named
        )
        with self._lock:
            self._granted[agent_id] = _Granted(now, grants)
        return grants


def credential_headers(connection: Connection, secret: str) -> dict[str, str]:
    """How a token or password goes upstream, as its connection says."""
    if connection.kind == Kind.BASIC or connection.scheme == Scheme.BASIC:
        return {"Authorization": encode_basic_auth(connection.username, secret)}
    if connection.scheme == Scheme.HEADER:
        return {connection.header: secret}
    return {"Authorization": f"Bearer {secret}"}
