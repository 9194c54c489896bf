"""Metering model requests against budgets: price, reserve, settle, release.

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

import hashlib
import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from functools import partial
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID
from zoneinfo import ZoneInfo

from celery import current_app
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db import connection, transaction
from django.db.models import Count, F, Q, Sum, Value
from django.db.models.functions import Round
from django.urls import reverse
from django.utils import timezone

from agents.models import Agent
from budgets import periods
from budgets.models import (
    DEFAULT_THRESHOLDS,
    Budget,
    Charge,
    GatewayToken,
    ModelKey,
    Outcome,
    Price,
    Reservation,
    Spend,
    Vendor,
)
from budgets.money import dollars
from budgets.usage import Usage
from covey import crypto
from organisations import webhooks
from organisations.models import Membership, Organisation, Role

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
        charge = Charge.objects.create(
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
        spends = _close(locked, Reservation.Status.SETTLED, spent=cost)
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
            Charge.objects.create(
                request_id=locked.request_id,
                organisation_id=locked.organisation_id,
                agent_id=locked.agent_id,
                run_id=locked.run_id,
                model=locked.model,
                cost=locked.amount,
                price=locked.price,
                outcome=Outcome.UNSETTLED,
                started_at=locked.created_at,
            )
            spends = _close(locked, Reservation.Status.SETTLED, spent=locked.amount)
            tell_reached(spends)
        logger.warning(
            "covey: request %s was never settled: charged its worst case, %s",
            locked.request_id,
            dollars(locked.amount, exact=True),
        )
        settled += 1
    return settled


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


ALERT = "budgets.alert"  # the task that emails an alert (budgets/tasks.py)
STOP_OVER_BUDGET = "runs.stop_over_budget"  # the task that stops a used-up budget's runs
THRESHOLD_EVENT = "budget.threshold"  # the webhook event (organisations/webhooks.py)


def reached(spend: Spend, threshold: int, *, used_up: bool = False) -> bool:
    """Whether the period has spent ``threshold`` percent of its limit; a period found used up
    has reached every threshold up to 100 %."""
    if used_up and threshold <= 100:
        return True
    return spend.limit > 0 and spend.spent * 100 >= spend.limit * threshold


def tell_reached(spend_ids: Iterable[int], *, used_up: bool = False) -> list[tuple[int, int]]:
    """In the transaction that changed these spends (their rows locked by it, so two never
    tell the same threshold): each threshold of their budgets reached now and not told this
    period is marked told (``Spend.alerted``), and once the transaction commits, emailed to
    the organisation's admins (a Celery task) and posted to its webhook. Returns the (spend
    id, threshold) pairs told."""
    told = []
    for spend in Spend.objects.select_related("budget").filter(pk__in=spend_ids).order_by("pk"):
        new = [
            t
            for t in spend.budget.thresholds
            if t not in spend.alerted and reached(spend, t, used_up=used_up)
        ]
        if not new:
            continue
        spend.alerted = sorted({*spend.alerted, *new})
        spend.save(update_fields=["alerted"])
        for threshold in new:
            told.append((spend.pk, threshold))
            webhooks.send(
                spend.budget.organisation_id,
                THRESHOLD_EVENT,
                alert_data(spend, threshold, used_up=used_up),
            )
        # One email for what one change reached (50 % and 80 % at once are one message).
        transaction.on_commit(
            partial(current_app.send_task, ALERT, args=[spend.pk, new, used_up]), robust=True
        )
    return told


def alert_data(spend: Spend, threshold: int, *, used_up: bool = False) -> dict[str, Any]:
    """An alert as its webhook event carries it (and its email tells it)."""
    budget = spend.budget
    agent = budget.agent
    return {
        "budget": budget.pk,
        "agent": {"id": agent.pk, "slug": agent.slug, "name": agent.name} if agent else None,
        "threshold": threshold,
        "used_up": used_up,
        "spent": str(spend.spent),
        "limit": str(spend.limit),
        "period": spend.period,
        "starts_at": spend.starts_at.isoformat(),
        "ends_at": spend.ends_at.isoformat() if spend.ends_at else None,
        "admin": settings.COVEY_CONTROL_PLANE_URL.rstrip("/")
        + reverse("admin:budgets_budget_change", args=[budget.pk]),
    }


def email_alert(spend_id: int, thresholds: list[int], used_up: bool = False) -> int:
    """Email the organisation's admins (those with an address) that a budget reached these
    thresholds (or was found used up); how many were told."""
    spend = Spend.objects.select_related("budget__organisation", "budget__agent").get(pk=spend_id)
    budget = spend.budget
    emails = sorted(
        set(
            Membership.objects.filter(organisation=budget.organisation, role=Role.ADMIN)
            .exclude(user__email="")
            .values_list("user__email", flat=True)
        )
    )
    if not emails:
        logger.warning(
            "covey: no admin of %s has an email address: the budget alert (%s %%) reached"
            " nobody by email",
            budget.organisation,
            ", ".join(map(str, thresholds)),
        )
        return 0
    data = alert_data(spend, max(thresholds), used_up=used_up)
    if budget.agent_id:
        whose = f"agent {budget.agent}"
        where = f"agent {budget.agent} ({budget.organisation})"
    else:
        whose = where = f"organisation {budget.organisation}"
    state = "is used up" if used_up else f"reached {max(thresholds)} %"
    send_mail(
        f"covey: the budget of {whose} {state}",
        f"The {spend.period} budget of {where} {state}: {dollars(spend.spent)}"
        f" of {dollars(spend.limit)} spent in the period from"
        f" {spend.starts_at:%Y-%m-%d %H:%M} UTC.\n\n"
        f"See or raise it: {data['admin']}\n",
        None,
        emails,
    )
    return len(emails)


def check_thresholds(value: Any) -> list[int]:
    """Alert thresholds, sorted without repeats (None: the default); ValueError if they are
    not whole percentages from 1 to 1000."""
    given = list(DEFAULT_THRESHOLDS) if value in (None, "") else value
    if not isinstance(given, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 < t <= 1000 for t in given
    ):
        raise ValueError("give a list of whole percentages from 1 to 1000, e.g. [50, 80, 100]")
    return sorted(set(given))


def set_budget(
    owner: Agent | Organisation,
    amount: Decimal,
    *,
    period: str = periods.MONTHLY,
    thresholds: list[int] | None = None,
) -> Budget:
    """The budget of an agent or an organisation, made or changed; the current period's limit
    follows at once: raising it lets the agent work again; lowering it to what was spent or
    less uses it up now, as a refused request would (its runs are stopped, its thresholds
    told)."""
    if amount < 0:
        raise ValidationError({"amount": ["a budget cannot be negative"]})
    if period not in periods.PERIODS:
        raise ValidationError({"period": [f"one of {', '.join(periods.PERIODS)}"]})
    try:
        wanted = check_thresholds(thresholds)
    except ValueError as exc:
        raise ValidationError({"thresholds": [str(exc)]}) from None
    fields: dict[str, Any] = {"amount": amount, "period": period, "thresholds": wanted}
    used_up_now: list[int] = []
    with transaction.atomic():
        if isinstance(owner, Agent):
            budget, _ = Budget.objects.update_or_create(
                agent=owner, defaults={**fields, "organisation_id": owner.organisation_id}
            )
        else:
            budget, _ = Budget.objects.update_or_create(
                organisation=owner, agent=None, defaults=fields
            )
        current_spend(budget)  # the current period exists, and takes the new limit:
        for spend in (
            Spend.objects.select_for_update()
            .filter(budget=budget, period=budget.period)
            .filter(Q(ends_at__isnull=True) | Q(ends_at__gt=timezone.now()))
        ):
            if amount == spend.limit:
                continue  # saved again unchanged: a used-up budget stays used up
            raised = amount > spend.limit
            spend.limit = amount
            if raised:  # the agent may work again; a threshold is told again when reached
                spend.exhausted_at = None
                spend.alerted = [t for t in spend.alerted if reached(spend, t)]
            elif spend.exhausted_at is None and spend.spent >= amount:
                spend.exhausted_at = timezone.now()
                used_up_now.append(spend.pk)
            spend.save(update_fields=["limit", "exhausted_at", "alerted"])
        if used_up_now:
            tell_reached(used_up_now, used_up=True)
            # Its runs are stopped (runs.tasks, by name: runs is above us), as the gateway does.
            agents = Agent.objects.filter(organisation_id=budget.organisation_id)
            some = budget.agent_id or agents.values_list("pk", flat=True).first()
            if some is not None:
                transaction.on_commit(
                    partial(current_app.send_task, STOP_OVER_BUDGET, args=[some]), robust=True
                )
    return budget


def used_up(agent: Agent, at: datetime | None = None) -> str:
    """Why the agent cannot spend now ("": it can): a budget of its own, or its organisation's,
    is used up in the current period (what was spent left less than the least a request can
    cost, or it was lowered to what was spent) and was not raised since."""
    budgets = budgets_of(agent)
    spends = current_spends(budgets, at)
    for budget in budgets:
        spend = spends[budget.pk]
        if spend.exhausted_at is not None:
            whose = f"agent {budget.agent}" if budget.agent_id else "its organisation"
            return (
                f"the budget of {whose} is used up this period"
                f" ({dollars(spend.spent, exact=True)} of {dollars(spend.limit, exact=True)}"
                " spent, too little left for any request): raise it, or wait for the next period"
            )
    return ""


def usage(
    agent: Agent, since: datetime | None = None, until: datetime | None = None
) -> dict[str, Any]:
    """What the agent spent from ``since`` to ``until`` (default: its own budget's current
    period, or the current month), in total and by model, and where each of its budgets stands
    now. Amounts in US dollars as strings."""
    own = Budget.objects.filter(agent=agent).first()
    if since is None:
        since, end = periods.bounds(own.period if own else periods.MONTHLY, timezone.now(), zone())
        until = until or end
    charges = Charge.objects.filter(agent=agent, started_at__gte=since)
    if until is not None:
        charges = charges.filter(started_at__lt=until)
    sums = {
        "requests": Count("id"),
        "input_tokens": Sum("input_tokens"),
        "cache_write_5m_tokens": Sum("cache_write_5m_tokens"),
        "cache_write_1h_tokens": Sum("cache_write_1h_tokens"),
        "cache_read_tokens": Sum("cache_read_tokens"),
        "output_tokens": Sum("output_tokens"),
        "cost": Sum("cost"),
    }

    def shown(row: dict[str, Any]) -> dict[str, Any]:
        return {
            key: str(Decimal(value or 0).quantize(MILLIONTH)) if key == "cost" else (value or 0)
            for key, value in row.items()
        }

    budgets = budgets_of(agent)
    spends = current_spends(budgets)
    return {
        "agent": agent.pk,
        "since": since,
        "until": until,
        "total": shown(charges.aggregate(**sums)),
        "by_model": [
            {"model": row["model"], **shown({k: v for k, v in row.items() if k != "model"})}
            for row in charges.values("model").annotate(**sums).order_by("-cost", "model")
        ],
        "budgets": [
            {
                "budget": budget.pk,
                "whose": "agent" if budget.agent_id else "organisation",
                "period": budget.period,
                "starts_at": spends[budget.pk].starts_at,
                "ends_at": spends[budget.pk].ends_at,
                "limit": str(spends[budget.pk].limit),
                "spent": str(spends[budget.pk].spent),
                "reserved": str(spends[budget.pk].reserved),
                "remaining": str(max(spends[budget.pk].remaining, Decimal(0))),
                "used_up": spends[budget.pk].exhausted_at is not None,
            }
            for budget in budgets
        ],
    }


MILLIONTH = Decimal("0.000001")


def spend_text(budget: Budget | None, spend: Spend | None) -> str:
    """'$3.20 of $10.00 this month (32 %)', for lists; '-' without a budget."""
    if budget is None or spend is None:
        return "-"
    share = f" ({spend.spent * 100 / spend.limit:.0f} %)" if spend.limit > 0 else ""
    used_up = ", used up" if spend.exhausted_at is not None else ""
    words = PERIOD_WORDS[budget.period]
    return f"{dollars(spend.spent)} of {dollars(spend.limit)} {words}{share}{used_up}"


PERIOD_WORDS = {
    periods.NONE: "in all",
    periods.DAILY: "today",
    periods.WEEKLY: "this week",
    periods.MONTHLY: "this month",
}


def exhausted(organisation_id: int | None = None) -> tuple[set[int], set[int]]:
    """The agents whose own budget, and the organisations whose budget, is used up now."""
    now = timezone.now()
    spends = Spend.objects.filter(
        exhausted_at__isnull=False, period=F("budget__period"), starts_at__lte=now
    ).filter(Q(ends_at__isnull=True) | Q(ends_at__gt=now))
    if organisation_id is not None:
        spends = spends.filter(budget__organisation_id=organisation_id)
    agents: set[int] = set()
    organisations: set[int] = set()
    for agent_id, org_id in spends.values_list("budget__agent_id", "budget__organisation_id"):
        if agent_id is None:
            organisations.add(org_id)
        else:
            agents.add(agent_id)
    return agents, organisations


def gateway_destination(url: str) -> tuple[str, int] | None:
    """(host, port) of the model gateway as sandboxes reach it (COVEY_MODEL_GATEWAY_URL); None
    when there is none; ValueError when it is not http(s)://HOST[:PORT]."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("give http://HOST:PORT or https://HOST[:PORT]")
    if parts.username is not None or parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(
            "give the gateway's root, with no user, path or query (the SDKs add /v1/…)"
        )
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80)


GATEWAY_TOKEN_PREFIX = "covey-gw-"  # noqa: S105 - what a gateway token starts with


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_gateway_token(agent: Agent, *, run_id: "UUID | str | None", ttl: timedelta) -> str:
    """A credential at the model gateway for the agent (and its run); returned only now."""
    if ttl <= timedelta(0):
        raise ValueError("a token must live for a positive time")
    secret = GATEWAY_TOKEN_PREFIX + secrets.token_urlsafe(32)
    GatewayToken.objects.create(
        agent=agent,
        run_id=run_id,
        sha256=hash_token(secret),
        prefix=secret[: len(GATEWAY_TOKEN_PREFIX) + 3],
        expires_at=timezone.now() + ttl,
    )
    return secret


def revoke_gateway_tokens(*, run_id: "UUID | str") -> int:
    """Revoke the run's live gateway tokens; returns how many."""
    return GatewayToken.objects.filter(run_id=run_id, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )


def model_vendors(organisation_id: int) -> tuple[str, ...]:
    """Whose APIs an organisation's sandboxes are told of: Anthropic's always (the default
    runtime's; without a key the gateway says so), and each other vendor it has a key at."""
    keyed = set(
        ModelKey.objects.filter(organisation_id=organisation_id).values_list("vendor", flat=True)
    )
    return tuple(v for v in Vendor.values if v == Vendor.ANTHROPIC or v in keyed)


def has_model_key(organisation_id: int, vendor: str) -> bool:
    """Whether the organisation has entered its API key at ``vendor``."""
    return ModelKey.objects.filter(organisation_id=organisation_id, vendor=vendor).exists()


def check_model_key(secret: str) -> str:
    """The key without surrounding spaces; ValueError if it cannot be one."""
    secret = secret.strip()
    if len(secret) < 8 or any(ord(c) < 33 or ord(c) > 126 for c in secret):
        raise ValueError("an API key is at least 8 printable characters, without spaces")
    return secret


def set_model_key(
    organisation: Organisation, secret: str, vendor: str = Vendor.ANTHROPIC
) -> ModelKey:
    """The organisation's key at ``vendor``, made or replaced; kept encrypted."""
    try:
        secret = check_model_key(secret)
    except ValueError as exc:
        raise ValidationError({"secret": [str(exc)]}) from None
    if vendor not in Vendor.values:
        raise ValidationError({"vendor": [f"one of {', '.join(Vendor.values)}"]})
    key, _ = ModelKey.objects.update_or_create(
        organisation=organisation,
        vendor=vendor,
        defaults={"secret": crypto.encrypt(secret), "hint": secret[-4:]},
    )
    return key
