"""The admin, as an operator uses it: pages render, saves are versioned, history is visible."""

import pytest
from django.urls import reverse

from agents.models import Agent
from templates.models import AllowlistTemplate
from tests.factories import AgentFactory

pytestmark = pytest.mark.django_db

# The sandbox fields of the agent form, as the admin shows them for a new agent.
SANDBOX_DEFAULTS = {
    "runtime_command": "[]",
    "cpus": "1",
    "memory_mb": "2048",
    "pids_limit": "512",
    "run_timeout": "3600",
}


@pytest.fixture
def operator(client, root):
    client.force_login(root)
    return client


@pytest.mark.parametrize(
    "name",
    [
        "agents_organisation",
        "agents_membership",
        "agents_agent",
        "agents_agentversion",
        "agents_run",
        "runners_runner",
        "templates_allowlisttemplate",
        "workplaces_workplace",
    ],
)
def test_every_changelist_renders_and_searches(operator, acme, name):
    AgentFactory(organisation=acme)
    url = reverse(f"admin:{name}_changelist")
    assert operator.get(url).status_code == 200
    assert operator.get(url, {"q": "acme"}).status_code == 200


def test_an_agent_saved_in_the_admin_gets_a_new_version(operator, acme, root):
    agent = AgentFactory(organisation=acme, name="builder")
    npm = AllowlistTemplate.objects.get(slug="npm")
    url = reverse("admin:agents_agent_change", args=[agent.pk])
    page = operator.get(url)
    assert page.status_code == 200
    assert b"api.anthropic.com:443" in page.content  # the effective allowlist is shown
    response = operator.post(
        url,
        {
            "organisation": acme.pk,
            "name": "builder",
            "slug": "builder",
            "enabled": "on",
            "workplace": "",
            "templates": [npm.pk],
            "allowlist": "one.example\n  # a comment line\nTWO.example:8080\n",
            "required_labels": "EU, gpu",
            **SANDBOX_DEFAULTS,
            "versions-TOTAL_FORMS": "0",
            "versions-INITIAL_FORMS": "1",
            "versions-MIN_NUM_FORMS": "0",
            "versions-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    agent.refresh_from_db()
    assert agent.version == 2
    assert agent.allowlist == ["one.example", "two.example:8080"]
    assert agent.required_labels == ["eu", "gpu"]
    assert list(agent.templates.values_list("slug", flat=True)) == ["npm"]
    latest = agent.versions.get(number=2)
    assert latest.created_by == root
    assert set(latest.changes) == {"allowlist", "required_labels", "templates"}
    assert b"two.example:8080" in operator.get(url).content  # the version inline shows it


def test_a_bad_entry_in_the_admin_is_a_form_error(operator, acme):
    agent = AgentFactory(organisation=acme, name="builder")
    url = reverse("admin:agents_agent_change", args=[agent.pk])
    response = operator.post(
        url,
        {
            "organisation": acme.pk,
            "name": "builder",
            "slug": "builder",
            "enabled": "on",
            "allowlist": "ok.example\n*.bad.example",
            "required_labels": "",
            "versions-TOTAL_FORMS": "0",
            "versions-INITIAL_FORMS": "1",
            "versions-MIN_NUM_FORMS": "0",
            "versions-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 200
    assert b"wildcards are not allowed" in response.content
    agent.refresh_from_db()
    assert agent.version == 1


def test_an_agent_added_in_the_admin_starts_at_version_one(operator, acme):
    response = operator.post(
        reverse("admin:agents_agent_add"),
        {
            "organisation": acme.pk,
            "name": "New one",
            "slug": "new-one",
            "enabled": "on",
            "allowlist": "",
            "required_labels": "",
            **SANDBOX_DEFAULTS,
            "versions-TOTAL_FORMS": "0",
            "versions-INITIAL_FORMS": "0",
            "versions-MIN_NUM_FORMS": "0",
            "versions-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 302
    agent = Agent.objects.get(slug="new-one")
    assert agent.version == 1
    assert agent.versions.count() == 1


def test_disabling_agents_reports_how_many_changed(operator, acme):
    agents = [AgentFactory(organisation=acme) for _ in range(3)]
    response = operator.post(
        reverse("admin:agents_agent_changelist"),
        {"action": "disable_agents", "_selected_action": [a.pk for a in agents[:2]]},
        follow=True,
    )
    assert b"2 agent(s) disabled" in response.content
    assert [a.version for a in Agent.objects.order_by("pk")] == [2, 2, 1]


def test_organisation_history_shows_who_changed_the_base_allowlist(operator, acme, root):
    url = reverse("admin:agents_organisation_change", args=[acme.pk])
    response = operator.post(
        url,
        {
            "name": "Acme",
            "slug": "acme",
            "base_allowlist": "api.anthropic.com\nmirror.example",
            "memberships-TOTAL_FORMS": "0",
            "memberships-INITIAL_FORMS": "0",
            "memberships-MIN_NUM_FORMS": "0",
            "memberships-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    record = acme.history.first()
    assert record.history_user == root
    assert record.base_allowlist == ["api.anthropic.com", "mirror.example"]
    history = operator.get(reverse("admin:agents_organisation_history", args=[acme.pk]))
    assert b"mirror.example" in history.content
    assert b"root" in history.content


def test_memberships_are_edited_inline(operator, acme):
    page = operator.get(reverse("admin:agents_organisation_change", args=[acme.pk]))
    assert b"memberships-TOTAL_FORMS" in page.content


def test_runs_are_listed_filtered_and_cancelled_in_the_admin(operator, acme):
    from agents import runs
    from agents.models import Run

    run = runs.queue_run(AgentFactory(organisation=acme), "something")
    url = reverse("admin:agents_run_changelist")
    assert operator.get(url, {"status__exact": "queued"}).status_code == 200
    assert operator.get(reverse("admin:agents_run_change", args=[run.pk])).status_code == 200
    response = operator.post(
        url, {"action": "cancel_runs", "_selected_action": [run.pk]}, follow=True
    )
    assert b"1 run(s) cancelled" in response.content
    assert Run.objects.get().status == "cancelled"


def test_runners_are_paused_and_resumed_in_the_admin(operator, acme):
    from runners.models import Runner

    runner = Runner.objects.get(organisation=acme, builtin=True)
    url = reverse("admin:runners_runner_changelist")
    operator.post(url, {"action": "pause_runners", "_selected_action": [runner.pk]})
    runner.refresh_from_db()
    assert runner.paused
    operator.post(url, {"action": "resume_runners", "_selected_action": [runner.pk]})
    runner.refresh_from_db()
    assert not runner.paused
