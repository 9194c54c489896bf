"""The wires between a proxy and the control plane, as a proxy of one version back speaks them.

The JSON here is what the proxy and the control plane sent before these bodies were typed
(egress/protocol.py), written out by hand from that code: an old proxy must keep working against
a new control plane, and a new proxy's bodies must be what an old control plane takes.
"""

import json
from datetime import UTC, datetime

import pytest
from rest_framework.test import APIClient

from egress.models import Decision, ProxySession
from egress.services import issue_token
from tests.factories import AgentFactory, online_runner

BOOT = "5f0c4b1e9a7d4e2f8b3a6c1d0e9f8a7b"
AT = 1765000000.25  # time.time() as the proxy sent it
DECISION_ID = "0b9e1c8a-4f3d-4e2a-9c7b-6d5e4f3a2b1c"
REFUSED_ID = "7a6b5c4d-3e2f-4a1b-8c9d-0e1f2a3b4c5d"


def old_events(agent_id: int) -> list[dict]:
    """A batch as a proxy of one version back posted it: its start, an allowed tunnel, a refused
    plain request, the tunnel's close and its stop."""
    return [
        {"event": "start", "boot": BOOT, "at": AT},
        {
            "event": "decision", "id": DECISION_ID, "agent_id": agent_id,
            "username": "acme.builder", "kind": "connect", "host": "good.example", "port": 443,
            "address": "203.0.113.9", "allowed": True, "reason": "allowed",
            "detail": "agent, template:github", "at": AT + 1, "boot": BOOT, "seq": 1,
        },
        {
            "event": "decision", "id": REFUSED_ID, "agent_id": None, "username": "",
            "kind": "http", "host": "bad.example", "port": 80, "address": None,
            "allowed": False, "reason": "proxy-auth-required", "detail": "", "at": AT + 2,
            "boot": BOOT, "seq": 2,
        },
        {"event": "close", "id": DECISION_ID, "bytes_up": 517, "bytes_down": 4096, "at": AT + 3},
        {"event": "stop", "boot": BOOT, "seq": 2, "at": AT + 4},
    ]  # fmt: skip


@pytest.mark.django_db
def test_a_batch_from_a_proxy_of_one_version_back_is_recorded_as_it_was(acme):
    agent = AgentFactory(organisation=acme)
    _, token = online_runner(acme)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Runner {token}")
    response = client.post(
        "/api/v1/egress/decisions/",
        json.dumps({"events": old_events(agent.pk)}),
        content_type="application/json",
    )
    assert response.status_code == 201, response.content
    assert response.json() == {"recorded": 5}
    allowed, refused = Decision.objects.get(pk=DECISION_ID), Decision.objects.get(pk=REFUSED_ID)
    assert (allowed.agent_id, allowed.kind, allowed.host, allowed.port, allowed.address) == (
        agent.pk, "connect", "good.example", 443, "203.0.113.9",
    )  # fmt: skip
    assert (allowed.allowed, allowed.reason, allowed.detail) == (
        True, "allowed", "agent, template:github",
    )  # fmt: skip
    assert (allowed.bytes_up, allowed.bytes_down) == (517, 4096)
    assert allowed.decided_at == datetime.fromtimestamp(AT + 1, tz=UTC)
    assert allowed.closed_at == datetime.fromtimestamp(AT + 3, tz=UTC)
    assert (refused.agent_id, refused.address, refused.allowed, refused.kind) == (
        None, None, False, "http",
    )  # fmt: skip
    session = ProxySession.objects.get(boot=BOOT)
    assert (session.end, session.made, session.recorded, session.gap) == ("stopped", 2, 2, "")


@pytest.mark.django_db
def test_the_policy_a_proxy_of_one_version_back_reads_keeps_its_shape(acme, settings):
    settings.COVEY_MODEL_GATEWAY_URL = "http://gateway.example:8002"
    agent = AgentFactory(organisation=acme, allowlist=["git.example", "deb.example:80"])
    token, _ = issue_token(agent)
    _, runner_token = online_runner(acme)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Runner {runner_token}")
    response = client.get("/api/v1/egress/policy/")
    assert response.status_code == 200
    body = json.loads(response.content)
    assert response.headers["ETag"] == f'"{body["generation"]}"'
    (served,) = body["agents"]
    entries = served.pop("entries")
    assert served == {
        "id": agent.pk,
        "username": f"{acme.slug}.{agent.slug}",
        "organisation": acme.slug,
        "enabled": True,
        "budget_exhausted": False,
        "tokens": [{"sha256": token.sha256, "expires_at": token.expires_at.timestamp()}],
    }
    assert entries["git.example"] == ["agent"]
    assert entries["deb.example:80"] == ["agent"]
    assert all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in entries.values())
    assert set(body) == {"generation", "agents", "built_in"}
    assert body["built_in"] == [{"host": "gateway.example", "port": 8002, "name": "model gateway"}]
