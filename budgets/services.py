"""Budgets: set one (an agent's or an organisation's), and read where they stand (used up,
usage, the words lists show). Metering requests against them is budgets/metering.py; their
alerts budgets/alerts.py; the model gateway's tokens and the vendors' keys budgets/keys.py."""

from datetime import datetime
from decimal import Decimal
from functools import partial
from typing import Any, cast

from celery import current_app
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Count, Field, Q, Sum
from django.utils import timezone

from agents.models import Agent
from budgets import periods
from budgets.alerts import check_thresholds, reached, tell_reached
from budgets.metering import budgets_of, current_spend, current_spends, zone
from budgets.models import Budget, Charge, Spend
from budgets.money import dollars
from organisations.models import Organisation

STOP_OVER_BUDGET = "runs.stop_over_budget"  # the task that stops a used-up budget's runs


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
    """The agents whose own budget, and the organisations whose budget, is used up now: a used
    up spend of the budget's current period whose window holds now.

    One statement written out: every proxy on the control plane's database asks this at each
    poll, and building the query through the ORM cost more than running it."""
    q = connection.ops.quote_name
    spend, budget = Spend._meta, Budget._meta

    def s(name: str) -> str:
        return f"s.{q(str(cast('Field[Any, Any]', spend.get_field(name)).column))}"

    def b(name: str) -> str:
        return f"b.{q(str(cast('Field[Any, Any]', budget.get_field(name)).column))}"

    now = cast("Field[Any, Any]", spend.get_field("starts_at")).get_db_prep_value(
        timezone.now(), connection
    )
    sql = (
        f"SELECT {b('agent')}, {b('organisation')} FROM {q(spend.db_table)} s"  # noqa: S608
        f" JOIN {q(budget.db_table)} b ON {b('id')} = {s('budget')}"
        f" WHERE {s('exhausted_at')} IS NOT NULL AND {s('period')} = {b('period')}"
        f" AND {s('starts_at')} <= %s AND ({s('ends_at')} IS NULL OR {s('ends_at')} > %s)"
    )
    params: list[Any] = [now, now]
    if organisation_id is not None:
        sql += f" AND {b('organisation')} = %s"
        params.append(organisation_id)
    agents: set[int] = set()
    organisations: set[int] = set()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for agent_id, org_id in cursor.fetchall():
            if agent_id is None:
                organisations.add(org_id)
            else:
                agents.add(agent_id)
    return agents, organisations
