"""Where a proxy gets its policy and sends its decisions: the database, or the control plane.

A proxy on the control-plane host reads the database directly; a proxy on a runner host has
no database credentials and asks the control plane over HTTP with its runner token.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import connection, transaction

# The proxy never waits on a lock: a batch or a refresh that would wait is retried next round,
# and a migration or bulk delete in the control plane is never stuck behind (or deadlocked
# with) a proxy.
LOCK_TIMEOUT = "500ms"


@contextmanager
def _brief_transaction() -> Iterator[None]:
    connection.close_if_unusable_or_obsolete()  # per CONN_MAX_AGE and CONN_HEALTH_CHECKS
    try:
        with transaction.atomic():
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

    def __call__(self, known_generation: str | None) -> Mapping[str, Any] | None:
        from egress.services import build_snapshot, policy_fingerprint

        with _brief_transaction():
            if known_generation == policy_fingerprint(self.organisation_id):
                return None
            return build_snapshot(self.organisation_id)


class DatabaseSink:
    """Decisions written straight to the database, in one transaction per batch."""

    def __init__(self, proxy: str) -> None:
        self.proxy = proxy

    def __call__(self, events: list[dict[str, Any]]) -> None:
        from egress.services import record_decisions

        with _brief_transaction():
            record_decisions(events, proxy=self.proxy)
