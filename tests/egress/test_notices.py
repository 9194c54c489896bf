"""PostgreSQL's notices of policy changes (egress/migrations/0003_policy_notices.py, 0004): every
table the policy is made of says what changed at commit, and nothing else does (a model call's
settlement is not a change of the policy)."""

from datetime import timedelta
from decimal import Decimal

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from agents import services as agent_services
from budgets.models import Budget, Spend
from egress.services import issue_token, revoke_tokens
from egress.stream.hub import EVERYTHING, LISTS, Change, Sync, parse_notice
from egress.stream.notices import CHANNEL
from organisations import services as organisations
from runners.streaming import psycopg_params
from templates.models import AllowlistTemplate

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def heard():
    """What the notices said, on a connection of their own (read with ``heard()``)."""
    listener = psycopg.connect(**psycopg_params(), autocommit=True)
    listener.execute(f"LISTEN {CHANNEL}")

    def read() -> list[Change | Sync | None]:
        return [parse_notice(n.payload) for n in listener.notifies(timeout=0.3)]

    yield read
    listener.close()


def test_each_part_of_the_policy_notifies_what_changed(heard, acme):
    agent = agent_services.create_agent(acme, "builder", allowlist=["a.test"])
    assert Change(acme.pk, agent.pk) in heard()
    agent_services.update_agent(agent, allowlist=["a.test", "b.test"])
    assert heard() == [Change(acme.pk, agent.pk)]  # one notice for the transaction's rows
    template = AllowlistTemplate.objects.get(slug="pypi")
    agent.templates.add(template)
    assert heard() == [Change(acme.pk, agent.pk)]
    token, _ = issue_token(agent)
    assert heard() == [Change(acme.pk, agent.pk)]
    revoke_tokens([token])
    assert heard() == [Change(acme.pk, agent.pk)]

    organisations.update_organisation(acme, base_allowlist=["c.test"])
    assert heard() == [Change(acme.pk)]
    template.entries = [*template.entries, "d.test"]
    template.save()
    assert heard() == [LISTS]  # its entries: one shared list
    template.slug = "pypi-mirror"
    template.save()
    assert heard() == [EVERYTHING]  # its slug: how every agent that has it names it
    made = AllowlistTemplate.objects.create(slug="made", name="Made", entries=["e.test"])
    assert heard() == [LISTS]
    agent.templates.add(made)
    heard()
    made.delete()
    assert set(heard()) == {Change(acme.pk, agent.pk), LISTS}  # who had it, and the lists

    budget = Budget.objects.create(organisation=acme, agent=agent, amount=Decimal(1))
    assert heard() == [Change(acme.pk, budgets=True)]
    spend = Spend.objects.create(
        budget=budget, period=budget.period, starts_at=timezone.now() - timedelta(hours=1),
        limit=Decimal(1),
    )  # fmt: skip
    assert heard() == [Change(acme.pk, budgets=True)]
    Spend.objects.filter(pk=spend.pk).update(spent=Decimal("0.5"))
    assert heard() == []  # a settlement: no change of who may connect
    Spend.objects.filter(pk=spend.pk).update(spent=Decimal(1), exhausted_at=timezone.now())
    assert heard() == [Change(acme.pk, budgets=True)]

    agent_id = agent.pk
    agent.delete()
    notices = heard()
    assert Change(acme.pk, agent_id) in notices
    assert set(notices) <= {Change(acme.pk, agent_id), Change(acme.pk, budgets=True), None}


def test_nothing_is_heard_of_a_change_rolled_back(heard, acme):
    from django.db import transaction

    agent = agent_services.create_agent(acme, "builder", allowlist=["a.test"])
    heard()
    with pytest.raises(RuntimeError), transaction.atomic():
        agent_services.update_agent(agent, enabled=False)
        raise RuntimeError("rolled back")
    assert heard() == []


def test_a_row_moved_by_hand_notifies_both_its_organisations_and_emptying_a_table_all(
    heard, acme, globex
):
    agent = agent_services.create_agent(acme, "builder", allowlist=["a.test"])
    heard()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE agents_agent SET organisation_id = %s WHERE id = %s", [globex.pk, agent.pk]
        )
        assert set(heard()) == {Change(acme.pk, agent.pk), Change(globex.pk, agent.pk)}
        cursor.execute("TRUNCATE budgets_spend CASCADE")
        assert heard() == [EVERYTHING]
