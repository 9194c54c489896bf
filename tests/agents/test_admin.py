"""The admin, as an operator uses it: pages render, saves are versioned, history is visible."""

import re

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
        "organisations_organisation",
        "organisations_membership",
        "agents_agent",
        "agents_agentversion",
        "runs_run",
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
    url = reverse("admin:organisations_organisation_change", args=[acme.pk])
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
    history = operator.get(reverse("admin:organisations_organisation_history", args=[acme.pk]))
    assert b"mirror.example" in history.content
    assert b"root" in history.content


def test_memberships_are_edited_inline(operator, acme):
    page = operator.get(reverse("admin:organisations_organisation_change", args=[acme.pk]))
    assert b"memberships-TOTAL_FORMS" in page.content


def test_runs_are_listed_filtered_and_cancelled_in_the_admin(operator, acme):
    from runs import services as runs
    from runs.models import Run

    run = runs.queue_run(AgentFactory(organisation=acme), "something")
    url = reverse("admin:runs_run_changelist")
    assert operator.get(url, {"status__exact": "queued"}).status_code == 200
    assert operator.get(reverse("admin:runs_run_change", args=[run.pk])).status_code == 200
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


EMPTY_MEMBERSHIPS = {
    "memberships-TOTAL_FORMS": "0",
    "memberships-INITIAL_FORMS": "0",
    "memberships-MIN_NUM_FORMS": "0",
    "memberships-MAX_NUM_FORMS": "1000",
}


def test_an_organisation_added_in_the_admin_is_made_by_the_service(operator, root, settings):
    """The add form shows the base list a new organisation starts with; saving gives it its
    built-in runner and makes its creator its admin, as the API does (issue 9, item 2)."""
    from organisations.models import Membership, Organisation, Role
    from runners.models import Runner

    settings.COVEY_EGRESS_BASE_ALLOWLIST = ["api.anthropic.com", "mirror.example:8443"]
    url = reverse("admin:organisations_organisation_add")
    page = operator.get(url).content.decode()
    assert "api.anthropic.com\nmirror.example:8443</textarea>" in page
    response = operator.post(
        url,
        {
            "name": "Initech",
            "slug": "initech",
            "base_allowlist": "api.anthropic.com\nmirror.example:8443",
            **EMPTY_MEMBERSHIPS,
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    organisation = Organisation.objects.get(slug="initech")
    assert organisation.base_allowlist == ["api.anthropic.com", "mirror.example:8443"]
    assert Membership.objects.get(organisation=organisation).user == root
    assert Membership.objects.get(organisation=organisation).role == Role.ADMIN
    assert Runner.objects.filter(organisation=organisation, builtin=True).count() == 1


def test_an_organisation_added_in_the_admin_may_name_its_creator_in_the_inline(operator, root):
    """A membership row for the creator sets their role instead of failing as a duplicate
    (another member is its admin: an organisation keeps one)."""
    from organisations.models import Membership, Organisation, Role
    from tests.factories import UserFactory

    lead = UserFactory(username="lead")
    response = operator.post(
        reverse("admin:organisations_organisation_add"),
        {
            "name": "Umbrella",
            "slug": "umbrella",
            "base_allowlist": "api.anthropic.com",
            **EMPTY_MEMBERSHIPS,
            "memberships-TOTAL_FORMS": "2",
            "memberships-0-user": root.username,
            "memberships-0-role": Role.VIEWER,
            "memberships-1-user": lead.username,
            "memberships-1-role": Role.ADMIN,
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    organisation = Organisation.objects.get(slug="umbrella")
    roles = Membership.objects.filter(organisation=organisation).values_list("user", "role")
    assert dict(roles) == {root.pk: Role.VIEWER, lead.pk: Role.ADMIN}


def test_a_bad_base_list_in_the_admin_is_a_form_error_and_makes_nothing(operator):
    from organisations.models import Organisation

    response = operator.post(
        reverse("admin:organisations_organisation_add"),
        {"name": "Broken", "slug": "broken", "base_allowlist": "10.0.0.1", **EMPTY_MEMBERSHIPS},
    )
    assert response.status_code == 200
    assert b"IP addresses are not allowed" in response.content
    assert not Organisation.objects.filter(slug="broken").exists()


def test_a_runs_output_opens_from_its_admin_page(operator, acme, orders):
    """The run page links to its output, which the admin serves (issue 9, item 3)."""
    from django.utils import timezone

    from runners.models import Runner
    from runs import output
    from runs import services as runs

    runner = Runner.objects.get(organisation=acme, builtin=True)
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=timezone.now())
    run = runs.queue_run(AgentFactory(organisation=acme), "something")
    assert run.runner_id == runner.pk
    runs.start(str(run.pk), runner)
    output.append_output(str(run.pk), runner, 0, "so far\n")
    page = operator.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    log_url = reverse("admin:runs_run_log", args=[run.pk])
    assert f'href="{log_url}"' in page
    assert operator.get(log_url).content == b"so far\n"
    output.save_log(str(run.pk), runner, "so far\nand the rest\n")
    page = operator.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert "the whole output" in page
    # A run is a record: nothing on its page can be changed, not even how much output it has.
    assert 'name="output_size"' not in page and 'name="_save"' not in page
    answer = operator.get(log_url)
    assert answer.status_code == 200
    assert answer["Content-Type"] == "text/plain; charset=utf-8"
    assert answer.getvalue() == b"so far\nand the rest\n"


def test_a_runs_output_is_404_for_a_run_that_is_not_there(operator):
    url = reverse("admin:runs_run_log", args=["00000000-0000-0000-0000-000000000000"])
    assert operator.get(url).status_code == 404


def test_an_agents_history_is_its_versions_with_each_change_before_and_after(operator, acme):
    """History links to the versions; a version shows each field before → after, and titles
    name the agent, not its id (issue 9, item 8)."""
    from agents import services

    agent = services.create_agent(acme, "Builder", allowlist=["one.example"])
    services.update_agent(agent, allowlist=["one.example", "two.example"], cpus=2.0)
    history = operator.get(reverse("admin:agents_agent_history", args=[agent.pk]))
    assert history.status_code == 302
    versions = operator.get(history["Location"]).content.decode()
    assert "2 agent versions" in versions and "two.example" in versions
    assert "<h1>Versions of acme/builder</h1>" in versions
    version = agent.versions.get(number=2)
    page = operator.get(reverse("admin:agents_agentversion_change", args=[version.pk]))
    text = page.content.decode()
    assert "acme/builder v2" in text and f"{agent.pk} v2" not in text
    assert "<th>allowlist</th><td>one.example</td><td>one.example, two.example</td>" in text
    assert re.search(r"<th>sandbox cpus</th><td>1(\.0)?</td><td>2(\.0)?</td>", text), text[-3000:]


def test_a_runtime_command_that_is_not_a_list_says_what_it_wants(operator, acme):
    response = operator.post(
        reverse("admin:agents_agent_add"),
        {
            "organisation": acme.pk,
            "name": "Echo",
            "slug": "echo",
            "enabled": "on",
            "allowlist": "",
            "required_labels": "",
            **SANDBOX_DEFAULTS,
            "runtime_command": "echo hi",
            "versions-TOTAL_FORMS": "0",
            "versions-INITIAL_FORMS": "0",
            "versions-MIN_NUM_FORMS": "0",
            "versions-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 200
    assert "a JSON list of arguments, e.g. [&quot;sh&quot;, &quot;-c&quot;" in (
        response.content.decode()
    )
    assert not Agent.objects.filter(slug="echo").exists()


def test_an_organisations_saved_version_opens_from_its_history(operator, acme):
    """simple_history's page of one version reads the admin's prepopulated fields directly:
    slug is read-only on an existing organisation, so none may be declared for it."""
    url = reverse("admin:organisations_organisation_change", args=[acme.pk])
    operator.post(
        url,
        {
            "name": "Acme",
            "base_allowlist": "api.anthropic.com\nmirror.example",
            **EMPTY_MEMBERSHIPS,
        },
    )
    for record in acme.history.all():
        page = reverse(
            "admin:organisations_organisation_simple_history", args=[acme.pk, record.history_id]
        )
        assert operator.get(page).status_code == 200
    added = operator.get(reverse("admin:organisations_organisation_add")).content.decode()
    # The add form still fills the slug in from the name.
    assert re.search(r'data-prepopulated-fields="[^"]*id_slug', added), added[-2000:]


def test_an_empty_organisation_is_deleted_from_the_admin_with_its_built_in_runner(operator):
    from organisations import services as organisations
    from organisations.models import Organisation
    from runners.models import Runner

    empty = organisations.create_organisation("Emptied")
    url = reverse("admin:organisations_organisation_delete", args=[empty.pk])
    confirm = operator.get(url).content.decode()
    assert "Cannot delete" not in confirm
    assert operator.post(url, {"post": "yes"}).status_code == 302
    assert not Organisation.objects.filter(pk=empty.pk).exists()
    assert not Runner.objects.filter(organisation_id=empty.pk).exists()


def test_an_organisation_with_a_registered_runner_is_kept(operator, acme):
    from tests.factories import online_runner

    online_runner(acme, "edge-1")
    url = reverse("admin:organisations_organisation_delete", args=[acme.pk])
    assert "Cannot delete organisation" in operator.get(url).content.decode()


def test_runner_labels_are_typed_and_cleaned_as_an_agents_are(operator, acme):
    from runners.models import Runner

    runner = Runner.objects.get(organisation=acme, builtin=True)
    url = reverse("admin:runners_runner_change", args=[runner.pk])
    page = operator.get(url).content.decode()
    inline = {  # the probes inline's management form, as the page gives it
        name: value
        for name, value in re.findall(r'name="([\w-]+-(?:TOTAL|INITIAL|MIN_NUM|MAX_NUM)_FORMS)"'
                                      r'[^>]*value="(\d+)"', page)
    }  # fmt: skip
    response = operator.post(url, {"name": runner.name, "labels": "GPU , eu", **inline})
    assert response.status_code == 302, response.content.decode()[-2000:]
    runner.refresh_from_db()
    assert runner.labels == ["eu", "gpu"]
    bad = operator.post(url, {"name": runner.name, "labels": "has space", **inline})
    assert bad.status_code == 200
    runner.refresh_from_db()
    assert runner.labels == ["eu", "gpu"]


def test_a_members_add_form_offers_only_their_organisations_rows(client, alice, acme, globex):
    from django.contrib.auth.models import Permission

    from tests.factories import WorkplaceFactory

    alice.is_staff = True
    alice.save()
    alice.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_agent", "view_agent", "change_agent"])
    )
    WorkplaceFactory(organisation=acme, name="Our bench")
    theirs = WorkplaceFactory(organisation=globex, name="Their lab")
    client.force_login(alice)
    page = client.get("/admin/agents/agent/add/").content.decode()
    organisation_select = page.split('name="organisation"', 1)[1].split("</select>", 1)[0]
    assert "Acme" in organisation_select and "Globex" not in organisation_select
    assert "Our bench" in page and "Their lab" not in page
    command_box = page.split('name="runtime_command"', 1)[1].split("</textarea>", 1)[0]
    assert command_box.endswith(">[]") or command_box.endswith(">\n[]"), command_box
    # Posting their ids anyway is refused as an invalid choice, and nothing is made.
    answer = client.post(
        "/admin/agents/agent/add/",
        {"organisation": globex.pk, "name": "Mole", "slug": "mole", "workplace": theirs.pk},
    )
    assert answer.status_code == 200
    assert "Select a valid choice" in answer.content.decode()
    assert not Agent.objects.filter(name="Mole").exists()


def test_a_member_sees_only_their_organisations_versions(client, alice, acme, globex):
    from django.contrib.auth.models import Permission

    alice.is_staff = True
    alice.save()
    alice.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_agentversion", "view_agent"])
    )
    ours = AgentFactory(organisation=acme, name="Builder")
    theirs = AgentFactory(organisation=globex, name="Spy")
    client.force_login(alice)
    page = client.get("/admin/agents/agentversion/").content.decode()
    assert "1 agent version" in page and str(ours) in page and str(theirs) not in page
    assert "Globex" not in page  # nor in the filters
    version = theirs.versions.get()
    assert client.get(f"/admin/agents/agentversion/{version.pk}/change/").status_code == 302
    titled = client.get(f"/admin/agents/agentversion/?agent__id__exact={theirs.pk}")
    assert f"Versions of {theirs}" not in titled.content.decode()
    mine = client.get(f"/admin/agents/agentversion/?agent__id__exact={ours.pk}")
    assert f"Versions of {ours}" in mine.content.decode()
