"""The model gateway's ledger in covey's database (budgets/metering.py), for the gateway's
worker threads: each keeps its database connection; one that fails is closed, so the next
call opens a new one, and the request is refused (503).

What every request would otherwise read again is kept for at most KEPT_SECONDS: who a token
belongs to (so a token revoked, an agent disabled or a key changed is seen within that time,
as the egress proxies see a change of policy), and the price rows (so a price row saved with
an ``effective_from`` less than that time ahead applies up to that time late). Budgets are
never kept: every reservation is decided by the database.

Settlements do not hold up the answers they end: :meth:`DjangoLedger.settle` and
:meth:`DjangoLedger.release` queue them for one writer thread (:class:`Settler`), which ends
what is queued in one transaction (budgets.metering.settle_all), so a thousand settlements a
second are a few dozen transactions. Until its settlement is written, a request's reservation
holds its worst case: no budget can be passed meanwhile, and a reservation refused as busy
while settlements are queued is tried again once they are written (a caller's next request
sees its last one settled).
"""

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from celery import current_app
from django.db import IntegrityError, InterfaceError, OperationalError, connection
from django.utils import timezone

from agents.models import Agent
from budgets import metering, services
from budgets.gateway.api import Refused
from budgets.gateway.server import (
    BUDGET_BUSY,
    BUDGET_EXHAUSTED,
    BUSY_RETRY_SECONDS,
    Caller,
    Hold,
)
from budgets.keys import hash_token
from budgets.metering import Settlement
from budgets.models import GatewayToken, ModelKey, Price, Reservation
from budgets.usage import Usage
from covey import crypto

logger = logging.getLogger(__name__)

KEPT_SECONDS = 0.5
KEPT_CALLERS = 10_000  # tokens remembered at once (the oldest go first)
BATCH = 500  # settlements written in one transaction, at most
RETRY_SECONDS = (0.2, 1.0, 5.0, 15.0)  # a batch the database refused is tried again after these
BUSY_WAIT_SECONDS = 2.0  # a busy reservation waits this long, at most, for queued settlements


@contextmanager
def database() -> Iterator[None]:
    try:
        yield
    except (OperationalError, InterfaceError):
        connection.close()
        raise


class DjangoLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        # token's sha256 → (read at, the token's end, its caller)
        self._callers: dict[str, tuple[float, datetime, Caller]] = {}
        self._prices: tuple[float, list[Price]] = (float("-inf"), [])
        self.settler = Settler(metering.settle_all)

    def problem(self) -> str:
        """'' when the database answers, else 'unreachable' (why, with its address, goes to the
        log for the people who run it, not to whoever asks /readyz)."""
        try:
            with database(), connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except (OperationalError, InterfaceError) as exc:
            where = connection.settings_dict.get("HOST") or connection.settings_dict.get("NAME")
            logger.warning("readyz: the database at %s does not answer: %s", where, exc)
            return "unreachable"
        return ""

    def known(self, token: str) -> Caller | None:
        kept = self._callers.get(hash_token(token))
        if kept is None or self.clock() - kept[0] >= KEPT_SECONDS or kept[1] <= timezone.now():
            return None
        return kept[2]

    def authenticate(self, token: str) -> Caller:
        caller = self.known(token)
        if caller is not None:
            return caller
        digest = hash_token(token)
        now = self.clock()
        ends, caller = self._authenticate(digest)
        with self._lock:
            self._callers.pop(digest, None)
            if len(self._callers) >= KEPT_CALLERS:
                self._callers.pop(next(iter(self._callers)))
            self._callers[digest] = (now, ends, caller)
        return caller

    def _prices_now(self, kept: float = KEPT_SECONDS) -> list[Price]:
        """The price rows, as read at most ``kept`` seconds ago."""
        read_at, prices = self._prices
        now = self.clock()
        if now - read_at >= kept:
            prices = list(Price.objects.all())
            self._prices = (now, prices)
        return prices

    def _authenticate(self, digest: str) -> tuple[datetime, Caller]:
        with database():
            found = (
                GatewayToken.objects.select_related("agent__organisation")
                .filter(
                    sha256=digest,
                    revoked_at__isnull=True,
                    expires_at__gt=timezone.now(),
                )
                .first()
            )
            if found is None:
                raise Refused(
                    401,
                    "authentication_error",
                    "covey's model gateway does not know this token, or it has ended (a run's"
                    " token ends with the run)",
                )
            agent = found.agent
            name = f"{agent.organisation.slug}/{agent.slug}"
            if not agent.enabled:
                raise Refused(403, "permission_error", f"the agent {name} is disabled")
            found_keys = list(ModelKey.objects.filter(organisation_id=agent.organisation_id))
        keys: dict[str, str] = {}
        for key in found_keys:
            try:
                keys[key.vendor] = crypto.decrypt(key.secret)
            except crypto.Undecryptable as exc:  # refused for that vendor alone (the gateway)
                logger.error("covey: the %s key of %s cannot be read (%s)", key.vendor, name, exc)
                keys[key.vendor] = ""
        return found.expires_at, Caller(
            agent_id=agent.pk,
            organisation_id=agent.organisation_id,
            run_id=str(found.run_id) if found.run_id else None,
            name=name,
            keys=keys,
        )

    def reserve(
        self,
        caller: Caller,
        *,
        vendor: str,
        model: str,
        input_bound: int,
        max_tokens: int,
        request_id: str,
    ) -> Hold:
        agent = Agent(pk=caller.agent_id, organisation_id=caller.organisation_id)
        with database():
            at = timezone.now()
            hold = partial(
                metering.reserve,
                agent,
                model=model,
                input_bound=input_bound,
                max_tokens=max_tokens,
                request_id=request_id,
                run_id=caller.run_id,
                at=at,
            )
            try:
                try:
                    reservation = self._hold(hold, model, at, vendor)
                except metering.Busy:
                    # What its settlements still hold is freed once they are written.
                    if not self.settler.wait(BUSY_WAIT_SECONDS):
                        raise
                    reservation = self._hold(hold, model, at, vendor)
            except metering.Unpriced as exc:
                raise Refused(400, "invalid_request_error", str(exc), "unpriced-model") from None
            except metering.Busy as exc:
                # Requests under way hold the rest: this one fits once they end. Not used up.
                raise Refused(
                    429, "rate_limit_error", str(exc), BUDGET_BUSY, BUSY_RETRY_SECONDS
                ) from None
            except metering.Exhausted as exc:
                if exc.first:  # its runs are stopped (runs.tasks), by name: runs is above us
                    current_app.send_task(services.STOP_OVER_BUDGET, args=[agent.pk])
                raise Refused(402, "billing_error", str(exc), BUDGET_EXHAUSTED) from None
        return Hold(reservation.pk, request_id)

    def _hold(
        self, hold: Callable[..., Reservation], model: str, at: datetime, vendor: str
    ) -> Reservation:
        try:
            return hold(price=metering.choose_price(self._prices_now(), model, at, vendor))
        except (metering.Unpriced, IntegrityError):
            # Priced (or a row gone) since the rows were read: read them now.
            return hold(price=metering.choose_price(self._prices_now(0), model, at, vendor))

    def settle(
        self, hold: Hold, usage: Usage, *, model: str, outcome: str, failed: Callable[[], None]
    ) -> None:
        settlement = Settlement(hold.reservation_id, usage, model, outcome, at=timezone.now())
        self.settler.put(settlement, hold.request_id, failed)

    def release(self, hold: Hold, *, failed: Callable[[], None]) -> None:
        self.settler.put(Settlement(hold.reservation_id, None), hold.request_id, failed)

    def close(self) -> None:
        self.settler.close()


class Settler:
    """One thread that writes queued settlements in batches, in the order they came, with
    ``write`` (budgets.metering.settle_all). A batch the database refuses is tried again (after
    RETRY_SECONDS), then one settlement at a time; one that still fails is logged, its
    ``failed`` called, and left to the stale sweep (budgets.metering.settle_stale), which
    charges its worst case."""

    def __init__(self, write: Callable[[Sequence[Settlement]], list[int]]) -> None:
        self.write = write
        self._changed = threading.Condition()
        self._queue: deque[Queued] = deque()
        self._queued = self._written = 0  # how many were ever queued, and written (or given up)
        self._closing = False
        self._thread: threading.Thread | None = None

    def put(
        self, settlement: Settlement, request_id: str, failed: Callable[[], None] = lambda: None
    ) -> None:
        """Queue a settlement (never blocks: called on the gateway's event loop)."""
        with self._changed:
            if self._closing:
                logger.error("covey: the gateway is stopping: request %s stays held", request_id)
                failed()
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="covey-settler", daemon=True)
                self._thread.start()
            self._queue.append(Queued(settlement, request_id, failed))
            self._queued += 1
            self._changed.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait until what was queued before this call is written; False at once when
        nothing was queued, or when ``timeout`` passed first."""
        with self._changed:
            until = self._queued
            if self._written >= until:
                return False
            return self._changed.wait_for(lambda: self._written >= until, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    connection.close()
                    return
                batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            if not self._written_with_retries(batch) and len(batch) > 1:
                for one in batch:
                    self._written_with_retries([one])
            with self._changed:
                self._written += len(batch)
                self._changed.notify_all()

    def _written_with_retries(self, batch: list["Queued"]) -> bool:
        for delay in (*RETRY_SECONDS, None):
            try:
                with database():
                    self.write([queued.settlement for queued in batch])
                return True
            except Exception:
                logger.exception("covey: the ledger failed to settle %d requests", len(batch))
                if delay is None:
                    break
                time.sleep(delay)
        if len(batch) == 1:
            logger.error(
                "covey: the reservation of request %s stays held: the ledger failed (the stale"
                " sweep charges its worst case)",
                batch[0].request_id,
            )
            batch[0].failed()
        return False


@dataclass(frozen=True)
class Queued:
    settlement: Settlement
    request_id: str
    failed: Callable[[], None]
