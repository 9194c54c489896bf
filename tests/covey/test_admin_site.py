"""covey's admin site: members sign in by being members, a refusal is a styled 403 that names
the role it takes (one log line, no traceback), an action changes only what the person may
change, the start page says what to do first, and the runners list says what the cooperative
level leaves open."""

import logging

import pytest
from django.contrib.auth.models import Permission
from django.utils import timezone

from approvals import services as approvals
from organisations.models import Membership, Role
from runners.models import Runner
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
    client.force_login(nobody)
    assert client.get("/admin/").status_code == 200
    listed = client.get("/admin/agents/agent/").content.decode()
    assert "0 agents" in listed


def test_the_refusal_page_has_the_admins_breadcrumbs(client, acme, vera):
    client.force_login(vera)
    page = client.get("/admin/agents/agent/add/").content.decode()
    assert '<ol class="breadcrumbs">' in page and "Not allowed" in page


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
