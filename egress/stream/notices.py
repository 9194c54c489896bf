"""Where the stream hears of changes: PostgreSQL's notices, or (on SQLite, which has none) a
fingerprint of the whole policy read a few times a second by this one process.

Each is an async iterator of :class:`~egress.stream.hub.Change`, and None once it hears (the
hub reads everything it holds again then: what changed before is not noticed). It raises when
it stops hearing; the hub ends every stream and calls it again.
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from egress.stream.hub import EVERYTHING, Change, parse_notice

# What the triggers of egress/migrations/0003_policy_notices.py notify.
CHANNEL = "covey_policy"
# How long the connection may be silent before it is asked whether it is there: a lost one
# must be found within a proxy's grace (COVEY_EGRESS_POLICY_GRACE, 15 s by default).
QUIET_SECONDS = 2.0


def postgres_notices(params: Mapping[str, Any]) -> Callable[[], AsyncIterator[Change | None]]:
    """Notices from PostgreSQL, on a connection of their own (``params``: psycopg's)."""

    async def notices() -> AsyncIterator[Change | None]:
        import psycopg  # the control plane's driver; not in the proxy's image

        connection = await psycopg.AsyncConnection.connect(**params, autocommit=True)
        async with connection:
            await connection.execute(f"LISTEN {CHANNEL}")
            yield None
            while True:
                async for notice in connection.notifies(timeout=QUIET_SECONDS):
                    change = parse_notice(notice.payload)
                    if change is not None:
                        yield change
                await connection.execute("SELECT 1")  # raises when the connection is gone

    return notices


def fingerprint_notices(
    fingerprint: Callable[[], str], every: float = 0.25
) -> Callable[[], AsyncIterator[Change | None]]:
    """Notices where the database sends none: everything, whenever the fingerprint of the
    whole policy (egress.services.policy_fingerprint) changes."""

    async def notices() -> AsyncIterator[Change | None]:
        known = await asyncio.to_thread(fingerprint)
        yield None
        while True:
            await asyncio.sleep(every)
            now = await asyncio.to_thread(fingerprint)
            if now != known:
                known = now
                yield EVERYTHING

    return notices
