"""A budget used up: found by the refused request, it stops the agent's runs, refuses new ones
and its egress, until the budget is raised or its period ends."""

from decimal import Decimal

import pytest
import time_machine
from celery import current_app
from django.core.exceptions import ValidationError

from budgets import services
from budgets.gateway.api import Refused
from budgets.gateway.ledger import DjangoLedger
from budgets.gateway.server import Caller
from budgets.usage import Usage
from egress.services import build_snapshot, policy_fingerprint
from runs import services as run_services
from runs.models import Run, RunStatus
from tests.factories import AgentFactory, online_runner

pytestmark = pytest.mark.django_db

SONNET = "claude-sonnet-4-5-20250929"


def refused(agent) -> services.Exhausted:
    with pytest.raises(services.Exhausted) as caught:
        services.reserve(agent, model=SONNET, input_bound=1000, max_tokens=1000, request_id="r")
    return caught.value


def test_the_refusal_that_finds_it_used_up_says_so_once(acme, sonnet_price):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.01"))
    assert services.used_up(agent) == ""
    assert refused(agent).first is True
    assert refused(agent).first is False  # already known
    assert "the budget of agent" in services.used_up(agent)
    assert services.exhausted() == ({agent.pk}, set())
    services.set_budget(agent, Decimal("0.01"))  # saved again unchanged: still used up
    services.set_budget(agent, Decimal("0.005"))  # lowered: still used up
    assert services.exhausted() == ({agent.pk}, set())
    assert services.current_spend(agent.budget).alerted == [50, 80, 100]
    services.set_budget(agent, Decimal(1))  # raised: it works again at once
    assert services.used_up(agent) == "" and services.exhausted() == (set(), set())
    services.reserve(agent, model=SONNET, input_bound=1000, max_tokens=1000, request_id="ok")


def test_a_new_period_ends_it_and_keeps_the_old_one(acme, sonnet_price):
    agent = AgentFactory(organisation=acme)
    with time_machine.travel("2026-11-30T12:00:00Z", tick=False):
        services.set_budget(agent, Decimal("0.01"), period="daily")
        refused(agent)
        assert services.used_up(agent)
    with time_machine.travel("2026-12-01T00:00:01Z", tick=False):
        assert services.used_up(agent) == ""
        assert services.exhausted() == (set(), set())
    assert agent.budget.spends.filter(exhausted_at__isnull=False).count() == 1  # history


def test_new_runs_are_refused_with_why(acme, sonnet_price):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.01"))
    refused(agent)
    with pytest.raises(ValidationError, match="is used up this period"):
        run_services.queue_run(agent, "more work")
    assert not Run.objects.exists()


def test_the_organisations_budget_stops_every_agents_runs(
    acme, orders, sonnet_price, django_capture_on_commit_callbacks
):
    first, second = AgentFactory(organisation=acme), AgentFactory(organisation=acme)
    runner, _ = online_runner(acme)
    services.set_budget(acme, Decimal("0.01"))
    runs = []
    for agent in (first, second):
        run = run_services.queue_run(agent, "work")
        Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, runner=runner)
        runs.append(run)
    assert run_services.stop_over_budget(first.pk) == 0  # not used up: nothing stops
    refused(first)
    with django_capture_on_commit_callbacks(execute=True):
        assert run_services.stop_over_budget(first.pk) == 2
    for run in runs:
        run.refresh_from_db()
        assert run.cancel_requested_at is not None
        assert "budget of its organisation is used up" in run.status_detail
    assert sorted(kind for kind, _, _ in orders if kind == "cancel") == ["cancel", "cancel"]


def test_the_proxy_is_told_and_refuses_the_agents_egress(acme, sonnet_price):
    agent, other = AgentFactory(organisation=acme), AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.01"))
    before = policy_fingerprint()
    refused(agent)
    assert policy_fingerprint() != before  # proxies load the change
    flags = {item["id"]: item["budget_exhausted"] for item in build_snapshot()["agents"]}
    assert flags == {agent.pk: True, other.pk: False}


def test_the_gateway_stops_the_runs_when_it_finds_the_budget_used_up(
    acme, sonnet_price, monkeypatch
):
    from celery import current_app

    sent = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args: sent.append((name, args)))
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.01"))
    caller = Caller(agent.pk, acme.pk, None, "acme/a", keys={"anthropic": "k"})
    ledger = DjangoLedger()
    for n in range(2):
        with pytest.raises(Refused) as caught:
            ledger.reserve(
                caller,
                vendor="anthropic",
                model=SONNET,
                input_bound=1000,
                max_tokens=1000,
                request_id=f"{n}",
            )
        assert (caught.value.status, caught.value.reason) == (402, "budget-exhausted")
    assert sent == [("runs.stop_over_budget", [agent.pk])]  # once


def test_every_agent_may_reach_the_gateway_its_runs_are_given(settings, acme):
    AgentFactory(organisation=acme)
    before = policy_fingerprint()
    settings.COVEY_MODEL_GATEWAY_URL = "http://172.17.0.1:8002"
    assert build_snapshot()["built_in"] == [
        {"host": "172.17.0.1", "port": 8002, "name": "model gateway"}
    ]
    assert policy_fingerprint() != before  # proxies load the change
    settings.COVEY_MODEL_GATEWAY_URL = ""
    assert build_snapshot()["built_in"] == []


def test_a_budget_lowered_to_what_was_spent_is_used_up_at_once(
    acme, sonnet_price, monkeypatch, django_capture_on_commit_callbacks
):
    sent = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args: sent.append((name, args)))
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal(1))
    held = services.reserve(agent, model=SONNET, input_bound=0, max_tokens=10, request_id="a")
    services.settle(held, Usage(output=20_000))  # $0.30
    services.set_budget(agent, Decimal("0.50"))  # lowered, still above what was spent
    assert services.used_up(agent) == "" and not [n for n, _ in sent if n.startswith("runs.")]
    with django_capture_on_commit_callbacks(execute=True):
        services.set_budget(agent, Decimal("0.30"))  # lowered to what was spent
    assert "the budget of agent" in services.used_up(agent)
    assert ("runs.stop_over_budget", [agent.pk]) in sent
    assert services.current_spend(agent.budget).alerted == [50, 80, 100]
    organisation_wide = services.set_budget(acme, Decimal(5))
    with django_capture_on_commit_callbacks(execute=True):
        services.set_budget(acme, Decimal("0.10"))  # the organisation's, below its agents' sum
    assert services.current_spend(organisation_wide).exhausted_at is not None
    assert [name for name, _ in sent].count("runs.stop_over_budget") == 2  # every agent's runs
