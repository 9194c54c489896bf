"""The control plane's /metrics: refused without the token, and what the database holds in
Prometheus's text format, parsed back as a scraper reads it."""

import math
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from agents.models import Agent
from approvals import services as approvals
from budgets.metering import current_spend
from budgets.models import Budget, Spend
from covey.metrics import _quantile
from runs import services as runs
from runs.models import Run, RunStatus
from tests.factories import (
    AgentFactory,
    WorkplaceFactory,
    decision_event,
    online_runner,
    record_events,
)

pytestmark = pytest.mark.django_db

TOKEN = "scrape-" + "s" * 32


@pytest.fixture
def token(settings):
    settings.COVEY_METRICS_TOKEN = TOKEN
    return TOKEN


def scrape(client) -> dict[tuple[str, tuple], float]:
    answer = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert answer.status_code == 200, answer.content
    assert answer["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(answer.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def decision(agent, reason, at):
    return decision_event(agent, allowed=reason == "allowed", reason=reason, at=at.timestamp())


def test_without_the_setting_everyone_is_refused(client, settings):
    settings.COVEY_METRICS_TOKEN = ""
    answer = client.get("/metrics", HTTP_AUTHORIZATION="Bearer ")
    assert answer.status_code == 403
    assert "COVEY_METRICS_TOKEN" in answer.json()["detail"]


def test_a_wrong_or_missing_token_is_refused(client, token, operator_client):
    for header in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"}, {"HTTP_AUTHORIZATION": TOKEN}):
        answer = client.get("/metrics", **header)
        assert answer.status_code == 401
        assert b"covey_" not in answer.content
    # An admin session is no token either.
    assert operator_client.get("/metrics").status_code == 401
    assert client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405


def test_it_reports_runs_decisions_budgets_homes_runners_and_requests(
    client, token, acme, globex, orders
):
    now = timezone.now()
    builder = AgentFactory(organisation=acme, name="Builder")
    packer = AgentFactory(
        organisation=acme, name="Packer", workplace=WorkplaceFactory(organisation=acme)
    )
    waiting = runs.queue_run(builder, "wait")
    Run.objects.filter(pk=waiting.pk).update(created_at=now - timedelta(seconds=90))
    for seconds in (2, 4, 6, 8, 40):  # started in the last hour after this long in the queue
        run = runs.queue_run(packer, "go")
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.SUCCEEDED,
            created_at=now - timedelta(minutes=10, seconds=seconds),
            started_at=now - timedelta(minutes=10),
            finished_at=now,
        )
    long_ago = runs.queue_run(packer, "old")
    Run.objects.filter(pk=long_ago.pk).update(
        status=RunStatus.FAILED,
        created_at=now - timedelta(hours=3, seconds=500),
        started_at=now - timedelta(hours=3),
    )
    record_events(
        [
            decision(builder, "allowed", now),
            decision(builder, "not-on-allowlist", now),
            decision(builder, "not-on-allowlist", now - timedelta(minutes=59)),
            decision(builder, "not-on-allowlist", now - timedelta(hours=2)),  # outside the hour
            decision(None, "proxy-auth-required", now),
        ]
    )
    budget = Budget.objects.create(organisation=acme, agent=builder, amount=Decimal(10))
    Budget.objects.create(organisation=acme, amount=Decimal(50))  # the organisation's own
    Spend.objects.filter(pk=current_spend(budget).pk).update(
        spent=Decimal("8.5"), reserved=Decimal("0.25")
    )
    Agent.objects.filter(pk=builder.pk).update(
        home_bytes=3 * 1024 * 1024, home_files=12, home_measured_at=now, home_quota_mb=100
    )
    online_runner(acme, "edge-1")
    online_runner(globex, "edge-2", paused=True)
    approvals.file_package(packer, "apt", "jq", reason="to parse JSON")

    got = scrape(client)

    def value(name, **labels):
        return got[(name, tuple(sorted(labels.items())))]

    assert value("covey_runs", status="queued") == 1
    assert value("covey_runs", status="succeeded") == 5
    assert value("covey_runs", status="failed") == 1
    assert value("covey_runs", status="running") == 0
    assert 90 <= value("covey_run_oldest_queued_seconds") < 120
    assert value("covey_runs_started_last_hour") == 5
    assert value("covey_run_queue_to_running_seconds", quantile="0.5") == pytest.approx(6)
    assert 8 < value("covey_run_queue_to_running_seconds", quantile="0.99") <= 40

    assert value("covey_egress_decisions_last_hour", organisation=acme.slug, reason="allowed") == 1
    denied = value(
        "covey_egress_decisions_last_hour", organisation=acme.slug, reason="not-on-allowlist"
    )
    assert denied == 2
    unknown = value(
        "covey_egress_decisions_last_hour", organisation="", reason="proxy-auth-required"
    )
    assert unknown == 1

    names = {"organisation": acme.slug, "agent": "Builder"}
    assert value("covey_budget_limit_dollars", **names) == 10
    assert value("covey_budget_spent_dollars", **names) == 8.5
    assert value("covey_budget_reserved_dollars", **names) == 0.25
    assert value("covey_budget_limit_dollars", organisation=acme.slug, agent="") == 50
    assert (
        "covey_budget_limit_dollars",
        tuple(sorted({**names, "agent": "Packer"}.items())),
    ) not in got

    assert value("covey_home_bytes", **names) == 3 * 1024 * 1024
    assert value("covey_home_files", **names) == 12
    assert value("covey_home_quota_bytes", **names) == 100 * 1024 * 1024
    assert value("covey_home_measured_timestamp_seconds", **names) == pytest.approx(now.timestamp())
    packer_names = {"organisation": acme.slug, "agent": "Packer"}
    assert ("covey_home_bytes", tuple(sorted(packer_names.items()))) not in got  # never measured
    assert value("covey_home_quota_bytes", **packer_names) > 0

    assert value("covey_runner_online", organisation=acme.slug, runner="edge-1") == 1
    assert value("covey_runner_paused", organisation=acme.slug, runner="edge-1") == 0
    assert value("covey_runner_paused", organisation=globex.slug, runner="edge-2") == 1
    assert value("covey_runner_probe_passed", organisation=acme.slug, runner="edge-1") == 1
    seen = value(
        "covey_runner_last_seen_timestamp_seconds", organisation=acme.slug, runner="edge-1"
    )
    assert seen == pytest.approx(now.timestamp(), abs=60)

    assert value("covey_requests_pending", organisation=acme.slug) == 1
    assert ("covey_requests_pending", (("organisation", globex.slug),)) not in got


def test_an_empty_control_plane_answers_with_every_family(client, token):
    got = scrape(client)
    assert got[("covey_runs", (("status", "queued"),))] == 0
    assert got[("covey_run_oldest_queued_seconds", ())] == 0
    assert math.isnan(got[("covey_run_queue_to_running_seconds", (("quantile", "0.5"),))])


def test_a_scrape_costs_the_same_queries_however_many_agents(client, token, acme):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            scrape(client)
        return len(captured)

    AgentFactory(organisation=acme)
    Budget.objects.create(organisation=acme, agent=AgentFactory(organisation=acme), amount=1)
    online_runner(acme, "edge-1")
    few = queries()
    for n in range(5):
        agent = AgentFactory(organisation=acme)
        Budget.objects.create(organisation=acme, agent=agent, amount=1)
        online_runner(acme, f"edge-more-{n}")
    assert queries() == few


def test_quantiles_are_of_the_values_given():
    assert _quantile([3.0], 0.5) == 3.0
    assert _quantile([1.0, 2.0, 3.0], 0.5) == 2.0
    assert _quantile(list(map(float, range(1, 101))), 0.9) == pytest.approx(90.1)
    assert math.isnan(_quantile([], 0.9))
