"""Where a proxy gets its policy and sends its decisions: the database, or the control plane.

A proxy on the control-plane host reads the database directly; a proxy on a runner host has
no database credentials and asks the control plane over HTTP with its runner token, or
follows the policy stream (egress/stream/), which reads the database through DatabaseStore.
"""

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import DataError, connection, transaction

from egress.protocol import AgentSnapshot, PolicySnapshot, ProxyEvent

# The proxy never waits on a lock: a batch or a refresh that would wait is retried next round,
# and a migration or bulk delete in the control plane is never stuck behind (or deadlocked
# with) a proxy.
LOCK_TIMEOUT = "500ms"


@contextmanager
def brief_transaction(*, one_read: bool = False) -> Iterator[None]:
    """A transaction that never waits on a lock for long; ``one_read``: its reads all see one
    moment (REPEATABLE READ on PostgreSQL; a policy is read in several statements)."""
    from egress.services import read_at_one_moment

    connection.close_if_unusable_or_obsolete()  # per CONN_MAX_AGE and CONN_HEALTH_CHECKS
    try:
        with transaction.atomic():
            if one_read:
                read_at_one_moment()  # first: before any other statement
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL lock_timeout = %s", [LOCK_TIMEOUT])
            yield
    except Exception:
        connection.close()  # a broken connection is replaced on the next round
        raise


class DatabaseSource:
    """Policy straight from the database: a cheap fingerprint query, a snapshot on change."""

    def __init__(self, organisation_id: int | None = None) -> None:
        self.organisation_id = organisation_id

    def __call__(self, known_generation: str | None) -> "PolicySnapshot | None":
        from egress.services import build_snapshot, policy_fingerprint

        with brief_transaction(one_read=True):
            if known_generation == policy_fingerprint(self.organisation_id):
                return None
            return build_snapshot(self.organisation_id)


class DatabaseSink:
    """Decisions written straight to the database, in one transaction per batch."""

    def __init__(self, proxy: str) -> None:
        self.proxy = proxy

    def __call__(self, events: "list[ProxyEvent]") -> None:
        from egress.proxy.feed import Refused
        from egress.services import MALFORMED, record_decisions

        try:
            with brief_transaction():
                record_decisions(events, proxy=self.proxy)
        except (*MALFORMED, DataError) as exc:  # for good: sending them again would not help
            raise Refused(repr(exc)) from exc


# The request desk on the control-plane host (egress/proxy/desk.py) files through the database:
# the approvals app, which builds on egress, puts its two functions here when it is ready
# (``file``: token SHA-256, filing → status, answer; ``status``: token SHA-256, id → the same).
desk_functions: dict[str, Callable[..., tuple[int, Mapping[str, Any]]]] = {}


class DatabaseDesk:
    """The desk's filings and questions, answered from the database."""

    def file(self, token_sha256: str, filing: Mapping[str, Any]) -> tuple[int, Mapping[str, Any]]:
        return self._call("file", token_sha256, filing)

    def status(self, token_sha256: str, request_id: int) -> tuple[int, Mapping[str, Any]]:
        return self._call("status", token_sha256, request_id)

    def _call(self, name: str, *args: Any) -> tuple[int, Mapping[str, Any]]:
        if name not in desk_functions:
            return 503, {"detail": "requests are not taken here (no approvals app)"}
        connection.close_if_unusable_or_obsolete()
        try:
            return desk_functions[name](*args)
        except Exception:
            connection.close()
            raise


class DatabaseStore:
    """The policy the stream reads (egress.stream.hub.Store), from the database; each call is
    one brief transaction, and a connection that failed is replaced on the next. Who follows
    (runners, by their tokens) is read by runners/streaming.py, which builds on this."""

    def load(self, organisation_id: int) -> PolicySnapshot:
        from egress.services import build_snapshot

        with brief_transaction(one_read=True):
            return build_snapshot(organisation_id)

    def agents(self, organisation_id: int, ids: Collection[int] | None) -> list[AgentSnapshot]:
        from egress.services import agent_snapshots

        with brief_transaction(one_read=True):
            return agent_snapshots(organisation_id, ids)

    def lists(self, organisation_id: int) -> dict[str, str]:
        from egress.services import shared_lists

        with brief_transaction(one_read=True):
            return shared_lists(organisation_id)

    def used_up(self, organisation_id: int) -> set[int]:
        from agents.models import Agent
        from budgets.services import exhausted

        with brief_transaction():
            agents, organisations = exhausted(organisation_id)
            if organisation_id in organisations:
                return set(
                    Agent.objects.filter(organisation_id=organisation_id).values_list(
                        "pk", flat=True
                    )
                )
            return agents

    def fingerprint(self) -> str:
        """The whole policy's fingerprint (where the database sends no notices, the stream
        reads it a few times a second)."""
        from egress.services import policy_fingerprint

        with brief_transaction():
            return policy_fingerprint()
