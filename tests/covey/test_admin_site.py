"""covey's admin site: members sign in by being members, a refusal is a styled 403 that names
the role it takes (one log line, no traceback), an action changes only what the person may
change, the start page says what to do first, and the runners list says what the cooperative
level leaves open."""

import logging
from decimal import Decimal

import pytest
from django.contrib.auth.models import Permission
from django.utils import timezone

from agents.models import Agent
from approvals import services as approvals
from budgets.models import Budget
from organisations.models import Membership, Role
from runners.models import RegistrationToken, Runner
from templates.models import AllowlistTemplate
from tests.factories import AgentFactory, online_runner

pytestmark = pytest.mark.django_db


def test_a_member_signs_in_without_the_staff_flag_and_a_stranger_does_not(client, vera, nobody):
    assert not vera.is_staff and not vera.user_permissions.exists()
    signed = client.post(
        "/admin/login/?next=/admin/",
        {"username": "vera", "password": "a-long-test-password"},
    )
    assert signed.status_code == 302 and signed.url == "/admin/"
    assert client.get("/admin/agents/agent/").status_code == 200
    client.logout()
    refused = client.post(
        "/admin/login/", {"username": "nobody", "password": "a-long-test-password"}
    )
    assert "belongs to no organisation yet" in refused.content.decode()
    client.force_login(nobody)
    assert client.get("/admin/agents/agent/").status_code == 302  # to the sign-in page


def test_a_refusal_is_a_styled_page_naming_the_role_and_one_line_in_the_log(
    client, acme, vera, caplog
):
    client.force_login(vera)
    with caplog.at_level(logging.WARNING, logger="django.request"):
        answer = client.get("/admin/agents/agent/add/")
    assert answer.status_code == 403
    page = answer.content.decode()
    assert "admin/css/base.css" in page and 'id="header"' in page
    assert (
        "Adding agents takes the admin role in their organisation; you are a viewer of Acme."
        in page
    )
    lines = [r for r in caplog.records if r.name == "django.request"]
    assert len(lines) == 1 and lines[0].exc_info is None  # no traceback


def test_an_action_changes_only_the_rows_of_organisations_the_person_administers(
    client, acme, globex, alice, gary
):
    Membership.objects.create(organisation=globex, user=alice, role=Role.VIEWER)
    ours, _ = online_runner(acme, "edge-1")
    theirs, _ = online_runner(globex, "their-edge")
    client.force_login(alice)
    answer = client.post(
        "/admin/runners/runner/",
        {"action": "pause_runners", "_selected_action": [ours.pk, theirs.pk]},
        follow=True,
    )
    assert Runner.objects.get(pk=ours.pk).paused
    assert not Runner.objects.get(pk=theirs.pk).paused
    said = answer.content.decode()
    assert "1 selected row(s) left alone: Changing runners takes the admin role" in said


def test_an_installation_with_no_organisation_says_what_to_do_first(client, root):
    client.force_login(root)
    page = client.get("/admin/").content.decode()
    assert 'id="first-step"' in page and "/admin/organisations/organisation/add/" in page


def test_the_runners_list_says_the_cooperative_level_is_bypassable_and_how_to_close_it(
    client, acme, alice
):
    runner, _ = online_runner(acme, "edge-1")
    client.force_login(alice)
    assert "Cooperative isolation" not in client.get("/admin/runners/runner/").content.decode()
    Runner.objects.filter(pk=runner.pk).update(isolation="cooperative")
    page = client.get("/admin/runners/runner/").content.decode()
    assert "Cooperative isolation on edge-1" in page
    assert "ignores its proxy settings" in page and "COVEY_EGRESS_ISOLATION=network" in page


def test_djangos_permissions_alone_let_nobody_in(client, acme, nobody):
    """The staff flag with every permission, but no membership: a member of nothing sees
    nothing of any organisation (the platform team is made of superusers)."""
    nobody.is_staff = True
    nobody.save()
    nobody.user_permissions.add(*Permission.objects.filter(content_type__app_label="agents"))
    agent = AgentFactory(organisation=acme, name="Builder")
    client.force_login(nobody)
    assert client.get("/admin/").status_code == 200
    listed = client.get("/admin/agents/agent/").content.decode()
    assert "0 agents" in listed and "Builder" not in listed
    assert client.get(f"/admin/agents/agent/{agent.pk}/change/").status_code == 302


def test_the_refusal_page_has_the_admins_breadcrumbs(client, acme, vera):
    client.force_login(vera)
    page = client.get("/admin/agents/agent/add/").content.decode()
    assert '<ol class="breadcrumbs">' in page and "Not allowed</li>" in page


def test_a_viewer_is_told_requests_wait_and_an_approver_to_decide_them(client, acme, vera, april):
    agent = AgentFactory(organisation=acme, name="Builder")  # no workplace of its own
    request = approvals.file_egress(agent, "registry.example.test", reason="the SDK")
    client.force_login(vera)
    index = client.get("/admin/").content.decode()
    assert "1 pending request</a> waiting for a decision" in index
    listed = client.get("/admin/approvals/request/?status__exact=pending").content.decode()
    assert "Select request to view" in listed
    client.force_login(april)
    assert "1 pending request</a> to decide" in client.get("/admin/").content.decode()
    decide = client.get(f"/admin/approvals/request/{request.pk}/decide/").content.decode()
    # Its agent has no workplace: "every agent of its workplace" would only be refused.
    assert 'value="agent"' in decide and 'value="workplace"' not in decide


def test_times_read_to_the_second_and_the_browser_asks_for_no_icon_in_vain(client, root, acme):
    client.force_login(root)
    page = client.get(f"/admin/organisations/organisation/{acme.pk}/change/").content.decode()
    made = timezone.localtime(acme.created_at).strftime("%Y-%m-%d %H:%M:%S")
    assert made in page
    assert client.get("/favicon.ico").status_code == 204


def test_the_user_page_says_members_need_no_staff_flag_and_lists_their_roles(client, root, vera):
    client.force_login(root)
    page = client.get(f"/admin/auth/user/{vera.pk}/change/").content.decode()
    assert "Not needed to sign in: a member of an organisation signs in" in page
    assert "Memberships (changed on each organisation" in page and "Viewer" in page


# --- what a review found (each failed before its fix) ------------------------------------


@pytest.fixture
def alice_in_both(acme, globex, alice, gary):
    """Alice: admin of Acme, viewer of Globex."""
    Membership.objects.create(organisation=globex, user=alice, role=Role.VIEWER)
    return alice


def test_history_pages_show_only_the_persons_rows_and_revert_nothing_for_a_reader(
    client, acme, globex, vera, gary
):
    client.force_login(vera)
    theirs = f"/admin/organisations/organisation/{globex.pk}/history/"
    assert client.get(theirs).status_code == 404
    version = globex.history.latest().history_id
    assert client.get(f"{theirs}{version}/").status_code == 404
    assert client.post(f"{theirs}{version}/", {"name": "Pwned"}).status_code == 404
    own = Membership.objects.get(organisation=acme, user=vera)
    page = f"/admin/organisations/membership/{own.pk}/history/{own.history.latest().history_id}/"
    assert client.get(page).status_code == 200  # her own row's past: read
    assert client.post(page, {"role": "admin"}).status_code == 403  # not saved back
    assert Membership.objects.get(pk=own.pk).role == Role.VIEWER
    template = AllowlistTemplate.objects.first()
    template.save()  # shipped by a migration: its first version in the history now
    page = f"/admin/templates/allowlisttemplate/{template.pk}/history/"
    answer = client.post(f"{page}{template.history.latest().history_id}/", {"entries": "x.test"})
    assert answer.status_code == 403 and "takes the platform team" in answer.content.decode()


def test_an_admin_of_one_organisation_adds_nothing_to_another_they_only_view(
    client, globex, alice_in_both
):
    client.force_login(alice_in_both)
    form = client.get("/admin/runners/registrationtoken/add/").content.decode()
    assert "Acme" in form and "Globex" not in form
    posted = client.post(
        "/admin/runners/registrationtoken/add/", {"organisation": globex.pk, "description": "x"}
    )
    assert posted.status_code == 200 and "Select a valid choice" in posted.content.decode()
    assert not RegistrationToken.objects.filter(organisation=globex).exists()


@pytest.mark.parametrize("index", ["-1", " 0", "7", "²"])
def test_an_action_is_narrowed_however_its_index_is_written(client, globex, alice_in_both, index):
    theirs = AgentFactory(organisation=globex, name="Spy")
    client.force_login(alice_in_both)
    answer = client.post(
        "/admin/agents/agent/",
        {"action": "disable_agents", "index": index, "_selected_action": [theirs.pk]},
    )
    assert answer.status_code in (200, 302)
    assert Agent.objects.get(pk=theirs.pk).enabled


def test_an_organisations_admin_deletes_neither_its_cap_nor_its_runners(client, acme, alice):
    cap = Budget.objects.create(organisation=acme, agent=None, amount=Decimal(10))
    runner, _ = online_runner(acme, "edge-1")
    client.force_login(alice)
    assert (
        client.post(f"/admin/budgets/budget/{cap.pk}/delete/", {"post": "yes"}).status_code == 403
    )
    deleted = client.post(f"/admin/runners/runner/{runner.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 403
    assert (
        Budget.objects.filter(pk=cap.pk).exists() and Runner.objects.filter(pk=runner.pk).exists()
    )


def test_a_deeply_nested_command_in_the_agent_form_is_a_form_error(client, acme, alice):
    agent = AgentFactory(organisation=acme, name="Builder")
    client.force_login(alice)
    page = client.get(f"/admin/agents/agent/{agent.pk}/change/")
    data = {
        field.name: field.value() or ""
        for field in page.context["adminform"].form
        if field.name not in ("templates", "required_labels")
    }
    data |= {"runtime_command": "[" * 100_000, "required_labels": ""}
    for key in [k for k in data if data[k] is None]:
        data[key] = ""
    answer = client.post(f"/admin/agents/agent/{agent.pk}/change/", data)
    assert answer.status_code == 200
    assert "Not JSON covey takes" in answer.content.decode()


def test_a_viewer_reads_the_organisation_without_empty_form_boxes(client, vera, acme):
    from organisations import webhooks

    acme.base_allowlist = ["api.anthropic.com", "pypi.example"]
    acme.save()
    webhooks.set_webhook(acme, "https://hooks.example/covey")
    client.force_login(vera)
    page = client.get(f"/admin/organisations/organisation/{acme.pk}/change/").content.decode()
    assert "api.anthropic.com<br>pypi.example" in page
    assert "None" not in page
    assert "hooks.example" not in page  # the URL is the admins'; its state is shown
    assert "signing secret made" in page


def test_the_organisation_autocomplete_pages_in_order(client, root, acme, globex, recwarn):
    client.force_login(root)
    url = (
        "/admin/autocomplete/?app_label=organisations&model_name=membership&field_name=organisation"
    )
    answer = client.get(url)
    assert [row["text"] for row in answer.json()["results"]] == ["Acme", "Globex"]
    assert not [w for w in recwarn if "unordered object_list" in str(w.message)]
