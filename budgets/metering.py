"""The ledger: metering model requests against budgets (price, reserve, settle, release) and
what each budget's current period holds.

A request is reserved at its worst case (:meth:`budgets.usage.Prices.worst_case`) against each
budget that applies (the agent's, and its organisation's, which caps the sum of its agents) in
one transaction that holds the budgets' spends locked while it reads and changes them
(``SELECT … FOR UPDATE`` on PostgreSQL; on SQLite the transaction holds the database), and
compares in whole millionths of a dollar (so SQLite's floating point cannot refuse an exact
fit): concurrent requests can never together hold or spend more than a budget has, and a
request that does not fit is refused before it is sent. Many requests are reserved in one such
transaction (:func:`reserve_all`), and settled in one (:func:`settle_all`): the gateway's
writer does both in batches. Settling charges the actual cost (a ledger row) and frees the
reservation; releasing frees it without a charge. A request is priced by the price row in
effect when it starts.

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

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo

import psycopg
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Q, Sum
from django.utils import timezone

from agents.models import Agent
from budgets import periods
from budgets.alerts import reached, tell_reached
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
from budgets.usage import CENT_FRACTION, Usage

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
    ask = Ask(
        agent.pk,
        agent.organisation_id,
        model,
        price,
        price.prices.worst_case(input_bound, max_tokens),
        request_id,
        run_id,
    )
    (held,) = reserve_all([ask], at)
    if isinstance(held, OverBudget):
        if isinstance(held, Exhausted):
            mark_used_up(held)
        raise held
    return held.reservation


@dataclass(frozen=True)
class Ask:
    """One request to reserve: its worst case (``amount``, at ``price``) against the budgets of
    an agent."""

    agent_id: int
    organisation_id: int
    model: str
    price: Price
    amount: Decimal
    request_id: str
    run_id: "UUID | str | None" = None


@dataclass(frozen=True)
class Reserved:
    """An ask held: its reservation, and the ids of the spends that hold it."""

    reservation: Reservation
    spends: tuple[int, ...]


def reserve_all(asks: Sequence[Ask], at: datetime) -> list["Reserved | OverBudget"]:
    """Hold the worst case of each ask against its agent's budgets in their periods at ``at``,
    in the order given, in one transaction (the gateway's writer reserves its requests in
    batches): the spends of every budget that applies are locked and read (in the order of
    their ids, as settlements take them: no deadlock; on SQLite the transaction holds the
    database), each ask is held by every one of its spends or by none (compared in whole
    millionths of a dollar), and the reservations are written. Returns, for each ask, what
    holds it, or why it was refused (:func:`_refusal`; nothing held for it). Marking a
    budget found used up is the caller's (:func:`mark_used_up`)."""
    results: list[Reserved | OverBudget] = []
    if not asks:
        return results
    starts = [_datetime(periods.bounds(kind, at, zone())[0]) for kind in periods.PERIODS]
    if len(asks) == 1 and connection.vendor == "postgresql":
        one = _reserve_one_postgresql(asks[0], starts)
        if one is not None:
            return [one]
    # On every model request, so in SQL of its own: a handful of statements a batch, where
    # the ORM spent milliseconds building each.
    with transaction.atomic(), connection.cursor() as cursor:
        found: dict[int, list[tuple[int | None, int]]] = {}  # agent → [(spend, budget)]
        for ask in asks:
            if ask.agent_id not in found:
                cursor.execute(_CURRENT_SPENDS, [*starts, ask.organisation_id, ask.agent_id])
                found[ask.agent_id] = [(spend, budget) for budget, spend in cursor.fetchall()]
        # A period's spend is made when the first request finds none; in the order of the
        # budgets' ids, so that two writers making two never wait for each other's.
        pairs = [pair for agent_pairs in found.values() for pair in agent_pairs]
        missing = sorted({budget for spend, budget in pairs if spend is None})
        created = {
            budget: current_spend(Budget.objects.get(pk=budget), at).pk for budget in missing
        }
        spends_of = {
            agent: sorted((spend or created[budget], budget) for spend, budget in agent_pairs)
            for agent, agent_pairs in found.items()
        }
        state: dict[int, list[int]] = {}  # spend id → [spent, reserved, limit] in millionths
        ids = sorted({spend_id for held in spends_of.values() for spend_id, _ in held})
        if ids:
            lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
            cursor.execute(_LOCK_SPENDS.format(_marks(ids), lock), ids)
            for pk, spent, reserved, limit in cursor.fetchall():
                state[pk] = [
                    micros(_amount(spent)),
                    micros(_amount(reserved)),
                    micros(_amount(limit)),
                ]
        added: dict[int, Decimal] = {}
        made: list[tuple[Reservation, list[tuple[int, int]]]] = []
        now = timezone.now()
        for ask in asks:
            needed = micros(ask.amount)
            held = spends_of[ask.agent_id]
            over = next(((s, b) for s, b in held if sum(state[s][:2]) + needed > state[s][2]), None)
            if over is not None:
                results.append(_refusal_of(over, state, ask))
                continue
            for spend_id, _ in held:
                state[spend_id][1] += needed
                added[spend_id] = added.get(spend_id, Decimal(0)) + ask.amount
            reservation = Reservation(
                request_id=ask.request_id,
                organisation_id=ask.organisation_id,
                agent_id=ask.agent_id,
                run_id=ask.run_id,
                model=ask.model,
                price=ask.price,
                amount=ask.amount,
                status=Reservation.Status.OPEN,
                created_at=now,
            )
            made.append((reservation, held))
            results.append(Reserved(reservation, tuple(spend_id for spend_id, _ in held)))
        if added:
            cases = " ".join(["WHEN %s THEN %s"] * len(added))
            by_spend = [x for pk, amount in sorted(added.items()) for x in (pk, _decimal(amount))]
            cursor.execute(_ADD_HELD.format(cases, _marks(added)), [*by_spend, *sorted(added)])
        if made:
            created, run = _datetime(now), Reservation._meta.get_field("run")
            rows = [
                x
                for r, _ in made
                for x in (r.request_id, r.organisation_id, r.agent_id,
                          run.get_db_prep_save(r.run_id, connection) if r.run_id else None,
                          r.model, r.price_id, _decimal(r.amount), r.status, created)
            ]  # fmt: skip
            values = ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s, %s)"] * len(made))
            cursor.execute(_INSERT_RESERVATIONS.format(values), rows)
            ids_of = {request_id: pk for pk, request_id in cursor.fetchall()}
            links: list[int] = []
            for reservation, held in made:
                reservation.pk = ids_of[reservation.request_id]
                links += [x for spend_id, _ in held for x in (reservation.pk, spend_id)]
            if links:
                values = ", ".join(["(%s, %s)"] * (len(links) // 2))
                cursor.execute(_LINK.format(values), links)
    return results


def _reserve_one_postgresql(ask: Ask, starts: list[Any]) -> "Reserved | OverBudget | None":
    """One ask on PostgreSQL, in one statement (one round trip, where :func:`reserve_all`'s
    transaction takes seven; what the time to the first byte of a lone request is made of):
    its spends locked in the order of their ids, held by all or by none, the reservation and
    its links written. None, with nothing done, when a budget has no spend for the period yet
    (:func:`reserve_all` makes it)."""
    run = Reservation._meta.get_field("run")
    row = [ask.request_id, ask.organisation_id, ask.agent_id,
           run.get_db_prep_save(ask.run_id, connection) if ask.run_id else None,
           ask.model, ask.price.pk, _decimal(ask.amount), _datetime(timezone.now())]  # fmt: skip
    params = [ask.organisation_id, ask.agent_id, *starts, micros(ask.amount),
              _decimal(ask.amount), *row]  # fmt: skip
    connection.ensure_connection()
    # A cursor that binds on the server, so that the statement is planned once per connection
    # (prepared), not once per request: its parameters are typed in the statement.
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(_RESERVE_ONE, params, prepare=True)
        answer = cursor.fetchone()
    assert answer is not None  # noqa: S101 - a SELECT of scalars answers one row
    made, complete, spends = answer
    if not complete:
        return None
    state = {
        pk: [micros(Decimal(spent)), micros(Decimal(reserved)), micros(Decimal(limit))]
        for pk, _, spent, reserved, limit in _json(spends or [])
    }
    held = [(pk, budget_id) for pk, budget_id, *_ in _json(spends or [])]
    if made is None:
        needed = micros(ask.amount)
        over = next((s, b) for s, b in held if sum(state[s][:2]) + needed > state[s][2])
        return _refusal_of(over, state, ask)
    reservation = Reservation(
        pk=made, request_id=ask.request_id, organisation_id=ask.organisation_id,
        agent_id=ask.agent_id, run_id=ask.run_id, model=ask.model, price=ask.price,
        amount=ask.amount, status=Reservation.Status.OPEN, created_at=row[-1],
    )  # fmt: skip
    return Reserved(reservation, tuple(pk for pk, _ in held))


def mark_used_up(refused: "Exhausted") -> None:
    """A budget found used up (``refused.used_up``), outside the transaction that refused it:
    its period is marked so from now (the proxy refuses the agent's egress, its runs are
    stopped, new ones refused, until the budget is raised), and the thresholds told;
    ``refused.first`` when this is the refusal that found it."""
    if not refused.used_up:
        return
    with transaction.atomic():
        # Read again, locked: a budget raised since the refusal is not marked used up.
        spend = Spend.objects.select_for_update().get(pk=refused.spend.pk)
        left = spend.limit - spend.spent
        if spend.exhausted_at is None and (left <= 0 or left < refused.least):
            spend.exhausted_at = timezone.now()
            spend.save(update_fields=["exhausted_at"])
            refused.first = True
            tell_reached([refused.spend.pk], used_up=True)


def _refusal_of(over: tuple[int, int], state: dict[int, list[int]], ask: Ask) -> "OverBudget":
    spend_id, budget_id = over
    spent, reserved, limit = (Decimal(value).scaleb(-6) for value in state[spend_id])
    spend = Spend(pk=spend_id, budget_id=budget_id, spent=spent, reserved=reserved, limit=limit)
    budget = Budget.objects.select_related("agent").get(pk=budget_id)
    return _refusal(budget, spend, ask.amount, ask.price.prices.least())


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


# The SQL of reserve(), in the standard SQL that PostgreSQL and SQLite share. The period
# kinds' starts are given in periods.PERIODS order (none, daily, weekly, monthly).
_CURRENT_SPENDS = (
    "SELECT b.id, s.id FROM budgets_budget b LEFT JOIN budgets_spend s ON s.budget_id = b.id"
    " AND s.period = b.period AND s.starts_at = (CASE b.period WHEN 'none' THEN %s"
    " WHEN 'daily' THEN %s WHEN 'weekly' THEN %s WHEN 'monthly' THEN %s END)"
    " WHERE b.organisation_id = %s AND (b.agent_id = %s OR b.agent_id IS NULL)"
)
# reserve_all() of one ask on PostgreSQL, in one statement: the budgets that apply, their
# spends in the period locked (FOR UPDATE waits for a concurrent change and reads the row as
# it committed), whether every one holds the ask (in millionths), and only then the holds,
# the reservation and its links; what it read comes back, to say why it was refused.
_RESERVE_ONE = """
WITH budgets AS (
    SELECT id, period FROM budgets_budget
    WHERE organisation_id = %s::bigint AND (agent_id = %s::bigint OR agent_id IS NULL)
), spends AS (
    SELECT s.id, s.budget_id, s.spent, s.reserved, s."limit" FROM budgets_spend s
    JOIN budgets b ON s.budget_id = b.id AND s.period = b.period AND s.starts_at = (CASE
        b.period WHEN 'none' THEN %s::timestamptz WHEN 'daily' THEN %s::timestamptz
        WHEN 'weekly' THEN %s::timestamptz WHEN 'monthly' THEN %s::timestamptz END)
    ORDER BY s.id FOR UPDATE OF s
), decided AS (
    SELECT (SELECT count(*) FROM budgets) = (SELECT count(*) FROM spends) AS complete,
        COALESCE(bool_and(CAST(ROUND(spent * 1000000) AS BIGINT)
            + CAST(ROUND(reserved * 1000000) AS BIGINT) + %s::bigint
            <= CAST(ROUND("limit" * 1000000) AS BIGINT)), TRUE) AS fits
    FROM spends
), held AS (
    UPDATE budgets_spend SET reserved = ROUND(reserved + %s::numeric, 6)
    WHERE id IN (SELECT id FROM spends) AND (SELECT complete AND fits FROM decided)
    RETURNING id
), made AS (
    INSERT INTO budgets_reservation (request_id, organisation_id, agent_id, run_id, model,
        price_id, amount, status, created_at)
    SELECT %s::text, %s::bigint, %s::bigint, %s::uuid, %s::text, %s::bigint, %s::numeric,
        'open', %s::timestamptz WHERE (SELECT complete AND fits FROM decided)
    RETURNING id
), linked AS (
    INSERT INTO budgets_reservation_spends (reservation_id, spend_id)
    SELECT made.id, held.id FROM made, held
)
SELECT (SELECT id FROM made), (SELECT complete FROM decided),
    (SELECT json_agg(json_build_array(id, budget_id, spent::text, reserved::text,
        "limit"::text) ORDER BY id) FROM spends)
"""
_LOCK_SPENDS = (
    'SELECT id, spent, reserved, "limit" FROM budgets_spend WHERE id IN ({}) ORDER BY id{}'
)
_ADD_HELD = (
    "UPDATE budgets_spend SET reserved = ROUND(reserved + CASE id {} END, 6) WHERE id IN ({})"
)
_INSERT_RESERVATIONS = (
    "INSERT INTO budgets_reservation (request_id, organisation_id, agent_id, run_id, model,"
    " price_id, amount, status, created_at) VALUES {} RETURNING id, request_id"
)
_LINK = "INSERT INTO budgets_reservation_spends (reservation_id, spend_id) VALUES {}"


@dataclass(frozen=True)
class Settlement:
    """How one reservation ends: charged what ``usage`` cost at the price it started under
    (``model``: the model that answered; '' keeps the one asked for), charged its worst case
    (``worst``: it was never settled), or freed without a charge (``usage`` None: the request
    never reached the model)."""

    reservation_id: int
    usage: Usage | None
    model: str = ""
    outcome: str = Outcome.COMPLETE
    worst: bool = False
    at: datetime | None = None  # when the request ended (None: when it is written)
    spends: tuple[int, ...] | None = None  # the ids of the spends it held (None: read them)


def settle(
    reservation: Reservation, usage: Usage, *, model: str = "", outcome: str = Outcome.COMPLETE
) -> Charge:
    """Charge what the request used, at the price it started under, and free its reservation."""
    _settle_one(Settlement(reservation.pk, usage, model, outcome))
    return Charge.objects.get(
        request_id=Reservation.objects.filter(pk=reservation.pk).values("request_id")[:1]
    )


def release(reservation: Reservation) -> None:
    """Free a reservation without a charge (the request never reached the model)."""
    _settle_one(Settlement(reservation.pk, None))


def _settle_one(settlement: Settlement) -> None:
    if not settle_all([settlement]):
        found = Reservation.objects.get(pk=settlement.reservation_id)
        raise ValidationError(f"reservation {found.request_id} is {found.status} already")


STALE_MARGIN = timedelta(minutes=5)


def settle_stale(now: datetime | None = None) -> int:
    """Charge every reservation still open longer than a request through the gateway may take
    (COVEY_GATEWAY_MAX_REQUEST_SECONDS, and a margin) its worst case: its request may have
    reached the model, and nothing is left unmetered. Returns how many."""
    now = now or timezone.now()
    limit = timedelta(seconds=settings.COVEY_GATEWAY_MAX_REQUEST_SECONDS) + STALE_MARGIN
    stale = Reservation.objects.filter(status=Reservation.Status.OPEN, created_at__lt=now - limit)
    settled = 0
    for pk, request_id, amount in stale.values_list("pk", "request_id", "amount"):
        if settle_all([Settlement(pk, Usage(), outcome=Outcome.UNSETTLED, worst=True)]):
            logger.warning(
                "covey: request %s was never settled: charged its worst case, %s",
                request_id,
                dollars(amount, exact=True),
            )
            settled += 1
    return settled


def settle_all(
    settlements: Sequence[Settlement], prices: Mapping[int, Price] | None = None
) -> list[int]:
    """End these reservations in one transaction, in a few statements whatever their number
    (one more for each spend they held; the gateway's writer settles in batches): each open one
    is closed
    (settled, or released), charged (a ledger row) at its price row (from ``prices`` when it
    is there, as the gateway keeps them: by id), and its spends freed of what it held and
    charged what it cost, in the order of their ids (as reservations take them: no deadlock).
    A threshold of a spend's budget is told (:func:`budgets.alerts.tell_reached`) only when
    one is reached and not told. Returns the ids of the reservations ended; one not open (ended
    already: by the stale sweep, say) is left as it is."""
    wanted = {s.reservation_id: s for s in settlements}
    if not wanted:
        return []
    now = _datetime(timezone.now())
    closed: dict[int, tuple[Any, ...]] = {}  # id → the row's columns (_CLOSE's RETURNING)
    with transaction.atomic(), connection.cursor() as cursor:
        for status, ids in (
            (Reservation.Status.SETTLED, [k for k, s in wanted.items() if s.usage is not None]),
            (Reservation.Status.RELEASED, [k for k, s in wanted.items() if s.usage is None]),
        ):
            if ids:
                cursor.execute(_CLOSE.format(_marks(ids)), [status, now, *sorted(ids)])
                closed.update((row[0], row) for row in cursor.fetchall())
        if not closed:
            return []
        known = dict(prices or {})
        missing = {row[6] for row in closed.values()} - set(known)
        if missing:
            known.update(Price.objects.in_bulk(missing))
        costs: dict[int, Decimal] = {}
        amounts: dict[int, Decimal] = {}
        rows: list[Any] = []
        for pk, row in sorted(closed.items()):
            request_id, organisation_id, agent_id, run_id, model, price_id, held, started = row[1:]
            amounts[pk] = amount = _amount(held)
            settlement = wanted[pk]
            usage = settlement.usage
            if usage is None:
                costs[pk] = Decimal(0)
                continue
            cost = amount if settlement.worst else known[price_id].prices.cost(usage)
            if cost > amount:
                # Its worst case was not one: the budget may be passed by the difference.
                logger.warning(
                    "covey: request %s cost %s, more than the %s reserved for it",
                    request_id,
                    dollars(cost, exact=True),
                    dollars(amount, exact=True),
                )
            costs[pk] = cost
            rows += [request_id, organisation_id, agent_id, run_id, settlement.model or model,
                     usage.input, usage.cache_write_5m, usage.cache_write_1h, usage.cache_read,
                     usage.output, _decimal(cost), price_id, settlement.outcome, started,
                     _datetime(settlement.at) if settlement.at else now]  # fmt: skip
        if rows:
            values = ", ".join([f"({_marks(range(15))})"] * (len(rows) // 15))
            cursor.execute(_INSERT_CHARGES.format(values), rows)
        held_by: list[tuple[int, int]] = []  # (reservation id, spend id)
        unknown = []
        for pk in closed:
            spends = wanted[pk].spends
            if spends is None:
                unknown.append(pk)
            else:
                held_by += [(pk, spend_id) for spend_id in spends]
        if unknown:
            cursor.execute(_LINKS.format(_marks(unknown)), sorted(unknown))
            held_by += cursor.fetchall()
        freed: dict[int, list[Decimal]] = {}  # spend id → [reserved to free, spent to add]
        for reservation_id, spend_id in held_by:
            change = freed.setdefault(spend_id, [Decimal(0), Decimal(0)])
            change[0] += amounts[reservation_id]
            change[1] += costs[reservation_id]
        reached_now = []
        for spend_id, (freed_now, spent) in sorted(freed.items()):
            cursor.execute(_FREE, [_decimal(freed_now), _decimal(spent), spend_id])
            if spent and _reaches(*cursor.fetchone()):
                reached_now.append(spend_id)
        if reached_now:
            tell_reached(reached_now)
    return sorted(closed)


def _reaches(spent: Any, limit: Any, alerted: Any, thresholds: Any) -> bool:
    """Whether a spend (as the row's columns came back) reached a threshold not told."""
    told = set(_json(alerted))
    spend = Spend(spent=_amount(spent), limit=_amount(limit))
    return any(t not in told and reached(spend, t) for t in _json(thresholds))


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def _marks(ids: Iterable[Any]) -> str:
    return ", ".join("%s" for _ in ids)


def _amount(value: Any) -> Decimal:
    """An amount column as read: numeric on PostgreSQL, binary floating point on SQLite."""
    return Decimal(value).quantize(CENT_FRACTION) if isinstance(value, float) else Decimal(value)


# The SQL of settle_all(), in the SQL that PostgreSQL and SQLite (3.35 and later) share.
_CLOSE = (
    "UPDATE budgets_reservation SET status = %s, closed_at = %s WHERE id IN ({})"
    " AND status = 'open' RETURNING id, request_id, organisation_id, agent_id, run_id, model,"
    " price_id, amount, created_at"
)
_INSERT_CHARGES = (
    "INSERT INTO budgets_charge (request_id, organisation_id, agent_id, run_id, model,"
    " input_tokens, cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens,"
    " output_tokens, cost, price_id, outcome, started_at, at) VALUES {}"
)
_LINKS = (
    "SELECT reservation_id, spend_id FROM budgets_reservation_spends WHERE reservation_id IN ({})"
)
_FREE = (
    "UPDATE budgets_spend SET reserved = ROUND(reserved - %s, 6), spent = ROUND(spent + %s, 6)"
    ' WHERE id = %s RETURNING spent, "limit", alerted,'
    " (SELECT thresholds FROM budgets_budget WHERE budgets_budget.id = budgets_spend.budget_id)"
)
