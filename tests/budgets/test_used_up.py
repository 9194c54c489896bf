"""A budget used up: what was spent leaves less than the least a request can cost. Found by the
refused request, it stops the agent's runs, refuses new ones and its egress, until the budget is
raised or its period ends. A request refused for what requests under way hold (busy), or too
large for what is left, never uses it up."""

from decimal import Decimal

import pytest
import time_machine
from celery import current_app
from django.core.exceptions import ValidationError

from budgets import metering, services
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
FULL = Decimal("0.015")  # what a request of 1000 tokens of Sonnet output costs


def spend_all(agent) -> None:
    """Spend the agent's budget of FULL (or its organisation's), whole: nothing is left."""
    held = metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=1000, request_id="all")
    metering.settle(held, Usage(output=1000))


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, list]]:
    """The tasks that would go to the broker (name, arguments); none is sent."""
    tasks: list[tuple[str, list]] = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args: tasks.append((name, args)))
    return tasks


def refused(agent) -> metering.Exhausted:
    with pytest.raises(metering.Exhausted) as caught:
        metering.reserve(agent, model=SONNET, input_bound=1000, max_tokens=1000, request_id="r")
    return caught.value


def test_the_refusal_that_finds_it_used_up_says_so_once(acme, sonnet_price):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, FULL)
    assert services.used_up(agent) == ""
    spend_all(agent)
    found = refused(agent)
    assert found.used_up is True and found.first is True
    assert (
        str(found) == f"the budget of agent {agent} is used up: $0.015 of $0.015 spent this period"
    )
    assert refused(agent).first is False  # already known
    assert services.used_up(agent) == (
        f"the budget of agent {agent} is used up this period ($0.015 of $0.015 spent, too little"
        " left for any request): raise it, or wait for the next period"
    )
    assert services.exhausted() == ({agent.pk}, set())
    services.set_budget(agent, FULL)  # saved again unchanged: still used up
    services.set_budget(agent, Decimal("0.005"))  # lowered: still used up
    assert services.exhausted() == ({agent.pk}, set())
    assert metering.current_spend(agent.budget).alerted == [50, 80, 100]
    services.set_budget(agent, Decimal(1))  # raised: it works again at once
    assert services.used_up(agent) == "" and services.exhausted() == (set(), set())
    metering.reserve(agent, model=SONNET, input_bound=1000, max_tokens=1000, request_id="ok")


def test_a_budget_raised_between_the_refusal_and_its_mark_is_not_used_up(
    acme, sonnet_price, monkeypatch
):
    """The mark is made after the refused transaction: a raise that commits in between wins
    (before, the stale refusal marked the raised budget used up and stopped its runs)."""
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, FULL)
    spend_all(agent)
    reserve_all = metering.reserve_all

    def raised_meanwhile(*args, **kwargs):
        results = reserve_all(*args, **kwargs)
        if isinstance(results[0], metering.Exhausted):
            services.set_budget(agent, Decimal(1))  # another person, just then
        return results

    monkeypatch.setattr(metering, "reserve_all", raised_meanwhile)
    found = refused(agent)
    assert found.used_up is True and found.first is False  # as read: not marked
    assert services.used_up(agent) == "" and services.exhausted() == (set(), set())


def test_a_new_period_ends_it_and_keeps_the_old_one(acme, sonnet_price):
    agent = AgentFactory(organisation=acme)
    with time_machine.travel("2026-11-30T12:00:00Z", tick=False):
        services.set_budget(agent, FULL, period="daily")
        spend_all(agent)
        refused(agent)
        assert services.used_up(agent)
    with time_machine.travel("2026-12-01T00:00:01Z", tick=False):
        assert services.used_up(agent) == ""
        assert services.exhausted() == (set(), set())
    assert agent.budget.spends.filter(exhausted_at__isnull=False).count() == 1  # history


def test_new_runs_are_refused_with_why(acme, sonnet_price):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, FULL)
    spend_all(agent)
    refused(agent)
    with pytest.raises(ValidationError, match="is used up this period"):
        run_services.queue_run(agent, "more work")
    assert not Run.objects.exists()


def test_the_organisations_budget_stops_every_agents_runs(
    acme, orders, sonnet_price, django_capture_on_commit_callbacks
):
    first, second = AgentFactory(organisation=acme), AgentFactory(organisation=acme)
    runner, _ = online_runner(acme)
    services.set_budget(acme, FULL)
    runs = []
    for agent in (first, second):
        run = run_services.queue_run(agent, "work")
        Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, runner=runner)
        runs.append(run)
    assert run_services.stop_over_budget(first.pk) == 0  # not used up: nothing stops
    spend_all(second)
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
    services.set_budget(agent, FULL)
    spend_all(agent)
    before = policy_fingerprint()
    refused(agent)
    assert policy_fingerprint() != before  # proxies load the change
    flags = {item["id"]: item["budget_exhausted"] for item in build_snapshot().to_json()["agents"]}
    assert flags == {agent.pk: True, other.pk: False}


@pytest.mark.django_db(transaction=True)  # the ledger's writer reserves in a thread of its own
def test_the_gateway_stops_the_runs_when_it_finds_the_budget_used_up(acme, sonnet_price, sent):

    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, FULL)
    spend_all(agent)
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
            ).result(10)
        assert (caught.value.status, caught.value.reason) == (402, "budget-exhausted")
    ledger.close()
    stopped = [(name, args) for name, args in sent if name == "runs.stop_over_budget"]
    assert stopped == [("runs.stop_over_budget", [agent.pk])]  # once


@pytest.mark.django_db(transaction=True)
def test_a_request_refused_for_what_others_hold_is_busy_and_uses_nothing_up(
    acme, sonnet_price, sent
):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.04"))
    ask = dict(model=SONNET, input_bound=0, max_tokens=1000)  # $0.015 at worst
    held = [metering.reserve(agent, request_id=f"{n}", **ask) for n in range(2)]
    with pytest.raises(metering.Busy) as busy:  # $0.01 free: the two hold $0.03
        metering.reserve(agent, request_id="third", **ask)
    assert str(busy.value) == (
        f"the budget of agent {agent} is busy: requests under way hold $0.03 of the $0.04 left"
        " this period, and this request may cost up to $0.015: retry when they end"
    )
    caller = Caller(agent.pk, acme.pk, None, "acme/a", keys={"anthropic": "k"})
    with pytest.raises(Refused) as answered:
        ledger = DjangoLedger()
        try:
            ledger.reserve(caller, vendor="anthropic", request_id="gw", **ask).result(10)
        finally:
            ledger.close()
    assert (answered.value.status, answered.value.reason) == (429, "budget-busy")
    assert answered.value.kind == "rate_limit_error" and answered.value.retry_after == 2
    spend = metering.current_spend(agent.budget)
    assert spend.exhausted_at is None and spend.alerted == [] and sent == []
    assert services.used_up(agent) == "" and services.exhausted() == (set(), set())
    metering.settle(held[0], Usage(output=100))  # one ends, for less than its worst case
    metering.reserve(agent, request_id="retried", **ask)  # and the same request fits


@pytest.mark.django_db(transaction=True)
def test_a_request_larger_than_what_is_left_is_refused_without_using_it_up(
    acme, sonnet_price, sent
):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.01"))
    too_large = refused(agent)  # $0.021 at worst
    assert (too_large.used_up, too_large.first) == (False, False)
    assert str(too_large) == (
        f"the budget of agent {agent} has $0.01 left this period; this request may cost up to"
        " $0.021: ask for fewer output tokens, or raise the budget"
    )
    caller = Caller(agent.pk, acme.pk, None, "acme/a", keys={"anthropic": "k"})
    ledger = DjangoLedger()
    with pytest.raises(Refused) as answered:
        ledger.reserve(
            caller, vendor="anthropic", model=SONNET, input_bound=1000, max_tokens=1000,
            request_id="gw",
        ).result(10)  # fmt: skip
    ledger.close()
    assert (answered.value.status, answered.value.reason) == (402, "budget-exhausted")
    assert services.used_up(agent) == "" and sent == []  # its runs go on
    metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=600, request_id="smaller")


def test_every_agent_may_reach_the_gateway_its_runs_are_given(settings, acme):
    AgentFactory(organisation=acme)
    before = policy_fingerprint()
    settings.COVEY_MODEL_GATEWAY_URL = "http://172.17.0.1:8002"
    assert build_snapshot().to_json()["built_in"] == [
        {"host": "172.17.0.1", "port": 8002, "name": "model gateway"}
    ]
    assert policy_fingerprint() != before  # proxies load the change
    settings.COVEY_MODEL_GATEWAY_URL = ""
    assert build_snapshot().to_json()["built_in"] == []


def test_a_budget_lowered_to_what_was_spent_is_used_up_at_once(
    acme, sonnet_price, sent, django_capture_on_commit_callbacks
):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal(1))
    held = metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=10, request_id="a")
    metering.settle(held, Usage(output=20_000))  # $0.30
    services.set_budget(agent, Decimal("0.50"))  # lowered, still above what was spent
    assert services.used_up(agent) == "" and not [n for n, _ in sent if n.startswith("runs.")]
    with django_capture_on_commit_callbacks(execute=True):
        services.set_budget(agent, Decimal("0.30"))  # lowered to what was spent
    assert "the budget of agent" in services.used_up(agent)
    assert ("runs.stop_over_budget", [agent.pk]) in sent
    assert metering.current_spend(agent.budget).alerted == [50, 80, 100]
    organisation_wide = services.set_budget(acme, Decimal(5))
    with django_capture_on_commit_callbacks(execute=True):
        services.set_budget(acme, Decimal("0.10"))  # the organisation's, below its agents' sum
    assert metering.current_spend(organisation_wide).exhausted_at is not None
    assert [name for name, _ in sent].count("runs.stop_over_budget") == 2  # every agent's runs
