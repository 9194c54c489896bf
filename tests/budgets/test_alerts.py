"""Alerts: each threshold of a budget told once per period, by email to the organisation's
admins and to its webhook (``budget.threshold``), when a charge reaches it or the budget is
found used up."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest
import time_machine
from django.core import mail

from budgets import alerts, metering, services
from budgets.models import Spend
from budgets.tasks import alert
from budgets.usage import Usage
from organisations import webhooks
from organisations.models import Membership, Role
from tests.factories import AgentFactory, UserFactory

pytestmark = pytest.mark.django_db

SONNET = "claude-sonnet-4-5-20250929"
DOLLAR = Usage(output=66_667)  # $1.000005 of Sonnet 4.5 output ($15 per million)


@pytest.fixture
def sent(monkeypatch):
    """Tasks sent: the alert's run here and now, as the worker would; the rest recorded."""
    from celery import current_app

    sent = []

    def send_task(name, args):
        sent.append((name, args))
        if name == alerts.ALERT:
            alert(*args)

    monkeypatch.setattr(current_app, "send_task", send_task)
    return sent


@pytest.fixture
def agent(acme, sonnet_price):
    for name, role in [("ada", Role.ADMIN), ("val", Role.VIEWER)]:
        user = UserFactory(username=name, email=f"{name}@example.test")
        Membership.objects.create(organisation=acme, user=user, role=role)
    agent = AgentFactory(organisation=acme, name="Spender")
    services.set_budget(agent, Decimal(10), thresholds=[50, 80, 100])
    return agent


def spend(agent, usage: Usage, request_id: str) -> None:
    held = metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=1, request_id=request_id)
    metering.settle(held, usage)


def told(agent) -> list[int]:
    """The thresholds told in the current period."""
    return metering.current_spend(agent.budget).alerted


def test_a_threshold_reached_is_told_once_to_the_admins(
    agent, sent, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        for n in range(4):
            spend(agent, DOLLAR, f"under-{n}")
    assert told(agent) == [] and mail.outbox == []
    with django_capture_on_commit_callbacks(execute=True):
        spend(agent, DOLLAR, "fifth")  # $5.000025: 50 %
        spend(agent, Usage(output=100), "more")  # still 50 %: told already
    assert told(agent) == [50]
    (message,) = mail.outbox
    assert message.to == ["ada@example.test"]  # admins only
    assert message.subject == f"covey: the budget of agent {agent} reached 50 %"
    assert "$5.00 of $10.00 spent" in message.body  # as it is when the email goes
    assert f"/admin/budgets/budget/{agent.budget.pk}/change/" in message.body
    assert [name for name, _ in sent] == [alerts.ALERT]


def test_two_thresholds_reached_at_once_are_both_told(
    agent, sent, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        spend(agent, Usage(output=8 * 66_667), "big")  # $8.00004: 50 % and 80 %
    assert told(agent) == [50, 80]
    assert [args[1] for name, args in sent if name == alerts.ALERT] == [[50, 80]]
    (message,) = mail.outbox  # one message for one change
    assert message.subject == f"covey: the budget of agent {agent} reached 80 %"


def test_a_budget_found_used_up_tells_every_threshold_up_to_100(
    agent, sent, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        spend(agent, Usage(output=6 * 66_667), "six")  # 60 %
        with pytest.raises(metering.Exhausted) as too_large:  # $4.5 of output; $4 left
            metering.reserve(
                agent, model=SONNET, input_bound=0, max_tokens=300_000, request_id="big"
            )
    assert not too_large.value.used_up and told(agent) == [50]  # a smaller one still fits
    with django_capture_on_commit_callbacks(execute=True):
        spend(agent, Usage(output=266_664), "rest")  # $9.99999: less than any request left
        with pytest.raises(metering.Exhausted):
            metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=1, request_id="1")
    assert told(agent) == [50, 80, 100]  # used up: every threshold up to 100 % is reached
    assert [m.subject for m in mail.outbox] == [
        f"covey: the budget of agent {agent} reached 50 %",
        f"covey: the budget of agent {agent} reached 80 %",
        f"covey: the budget of agent {agent} is used up",
    ]
    assert "is used up: $10.00 of $10.00 spent" in mail.outbox[-1].body  # in cents


def test_the_webhook_hears_of_it(agent, acme, sent, django_capture_on_commit_callbacks):
    webhooks.set_webhook(acme, "https://hooks.example.org/covey")
    with django_capture_on_commit_callbacks(execute=True):
        spend(agent, Usage(output=5 * 66_667), "half")
    (delivery,) = [args for name, args in sent if name == webhooks.DELIVER]
    organisation, event, _, _, data = delivery
    assert (organisation, event) == (acme.pk, "budget.threshold")
    assert data["threshold"] == 50 and data["agent"]["slug"] == agent.slug
    assert (data["spent"], data["limit"], data["used_up"]) == ("5.000025", "10.000000", False)


def test_a_new_period_or_a_raised_budget_tells_again(
    agent, sent, django_capture_on_commit_callbacks
):
    with time_machine.travel(datetime(2026, 11, 20, tzinfo=UTC)):
        with django_capture_on_commit_callbacks(execute=True):
            spend(agent, Usage(output=5 * 66_667), "november")
        assert told(agent) == [50]
        services.set_budget(agent, Decimal(20), thresholds=[50, 80, 100])
        assert told(agent) == []  # 25 % of the new limit
        with django_capture_on_commit_callbacks(execute=True):
            spend(agent, Usage(output=5 * 66_667), "november-2")
        assert told(agent) == [50]
    with time_machine.travel(datetime(2026, 12, 2, tzinfo=UTC)):
        with django_capture_on_commit_callbacks(execute=True):
            spend(agent, Usage(output=10 * 66_667), "december")
        december = Spend.objects.get(budget__agent=agent, starts_at__month=12)
        assert december.alerted == [50]
    november = Spend.objects.get(budget__agent=agent, starts_at__month=11)
    assert november.alerted == [50] and november.spent == Decimal("10.000050")  # kept
    assert len(mail.outbox) == 3
