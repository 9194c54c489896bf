"""Memberships through the API: members read, admins add, change and remove, as in the admin;
another organisation's are simply 404."""

import pytest

from organisations.models import Membership, Role
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_members_read_their_organisations_memberships_and_no_others(api, acme, alice, vera, gary):
    answer = api(vera).get("/api/v1/memberships/")
    assert answer.status_code == 200
    rows = {(row["user"], row["role"]) for row in answer.json()["results"]}
    assert ("alice", "admin") in rows and ("vera", "viewer") in rows
    assert all(row["organisation"] == acme.pk for row in answer.json()["results"])
    theirs = Membership.objects.get(user=gary)
    assert api(alice).get(f"/api/v1/memberships/{theirs.pk}/").status_code == 404
    assert api(alice).delete(f"/api/v1/memberships/{theirs.pk}/").status_code == 404


def test_an_admin_adds_a_member_changes_their_role_and_removes_them(api, acme, alice):
    UserFactory(username="nina")
    added = api(alice).post(
        "/api/v1/memberships/", {"organisation": acme.pk, "user": "nina", "role": "viewer"}, "json"
    )
    assert added.status_code == 201, added.json()
    url = f"/api/v1/memberships/{added.json()['id']}/"
    changed = api(alice).patch(url, {"role": "approver"}, "json")
    assert (changed.status_code, changed.json()["role"]) == (200, "approver")
    membership = Membership.objects.get(user__username="nina")
    assert membership.role == Role.APPROVER
    assert membership.history.first().history_user == alice  # recorded, with who did it
    again = api(alice).post(
        "/api/v1/memberships/", {"organisation": acme.pk, "user": "nina"}, "json"
    )
    assert again.status_code == 400 and "member of Acme already" in str(again.json())
    assert api(alice).delete(url).status_code == 204
    assert not Membership.objects.filter(user__username="nina").exists()


def test_approvers_and_viewers_change_nothing(api, acme, april, vera, alice):
    UserFactory(username="nina")
    for user in (april, vera):
        added = api(user).post(
            "/api/v1/memberships/", {"organisation": acme.pk, "user": "nina"}, "json"
        )
        assert added.status_code == 400 and "does not allow this" in str(added.json())
    theirs = Membership.objects.get(user=vera)
    assert (
        api(vera).patch(f"/api/v1/memberships/{theirs.pk}/", {"role": "admin"}, "json").status_code
        == 403
    )
    assert api(april).delete(f"/api/v1/memberships/{theirs.pk}/").status_code == 403
    assert Membership.objects.get(user=vera).role == Role.VIEWER


def test_an_organisation_keeps_its_last_admin(api, acme, alice):
    own = Membership.objects.get(user=alice, organisation=acme)
    demoted = api(alice).patch(f"/api/v1/memberships/{own.pk}/", {"role": "viewer"}, "json")
    assert demoted.status_code == 400 and "at least one admin" in str(demoted.json())
    assert api(alice).delete(f"/api/v1/memberships/{own.pk}/").status_code == 400
    assert Membership.objects.get(pk=own.pk).role == Role.ADMIN
    # With a second admin, the first may step down.
    UserFactory(username="nina")
    api(alice).post(
        "/api/v1/memberships/", {"organisation": acme.pk, "user": "nina", "role": "admin"}, "json"
    )
    assert (
        api(alice).patch(f"/api/v1/memberships/{own.pk}/", {"role": "viewer"}, "json").status_code
        == 200
    )


def test_bad_input_says_what_is_wrong(api, acme, alice, globex):
    unknown = api(alice).post(
        "/api/v1/memberships/", {"organisation": acme.pk, "user": "nobody-here"}, "json"
    )
    assert unknown.status_code == 400 and "user" in unknown.json()
    UserFactory(username="nina")
    role = api(alice).post(
        "/api/v1/memberships/", {"organisation": acme.pk, "user": "nina", "role": "owner"}, "json"
    )
    assert role.status_code == 400 and "role" in role.json()
    elsewhere = api(alice).post(
        "/api/v1/memberships/", {"organisation": globex.pk, "user": "nina"}, "json"
    )
    assert elsewhere.status_code == 400 and "organisation" in elsewhere.json()
    own = Membership.objects.get(user=alice, organisation=acme)
    moved = api(alice).patch(f"/api/v1/memberships/{own.pk}/", {"user": "nina"}, "json")
    assert moved.status_code == 400 and "do not change" in str(moved.json())
    assert not Membership.objects.filter(user__username="nina").exists()
