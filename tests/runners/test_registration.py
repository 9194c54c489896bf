"""Runner registration and runner-token authentication of the egress endpoints."""

import pytest

from agents import services as agent_services
from egress.services import issue_token
from runners.models import Runner
from runners.services import create_registration_token
from tests.factories import AgentFactory

pytestmark = pytest.mark.django_db


def register(client, secret, name="edge-1", labels=("eu",)):
    return client.post(
        "/api/v1/runners/register/",
        {"registration_token": secret, "name": name, "labels": list(labels)},
        content_type="application/json",
    )


def test_a_registration_token_buys_a_runner_token_shown_once(client, acme):
    _, secret = create_registration_token(acme)
    response = register(client, secret)
    assert response.status_code == 201, response.content
    body = response.json()
    runner = Runner.objects.get(pk=body["id"])
    assert runner.organisation == acme
    assert body["token"].startswith("covey-run-")
    assert body["token"] not in str(Runner.objects.values_list())  # stored hashed


@pytest.mark.parametrize(
    ("secret", "name", "labels", "field"),
    [
        ("covey-reg-wrong", "edge-1", ["eu"], "registration_token"),
        (None, "edge-1", ["bad label"], "labels"),
        (None, "", ["eu"], "name"),
    ],
)
def test_bad_registrations_are_field_errors(client, acme, secret, name, labels, field):
    _, good = create_registration_token(acme)
    response = register(client, secret or good, name=name, labels=labels)
    assert response.status_code == 400
    assert field in response.json()
    assert Runner.objects.filter(builtin=False).count() == 0


def test_a_revoked_registration_token_is_refused(client, acme):
    token, secret = create_registration_token(acme)
    token.revoked_at = token.created_at
    token.save()
    assert register(client, secret).status_code == 400


def test_runner_names_are_unique_per_organisation(client, acme):
    _, secret = create_registration_token(acme)
    assert register(client, secret).status_code == 201
    response = register(client, secret)
    assert response.status_code == 400
    assert "exists already" in str(response.json()["name"])


def test_the_policy_endpoint_serves_only_the_runners_organisation(client, acme, globex):
    ours = AgentFactory(organisation=acme)
    AgentFactory(organisation=globex)
    issue_token(ours)
    _, secret = create_registration_token(acme)
    token = register(client, secret).json()["token"]
    auth = {"HTTP_AUTHORIZATION": f"Runner {token}"}
    response = client.get("/api/v1/egress/policy/", **auth)
    assert response.status_code == 200
    body = response.json()
    assert [a["id"] for a in body["agents"]] == [ours.pk]
    assert len(body["agents"][0]["tokens"]) == 1
    etag = response.headers["ETag"]
    unchanged = client.get("/api/v1/egress/policy/", HTTP_IF_NONE_MATCH=etag, **auth)
    assert unchanged.status_code == 304
    agent_services.update_agent(ours, allowlist=["new.example"])
    changed = client.get("/api/v1/egress/policy/", HTTP_IF_NONE_MATCH=etag, **auth)
    assert changed.status_code == 200
    assert "new.example" in changed.json()["agents"][0]["entries"]


def test_the_decision_endpoint_refuses_people_and_malformed_batches(client, api, root, acme):
    assert api(root).post("/api/v1/egress/decisions/", {"events": []}).status_code in (401, 403)
    _, secret = create_registration_token(acme)
    token = register(client, secret).json()["token"]
    response = client.post(
        "/api/v1/egress/decisions/",
        {"events": [{"event": "decision", "id": "not-a-uuid"}]},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Runner {token}",
    )
    assert response.status_code == 400
