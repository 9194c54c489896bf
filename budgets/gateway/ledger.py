"""The model gateway's ledger in covey's database (budgets/metering.py), for the gateway's
worker threads: each keeps its database connection; one that fails is closed, so the next
call opens a new one, and the request is refused (503).

What every request would otherwise read again is kept for at most KEPT_SECONDS: who a token
belongs to (so a token revoked, an agent disabled or a key changed is seen within that time,
as the egress proxies see a change of policy), and the price rows (so a price row saved with
an ``effective_from`` less than that time ahead applies up to that time late). Budgets are
never kept: every reservation is decided by the database.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from budgets.models import GatewayToken, ModelKey, Price, Reservation
from budgets.usage import Usage
from covey import crypto

logger = logging.getLogger(__name__)

KEPT_SECONDS = 0.5
KEPT_CALLERS = 10_000  # tokens remembered at once (the oldest go first)


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
                    reservation = hold(
                        price=metering.choose_price(self._prices_now(), model, at, vendor)
                    )
                except (metering.Unpriced, IntegrityError):
                    # Priced (or a row gone) since the rows were read: read them now.
                    reservation = hold(
                        price=metering.choose_price(self._prices_now(0), model, at, vendor)
                    )
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

    def settle(self, hold: Hold, usage: Usage, *, model: str, outcome: str) -> None:
        with database():
            metering.settle(
                Reservation(pk=hold.reservation_id), usage, model=model, outcome=outcome
            )

    def release(self, hold: Hold) -> None:
        with database():
            metering.release(Reservation(pk=hold.reservation_id))
