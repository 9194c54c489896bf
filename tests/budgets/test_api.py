"""Budgets and the ledger through the API, and in the admin."""

from decimal import Decimal

import pytest

from budgets import metering, services
from budgets.models import Budget
from budgets.usage import Usage
from tests.agents.test_admin_browser import browser, page  # noqa: F401 (fixtures)
from tests.factories import AgentFactory

SONNET = "claude-sonnet-4-5-20250929"


@pytest.mark.django_db
def test_admins_set_budgets_and_everyone_in_the_organisation_reads_the_spend(
    api, acme, alice, vera, gary
):
    agent = AgentFactory(organisation=acme)
    made = api(alice).post(
        "/api/v1/budgets/",
        {"organisation": acme.pk, "agent": agent.pk, "amount": "2.50", "period": "daily"},
        format="json",
    )
    assert made.status_code == 201, made.content
    budget = made.json()
    assert (budget["amount"], budget["period"], budget["thresholds"]) == (
        "2.500000",
        "daily",
        [50, 80, 100],
    )
    held = metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=1000, request_id="r1")
    metering.settle(held, Usage(output=100))  # $0.0015
    shown = api(vera).get(f"/api/v1/budgets/{budget['id']}/").json()
    assert shown["current"]["spent"] == "0.001500"
    assert shown["current"]["remaining"] == "2.498500"
    # A second budget for the agent is refused, naming the first, which is changed in place;
    # viewers and other organisations cannot.
    again = api(alice).post(
        "/api/v1/budgets/",
        {"organisation": acme.pk, "agent": agent.pk, "amount": "5"},
        format="json",
    )
    assert again.status_code == 400
    assert f"PATCH /api/v1/budgets/{budget['id']}/" in again.json()["agent"][0]
    changed = api(alice).patch(f"/api/v1/budgets/{budget['id']}/", {"amount": "5"}, format="json")
    assert changed.status_code == 200 and changed.json()["period"] == "daily"  # kept
    assert Budget.objects.get().amount == 5
    assert (
        api(vera)
        .patch(f"/api/v1/budgets/{budget['id']}/", {"amount": "9"}, format="json")
        .status_code
        == 403
    )
    assert api(gary).get(f"/api/v1/budgets/{budget['id']}/").status_code == 404
    refused = api(alice).patch(f"/api/v1/budgets/{budget['id']}/", {"amount": "-1"}, format="json")
    assert refused.status_code == 400
    assert api(alice).delete(f"/api/v1/budgets/{budget['id']}/").status_code == 405
    ledger = api(vera).get("/api/v1/charges/", {"agent": agent.pk}).json()
    (charge,) = ledger["results"]
    assert (charge["request_id"], charge["output_tokens"], charge["cost"]) == (
        "r1",
        100,
        "0.001500",
    )
    assert api(gary).get("/api/v1/charges/").json()["results"] == []


@pytest.mark.django_db
def test_the_organisations_own_budget_is_the_platform_teams(api, acme, alice, root):
    wanted = {"organisation": acme.pk, "amount": "100"}
    refused = api(alice).post("/api/v1/budgets/", wanted, format="json")
    assert refused.status_code == 403 and "set by the platform team" in refused.json()["detail"]
    made = api(root).post("/api/v1/budgets/", wanted, format="json")
    assert made.status_code == 201 and made.json()["agent"] is None
    raised = api(alice).patch(
        f"/api/v1/budgets/{made.json()['id']}/", {"amount": "1000"}, format="json"
    )
    assert raised.status_code == 403
    assert Budget.objects.get().amount == 100
    bad = api(root).patch(
        f"/api/v1/budgets/{made.json()['id']}/", {"thresholds": [0]}, format="json"
    )
    assert bad.status_code == 400


@pytest.mark.django_db
def test_an_agent_of_another_organisation_is_refused(api, acme, globex, alice):
    outsider = AgentFactory(organisation=globex)
    answer = api(alice).post(
        "/api/v1/budgets/",
        {"organisation": acme.pk, "agent": outsider.pk, "amount": "1"},
        format="json",
    )
    assert answer.status_code == 400
    assert not Budget.objects.exists()


@pytest.mark.django_db
def test_the_admin_pages_of_budgets_prices_and_charges_open(operator_client, acme):
    agent = AgentFactory(organisation=acme)
    budget = services.set_budget(agent, Decimal("1"))
    held = metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=10, request_id="r1")
    metering.settle(held, Usage(output=10))
    for path in (
        "/admin/budgets/budget/",
        f"/admin/budgets/budget/{budget.pk}/change/",
        "/admin/budgets/price/",
        "/admin/budgets/charge/",
    ):
        answer = operator_client.get(path)
        assert answer.status_code == 200, path
    listing = operator_client.get("/admin/budgets/budget/").text
    assert "$1.00" in listing and "$0.00015" in listing and "0.000150" not in listing


@pytest.mark.django_db(transaction=True)
def test_a_budget_is_set_in_the_admin_in_a_browser(page, acme, sonnet_price):  # noqa: F811
    agent = AgentFactory(organisation=acme, name="Builder")
    page.goto("/admin/budgets/budget/add/")
    page.select_option("#id_organisation", str(acme.pk))
    page.select_option("#id_agent", str(agent.pk))
    page.fill("#id_amount", "3.5")
    page.select_option("#id_period", "weekly")
    assert [page.input_value(f"#id_alert_{n}") for n in (1, 2, 3)] == ["50", "80", "100"]
    page.fill("#id_alert_2", "")  # one alert fewer
    page.fill("#id_alert_3", "90")
    page.click("input[name=_continue]")
    page.wait_for_selector("text=was added successfully")
    budget = Budget.objects.get(agent=agent)
    assert (budget.amount, budget.period, budget.thresholds) == (Decimal("3.5"), "weekly", [50, 90])
    assert page.input_value("#id_amount") == "3.50"  # not the column's 3.500000
    held = metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=10, request_id="r1")
    metering.settle(held, Usage(output=1000))
    page.goto("/admin/budgets/budget/")
    row = page.inner_text("#result_list")
    assert "$3.50" in row and "$0.02" in row and "$3.49" in row  # amount, spent, what remains
    page.goto(f"/admin/budgets/budget/{budget.pk}/change/")
    assert "$0.015" in page.inner_text("#spends-group")  # the period, on the record: exact


@pytest.mark.django_db
def test_in_the_admin_too_the_organisations_own_budget_is_the_platform_teams(
    client, acme, alice, root
):
    from django.contrib.auth.models import Permission

    # Even the organisation's own admin, with the permission to add budgets.
    alice.is_staff = True
    alice.save()
    alice.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_budget", "view_budget"])
    )
    client.force_login(alice)
    form = {"organisation": acme.pk, "amount": "100", "period": "monthly", "alert_1": "50"}
    form |= {"spends-TOTAL_FORMS": "0", "spends-INITIAL_FORMS": "0"}
    refused = client.post("/admin/budgets/budget/add/", form)
    assert "set by the platform team" in refused.text and not Budget.objects.exists()
    client.force_login(root)
    assert client.post("/admin/budgets/budget/add/", form).status_code == 302
    again = client.post("/admin/budgets/budget/add/", form)
    assert "has a budget of its own already" in again.text
    assert Budget.objects.count() == 1
    bad = client.post("/admin/budgets/budget/add/", {**form, "alert_1": "0"})
    assert "Ensure this value is greater than or equal to 1." in bad.text


@pytest.mark.django_db
def test_an_agents_usage_in_total_and_by_model_and_its_budgets_now(api, acme, vera, gary):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal(10), period="daily")
    services.set_budget(acme, Decimal(100))
    for n, (model, output) in enumerate(
        [(SONNET, 1000), (SONNET, 2000), ("claude-opus-4-5-20251101", 1000)]
    ):
        held = metering.reserve(
            agent, model=model, input_bound=0, max_tokens=2000, request_id=f"{n}"
        )
        metering.settle(held, Usage(input=10, output=output))
    answer = api(vera).get(f"/api/v1/agents/{agent.pk}/usage/")
    assert answer.status_code == 200, answer.content
    usage = answer.json()
    assert usage["total"]["requests"] == 3 and usage["total"]["output_tokens"] == 4000
    assert usage["total"]["cost"] == "0.070110"  # 0.01503 + 0.03003 + 0.02505
    assert [(m["model"], m["requests"], m["cost"]) for m in usage["by_model"]] == [
        (SONNET, 2, "0.045060"),
        ("claude-opus-4-5-20251101", 1, "0.025050"),
    ]
    assert [(b["whose"], b["period"], b["spent"]) for b in usage["budgets"]] == [
        ("agent", "daily", "0.070110"),
        ("organisation", "monthly", "0.070110"),
    ]
    later = api(vera).get(f"/api/v1/agents/{agent.pk}/usage/?since=2999-01-01T00:00:00Z").json()
    assert later["total"] == {**usage["total"], "requests": 0, "input_tokens": 0,
                              "output_tokens": 0, "cost": "0.000000"}  # fmt: skip
    bad = api(vera).get(f"/api/v1/agents/{agent.pk}/usage/?until=yesterday")
    assert bad.status_code == 400 and "ISO 8601" in bad.text
    assert api(gary).get(f"/api/v1/agents/{agent.pk}/usage/").status_code == 404


@pytest.mark.django_db
def test_the_agent_list_shows_what_each_spent_against_its_budget(operator_client, acme):
    spender = AgentFactory(organisation=acme, name="Spender")
    AgentFactory(organisation=acme, name="Unbounded")
    services.set_budget(spender, Decimal(6))
    held = metering.reserve(spender, model=SONNET, input_bound=0, max_tokens=10, request_id="r")
    metering.settle(held, Usage(output=100_000))  # $1.50
    small = AgentFactory(organisation=acme, name="Small")
    services.set_budget(small, Decimal(5))
    held = metering.reserve(small, model=SONNET, input_bound=0, max_tokens=10, request_id="s")
    metering.settle(held, Usage(output=83))  # $0.001245: cents would say $0.00
    listing = operator_client.get("/admin/agents/agent/").text
    assert "$1.50 of $6.00 this month (25 %)" in listing and "no budget of its own" in listing
    assert "$0.001245 of $5.00 this month (0 %)" in listing
    shown = operator_client.get(f"/admin/agents/agent/{spender.pk}/change/")
    assert shown.status_code == 200 and "$1.50 of $6.00 this month (25 %)" in shown.text


@pytest.mark.django_db
def test_a_second_price_from_the_same_moment_or_a_pattern_inside_a_name_is_refused(
    operator_client,
):
    from budgets.models import Price

    shipped = Price.objects.get(model="claude-haiku-4-5-*")
    form = {
        "vendor": "anthropic", "model": shipped.model, "input": "100", "cache_write_5m": "1",
        "cache_write_1h": "1", "cache_read": "1", "output": "1", "source": "mine",
        "effective_from_0": shipped.effective_from.strftime("%Y-%m-%d"),
        "effective_from_1": shipped.effective_from.strftime("%H:%M:%S"),
    }  # fmt: skip
    count = Price.objects.count()
    twice = operator_client.post("/admin/budgets/price/add/", form)
    assert "Vendor, Model and Effective from already exists" in twice.text
    inside = operator_client.post("/admin/budgets/price/add/", {**form, "model": "claude-*-x"})
    assert "one * at its end" in inside.text
    assert Price.objects.count() == count
