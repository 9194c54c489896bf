"""Runs in the admin: started from the agent's page, followed and cancelled on their own, and
linked from the decisions, tokens and charges that belong to them."""

import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from budgets.models import Charge, Price
from egress.models import Decision, EgressToken
from runners.models import Runner
from runs import output
from runs import services as runs
from runs.models import Run, RunStatus
from tests.factories import AgentFactory, record_events

pytestmark = pytest.mark.django_db


def started(run: Run, runner: Runner, minutes_ago: float = 0) -> Run:
    runs.start(str(run.pk), runner)
    Run.objects.filter(pk=run.pk).update(started_at=timezone.now() - timedelta(minutes=minutes_ago))
    run.refresh_from_db()
    return run


def decision(agent, host, at, allowed=False):
    record_events(
        [{"event": "decision", "id": str(uuid.uuid4()), "agent_id": agent.pk, "username": "x",
          "kind": "connect", "host": host, "port": 443, "allowed": allowed,
          "reason": "allowed" if allowed else "not-on-allowlist", "at": at.timestamp()}]
    )  # fmt: skip
    return Decision.objects.get(host=host)


@pytest.fixture
def builtin(acme):
    runner = Runner.objects.get(organisation=acme, builtin=True)
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=timezone.now())
    return runner


def test_an_admin_starts_a_run_from_the_agents_page(
    operator_client, acme, builtin, orders, root, django_capture_on_commit_callbacks
):
    agent = AgentFactory(organisation=acme, name="Builder")
    page = operator_client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert 'id="start-run"' in page and f"/admin/agents/agent/{agent.pk}/start-run/" in page

    with django_capture_on_commit_callbacks(execute=True):
        answer = operator_client.post(f"/admin/agents/agent/{agent.pk}/start-run/", {"task": "go"})
    run = Run.objects.get(agent=agent)
    assert answer.status_code == 302 and answer["Location"] == f"/admin/runs/run/{run.pk}/change/"
    assert (run.task, run.created_by) == ("go", root)
    assert ("launch", builtin.pk, str(run.pk)) in orders  # placed, as one from the API

    page = operator_client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert f"/admin/runs/run/{run.pk}/change/" in page  # among its recent runs
    assert "1 version(s)" in page and f"agentversion/?agent__id__exact={agent.pk}" in page


def test_an_empty_task_or_a_disabled_agent_starts_nothing_and_says_why(operator_client, acme):
    agent = AgentFactory(organisation=acme, name="Builder")
    answer = operator_client.post(
        f"/admin/agents/agent/{agent.pk}/start-run/", {"task": "  "}, follow=True
    )
    assert "No run started: the task is empty." in answer.content.decode()
    assert operator_client.get(f"/admin/agents/agent/{agent.pk}/start-run/").status_code == 405
    AgentFactory._meta.model.objects.filter(pk=agent.pk).update(enabled=False)
    page = operator_client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert 'id="start-run"' not in page
    answer = operator_client.post(
        f"/admin/agents/agent/{agent.pk}/start-run/", {"task": "go"}, follow=True
    )
    assert "No run started: the agent is disabled." in answer.content.decode()
    assert not Run.objects.exists()


def test_a_viewer_may_not_start_or_cancel_runs(client, acme, vera, orders):
    agent = AgentFactory(organisation=acme, name="Builder")
    client.force_login(vera)
    page = client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert 'id="start-run"' not in page
    refused = client.post(f"/admin/agents/agent/{agent.pk}/start-run/", {"task": "go"})
    assert refused.status_code == 403
    assert "Starting a run takes the admin role in Acme; you are a viewer of Acme." in (
        refused.content.decode()
    )
    run = runs.queue_run(agent, "theirs")
    page = client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert "theirs" in page and 'id="cancel-run"' not in page
    assert client.post(f"/admin/runs/run/{run.pk}/cancel/").status_code == 403
    # Nor through the list's action, which a viewer is not offered.
    listed = client.get("/admin/runs/run/").content.decode()
    assert run.short_id in listed and "cancel_runs" not in listed
    client.post("/admin/runs/run/", {"action": "cancel_runs", "_selected_action": [str(run.pk)]})
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED


def test_a_runs_page_shows_its_command_follows_its_output_and_cancels_it(
    operator_client, acme, builtin, orders, django_capture_on_commit_callbacks
):
    agent = AgentFactory(
        organisation=acme, name="Builder", runtime_command=["sh", "-c", "make test && echo ok"]
    )
    run = started(runs.queue_run(agent, "test it"), builtin)
    first = len("compiling…\n".encode())
    output.append_output(str(run.pk), builtin, 0, "compiling…\n")
    page = operator_client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert "sh -c &#x27;make test &amp;&amp; echo ok&#x27;" in page
    assert 'data-live="true"' in page and "compiling…" in page
    assert 'id="cancel-run"' in page
    assert f'data-offset="{first}"' in page

    # What the page asks for next: the output from where its tail ended.
    output.append_output(str(run.pk), builtin, first, "linking\n")
    more = operator_client.get(f"/admin/runs/run/{run.pk}/log/", {"offset": first})
    assert (more.content, more["X-Covey-Log-Complete"]) == (b"linking\n", "false")
    for view in ("log", "live"):  # "²" is a digit to str.isdigit, and no number to int()
        for bad in ("-1", "²"):
            asked = operator_client.get(f"/admin/runs/run/{run.pk}/{view}/", {"offset": bad})
            assert asked.status_code == 400, (view, bad)

    with django_capture_on_commit_callbacks(execute=True):
        answer = operator_client.post(f"/admin/runs/run/{run.pk}/cancel/", follow=True)
    assert "The run is cancelled or cancelling." in answer.content.decode()
    assert Run.objects.get(pk=run.pk).cancel_requested_at is not None
    assert ("cancel", builtin.pk, str(run.pk)) in orders


def test_the_claude_runtime_is_shown_as_the_command_of_an_agent_without_one(
    operator_client, acme, orders
):
    run = runs.queue_run(AgentFactory(organisation=acme, name="Claude"), "hello")
    page = operator_client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert "exec claude --print --dangerously-skip-permissions" in page


def test_decisions_tokens_and_charges_lead_to_their_run_and_back(
    operator_client, acme, builtin, orders
):
    agent = AgentFactory(organisation=acme, name="Builder")
    before = decision(agent, "before.example.test", timezone.now() - timedelta(minutes=30))
    run = started(runs.queue_run(agent, "build it"), builtin, minutes_ago=10)
    during = decision(agent, "during.example.test", timezone.now() - timedelta(minutes=5))
    decision(agent, "allowed.example.test", timezone.now() - timedelta(minutes=4), allowed=True)

    page = operator_client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert "1 allowed, 1 denied" in page
    listed = operator_client.get(
        "/admin/egress/decision/",
        {"agent__id__exact": agent.pk, "decided_at__gte": run.started_at.isoformat()},
    ).content.decode()
    assert "during.example.test" in listed and "before.example.test" not in listed
    assert f"/admin/runs/run/{run.pk}/change/" in listed  # the run column
    one = operator_client.get(f"/admin/egress/decision/{during.pk}/change/").content.decode()
    assert f"/admin/runs/run/{run.pk}/change/" in one
    other = operator_client.get(f"/admin/egress/decision/{before.pk}/change/").content.decode()
    assert f"/admin/runs/run/{run.pk}/change/" not in other  # before the run: no run

    token = EgressToken.objects.get(pk=run.egress_token_id)
    tokens = operator_client.get("/admin/egress/egresstoken/").content.decode()
    assert f"/admin/runs/run/{run.pk}/change/" in tokens
    one = operator_client.get(f"/admin/egress/egresstoken/{token.pk}/change/").content.decode()
    assert f"/admin/runs/run/{run.pk}/change/" in one

    price = Price.objects.filter(model__startswith="claude-").first()
    Charge.objects.create(
        request_id="r1", organisation=acme, agent=agent, run=run, model=price.model,
        cost=Decimal("0.25"), price=price, started_at=timezone.now(),
    )  # fmt: skip
    page = operator_client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert "1 request(s), $0.25" in page and f"run__id__exact={run.pk}" in page
    assert operator_client.get(f"/admin/budgets/charge/?run__id__exact={run.pk}").status_code == 200

    denials = operator_client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert "during.example.test:443" in denials and "allowed.example.test" not in denials


def test_an_organisations_page_links_to_its_agents_runners_and_runs(operator_client, acme):
    AgentFactory(organisation=acme, name="Builder")
    page = operator_client.get(f"/admin/organisations/organisation/{acme.pk}/change/")
    text = page.content.decode()
    assert (
        f"/admin/agents/agent/?organisation__id__exact={acme.pk}" in text and "1 agent(s)" in text
    )
    assert f"/admin/runners/runner/?organisation__id__exact={acme.pk}" in text
    assert f"/admin/runs/run/?agent__organisation__id__exact={acme.pk}" in text
    for link in (
        f"/admin/agents/agent/?organisation__id__exact={acme.pk}",
        f"/admin/runners/runner/?organisation__id__exact={acme.pk}",
        f"/admin/runs/run/?agent__organisation__id__exact={acme.pk}",
    ):
        answer = operator_client.get(link)
        assert answer.status_code == 200 and "?e=1" not in answer.get("Location", "")


def test_the_runs_list_shows_short_ids(operator_client, acme, orders):
    run = runs.queue_run(AgentFactory(organisation=acme, name="Builder"), "go")
    page = operator_client.get("/admin/runs/run/").content.decode()
    assert f">{run.short_id}</a>" in page
