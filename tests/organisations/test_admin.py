"""Organisations and memberships in the admin, as in the API: a member sees their
organisations' rows only; their admins change them, through the same services (an
organisation keeps at least one admin); the platform team (superusers) everywhere."""

import pytest
from django.contrib.auth.models import Permission
from django.urls import reverse

from organisations.models import Membership, Organisation, Role, Webhook
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def staff(client, user):
    """The user as a staff member with every permission on organisations and memberships:
    what they may do is then their organisations' and roles' to say."""
    user.is_staff = True
    user.save()
    user.user_permissions.add(*Permission.objects.filter(content_type__app_label="organisations"))
    client.force_login(user)
    return client


def membership(organisation, user):
    return Membership.objects.get(organisation=organisation, user=user)


def change_url(row):
    return reverse("admin:organisations_membership_change", args=[row.pk])


def organisation_form(organisation, rows, *, extra=()):
    """What the organisation's page posts: its fields and its member rows (``rows``: existing
    memberships with their new roles, or to delete; ``extra``: new (user, role))."""
    data = {
        "name": organisation.name,
        "base_allowlist": "\n".join(organisation.base_allowlist),
        "request_expiry_minutes": "",
        "own_requests": organisation.own_requests,
        "webhook_url": "",
        "memberships-TOTAL_FORMS": str(len(rows) + len(extra)),
        "memberships-INITIAL_FORMS": str(len(rows)),
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
    }
    for n, (row, role) in enumerate(rows):
        data |= {
            f"memberships-{n}-id": str(row.pk),
            f"memberships-{n}-organisation": str(organisation.pk),
            f"memberships-{n}-user": row.user.username,
            f"memberships-{n}-role": role or row.role,
        }
        if role is None:
            data[f"memberships-{n}-DELETE"] = "on"
    for n, (user, role) in enumerate(extra, start=len(rows)):
        data |= {
            f"memberships-{n}-organisation": str(organisation.pk),
            f"memberships-{n}-user": user.username,
            f"memberships-{n}-role": role,
        }
    return data


def test_a_member_sees_only_their_organisations_and_memberships(client, acme, globex, vera, gary):
    staff(client, vera)
    listed = client.get(reverse("admin:organisations_membership_changelist")).content.decode()
    assert "vera" in listed and "gary" not in listed
    organisations = client.get(reverse("admin:organisations_organisation_changelist"))
    assert "Acme" in organisations.content.decode()
    assert "Globex" not in organisations.content.decode()
    other = client.get(change_url(membership(globex, gary)))
    assert other.status_code == 302  # "doesn't exist": another organisation's row
    page = client.get(reverse("admin:organisations_organisation_change", args=[globex.pk]))
    assert page.status_code == 302


def test_a_viewer_changes_no_membership_nor_makes_themselves_admin(client, acme, alice, vera):
    staff(client, vera)
    own = membership(acme, vera)
    assert client.post(change_url(own), {"role": Role.ADMIN}).status_code == 403
    delete = reverse("admin:organisations_membership_delete", args=[membership(acme, alice).pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403
    added = client.post(
        reverse("admin:organisations_membership_add"),
        {
            "organisation": acme.pk,
            "user": UserFactory(username="newcomer").username,
            "role": "admin",
        },
    )
    assert added.status_code == 403  # adding members takes an admin role somewhere
    rows = [(own, Role.ADMIN), (membership(acme, alice), None)]
    page = reverse("admin:organisations_organisation_change", args=[acme.pk])
    assert client.post(page, organisation_form(acme, rows)).status_code == 403
    assert membership(acme, vera).role == Role.VIEWER
    assert membership(acme, alice).role == Role.ADMIN


def test_the_last_admin_is_neither_demoted_nor_removed(client, acme, alice, vera):
    staff(client, alice)
    own = membership(acme, alice)
    demoted = client.post(change_url(own), {"role": Role.VIEWER})
    assert demoted.status_code == 200
    assert b"an organisation keeps at least one admin" in demoted.content
    delete = reverse("admin:organisations_membership_delete", args=[own.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403
    page = reverse("admin:organisations_organisation_change", args=[acme.pk])
    rows = [(own, Role.VIEWER), (membership(acme, vera), None)]
    response = client.post(page, organisation_form(acme, rows))
    assert response.status_code == 200
    assert b"an organisation keeps at least one admin" in response.content
    assert set(Membership.objects.filter(organisation=acme).values_list("role", flat=True)) == {
        Role.ADMIN,
        Role.VIEWER,
    }
    changelist = reverse("admin:organisations_membership_changelist")
    both = {"action": "delete_selected", "_selected_action": [own.pk, membership(acme, vera).pk]}
    asked = client.post(changelist, both)  # the confirmation names what may not be deleted
    assert b"would result in deleting related objects" in asked.content
    assert client.post(changelist, both | {"post": "yes"}).status_code == 403
    assert Membership.objects.filter(organisation=acme).count() == 2
    vera_only = {"action": "delete_selected", "_selected_action": [membership(acme, vera).pk]}
    client.post(changelist, vera_only | {"post": "yes"})
    assert list(Membership.objects.filter(organisation=acme).values_list("user", flat=True)) == [
        alice.pk
    ]


def test_an_admin_hands_over_and_adds_members_on_the_organisations_page(client, acme, alice, vera):
    staff(client, alice)
    newcomer = UserFactory(username="newcomer")
    page = reverse("admin:organisations_organisation_change", args=[acme.pk])
    rows = [(membership(acme, alice), Role.VIEWER), (membership(acme, vera), Role.ADMIN)]
    response = client.post(page, organisation_form(acme, rows, extra=[(newcomer, "approver")]))
    assert response.status_code == 302, response.content.decode()[-2000:]
    roles = dict(Membership.objects.filter(organisation=acme).values_list("user__username", "role"))
    assert roles == {"alice": "viewer", "vera": "admin", "newcomer": "approver"}
    added = Membership.history.filter(user=newcomer, history_type="+").get()
    assert added.history_user == alice


def test_a_new_organisations_creator_is_its_admin_unless_the_rows_leave_none(client, root):
    client.force_login(root)
    other = UserFactory(username="other")
    add = reverse("admin:organisations_organisation_add")
    blank = Organisation(name="Initech", base_allowlist=["api.anthropic.com"])
    data = organisation_form(blank, [], extra=[(root, Role.VIEWER)]) | {"slug": "initech"}
    refused = client.post(add, data)
    assert refused.status_code == 200
    assert b"an organisation keeps at least one admin" in refused.content
    assert not Organisation.objects.filter(name="Initech").exists()
    data = organisation_form(blank, [], extra=[(other, Role.VIEWER)]) | {"slug": "initech"}
    assert client.post(add, data).status_code == 302
    made = Organisation.objects.get(name="Initech")
    roles = dict(Membership.objects.filter(organisation=made).values_list("user__username", "role"))
    assert roles == {"root": "admin", "other": "viewer"}


def test_a_loopback_webhook_is_refused_when_the_organisation_is_saved(operator_client, acme):
    page = reverse("admin:organisations_organisation_change", args=[acme.pk])
    data = organisation_form(acme, []) | {"webhook_url": "http://127.0.0.1:9/hook"}
    answer = operator_client.post(page, data)
    assert answer.status_code == 200
    assert "127.0.0.1 is at 127.0.0.1, not a public address" in answer.content.decode()
    assert not Webhook.objects.filter(organisation=acme).exists()
