"""The control plane's Prometheus metrics (/metrics), read from the database at each scrape.

Every web process answers for the whole control plane, so any one of them may be scraped and
they all agree: nothing is counted in a process's memory. Each family is one query over indexed
columns (or a bounded window of the last hour), so a scrape stays cheap however long covey has
run. The figures are gauges of what the database holds now; "last hour" families are windows
(their rate is the figure itself, not rate()).

The endpoint answers only a bearer token equal to COVEY_METRICS_TOKEN; without that setting it
refuses everyone (403), as the numbers name organisations, agents and runners.
"""

import statistics
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Min
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.http import require_safe
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from agents.models import Agent
from approvals.models import Request
from approvals.models import Status as RequestStatus
from budgets.metering import current_spends
from budgets.models import Budget
from egress.models import Decision
from runners.models import Runner
from runs.models import Run, RunStatus
from status import metrics_refusal

WINDOW = timedelta(hours=1)  # the "last hour" families
QUANTILES = (0.5, 0.9, 0.99)


class ControlPlaneCollector(Collector):
    """What the database holds now, as Prometheus families."""

    def collect(self) -> Iterator[Metric]:
        now = timezone.now()
        yield from runs(now)
        yield from decisions(now)
        yield from budgets(now)
        yield from homes()
        yield from runners()
        yield from requests()


def runs(now: Any) -> Iterator[Metric]:
    by_status = GaugeMetricFamily("covey_runs", "Runs in each status.", labels=["status"])
    counted = dict(Run.objects.values_list("status").annotate(n=Count("id")).order_by())
    for status in RunStatus:
        by_status.add_metric([status.value], counted.get(status.value, 0))
    yield by_status

    oldest = Run.objects.filter(status=RunStatus.QUEUED).aggregate(at=Min("created_at"))["at"]
    yield GaugeMetricFamily(
        "covey_run_oldest_queued_seconds",
        "How long the oldest queued run has waited for a runner (0: none waits).",
        value=(now - oldest).total_seconds() if oldest else 0.0,
    )

    started = Run.objects.filter(started_at__gte=now - WINDOW)
    waits = sorted(
        (begun - queued).total_seconds()
        for queued, begun in started.values_list("created_at", "started_at")
        if begun is not None
    )
    latency = GaugeMetricFamily(
        "covey_run_queue_to_running_seconds",
        "From queued to running, for the runs that started in the last hour (quantiles).",
        labels=["quantile"],
    )
    for q in QUANTILES:
        latency.add_metric([str(q)], _quantile(waits, q))
    yield latency
    yield GaugeMetricFamily(
        "covey_runs_started_last_hour", "Runs that started in the last hour.", value=len(waits)
    )


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted values, interpolated between the two nearest (NaN when there
    are none)."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[round(q * 100) - 1]


def decisions(now: Any) -> Iterator[Metric]:
    family = GaugeMetricFamily(
        "covey_egress_decisions_last_hour",
        "Egress decisions the proxies reported for the last hour, by organisation and reason"
        " ('allowed' or the deny code).",
        labels=["organisation", "reason"],
    )
    counted = (
        Decision.objects.filter(decided_at__gte=now - WINDOW)
        .values_list("agent__organisation__slug", "reason")
        .annotate(n=Count("id"))
        .order_by("agent__organisation__slug", "reason")
    )
    for organisation, reason, n in counted:  # no organisation: no agent was identified
        family.add_metric([organisation or "", reason], n)
    yield family


def budgets(now: Any) -> Iterator[Metric]:
    labels = ["organisation", "agent"]
    limit = GaugeMetricFamily(
        "covey_budget_limit_dollars",
        "Each budget's limit in its current period (agent '': the organisation's own).",
        labels=labels,
    )
    spent = GaugeMetricFamily(
        "covey_budget_spent_dollars", "What the agent spent in the period.", labels=labels
    )
    reserved = GaugeMetricFamily(
        "covey_budget_reserved_dollars",
        "What the agent's model requests under way hold against it.",
        labels=labels,
    )
    listed = list(Budget.objects.select_related("organisation", "agent").order_by("pk"))
    spends = current_spends(listed, now)
    for budget in listed:
        spend = spends[budget.pk]
        # An organisation's own budget (the cap on the sum of its agents) has agent="".
        names = [budget.organisation.slug, budget.agent.name if budget.agent else ""]
        limit.add_metric(names, float(spend.limit))
        spent.add_metric(names, float(spend.spent))
        reserved.add_metric(names, float(spend.reserved))
    yield from (limit, spent, reserved)


def homes() -> Iterator[Metric]:
    labels = ["organisation", "agent"]
    used = GaugeMetricFamily(
        "covey_home_bytes", "What each agent's home held when last measured.", labels=labels
    )
    files = GaugeMetricFamily(
        "covey_home_files", "Files in each agent's home when last measured.", labels=labels
    )
    quota = GaugeMetricFamily(
        "covey_home_quota_bytes", "Each agent's home quota (0: none).", labels=labels
    )
    measured = GaugeMetricFamily(
        "covey_home_measured_timestamp_seconds",
        "When each agent's home was last measured (Unix time).",
        labels=labels,
    )
    listed = Agent.objects.select_related("organisation").order_by("organisation__slug", "name")
    for agent in listed:
        names = [agent.organisation.slug, agent.name]
        quota.add_metric(names, agent.home_quota_bytes)
        if agent.home_measured_at is not None and agent.home_bytes is not None:
            used.add_metric(names, agent.home_bytes)
            files.add_metric(names, agent.home_files or 0)
            measured.add_metric(names, agent.home_measured_at.timestamp())
    yield from (used, files, quota, measured)


def runners() -> Iterator[Metric]:
    labels = ["organisation", "runner"]
    online = GaugeMetricFamily(
        "covey_runner_online", "1 when the runner sent a heartbeat recently.", labels=labels
    )
    paused = GaugeMetricFamily("covey_runner_paused", "1 when the runner is paused.", labels=labels)
    trusted = GaugeMetricFamily(
        "covey_runner_probe_passed",
        "1 when the runner is not under hard isolation, or its latest egress probe passed (it"
        " takes work when its host is also ready: covey_runner_ready).",
        labels=labels,
    )
    seen = GaugeMetricFamily(
        "covey_runner_last_seen_timestamp_seconds",
        "The runner's latest heartbeat (Unix time).",
        labels=labels,
    )
    ready = GaugeMetricFamily(
        "covey_runner_ready",
        "1 when the runner's host said at its last heartbeat that it can take work (absent:"
        " it has not said; its /readyz says why not).",
        labels=labels,
    )
    proxy_seen = GaugeMetricFamily(
        "covey_runner_proxy_last_seen_timestamp_seconds",
        "When the runner's egress proxy last asked for its policy (Unix time).",
        labels=labels,
    )
    listed = Runner.objects.select_related("organisation", "last_probe")
    for runner in listed.order_by("organisation__slug", "name"):
        names = [runner.organisation.slug, runner.name]
        online.add_metric(names, int(runner.online))
        paused.add_metric(names, int(runner.paused))
        trusted.add_metric(names, int(runner.probe_passed))
        if runner.last_seen_at is not None:
            seen.add_metric(names, runner.last_seen_at.timestamp())
        if runner.host_ready is not None:
            ready.add_metric(names, int(runner.host_ready))
        if runner.proxy_seen_at is not None:
            proxy_seen.add_metric(names, runner.proxy_seen_at.timestamp())
    yield from (online, paused, trusted, seen, ready, proxy_seen)


def requests() -> Iterator[Metric]:
    family = GaugeMetricFamily(
        "covey_requests_pending",
        "Requests (packages, routes) waiting for a person, by organisation.",
        labels=["organisation"],
    )
    counted = (
        Request.objects.filter(status=RequestStatus.PENDING)
        .values_list("organisation__slug")
        .annotate(n=Count("id"))
        .order_by("organisation__slug")
    )
    for organisation, n in counted:
        family.add_metric([organisation], n)
    yield family


registry = CollectorRegistry(auto_describe=False)
registry.register(ControlPlaneCollector())


@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """The families above in Prometheus's text format, for a bearer of COVEY_METRICS_TOKEN."""
    authorization = request.headers.get("Authorization", "")
    if refusal := metrics_refusal(authorization, settings.COVEY_METRICS_TOKEN):
        code, detail = refusal
        return JsonResponse({"detail": detail}, status=code)
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
