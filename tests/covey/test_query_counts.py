"""List endpoints cost the same number of queries however many rows they return."""

from decimal import Decimal
from uuid import uuid4

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agents import services
from approvals.services import approve, file_egress, file_package
from budgets import metering
from budgets import services as budgets
from budgets.usage import Usage
from connections.models import CredentialedRequest
from connections.services import create_connection
from covey.pagination import BoundedPagination
from covey.urls import router
from egress.models import Decision
from egress.services import issue_token
from organisations.models import Membership, Role
from runners.models import Runner
from runs import services as runs
from templates.models import AllowlistTemplate
from tests.factories import (
    AgentFactory,
    OrganisationFactory,
    UserFactory,
    WorkplaceFactory,
    online_runner,
)

pytestmark = pytest.mark.django_db
SONNET = "claude-sonnet-4-5-20250929"  # priced by the shipped prices


def queries_for(client, url):
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200, response.content
    return len(captured), response.json()


def make_rows(acme, alice, count):
    """``count`` more rows of every kind a list endpoint shows, for alice (admin of acme)."""
    templates = list(AllowlistTemplate.objects.all()[:3])
    for _ in range(count):
        workplace = WorkplaceFactory(organisation=acme)
        agent = AgentFactory(organisation=acme, templates=templates, workplace=workplace)
        services.update_agent(agent, by=alice, enabled=False)
        services.update_agent(agent, by=alice, enabled=True)
        org = OrganisationFactory()
        Membership.objects.create(organisation=org, user=alice, role=Role.VIEWER)
        AllowlistTemplate.objects.create(
            slug=f"extra-{AllowlistTemplate.objects.count()}",
            name="Extra",
            entries=["mirror.example"],
        )
        forge = create_connection(
            acme, f"git-{Runner.objects.count()}", "token", "a-token", git_url="https://git.example"
        )
        runner, _ = online_runner(acme, f"edge-{Runner.objects.count()}")
        run = runs.queue_run(agent, "work", by=alice)
        runs.start(str(run.pk), run.runner)
        CredentialedRequest.objects.create(
            organisation=acme, agent=agent, run=run, connection=forge, at=timezone.now(),
            method="GET", host="git.example", repository="acme/app", service="git-upload-pack",
            status=200,
        )  # fmt: skip
        issue_token(agent, by=alice)
        refusal = Decision.objects.create(
            agent=agent, kind="connect", host="a.example", port=443, allowed=True,
            reason="allowed", proxy=runner.name, decided_at=timezone.now(),
        )  # fmt: skip
        asked = file_egress(agent, "b.example", reason="b", run=run, refusal=refusal)
        file_egress(agent, "b.example", reason="again", by=alice)
        file_package(agent, "apt", "jq", reason="jq")
        approve(asked, by=UserFactory(username="decider", is_superuser=True), note="fine")
        budgets.set_budget(agent, Decimal("10"), period="daily")
        held = metering.reserve(
            agent, model=SONNET, input_bound=10, max_tokens=10, request_id=str(uuid4())
        )
        metering.settle(held, Usage(output=5))


# Every list endpoint of the router, from the router itself: a new resource is measured too
# (and fails here until make_rows gives it rows).
LISTS = [f"/api/v1/{prefix}/" for prefix, _, _ in router.registry]


def test_list_endpoints_use_a_constant_number_of_queries(api, alice, acme, orders):
    """Every list measured on one set of rows, then on ten times as many (the rows are made
    once for all of them: making them per list took 11 s a list)."""
    client = api(alice)
    make_rows(acme, alice, 2)
    few = {url: queries_for(client, url) for url in LISTS}
    make_rows(acme, alice, 20)
    many = {url: queries_for(client, url) for url in LISTS}
    grew = {url: len(many[url][1]["results"]) > len(few[url][1]["results"]) for url in LISTS}
    assert all(grew.values()), [url for url, yes in grew.items() if not yes]
    counts = {url: (few[url][0], many[url][0]) for url in LISTS}
    assert all(a == b for a, b in counts.values()), {
        url: pair for url, pair in counts.items() if pair[0] != pair[1]
    }


def test_the_version_list_uses_a_constant_number_of_queries(api, alice, acme):
    client = api(alice)
    agent = AgentFactory(organisation=acme)
    url = f"/api/v1/agents/{agent.pk}/versions/"
    few, _ = queries_for(client, url)
    for number in range(15):
        services.update_agent(agent, by=alice, allowlist=[f"host{number}.example"])
    many, body = queries_for(client, url)
    assert body["count"] == 16
    assert many == few


def test_pages_are_bounded_whatever_size_is_asked_for(api, root, acme, monkeypatch):
    monkeypatch.setattr(BoundedPagination, "max_page_size", 2)
    for _ in range(3):
        AgentFactory(organisation=acme)
    body = api(root).get("/api/v1/agents/?page_size=100000").json()
    assert len(body["results"]) == 2
    assert body["count"] == 3
    assert body["next"]
