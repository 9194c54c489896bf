"""The wires between a proxy and the control plane, as a proxy of one version back speaks them.

The JSON here is what the proxy and the control plane sent before these bodies were typed
(egress/protocol.py), written out by hand from that code: an old proxy must keep working against
a new control plane, and a new proxy's bodies must be what an old control plane takes.
"""

import json
import re
from datetime import UTC, datetime

import httpx
import pytest
from rest_framework.test import APIClient

from allowlists.entries import Entry
from egress.models import Decision, ProxySession
from egress.policy import Code, Policy, hash_token
from egress.protocol import (
    STREAM_HEADER,
    CloseEvent,
    ConnectionKind,
    DecisionBatch,
    DecisionEvent,
    PolicySnapshot,
    snapshot_v1_json,
)
from egress.proxy.control_plane import ControlPlaneSource
from egress.proxy.feed import DecisionLog, PolicyFeed
from egress.services import issue_token
from templates.models import AllowlistTemplate
from tests.factories import AgentFactory, online_runner
from wire import ProtocolError

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


@pytest.mark.django_db
def test_a_proxy_that_asks_for_shared_lists_gets_each_list_once(acme, settings):
    stream = settings.COVEY_EGRESS_STREAM_URL = (
        "http://stream.example:8004/api/v1/egress/policy/stream/"
    )
    npm = AllowlistTemplate.objects.get(slug="npm")
    agents = [AgentFactory(organisation=acme, allowlist=[f"own-{n}.example"]) for n in range(3)]
    for agent in agents:
        agent.templates.add(npm)
    _, runner_token = online_runner(acme)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Runner {runner_token}")
    body = client.get("/api/v1/egress/policy/?v=2").json()
    snapshot = PolicySnapshot.from_json(body)
    base = f"base:{acme.slug}"
    assert snapshot.lists[base] == "\n".join(acme.base_allowlist)
    assert snapshot.lists["template:npm"] == "\n".join(npm.entries)
    assert len(snapshot.lists) == 1 + AllowlistTemplate.objects.count()
    served = {a.id: a for a in snapshot.agents}
    for n, agent in enumerate(agents):
        assert served[agent.pk].lists == (base, "template:npm")
        assert served[agent.pk].own == f"own-{n}.example"
    # The same policy as a proxy of before reads it: each agent's whole allowlist; and only
    # today's proxies are told of the stream, which sends today's form alone.
    answer = client.get("/api/v1/egress/policy/")
    old = answer.json()
    assert old == snapshot_v1_json(snapshot)
    assert STREAM_HEADER not in answer.headers
    assert client.get("/api/v1/egress/policy/?v=2").headers[STREAM_HEADER] == stream
    assert {tuple(a["entries"][npm.entries[0]]) for a in old["agents"]} == {("template:npm",)}


def test_a_new_proxys_batch_is_the_shape_an_old_control_plane_takes():
    sent = old_events(7)
    assert DecisionBatch.from_json({"events": sent}).to_json() == {"events": sent}


def test_the_addon_and_the_log_make_events_of_the_old_shape():
    written: list[dict] = []
    log = DecisionLog(lambda events: written.extend(e.to_json() for e in events), interval=3600)
    log.start()
    log.add(
        DecisionEvent(
            id=DECISION_ID, agent_id=7, username="acme.builder", kind=ConnectionKind.CONNECT,
            host="good.example", port=443, address="203.0.113.9", allowed=True,
            reason=Code.ALLOWED, detail="agent, template:github", at=AT + 1,
        )
    )  # fmt: skip
    log.add(CloseEvent(id=DECISION_ID, bytes_up=517, bytes_down=4096, at=AT + 3))
    log.stop()
    start, decision, close, stop = written
    old_start, old_decision, _, old_close, old_stop = old_events(7)
    assert set(start) == set(old_start) and set(stop) == set(old_stop)
    assert decision == {**old_decision, "boot": log.boot}
    assert close == old_close


@pytest.mark.django_db
def test_a_malformed_event_is_refused_with_a_400_naming_it_and_nothing_is_written(acme):
    agent = AgentFactory(organisation=acme)
    _, token = online_runner(acme)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Runner {token}")
    events = old_events(agent.pk)
    events[1] = {**events[1], "port": "443"}
    events[2] = {**events[2], "reason": "because"}
    response = client.post(
        "/api/v1/egress/decisions/", json.dumps({"events": events}), content_type="application/json"
    )
    assert response.status_code == 400
    assert response.json() == {"events": ["events[1].port: expected int, got str"]}
    assert not Decision.objects.exists() and not ProxySession.objects.exists()
    events[1] = old_events(agent.pk)[1]
    response = client.post(
        "/api/v1/egress/decisions/", json.dumps({"events": events}), content_type="application/json"
    )
    (problem,) = response.json()["events"]
    assert problem.startswith("events[2].reason: 'because' is not one of allowed, ")


OLD_AGENT = {"id": 7, "username": "a.b", "organisation": "a", "enabled": True,
             "budget_exhausted": False, "tokens": []}  # fmt: skip


def served(body: object) -> httpx.MockTransport:
    """A control plane that answers the policy with ``body`` (JSON)."""
    return httpx.MockTransport(lambda request: httpx.Response(200, json=body))


def test_a_proxy_reads_the_policy_an_old_control_plane_serves():
    old = {
        "generation": "g1",
        "agents": [
            {
                "id": 7, "username": "acme.builder", "organisation": "acme", "enabled": True,
                "budget_exhausted": False, "entries": {"git.example": ["agent"]},
                "tokens": [{"sha256": hash_token("s3cret"), "expires_at": AT}],
            }
        ],
        "built_in": [{"host": "gateway.example", "port": 8002, "name": "model gateway"}],
    }  # fmt: skip
    old["agents"][0]["entries"].update(
        {"api.example": ["base", "agent"], "deb.example:80": ["template:debian-ubuntu"]}
    )
    source = ControlPlaneSource("http://control-plane.invalid", lambda: "t")
    source._client = httpx.Client(base_url=source.url, transport=served(old))
    snapshot = source(None)
    assert snapshot is not None and snapshot_v1_json(snapshot) == old
    assert snapshot.lists == {
        "base:acme": "api.example",
        "template:debian-ubuntu": "deb.example:80",
    }
    policy = Policy.from_snapshot(snapshot)
    agent = policy.agents[7]
    assert policy.identify(("acme.builder", "s3cret"), AT - 1)[0] == agent
    assert policy.built_in == {("gateway.example", 8002): "model gateway"}
    assert agent.sources(Entry("api.example")) == ("base", "agent")
    assert agent.sources(Entry("deb.example", 80)) == ("template:debian-ubuntu",)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"generation": "g2", "agents": [{"id": "7"}]}, "PolicySnapshot.agents[0].id"),
        ({"generation": "g2"}, "PolicySnapshot.agents: missing"),
        ({"generation": "g2", "agents": [], "built_in": [{"host": "x"}]}, "built_in[0].port"),
        ([], "PolicySnapshot: expected an object"),
        # Of either form, the misfit is named where it is.
        (
            {
                "generation": "g2",
                "agents": [
                    {**OLD_AGENT, "entries": {"a.example": ["agent"]}},
                    {**OLD_AGENT, "entries": {"b.example": "agent"}},
                ],
            },
            "PolicySnapshot.agents[1].entries['b.example']: expected a list of text",
        ),
        (
            {"generation": "g2", "agents": [{**OLD_AGENT, "entries": {"a b": ["agent"]}}]},
            "PolicySnapshot.agents[0].entries: 'a b': whitespace",
        ),
        (
            {
                "generation": "g2",
                "agents": [{**OLD_AGENT, "lists": [], "own": ["a.example"]}],
                "lists": {},
            },
            "PolicySnapshot.agents[0].own: expected str, got list",
        ),
    ],
)
def test_a_proxy_refuses_a_malformed_policy_and_keeps_its_last_good_one(body, named):
    source = ControlPlaneSource("http://control-plane.invalid", lambda: "t")
    good = {"generation": "g1", "agents": []}
    source._client = httpx.Client(base_url=source.url, transport=served(good))
    feed = PolicyFeed(source, poll=60, grace=60)
    feed.refresh()
    source._client = httpx.Client(base_url=source.url, transport=served(body))
    with pytest.raises(ProtocolError, match=re.escape(named)):
        feed.refresh()
    current = feed.current()
    assert current is not None and current.generation == "g1"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_policy_is_read_at_one_moment(acme):
    """An agent's templates and what they hold are read in statements apart: on PostgreSQL
    (whose default gives each statement a moment of its own) every reader of the policy reads
    them in one snapshot, its transaction's first statement saying so."""
    from django.db import connection

    from egress.services import build_snapshot
    from egress.sources import DatabaseSource, DatabaseStore

    AgentFactory(organisation=acme)
    readers = {
        "the control plane's poll": lambda: build_snapshot(acme.pk),
        "the database proxy": lambda: DatabaseSource(acme.pk)(None),
        "the stream's load": lambda: DatabaseStore().load(acme.pk),
        "the stream's agents": lambda: DatabaseStore().agents(acme.pk, None),
        "the stream's lists": lambda: DatabaseStore().lists(acme.pk),
    }
    for name, read in readers.items():
        statements: list[str] = []

        def record(execute, sql, params, many, context, statements=statements):
            statements.append(sql)
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            read()
        assert statements[0] == "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", name
