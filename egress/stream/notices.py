"""Where the stream hears of changes: PostgreSQL's notices, or (on SQLite, which has none) a
fingerprint of the whole policy read a few times a second by this one process.

Each is an async iterator of :class:`~egress.stream.hub.Change`, with ``Heard.LISTENING`` once
it hears (the hub reads everything it holds again then: what changed before is not noticed) and
``Heard.STILL`` whenever it has made sure it still hears. It raises when it stops hearing; the
hub ends every stream and calls it again.
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from egress.stream.hub import EVERYTHING, Change, Heard, Sync, parse_notice

# What the triggers of egress/migrations/0003_policy_notices.py notify.
CHANNEL = "covey_policy"
# How long the connection may be silent before it is asked whether it is there, and how long
# it has to answer: a lost one is found well within the hub's TRUST_SECONDS.
QUIET_SECONDS = 2.0
CONNECT_SECONDS = 5.0
# libpq's TCP keepalives: a connection whose peer went away without a word is closed in ~5 s.
TCP = {"keepalives": 1, "keepalives_idle": 2, "keepalives_interval": 1, "keepalives_count": 3}


class PostgresNotices:
    """Notices from PostgreSQL, on a connection of their own (``params``: psycopg's). A lost
    connection is found within QUIET_SECONDS: it is asked whether it is there whenever it has
    been quiet that long, and TCP keepalives find one that went away without a word. Barriers
    are announced on a second connection, as ``NOTIFY``s of their own: PostgreSQL delivers
    notices in the order of their commits."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = {**TCP, **params}
        self._announcer: Any = None  # a psycopg AsyncConnection, made when first needed
        self._announcing = asyncio.Lock()

    async def _connect(self) -> Any:
        import psycopg  # the control plane's driver; not in the proxy's image

        return await asyncio.wait_for(
            psycopg.AsyncConnection.connect(**self.params, autocommit=True), CONNECT_SECONDS
        )

    async def __call__(self) -> AsyncIterator[Change | Heard | Sync]:
        connection = await self._connect()
        async with connection:
            await asyncio.wait_for(connection.execute(f"LISTEN {CHANNEL}"), QUIET_SECONDS)
            yield Heard.LISTENING
            while True:
                async for notice in connection.notifies(timeout=QUIET_SECONDS):
                    change = parse_notice(notice.payload)
                    if change is not None:
                        yield change
                # Raises when the connection is gone, or does not answer in time.
                await asyncio.wait_for(connection.execute("SELECT 1"), QUIET_SECONDS)
                yield Heard.STILL

    async def announce(self, nonce: str) -> None:
        async with self._announcing:
            try:
                if self._announcer is None or self._announcer.closed:
                    self._announcer = await self._connect()
                await self._announcer.execute("SELECT pg_notify(%s, %s)", [CHANNEL, f"s:{nonce}"])
            except BaseException:
                if self._announcer is not None:
                    await self._announcer.close()
                self._announcer = None
                raise


class FingerprintNotices:
    """Notices where the database sends none: everything, whenever the fingerprint of the
    whole policy (egress.services.policy_fingerprint) changes, read every ``every`` seconds by
    this one process. A barrier comes after the next fingerprint read that began after it was
    announced."""

    def __init__(self, fingerprint: Callable[[], str], every: float = 0.25) -> None:
        self.fingerprint = fingerprint
        self.every = every
        self._announced: list[str] = []

    async def __call__(self) -> AsyncIterator[Change | Heard | Sync]:
        known = await asyncio.to_thread(self.fingerprint)
        yield Heard.LISTENING
        while True:
            await asyncio.sleep(self.every)
            asked, self._announced = self._announced, []
            now = await asyncio.to_thread(self.fingerprint)
            yield Heard.STILL
            if now != known:
                known = now
                yield EVERYTHING
            for nonce in asked:
                yield Sync(nonce)

    async def announce(self, nonce: str) -> None:
        self._announced.append(nonce)
