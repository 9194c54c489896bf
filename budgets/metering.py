"""The ledger: metering model requests against budgets (price, reserve, settle, release) and
what each budget's current period holds.

A request is reserved at its worst case (:meth:`budgets.usage.Prices.worst_case`) against each
budget that applies (the agent's, and its organisation's, which caps the sum of its agents) in
one transaction of conditional updates (``… SET reserved = reserved + x WHERE spent + reserved +
x <= limit``, compared in whole millionths of a dollar, so SQLite's floating point cannot refuse
an exact fit): the database decides, row by row, so concurrent requests can never together
hold or spend more than a budget has, and a request that does not fit is refused before it is
sent. Settling charges the actual cost (a ledger row) and frees the reservation; releasing
frees it without a charge. A request is priced by the price row in effect when it starts.

A request that does not fit is refused for one of three reasons (:func:`_refusal`), judged by
what was *spent*, never by what requests under way hold:

- what was spent leaves room for it: requests under way hold the rest (:class:`Busy`, the
  gateway's 429 with ``retry-after``); once they end it fits again;
- what was spent leaves less than the least any request can cost
  (:meth:`budgets.usage.Prices.least`): the budget is used up (:class:`Exhausted`,
  ``used_up``): its period is marked so, which stops the agent's runs until it is raised or the
  period ends;
- else it is larger than what is left (:class:`Exhausted`): a smaller one may still fit.
"""

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import F, Q, Sum, Value
from django.db.models.functions import Round
from django.utils import timezone

from agents.models import Agent
from budgets import periods
from budgets.alerts import tell_reached
from budgets.models import (
    Budget,
    Charge,
    Outcome,
    Price,
    Reservation,
    Spend,
    Vendor,
)
from budgets.money import dollars
from budgets.usage import Usage

logger = logging.getLogger(__name__)


class Unpriced(Exception):
    """No price row applies to the model: it is refused, never metered at zero."""

    def __init__(self, model: str, vendor: str = Vendor.ANTHROPIC) -> None:
        super().__init__(
            f"covey has no price for {Vendor(vendor).label.split(' (')[0]}'s model {model!r}:"
            " an admin adds one (Budgets → Prices) before it can be used"
        )
        self.model, self.vendor = model, vendor


@dataclass
class OverBudget(Exception):
    """A budget cannot hold the request's worst case now (nothing was held for it); ``spend``
    is its period as read when the request was refused."""

    budget: Budget
    spend: Spend
    needed: Decimal

    @property
    def whose(self) -> str:
        return f"agent {self.budget.agent}" if self.budget.agent_id else "the organisation"

    @property
    def left(self) -> Decimal:
        """What was spent leaves this (what requests under way hold is not taken off)."""
        return max(self.spend.limit - self.spend.spent, Decimal(0))


@dataclass
class Busy(OverBudget):
    """Requests under way hold what the request needs: it fits once they end. Never a reason
    to find the budget used up."""

    def __str__(self) -> str:
        return (
            f"the budget of {self.whose} is busy: requests under way hold"
            f" {dollars(self.spend.reserved, exact=True)} of the {dollars(self.left, exact=True)}"
            " left this period, and this request may cost up to"
            f" {dollars(self.needed, exact=True)}: retry when they end"
        )


@dataclass
class Exhausted(OverBudget):
    """What was spent leaves too little for the request: ``used_up`` when too little for any
    request (the least one can cost), else for this one."""

    used_up: bool = False
    first: bool = False  # this refusal is the one that found the budget used up
    least: Decimal = Decimal(0)  # what the least request costs: used up below it

    def __str__(self) -> str:
        if self.used_up:
            return (
                f"the budget of {self.whose} is used up: {dollars(self.spend.spent, exact=True)}"
                f" of {dollars(self.spend.limit, exact=True)} spent this period"
            )
        return (
            f"the budget of {self.whose} has {dollars(self.left, exact=True)} left this"
            f" period; this request may cost up to {dollars(self.needed, exact=True)}: ask for"
            " fewer output tokens, or raise the budget"
        )


def zone() -> ZoneInfo:
    return ZoneInfo(settings.COVEY_BUDGET_TIME_ZONE)


def price_for(model: str, at: datetime | None = None, vendor: str = Vendor.ANTHROPIC) -> Price:
    """The price in effect at ``at`` for ``vendor``'s ``model`` (:func:`choose_price` among the
    rows that name it or end in ``*``). Unpriced when none."""
    return choose_price(
        Price.objects.filter(Q(model=model) | Q(model__endswith="*"), vendor=vendor),
        model,
        at or timezone.now(),
        vendor,
    )


def choose_price(
    prices: Iterable[Price], model: str, at: datetime, vendor: str = Vendor.ANTHROPIC
) -> Price:
    """Among ``prices``, the one in effect at ``at`` for ``vendor``'s ``model``: the row naming
    it, else the row of the longest pattern that matches it (``claude-sonnet-4-5-*`` for
    ``claude-sonnet-4-5-20250929``); among rows of one name, the newest in effect. Unpriced
    when none."""
    best: Price | None = None
    best_rank = (0, 0)
    for price in prices:
        if price.vendor != vendor:
            continue
        if price.effective_from > at or (
            price.effective_until is not None and price.effective_until <= at
        ):
            continue
        if price.model == model:
            rank = (2, 0)
        elif price.model.endswith("*") and model.startswith(price.model[:-1]):
            rank = (1, len(price.model))
        else:
            continue
        if best is None or (rank, price.effective_from) > (best_rank, best.effective_from):
            best, best_rank = price, rank
    if best is None:
        raise Unpriced(model, vendor)
    return best


def budgets_of(agent: Agent) -> list[Budget]:
    """The budgets that apply to the agent: its own and its organisation's (either may be
    missing: then nothing limits it there, but every request is still charged)."""
    return list(
        Budget.objects.filter(organisation_id=agent.organisation_id)
        .filter(Q(agent=agent) | Q(agent__isnull=True))
        .order_by("pk")
    )


def current_spend(budget: Budget, at: datetime | None = None) -> Spend:
    """The budget's spend in the period holding ``at``, made when the period starts (with what
    the ledger already holds for that time, when the budget's period kind was changed in it)."""
    starts, ends = periods.bounds(budget.period, at or timezone.now(), zone())
    found = Spend.objects.filter(budget=budget, period=budget.period, starts_at=starts).first()
    if found is not None:
        return found
    spent = _charged(budget, starts, ends)
    spend, _ = Spend.objects.get_or_create(
        budget=budget,
        period=budget.period,
        starts_at=starts,
        defaults={"ends_at": ends, "limit": budget.amount, "spent": spent},
    )
    return spend


def _charged(budget: Budget, starts: datetime, ends: datetime | None) -> Decimal:
    """What the ledger holds for the budget's agent (or organisation) in a period."""
    charges = Charge.objects.filter(organisation_id=budget.organisation_id, started_at__gte=starts)
    if budget.agent_id is not None:
        charges = charges.filter(agent_id=budget.agent_id)
    if ends is not None:
        charges = charges.filter(started_at__lt=ends)
    return charges.aggregate(total=Sum("cost"))["total"] or Decimal(0)


def current_spends(budgets: list[Budget], at: datetime | None = None) -> dict[int, Spend]:
    """Each budget's spend in the period holding ``at``, in one query, without making any: a
    period nothing was spent in yet is shown as a new one (limit = amount, nothing spent)."""
    at = at or timezone.now()
    starts: dict[int, tuple[datetime, datetime | None]] = {
        budget.pk: periods.bounds(budget.period, at, zone()) for budget in budgets
    }
    wanted = Q(pk__in=[])
    kinds = {budget.pk: budget.period for budget in budgets}
    for pk, (start, _) in starts.items():
        wanted |= Q(budget_id=pk, period=kinds[pk], starts_at=start)
    found = {spend.budget_id: spend for spend in Spend.objects.filter(wanted)}
    return {
        budget.pk: found.get(budget.pk)
        or Spend(
            budget=budget,
            period=budget.period,
            starts_at=starts[budget.pk][0],
            ends_at=starts[budget.pk][1],
            limit=budget.amount,
        )
        for budget in budgets
    }


def reserve(
    agent: Agent,
    *,
    model: str,
    input_bound: int,
    max_tokens: int,
    request_id: str,
    run_id: "UUID | str | None" = None,
    at: datetime | None = None,
    price: Price | None = None,
    vendor: str = Vendor.ANTHROPIC,
) -> Reservation:
    """Hold the worst case of a request against the agent's budgets (only its id and its
    organisation's are read), priced by ``price`` (the gateway keeps the rows; else
    :func:`price_for`). Unpriced for a model without a price; Busy or Exhausted (nothing held)
    when a budget cannot hold it (:func:`_refusal`); ValueError for a negative bound."""
    at = at or timezone.now()
    price = price or price_for(model, at, vendor)
    amount = price.prices.worst_case(input_bound, max_tokens)
    try:
        return _reserve(agent, model, price, amount, request_id, run_id, at)
    except Exhausted as exc:
        if not exc.used_up:
            raise
        # Used up from now (outside the refused transaction): the proxy refuses the agent's
        # egress, its runs are stopped, new ones refused, until the budget is raised.
        with transaction.atomic():
            # Read again, locked: a budget raised since the refusal is not marked used up.
            spend = Spend.objects.select_for_update().get(pk=exc.spend.pk)
            left = spend.limit - spend.spent
            if spend.exhausted_at is None and (left <= 0 or left < exc.least):
                spend.exhausted_at = timezone.now()
                spend.save(update_fields=["exhausted_at"])
                exc.first = True
                tell_reached([exc.spend.pk], used_up=True)
        raise


def _reserve(
    agent: Agent,
    model: str,
    price: Price,
    amount: Decimal,
    request_id: str,
    run_id: "UUID | str | None",
    at: datetime,
) -> Reservation:
    # On every model request, so in SQL of its own: a handful of statements, each one round
    # trip, where the ORM spent milliseconds building them.
    with transaction.atomic(), connection.cursor() as cursor:
        # Rows are updated in one order (by id) by every reservation and settlement, so two
        # requests never wait for each other's rows in opposite orders (a deadlock).
        held = sorted(_current_spend_ids(cursor, agent, at))
        for spend_id, budget_id in held:
            cursor.execute(_HOLD, [_decimal(amount), spend_id, micros(amount)])
            if cursor.rowcount != 1:
                raise _refusal(
                    Budget.objects.get(pk=budget_id),
                    Spend.objects.get(pk=spend_id),
                    amount,
                    price.prices.least(),
                )
        reservation = Reservation(
            request_id=request_id,
            organisation_id=agent.organisation_id,
            agent_id=agent.pk,
            run_id=run_id,
            model=model,
            price=price,
            amount=amount,
            status=Reservation.Status.OPEN,
            created_at=timezone.now(),
        )
        row = [_prep(reservation, name) for name in _RESERVATION_FIELDS]
        cursor.execute(_INSERT_RESERVATION, row)
        reservation.pk = cursor.fetchone()[0]
        if held:
            cursor.executemany(_LINK, [[reservation.pk, spend_id] for spend_id, _ in held])
    return reservation


def _current_spend_ids(cursor: Any, agent: Agent, at: datetime) -> list[tuple[int, int]]:
    """(spend id, budget id) of the current period of each budget that applies to the agent
    (a period's spend is made, with :func:`current_spend`, when the first request finds none)."""
    starts = {kind: periods.bounds(kind, at, zone())[0] for kind in periods.PERIODS}
    cursor.execute(
        _CURRENT_SPENDS,
        [*(_datetime(starts[kind]) for kind in periods.PERIODS), agent.organisation_id, agent.pk],
    )
    found = []
    for budget_id, spend_id in cursor.fetchall():
        if spend_id is None:
            spend_id = current_spend(Budget.objects.get(pk=budget_id), at).pk
        found.append((spend_id, budget_id))
    return found


def _refusal(budget: Budget, spend: Spend, needed: Decimal, least: Decimal) -> OverBudget:
    """Why ``spend`` (read after its hold was refused) cannot hold ``needed`` now, judged by
    what was spent alone (the module's docstring): busy, used up, or too large for what is
    left."""
    left = spend.limit - spend.spent
    if left >= needed:
        return Busy(budget, spend, needed)
    return Exhausted(budget, spend, needed, used_up=left <= 0 or left < least, least=least)


def micros(amount: Decimal) -> int:
    """An amount in whole millionths of a dollar (amounts are kept to a millionth)."""
    return int(amount.scaleb(6).to_integral_value())


def _decimal(value: Decimal) -> Any:
    return connection.ops.adapt_decimalfield_value(value, 14, 6)


def _datetime(value: datetime) -> Any:
    return connection.ops.adapt_datetimefield_value(value)


def _prep(instance: Any, name: str) -> Any:
    field = instance._meta.get_field(name)
    return field.get_db_prep_save(getattr(instance, field.attname), connection)


# The SQL of reserve(), in the standard SQL that PostgreSQL and SQLite share. The period
# kinds' starts are given in periods.PERIODS order (none, daily, weekly, monthly).
_CURRENT_SPENDS = (
    "SELECT b.id, s.id FROM budgets_budget b LEFT JOIN budgets_spend s ON s.budget_id = b.id"
    " AND s.period = b.period AND s.starts_at = (CASE b.period WHEN 'none' THEN %s"
    " WHEN 'daily' THEN %s WHEN 'weekly' THEN %s WHEN 'monthly' THEN %s END)"
    " WHERE b.organisation_id = %s AND (b.agent_id = %s OR b.agent_id IS NULL)"
)
# Compared in whole millionths of a dollar (the last parameter is the amount's, micros()), so
# exactly on PostgreSQL (numeric) and on SQLite, whose columns hold binary floating point
# (0.012258 - 0.008172 - 0.004086 is below 0 there: an exact fit was refused). A column's
# amount of up to 14 digits, times a million, is off a whole number by far less than a half in
# a double, so ROUND finds it exactly.
_HOLD = (
    "UPDATE budgets_spend SET reserved = ROUND(reserved + %s, 6) WHERE id = %s"
    " AND CAST(ROUND(spent * 1000000) AS BIGINT) + CAST(ROUND(reserved * 1000000) AS BIGINT)"
    ' + %s <= CAST(ROUND("limit" * 1000000) AS BIGINT)'
)
_RESERVATION_FIELDS = (
    "request_id",
    "organisation",
    "agent",
    "run",
    "model",
    "price",
    "amount",
    "status",
    "created_at",
)
_INSERT_RESERVATION = (
    "INSERT INTO budgets_reservation (request_id, organisation_id, agent_id, run_id, model,"
    " price_id, amount, status, created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
    " RETURNING id"
)
_LINK = "INSERT INTO budgets_reservation_spends (reservation_id, spend_id) VALUES (%s, %s)"


def settle(
    reservation: Reservation, usage: Usage, *, model: str = "", outcome: str = Outcome.COMPLETE
) -> Charge:
    """Charge what the request used, at the price it started under, and free its reservation."""
    with transaction.atomic():
        locked = _open(reservation)
        cost = locked.price.prices.cost(usage)
        if cost > locked.amount:
            # Its worst case was not one: the budget may be passed by the difference.
            logger.warning(
                "covey: request %s cost %s, more than the %s reserved for it",
                locked.request_id,
                dollars(cost, exact=True),
                dollars(locked.amount, exact=True),
            )
        charge, spends = _charge(locked, usage, cost, outcome, model=model)
        if cost:
            tell_reached(spends)
    return charge


STALE_MARGIN = timedelta(minutes=5)


def settle_stale(now: datetime | None = None) -> int:
    """Charge every reservation still open longer than a request through the gateway may take
    (COVEY_GATEWAY_MAX_REQUEST_SECONDS, and a margin) its worst case: its request may have
    reached the model, and nothing is left unmetered. Returns how many."""
    now = now or timezone.now()
    limit = timedelta(seconds=settings.COVEY_GATEWAY_MAX_REQUEST_SECONDS) + STALE_MARGIN
    settled = 0
    for pk in Reservation.objects.filter(
        status=Reservation.Status.OPEN, created_at__lt=now - limit
    ).values_list("pk", flat=True):
        with transaction.atomic():
            locked = _open(Reservation(pk=pk))
            _, spends = _charge(locked, Usage(), locked.amount, Outcome.UNSETTLED)
            tell_reached(spends)
        logger.warning(
            "covey: request %s was never settled: charged its worst case, %s",
            locked.request_id,
            dollars(locked.amount, exact=True),
        )
        settled += 1
    return settled


def _charge(
    locked: Reservation, usage: Usage, cost: Decimal, outcome: str, *, model: str = ""
) -> tuple[Charge, list[int]]:
    """The ledger's row for a reservation (locked, open), charged ``cost`` at the price it
    started under, and the reservation settled; the row, and the ids of the spends it held."""
    row = Charge.objects.create(
        request_id=locked.request_id,
        organisation_id=locked.organisation_id,
        agent_id=locked.agent_id,
        run_id=locked.run_id,
        model=model or locked.model,
        input_tokens=usage.input,
        cache_write_5m_tokens=usage.cache_write_5m,
        cache_write_1h_tokens=usage.cache_write_1h,
        cache_read_tokens=usage.cache_read,
        output_tokens=usage.output,
        cost=cost,
        price=locked.price,
        outcome=outcome,
        started_at=locked.created_at,
    )
    return row, _close(locked, Reservation.Status.SETTLED, spent=cost)


def release(reservation: Reservation) -> None:
    """Free a reservation without a charge (the request never reached the model)."""
    with transaction.atomic():
        _close(_open(reservation), Reservation.Status.RELEASED, spent=Decimal(0))


def _open(reservation: Reservation) -> Reservation:
    # Its own row alone: FOR UPDATE of the join would lock the price row too, which every
    # other request's foreign keys share-lock at commit (a deadlock under load).
    locked = (
        Reservation.objects.select_for_update(of=("self",))
        .select_related("price")
        .get(pk=reservation.pk)
    )
    if locked.status != Reservation.Status.OPEN:
        raise ValidationError(f"reservation {locked.request_id} is {locked.status} already")
    return locked


def _exact(amount: Any) -> Round:
    """An amount kept to a millionth of a dollar: exact on PostgreSQL (numeric) already, and
    on SQLite, whose arithmetic is binary floating point (0.3 - 0.1 - 0.2 is not 0 there)."""
    return Round(amount, 6)


def _close(reservation: Reservation, status: str, *, spent: Decimal) -> list[int]:
    """Free the reservation, charging ``spent``; the ids of the spends it held (their rows
    locked until the transaction ends)."""
    ids = list(reservation.spends.order_by("pk").values_list("pk", flat=True))
    for pk in ids:
        Spend.objects.filter(pk=pk).update(
            reserved=_exact(F("reserved") - Value(reservation.amount)),
            spent=_exact(F("spent") + Value(spent)),
        )
    reservation.status = status
    reservation.closed_at = timezone.now()
    reservation.save(update_fields=["status", "closed_at"])
    return ids
