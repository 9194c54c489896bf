"""The admin index's dashboard: what wants a person now, each section linked to its list, for
the user's organisations only, and only what the user may view."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from approvals import services as approvals
from budgets.metering import current_spend
from budgets.models import Budget, Spend
from runners.models import Runner
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


def denial(agent, host, at=None):
    return decision_event(
        agent,
        host=host,
        allowed=False,
        reason="not-on-allowlist",
        at=(at or timezone.now()).timestamp(),
    )


def section(page: str, key: str) -> str:
    start = page.index(f'id="dashboard-{key}"')
    return page[start : page.index("</table>", start)]


@pytest.fixture
def busy(acme, globex, orders):
    """Acme with something in every section; Globex with its own, which Acme never sees."""
    builder = AgentFactory(organisation=acme, name="Builder")
    quiet = AgentFactory(organisation=acme, name="Quiet")
    workplace = WorkplaceFactory(organisation=acme)
    builder_in = AgentFactory(organisation=acme, name="Packer", workplace=workplace)
    approvals.file_package(builder_in, "apt", "jq", reason="to parse JSON")
    going = runs.queue_run(builder, "build it")
    failed = runs.queue_run(quiet, "test it")
    Run.objects.filter(pk=failed.pk).update(
        status=RunStatus.FAILED, status_detail="exit code 3", finished_at=timezone.now()
    )
    old = runs.queue_run(builder_in, "long ago")
    Run.objects.filter(pk=old.pk).update(
        status=RunStatus.FAILED, finished_at=timezone.now() - timedelta(days=2)
    )
    budget = Budget.objects.create(organisation=acme, agent=builder, amount=Decimal(10))
    Spend.objects.filter(pk=current_spend(budget).pk).update(spent=Decimal("8.50"))
    Budget.objects.create(organisation=acme, agent=quiet, amount=Decimal(10))  # nothing spent
    online_runner(acme, "edge-1")
    _, _ = online_runner(acme, "edge-2", paused=True)
    record_events([denial(builder, "evil.example.test")])

    theirs = AgentFactory(organisation=globex, name="Spy")
    runs.queue_run(theirs, "their work")
    online_runner(globex, "their-edge")
    record_events([denial(theirs, "their.example.test")])
    return {"going": going, "failed": failed, "old": old, "builder": builder}


def test_it_shows_what_wants_a_person_each_linked_to_its_list(operator_client, busy):
    page = operator_client.get("/admin/").content.decode()

    requests = section(page, "requests")
    assert "Pending requests (1)" in requests and "package apt jq" in requests
    assert "/admin/approvals/request/?status__exact=pending" in requests

    now = section(page, "runs-now")
    assert busy["going"].short_id in now and "acme/builder" in now
    assert f"/admin/runs/run/{busy['going'].pk}/change/" in now

    failed = section(page, "failed")
    assert "Failed in the last 24 hours (1)" in failed
    assert busy["failed"].short_id in failed and "exit code 3" in failed
    assert busy["old"].short_id not in failed  # two days ago is not recent
    assert "/admin/runs/run/?status__in=failed%2Ctimed_out&amp;finished_at__gte=" in failed

    budgets = section(page, "budgets")
    assert "Near or over budget (1)" in budgets
    assert "$8.50 of $10.00 this month (85 %)" in budgets and "acme/quiet" not in budgets

    runners = section(page, "runners")
    assert "edge-1" in runners and "online" in runners
    assert "edge-2" in runners and "paused" in runners
    assert "builtin" in runners and "never seen" in runners
    # What wants a look comes first.
    assert runners.index("paused") < runners.index("edge-1")

    denials = section(page, "denials")
    assert "evil.example.test:443" in denials and "not-on-allowlist" in denials
    assert "/admin/egress/decision/?allowed__exact=0" in denials


def test_a_member_sees_only_their_organisations_and_what_they_may_view(client, busy, vera):
    # A viewer, with neither Django's staff flag nor any permission of Django's: her role is
    # what lets her read every section, of her organisation only.
    assert not vera.is_staff and not vera.user_permissions.exists()
    client.force_login(vera)
    page = client.get("/admin/").content.decode()
    assert "globex/spy" not in page and "their-edge" not in page
    assert "their.example.test" not in page
    assert "evil.example.test" in section(page, "denials")
    assert "Runs now (1)" in section(page, "runs-now")
    assert "Runners (3)" in section(page, "runners")  # edge-1, edge-2 and the built-in one
    assert 'id="dashboard-requests"' in page and 'id="dashboard-budgets"' in page


def test_a_runner_silent_too_long_is_stale_and_one_that_failed_its_probe_says_so(
    operator_client, acme
):
    stale, _ = online_runner(acme, "edge-stale")
    Runner.objects.filter(pk=stale.pk).update(last_seen_at=timezone.now() - timedelta(hours=1))
    hard, _ = online_runner(acme, "edge-hard")
    Runner.objects.filter(pk=hard.pk).update(isolation="network")
    runners = section(operator_client.get("/admin/").content.decode(), "runners")
    assert "silent for 60 min" in runners
    assert "not probed yet" in runners


def test_an_empty_installation_says_nothing_waits(operator_client):
    page = operator_client.get("/admin/").content.decode()
    assert "Nothing waits for a decision." in page
    assert "No run is going." in page
    assert "Nothing was refused." in page


def test_the_pages_it_links_to_show_a_member_only_their_organisations(client, busy, alice, globex):
    """Not the dashboard alone: every admin list and page a member reaches from it is scoped,
    as the API is, and so are the actions on them."""
    client.force_login(alice)  # an admin of acme by membership alone (no staff flag)
    theirs = Run.objects.get(agent__organisation=globex)
    for listing in (
        "/admin/runs/run/", "/admin/egress/decision/", "/admin/runners/runner/",
        "/admin/agents/agent/", "/admin/budgets/budget/",
    ):  # fmt: skip
        page = client.get(listing)
        assert page.status_code == 200, listing
        text = page.content.decode()
        assert "Spy" not in text and "their-edge" not in text and "their.example" not in text
        assert "Globex" not in text  # nor in a filter by organisation (agent__organisation)
    assert "Builder" in client.get("/admin/agents/agent/").content.decode()
    # Their run, its output and its agent's page are not found for her.
    assert client.get(f"/admin/runs/run/{theirs.pk}/change/").status_code == 302
    assert client.get(f"/admin/runs/run/{theirs.pk}/log/").status_code in (302, 404)
    assert client.get(f"/admin/agents/agent/{theirs.agent_id}/change/").status_code == 302
    # An action posted with their run's id leaves it alone.
    client.post(
        "/admin/runs/run/",
        {"action": "cancel_runs", "_selected_action": [str(theirs.pk)]},
    )
    theirs.refresh_from_db()
    assert theirs.status == RunStatus.QUEUED and theirs.cancel_requested_at is None


def test_its_links_lead_to_lists_of_what_it_counted(operator_client, busy):
    timed_out = Run.objects.get(pk=busy["failed"].pk)
    Run.objects.filter(pk=timed_out.pk).update(status=RunStatus.TIMED_OUT)
    page = operator_client.get("/admin/").content.decode()
    failed = section(page, "failed")
    assert "Failed in the last 24 hours (1)" in failed
    link = failed.split('href="', 1)[1].split('"', 1)[0].replace("&amp;", "&")
    listed = operator_client.get(link).content.decode()
    assert timed_out.short_id in listed and busy["old"].short_id not in listed
