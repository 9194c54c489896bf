"""Budget alerts: a threshold of a budget's period reached (or the budget found used up) is
marked told in the transaction that reached it, emailed to the organisation's admins (a Celery
task, budgets/tasks.py) and posted to its webhook."""

import logging
from collections.abc import Iterable
from functools import partial
from typing import Any

from celery import current_app
from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.urls import reverse

from budgets.models import DEFAULT_THRESHOLDS, Spend
from budgets.money import dollars
from organisations import webhooks
from organisations.models import Membership, Role

logger = logging.getLogger(__name__)


ALERT = "budgets.alert"  # the task that emails an alert (budgets/tasks.py)
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
