"""What the web process answers when the database refuses a value a validator let through
(covey.middleware.ValueRefused): 400 with the reason, never a 500, nothing written. Found by
the API fuzzer (tests/security/test_api_fuzz.py), on the real PostgreSQL."""

import pytest
from rest_framework.test import APIClient

from organisations.models import Membership

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def api(alice) -> APIClient:
    client = APIClient()
    client.force_authenticate(alice)
    return client


def test_a_time_zone_offset_past_what_postgresql_knows_is_a_400(api):
    answer = api.get("/api/v1/egress-decisions/?decided_at__gte=2299-03-26T22:28:48.6-21:58")
    assert answer.status_code == 400, answer.content
    assert "time zone displacement out of range" in answer.json()["detail"]
    later = api.get("/api/v1/egress-decisions/?decided_at__gte=2299-03-26T22:28:48.6-02:00")
    assert later.status_code == 200


def test_a_nul_character_in_a_looked_up_name_is_a_400_and_adds_nobody(api, acme):
    members = Membership.objects.count()
    answer = api.post(
        "/api/v1/memberships/",
        {"organisation": acme.slug, "user": "bo\x00b", "role": "viewer"},
        format="json",
    )
    assert answer.status_code == 400, answer.content
    assert "NUL" in answer.json()["detail"]
    assert Membership.objects.count() == members
