"""The model gateway's ledger in covey's database (budgets/metering.py).

Every write is one thread's (:class:`Writer`): it reserves what is asked for in batches (each
in one transaction: budgets.metering.reserve_all), and settles in batches (budgets.metering.
settle_all), reservations first, so a thousand requests a second are a few dozen transactions,
and on SQLite nothing waits for another writer. :meth:`DjangoLedger.reserve` answers a future;
:meth:`DjangoLedger.settle` and :meth:`DjangoLedger.release` only queue: the answer a
settlement ends never waits for it. Until its settlement is written, a request's reservation
holds its worst case, so no budget can be passed meanwhile; a reservation refused as busy while
settlements are queued is asked again in the next round, after them (so a caller's next request
finds its last one settled). The gateway's worker threads read (who a token is, readiness);
each keeps its database connection; one that fails is closed, so the next call opens a new
one, and the request is refused (503).

What every request would otherwise read again is kept for at most KEPT_SECONDS: who a token
belongs to (so a token revoked, an agent disabled or a key changed is seen within that time,
as the egress proxies see a change of policy), and the price rows (so a price row saved with
an ``effective_from`` less than that time ahead applies up to that time late). Budgets are
never kept: every reservation is decided by the database.
"""

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TypeVar

from celery import current_app
from django.db import IntegrityError, InterfaceError, OperationalError, connection
from django.utils import timezone

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
from budgets.models import GatewayToken, ModelKey, Price
from budgets.usage import Usage
from covey import crypto

logger = logging.getLogger(__name__)

T = TypeVar("T")

KEPT_SECONDS = 0.5
KEPT_CALLERS = 10_000  # tokens remembered at once (the oldest go first)
BATCH = 500  # reservations, or settlements, written in one transaction at most
RETRY_SECONDS = (0.1, 0.5, 2.0)  # settlements the database refused are tried again after these
# A settlement waits up to this long for the writer (or until SETTLE_AT_ONCE are queued), so
# that the settlements of many requests are written in one transaction (a transaction costs the
# writer a millisecond or more of CPU whatever its size) and the reservations that come
# meanwhile go first; then they go before any.
LINGER_SECONDS = 0.02
SETTLE_AT_ONCE = 100


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
        self._prices_by_id: dict[int, Price] = {}
        self.writer = Writer(self._reserve, self._settle)

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
            self._prices_by_id = {price.pk: price for price in prices}
        return prices

    def _settle(self, batch: Sequence[Settlement]) -> list[int]:
        """Settle a batch (in the writer's thread), with the price rows as last read."""
        return metering.settle_all(batch, self._prices_by_id)

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
    ) -> "Future[Hold]":
        asked = Asked(caller, vendor, model, input_bound, max_tokens, request_id, Future())
        self.writer.ask(asked)
        return asked.future

    def settle(
        self, hold: Hold, usage: Usage, *, model: str, outcome: str, failed: Callable[[], None]
    ) -> None:
        settlement = Settlement(
            hold.reservation_id, usage, model, outcome, at=timezone.now(), spends=hold.spends
        )
        self.writer.settle(Queued(settlement, hold.request_id, failed))

    def release(self, hold: Hold, *, failed: Callable[[], None]) -> None:
        settlement = Settlement(hold.reservation_id, None, spends=hold.spends)
        self.writer.settle(Queued(settlement, hold.request_id, failed))

    def close(self) -> None:
        self.writer.close()

    def _reserve(self, batch: list["Asked"], settling: Callable[[], bool]) -> list["Asked"]:
        """Reserve a batch (in the writer's thread), answering each one's future; those to
        ask again in its next round."""
        at = timezone.now()
        priced: list[tuple[Asked, metering.Ask]] = []
        for asked in batch:
            try:
                priced.append((asked, self._priced(asked, at)))
            except Refused as refused:
                _answer(asked.future, refused)
            except Exception as exc:  # the database, or a bound it cannot price: 503
                logger.exception("covey: the ledger failed to price request %s", asked.request_id)
                _answer(asked.future, exc)
        if not priced:
            return []
        try:
            with database():
                try:
                    results = metering.reserve_all([ask for _, ask in priced], at)
                except IntegrityError:  # a price row gone since the rows were read
                    prices = self._prices_now(0)
                    priced = [(asked, self._ask(asked, at, prices)) for asked, _ in priced]
                    results = metering.reserve_all([ask for _, ask in priced], at)
        except Exception as exc:
            if len(priced) > 1 and not isinstance(exc, OperationalError | InterfaceError):
                # Not the database: one of them (a run gone, say); each is asked alone.
                return [again for asked, _ in priced for again in self._reserve([asked], settling)]
            logger.exception("covey: the ledger failed to reserve %d requests", len(priced))
            for asked, _ in priced:
                _answer(asked.future, exc)
            return []
        again = []
        for (asked, _), result in zip(priced, results, strict=True):
            if isinstance(result, metering.Reserved):
                held = Hold(result.reservation.pk, asked.request_id, result.spends)
                _answer(asked.future, held)
            elif isinstance(result, metering.Busy):
                if not asked.again and settling():
                    # What settlements still queued hold is freed once they are written.
                    again.append(replace(asked, again=True))
                    continue
                # Requests under way hold the rest: this one fits once they end. Not used up.
                busy = Refused(
                    429, "rate_limit_error", str(result), BUDGET_BUSY, BUSY_RETRY_SECONDS
                )
                _answer(asked.future, busy)
            else:
                assert isinstance(result, metering.Exhausted)  # noqa: S101 - the third kind
                try:
                    with database():
                        metering.mark_used_up(result)
                    if result.first:  # its runs are stopped (runs.tasks), by name: runs is above
                        agent_id = asked.caller.agent_id
                        current_app.send_task(services.STOP_OVER_BUDGET, args=[agent_id])
                except Exception:
                    logger.exception("covey: a used-up budget could not be marked")
                used_up = Refused(402, "billing_error", str(result), BUDGET_EXHAUSTED)
                _answer(asked.future, used_up)
        return again

    def _priced(self, asked: "Asked", at: datetime) -> metering.Ask:
        with database():
            try:
                return self._ask(asked, at, self._prices_now())
            except metering.Unpriced:
                pass
            try:  # priced since the rows were read?
                return self._ask(asked, at, self._prices_now(0))
            except metering.Unpriced as exc:
                raise Refused(400, "invalid_request_error", str(exc), "unpriced-model") from None

    @staticmethod
    def _ask(asked: "Asked", at: datetime, prices: list[Price]) -> metering.Ask:
        price = metering.choose_price(prices, asked.model, at, asked.vendor)
        return metering.Ask(
            asked.caller.agent_id,
            asked.caller.organisation_id,
            asked.model,
            price,
            price.prices.worst_case(asked.input_bound, asked.max_tokens),
            asked.request_id,
            asked.caller.run_id,
        )


@dataclass(frozen=True)
class Asked:
    """A reservation asked for, and the future its answer goes to."""

    caller: Caller
    vendor: str
    model: str
    input_bound: int
    max_tokens: int
    request_id: str
    future: "Future[Hold]"
    again: bool = False  # asked again: refused as busy while settlements were queued


@dataclass(frozen=True)
class Queued:
    """A settlement queued, and whom to tell if it cannot be written."""

    settlement: Settlement
    request_id: str
    failed: Callable[[], None]
    queued_at: float = field(default_factory=time.monotonic)


class Writer:
    """One thread that writes the ledger, in batches: the reservations asked for (``reserve``,
    which answers each one's future and returns those to ask again), first; the settlements
    queued (``write``: budgets.metering.settle_all) when SETTLE_AT_ONCE are queued, or the
    oldest has waited LINGER_SECONDS, or reservations were asked again for them (they go next).
    Settlements the database cannot take are tried again after RETRY_SECONDS; then they are
    logged, each one's ``failed`` called, and left to the stale sweep (budgets.metering.
    settle_stale), which charges their worst case. A batch that fails for another reason is
    written one settlement at a time, so one bad settlement fails alone."""

    def __init__(
        self,
        reserve: Callable[[list[Asked], Callable[[], bool]], list[Asked]],
        write: Callable[[Sequence[Settlement]], list[int]],
    ) -> None:
        self.reserve, self.write = reserve, write
        self._changed = threading.Condition()
        self._asked: deque[Asked] = deque()
        self._settling: deque[Queued] = deque()
        self._busy = self._closing = False
        self._thread: threading.Thread | None = None

    def ask(self, asked: Asked) -> None:
        """Queue a reservation (never blocks: called on the gateway's event loop)."""
        with self._changed:
            if self._closing:
                asked.future.set_exception(
                    Refused(503, "api_error", "covey's model gateway is stopping: try again")
                )
                return
            self._asked.append(asked)
            self._wake()

    def settle(self, queued: Queued) -> None:
        """Queue a settlement (never blocks: called on the gateway's event loop)."""
        with self._changed:
            if self._closing:
                self._gave_up([queued], "the gateway is stopping")
                return
            self._settling.append(queued)
            self._wake()

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="covey-ledger", daemon=True)
            self._thread.start()
        self._changed.notify()

    def idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or being written; whether that came in time."""
        with self._changed:
            return self._changed.wait_for(
                lambda: not (self._asked or self._settling or self._busy), timeout
            )

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        first = False  # settlements before any reservation: some were asked again for them
        while True:
            with self._changed:
                self._busy = False
                self._changed.notify_all()
                while not (self._asked or self._due(first)):
                    if self._closing and not self._settling:
                        connection.close()
                        return
                    self._changed.wait(LINGER_SECONDS if self._settling else None)
                self._busy = True
                if self._due(first):
                    asked, settlements = [], _take(self._settling)
                else:
                    asked, settlements = _take(self._asked), []
            first = False
            try:
                if settlements:
                    self._write(settlements)
                if asked:
                    again = self.reserve(asked, lambda: bool(self._settling))
                    if again:
                        first = True
                        with self._changed:
                            self._asked.extendleft(reversed(again))
            except Exception as exc:  # the writer's own bug: its batch fails, it goes on
                logger.exception("covey: the ledger's writer failed")
                for one in asked:
                    _answer(one.future, exc)

    def _due(self, first: bool) -> bool:
        """Whether the settlements queued are to be written now: reservations go first, unless
        they were waited for, SETTLE_AT_ONCE are queued, or the oldest waited LINGER_SECONDS."""
        if not self._settling:
            return False
        waited = time.monotonic() - self._settling[0].queued_at
        many = len(self._settling) >= SETTLE_AT_ONCE
        return first or self._closing or many or waited >= LINGER_SECONDS

    def _write(self, batch: list[Queued]) -> None:
        for delay in (*RETRY_SECONDS, None):
            try:
                with database():
                    self.write([queued.settlement for queued in batch])
                return
            except (OperationalError, InterfaceError) as exc:  # the database: try again
                logger.warning("covey: the ledger cannot settle %d requests: %s", len(batch), exc)
                if delay is None:
                    self._gave_up(batch, "the ledger failed")
                    return
                time.sleep(delay)
            except Exception:
                logger.exception("covey: the ledger failed to settle %d requests", len(batch))
                if len(batch) == 1:
                    self._gave_up(batch, "the ledger failed")
                else:
                    for one in batch:
                        self._write([one])
                return

    @staticmethod
    def _gave_up(batch: list[Queued], why: str) -> None:
        for queued in batch:
            logger.error(
                "covey: the reservation of request %s stays held: %s (the stale sweep charges"
                " its worst case)",
                queued.request_id,
                why,
            )
            queued.failed()


def _answer(future: "Future[Hold]", answer: "Hold | BaseException") -> None:
    """Answer a reservation's future, once (a batch that failed part way may answer again)."""
    if future.done():
        return
    if isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def _take(queue: "deque[T]") -> "list[T]":
    return [queue.popleft() for _ in range(min(BATCH, len(queue)))]
