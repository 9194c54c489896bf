"""Budgets in the admin: money shown in dollars (as on the dashboard and in the agent list),
and the alert thresholds as three number fields."""

from decimal import Decimal

import pytest
from django.contrib.auth.models import Permission

from budgets import metering, services
from budgets.models import Budget
from budgets.usage import Usage
from tests.factories import AgentFactory

pytestmark = pytest.mark.django_db

SONNET = "claude-sonnet-4-5-20250929"


def budget_form(budget: Budget, **alerts: str) -> dict[str, str]:
    return {
        "amount": str(budget.amount), "period": budget.period, "spends-TOTAL_FORMS": "0",
        "spends-INITIAL_FORMS": "0", **alerts,
    }  # fmt: skip


def test_money_is_in_dollars_on_the_dashboard_and_every_list_alike(
    operator_client, acme, sonnet_price
):
    agent = AgentFactory(organisation=acme, name="Builder")
    budget = services.set_budget(agent, Decimal(10))
    held = metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=10, request_id="a")
    metering.settle(held, Usage(output=541_563))  # $8.123445: 81 %, near its budget
    metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=100, request_id="b")
    pages = {
        path: operator_client.get(path).text
        for path in ("/admin/", "/admin/budgets/budget/", "/admin/agents/agent/")
    }
    for path, text in pages.items():
        assert "8.123445" not in text and "10.000000" not in text, path
    spent = "$8.12 of $10.00 this month (81 %)"
    assert spent in pages["/admin/"] and spent in pages["/admin/agents/agent/"]
    listing = pages["/admin/budgets/budget/"]
    assert "$10.00" in listing and "$8.12 ($0.0015 held)" in listing and "$1.88" in listing
    change = operator_client.get(f"/admin/budgets/budget/{budget.pk}/change/").text
    assert 'value="10.00"' in change  # the amount's field
    assert "$8.123445" in change and "$0.0015" in change  # the period's row: exact
    prices = operator_client.get("/admin/budgets/price/").text
    assert "$3.00" in prices and "$0.30" in prices and "3.000000" not in prices
    charges = operator_client.get("/admin/budgets/charge/").text
    assert "$8.123445" in charges  # a row of the ledger: every digit


def test_the_thresholds_are_three_number_fields(operator_client, acme):
    agent = AgentFactory(organisation=acme)
    budget = services.set_budget(agent, Decimal(5), thresholds=[25, 75])
    change = f"/admin/budgets/budget/{budget.pk}/change/"
    page = operator_client.get(change).text
    assert 'name="alert_1" value="25"' in page and 'name="alert_2" value="75"' in page
    assert 'name="alert_3"' in page and 'name="thresholds"' not in page  # not JSON
    form = budget_form(budget, alert_1="90", alert_2="", alert_3="50")
    saved = operator_client.post(change, form)
    assert saved.status_code == 302, saved.text
    budget.refresh_from_db()
    assert budget.thresholds == [50, 90]  # sorted, the empty one dropped
    bad = operator_client.post(change, budget_form(budget, alert_1="1001"))
    assert "Ensure this value is less than or equal to 1000." in bad.text
    budget.refresh_from_db()
    assert budget.thresholds == [50, 90]


def test_thresholds_beyond_three_set_through_the_api_are_kept(operator_client, acme):
    agent = AgentFactory(organisation=acme)
    budget = services.set_budget(agent, Decimal(5), thresholds=[25, 50, 75, 100])
    change = f"/admin/budgets/budget/{budget.pk}/change/"
    assert "also alerts at 100 % (set through the API): kept" in operator_client.get(change).text
    operator_client.post(change, budget_form(budget, alert_1="30", alert_2="50", alert_3="75"))
    budget.refresh_from_db()
    assert budget.thresholds == [30, 50, 75, 100]


def test_who_may_only_view_a_budget_sees_its_amount_and_thresholds_on_one_line(client, acme, vera):
    vera.is_staff = True
    vera.save()
    vera.user_permissions.add(Permission.objects.get(codename="view_budget"))
    agent = AgentFactory(organisation=acme)
    budget = services.set_budget(agent, Decimal(5), thresholds=[50, 80])
    client.force_login(vera)
    page = client.get(f"/admin/budgets/budget/{budget.pk}/change/").text
    assert "$5.00" in page and "50 %, 80 %" in page and 'name="alert_1"' not in page
