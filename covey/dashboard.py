"""The admin index's dashboard: what wants a person now, across every app, for the user's
organisations (a superuser's: all). Each section links to its list; each is one or two queries
over indexed columns, so the index stays fast however long covey has run.

Registered as the template library ``covey_dashboard`` (settings.TEMPLATES): covey's own package
sits above the apps, so it is the one place that may read all of them.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django import template
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.text import Truncator

from approvals.models import Request
from approvals.models import Status as RequestStatus
from approvals.services import decidable
from budgets.metering import current_spends
from budgets.models import Budget
from budgets.services import spend_text
from covey.display import linked, seconds
from egress.models import Decision
from organisations.admin import may_view
from runners.models import Runner
from runs.models import FINISHED, Run, RunStatus

register = template.Library()

RECENT = timedelta(hours=24)  # "recently" failed runs and denials
SHOWN = 8  # rows per section; the link leads to all of them
NEAR = Decimal("0.8")  # an agent is near its budget from this share on


@dataclass
class Section:
    """One module of the dashboard: a title with a count, rows, and where the rest are."""

    key: str
    title: str
    count: int
    link: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    empty: str = ""


@register.simple_tag(takes_context=True)
def dashboard(context: dict[str, Any]) -> SafeString:
    """The dashboard's sections for the request's user, rendered in the admin's look."""
    request = context["request"]
    user = request.user
    now = timezone.now()
    builders: list[tuple[Callable[[], Section], str]] = [
        (lambda: pending_requests(user), "approvals.request"),
        (lambda: runs_now(user), "runs.run"),
        (lambda: recently_failed(user, now), "runs.run"),
        (lambda: budgets_near(user), "budgets.budget"),
        (lambda: runners(user, now), "runners.runner"),
        (lambda: denials(user, now), "egress.decision"),
    ]
    # Each section needs the permission to view what it shows, as its list does.
    shown = [build() for build, model in builders if may_view(request, model)]
    return render_to_string("admin/covey_dashboard.html", {"sections": shown})


def _short(text: str) -> str:
    """A long text cut to fit a row (its page has it whole)."""
    return Truncator(text).chars(90)


def _list(name: str, **filters: Any) -> str:
    url = reverse(f"admin:{name}_changelist")
    return f"{url}?{urlencode(filters)}" if filters else url


def _change(name: str, pk: Any) -> str:
    return reverse(f"admin:{name}_change", args=[pk])


def pending_requests(user: Any) -> Section:
    pending = Request.objects.for_user(user).filter(status=RequestStatus.PENDING)
    shown = list(
        pending.select_related("agent__organisation", "organisation").order_by("-created_at")[
            :SHOWN
        ]
    )
    allowed = decidable(user, shown)
    rows = [
        {
            # Who may decide goes to the decision; anyone else to the request's page.
            "link": reverse("admin:approvals_request_decide", args=[r.pk])
            if r.pk in allowed
            else _change("approvals_request", r.pk),
            "cells": [r.agent, _short(f"{r.kind} {r.thing}"), seconds(r.created_at)],
        }
        for r in shown
    ]
    return Section(
        "requests",
        "Pending requests",
        pending.count(),
        _list("approvals_request", status__exact=RequestStatus.PENDING),
        rows,
        "Nothing waits for a decision.",
    )


def runs_now(user: Any) -> Section:
    going = Run.objects.for_user(user).exclude(status__in=FINISHED)
    rows = [
        {
            "link": _change("runs_run", run.pk),
            "cells": [run.short_id, run.agent, run.get_status_display(), seconds(run.created_at)],
        }
        for run in going.select_related("agent__organisation").order_by("created_at")[:SHOWN]
    ]
    unfinished = ",".join(status for status in RunStatus if status not in FINISHED)
    return Section(
        "runs-now",
        "Runs now",
        going.count(),
        _list("runs_run", status__in=unfinished),
        rows,
        "No run is going.",
    )


def recently_failed(user: Any, now: Any) -> Section:
    failed = Run.objects.for_user(user).filter(
        status__in=[RunStatus.FAILED, RunStatus.TIMED_OUT], finished_at__gte=now - RECENT
    )
    rows = [
        {
            "link": _change("runs_run", run.pk),
            "cells": [
                run.short_id,
                run.agent,
                # Whole: a refused run says what to do and where, the admin path a link.
                format_html(
                    '<span class="covey-message">{}</span>', linked(run.status_detail or run.status)
                ),
                seconds(run.finished_at),
            ],
        }
        for run in failed.select_related("agent__organisation").order_by("-finished_at")[:SHOWN]
    ]
    return Section(
        "failed",
        "Failed in the last 24 hours",
        failed.count(),
        _list(
            "runs_run",
            status__in=f"{RunStatus.FAILED},{RunStatus.TIMED_OUT}",
            finished_at__gte=(now - RECENT).isoformat(),
        ),
        rows,
        "No run failed.",
    )


def budgets_near(user: Any) -> Section:
    """Budgets at NEAR of their limit or more this period (spent and held), or used up."""
    budgets = list(
        Budget.objects.for_user(user).select_related("agent__organisation", "organisation")
    )
    spends = current_spends(budgets)
    near = []
    for budget in budgets:
        spend = spends[budget.pk]
        used = spend.spent + spend.reserved
        if spend.exhausted_at is not None or (spend.limit > 0 and used >= spend.limit * NEAR):
            share = used / spend.limit if spend.limit > 0 else Decimal(1)
            near.append((share, budget, spend))
    near.sort(key=lambda item: item[0], reverse=True)
    rows = [
        {
            "link": _change("budgets_budget", budget.pk),
            "cells": [
                budget.agent or f"{budget.organisation} (all agents)",
                spend_text(budget, spend),
            ],
        }
        for _, budget, spend in near[:SHOWN]
    ]
    return Section(
        "budgets",
        "Near or over budget",
        len(near),
        _list("budgets_budget"),
        rows,
        "Every budget has more than a fifth left.",
    )


def runner_state(runner: Runner, now: Any) -> str:
    """'paused', 'probe failed', 'stale since …', 'never seen', 'not ready: …'
    or 'online'."""
    if runner.paused:
        return "paused"
    if not runner.probe_passed:  # hard isolation without a passed probe: it gets no work
        return "probe failed" if runner.last_probe is not None else "not probed yet"
    if runner.last_seen_at is None:
        return "never seen"
    if not runner.online:
        minutes = int((now - runner.last_seen_at).total_seconds() // 60)
        return f"stale: silent for {minutes} min"
    if runner.host_ready is False:  # its host says why it cannot take work
        return f"not ready: {runner.host_problem}"
    return "online"


def runners(user: Any, now: Any) -> Section:
    listed = Runner.objects.for_user(user).select_related("organisation", "last_probe")
    every = list(listed.order_by("organisation__name", "name"))
    # What wants a look first: anything but online.
    every.sort(key=lambda runner: runner_state(runner, now) == "online")
    rows = [
        {
            "link": _change("runners_runner", runner.pk),
            "cells": [runner.name, runner.organisation, runner_state(runner, now)],
            "alert": runner_state(runner, now) != "online",
        }
        for runner in every[:SHOWN]
    ]
    return Section("runners", "Runners", len(every), _list("runners_runner"), rows, "No runner.")


def denials(user: Any, now: Any) -> Section:
    refused = Decision.objects.for_user(user).filter(allowed=False, decided_at__gte=now - RECENT)
    rows = [
        {
            "link": _change("egress_decision", decision.pk),
            "cells": [
                decision.agent or decision.username or "unidentified",
                f"{decision.host}:{decision.port}",
                decision.reason,
                seconds(decision.decided_at),
            ],
        }
        for decision in refused.select_related("agent__organisation")[:SHOWN]
    ]
    return Section(
        "denials",
        "Egress denials in the last 24 hours",
        refused.count(),
        _list("egress_decision", allowed__exact=0, decided_at__gte=(now - RECENT).isoformat()),
        rows,
        "Nothing was refused.",
    )
