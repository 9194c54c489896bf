"""A transactional test's teardown leaves every table empty (tests/conftest.py empties them with
DELETE on PostgreSQL), whatever refers to what."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.apps import apps
from django.core.management import call_command
from django.core.management.color import no_style
from django.db import connection
from django.utils import timezone

from agents import services as agent_services
from budgets.models import Budget, Spend
from egress.services import issue_token
from tests.factories import OrganisationFactory, UserFactory

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_the_flush_of_a_transactional_test_empties_every_table():
    organisation = OrganisationFactory(name="Acme")
    agent = agent_services.create_agent(organisation, "builder", allowlist=["a.example"])
    issue_token(agent)
    UserFactory(username="someone")
    budget = Budget.objects.create(organisation=organisation, agent=agent, amount=Decimal(1))
    Spend.objects.create(
        budget=budget, period=budget.period, starts_at=timezone.now() - timedelta(hours=1),
        limit=Decimal(1),
    )  # fmt: skip
    tables = [
        model._meta.db_table
        for model in apps.get_models(include_auto_created=True)
        if model._meta.managed and not model._meta.proxy
    ]
    held = {table: count(table) for table in tables}
    # Rows that refer to each other, some with the policy's triggers (a spend's reads its budget).
    for model in ("agents_agent", "egress_egresstoken", "budgets_budget", "budgets_spend"):
        assert held[model] == 1, held

    assert connection.ops.sql_flush(no_style(), tables)[0] == "SET CONSTRAINTS ALL DEFERRED"
    call_command("flush", verbosity=0, interactive=False, inhibit_post_migrate=True)

    assert {table: n for table in tables if (n := count(table))} == {}


def count(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {connection.ops.quote_name(table)}")  # noqa: S608
        return int(cursor.fetchone()[0])
