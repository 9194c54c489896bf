"""Hostile JSON at every door of the web process: a body nested past any sense, NaN and
Infinity, lone surrogates, and fields the API does not have are each a 400 saying what is wrong
and where, never a server error or a silent acceptance. The desk's filings (what a sandbox asks
for, through its proxy) are held to the REST API's own serializer. The proxy's desk and the
model gateway, as real processes: tests/egress/test_desk.py, tests/budgets/test_gateway.py."""

import json
from typing import Any
from unittest import mock

import pytest
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiRequest
from rest_framework import serializers
from rest_framework.test import APIClient

import jsonbodies
from agents.models import Agent
from approvals.models import Request
from covey.api import RefusesUnknownFields
from egress.environment import DESK_TOKEN_HEADER
from egress.policy import hash_token
from egress.services import issue_token
from homes import services as homes
from runners.auth import RunnerEndpoint
from runners.protocol import HOME_ANSWER_HEADER, HomeOp
from runners.views import RegisterRunnerView
from tests.factories import AgentFactory, online_runner, runner_api

pytestmark = pytest.mark.django_db

NESTED = "[" * 50_000
LONE = json.dumps({"reason": {"evil": ["\ud800"]}})  # "\ud800" escaped: what a client sends


def post(client: APIClient, url: str, raw: str, headers: dict[str, str] | None = None) -> Any:
    return client.post(url, raw, content_type="application/json", headers=headers)


@pytest.fixture
def runner(acme):
    return online_runner(acme)


def test_it_reads_json_strictly_and_says_where_it_is_wrong():
    table = {
        b"[" * 50_000: (None, "nested deeper than 64 levels"),
        b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}": ("a", "nested deeper than 64 levels"),
        b'{"reason": NaN}': ("reason", "not a finite number"),
        b'{"n": [1, -Infinity]}': ("n", "n[1]: not a finite number"),
        b'{"n": 1e999}': ("n", "not a finite number"),
        LONE.encode(): ("reason", r"reason.evil[0]: a lone surrogate (\ud800)"),
        b'{"\\udfff": 1}': (r"\udfff", r"a lone surrogate (\udfff)"),
        b'"\xed\xa0\x80"': (None, "not utf-8 text"),  # a surrogate spelt in UTF-8 bytes
        b'{"reason": "x"': (None, "not JSON: Expecting"),
    }
    for raw, (field, said) in table.items():
        with pytest.raises(jsonbodies.Malformed) as refused:
            jsonbodies.loads(raw)
        assert refused.value.field == field, raw[:40]
        assert said in refused.value.message, raw[:40]
    deep_enough = b"[" * 64 + b"]" * 64
    assert jsonbodies.loads(deep_enough)
    assert jsonbodies.loads('{"name": "caf\u00e9 \U0001f600", "n": 1.5}')["n"] == 1.5


# --- 11: nesting past the stack, at every JSON door of the web process ---------------------


def test_a_body_nested_50000_deep_is_a_400_at_every_door_people_use(api, acme, alice):
    agent = AgentFactory(organisation=acme)
    client = api(alice)
    doors = [
        ("post", "/api/v1/requests/"),
        ("post", "/api/v1/agents/"),
        ("patch", f"/api/v1/agents/{agent.pk}/"),
        ("post", "/api/v1/runs/"),
        ("post", f"/api/v1/agents/{agent.pk}/home/mkdir/"),
        ("post", "/api/v1/runners/register/"),
    ]
    for method, url in doors:
        answer = getattr(client, method)(url, NESTED, content_type="application/json")
        assert answer.status_code == 400, (url, answer.content[:200])
        assert answer.json() == {"detail": "JSON parse error - nested deeper than 64 levels"}


def test_a_body_nested_50000_deep_is_a_400_at_every_door_runners_use(acme, runner):
    _, token = runner
    client = runner_api(APIClient(), token)
    for url in (
        "/api/v1/runner/",
        "/api/v1/runner/probes/",
        "/api/v1/runner/pause/",
        "/api/v1/runner/requests/",
        "/api/v1/egress/decisions/",
    ):
        answer = post(client, url, NESTED)
        assert answer.status_code == 400, (url, answer.content[:200])
        assert "nested deeper than 64 levels" in answer.json()["detail"]


def test_a_home_answer_header_nested_past_the_stack_is_a_400(acme, runner, orders):
    found, token = runner
    agent = AgentFactory(organisation=acme)
    Agent.objects.filter(pk=agent.pk).update(home_runner=found)
    op = homes.order(Agent.objects.get(pk=agent.pk), HomeOp.READ, path="a")
    client = runner_api(APIClient(), token)
    assert client.post(f"/api/v1/runner/home/{op.pk}/take/").status_code == 200
    answer = client.put(
        f"/api/v1/runner/home/{op.pk}/body/",
        b"",
        content_type="application/octet-stream",
        # gunicorn takes 8190 bytes of a header; the view must not count on a server's limit
        headers={HOME_ANSWER_HEADER: NESTED},
    )
    assert answer.status_code == 400
    assert "nested deeper than 64 levels" in answer.json()[HOME_ANSWER_HEADER]


# --- 13: NaN, Infinity and lone surrogates are a 400 naming the field ------------------------


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ('{"name": NaN}', "not a finite number"),
        ('{"name": Infinity}', "not a finite number"),
        ('{"name": 1e999}', "not a finite number"),
        ('{"name": "a\\ud800b"}', r"a lone surrogate (\ud800) is not Unicode text"),
        ('{"name": "a\\udfffb"}', r"a lone surrogate (\udfff) is not Unicode text"),
    ],
)
def test_nan_infinity_and_lone_surrogates_are_a_400_naming_the_field(api, acme, alice, raw, said):
    answer = post(api(alice), "/api/v1/agents/", raw)
    assert answer.status_code == 400
    (told,) = answer.json()["name"]
    assert said in told and set(answer.json()) == {"name"}
    assert not Agent.objects.exists()


def test_a_key_that_is_a_lone_surrogate_is_named_escaped(api, alice):
    answer = post(api(alice), "/api/v1/agents/", '{"\\udfff": 1}')
    assert answer.status_code == 400
    assert answer.json() == {r"\udfff": [r"a lone surrogate (\udfff) is not Unicode text"]}


# --- 12: the desk's filings go through the REST API's serializer -----------------------------


@pytest.fixture
def credential(acme):
    agent = AgentFactory(organisation=acme)
    _, credentials = issue_token(agent)
    return agent, hash_token(credentials.split(":", 1)[1])


def test_the_desk_refuses_a_reason_that_is_not_text_as_the_rest_api_does(
    api, acme, alice, runner, credential
):
    agent, token_sha256 = credential
    desk = runner_api(APIClient(), runner[1])
    for reason in ({"evil": ["x"]}, ["x"], None, True):
        filing = {"kind": "egress", "target": "pypi.org", "reason": reason}
        at_desk = post(desk, "/api/v1/runner/requests/", json.dumps(filing),
                       headers={DESK_TOKEN_HEADER: token_sha256})  # fmt: skip
        by_api = post(api(alice), "/api/v1/requests/", json.dumps({**filing, "agent": agent.pk}))
        assert (at_desk.status_code, by_api.status_code) == (400, 400), reason
        assert at_desk.json()["reason"] == by_api.json()["reason"], reason
        assert at_desk.json()["detail"].startswith("reason: ")
    assert not Request.objects.exists()  # nothing stored "{'evil': ['x']}"


def test_the_desk_refuses_fields_it_does_not_have_and_takes_what_covey_request_sends(
    runner, credential
):
    _, token_sha256 = credential
    desk = runner_api(APIClient(), runner[1])
    extra = {"kind": "egress", "target": "pypi.org", "reason": "x", "agent": 1, "scope": "org"}
    refused = post(desk, "/api/v1/runner/requests/", json.dumps(extra),
                   headers={DESK_TOKEN_HEADER: token_sha256})  # fmt: skip
    assert refused.status_code == 400
    assert set(refused.json()) == {"agent", "scope", "detail"}
    assert "Unknown field" in refused.json()["scope"][0]
    listed = post(desk, "/api/v1/runner/requests/", "[]", headers={DESK_TOKEN_HEADER: token_sha256})
    assert listed.status_code == 400 and "Expected a dictionary" in listed.json()["detail"]
    # Exactly what covey-request sends (egress/sandbox/covey_request.py).
    for filing, status in (
        ({"kind": "egress", "target": "registry.example.test", "reason": "the SDK"}, 201),
        # Its agent has no workplace: refused for that, not for a field covey-request sends.
        ({"kind": "package", "ecosystem": "apt", "package": "jq", "reason": "parse JSON"}, 400),
    ):
        answer = post(desk, "/api/v1/runner/requests/", json.dumps(filing),
                      headers={DESK_TOKEN_HEADER: token_sha256})  # fmt: skip
        assert answer.status_code == status, answer.content
        assert "Unknown field" not in answer.content.decode()
        if status == 400:
            assert "no workplace" in answer.content.decode()
    assert Request.objects.filter(kind="egress").count() == 1


def test_the_control_plane_hosts_desk_validates_as_the_runners_does(credential):
    from egress import sources

    _, token_sha256 = credential
    file = sources.desk_functions["file"]  # what DatabaseDesk calls, in a transaction of its own
    filing = {"kind": "egress", "target": "pypi.org", "reason": {"evil": ["x"]}}
    code, body = file(token_sha256, filing)
    assert code == 400 and body["reason"] == ["Not a valid string."]
    code, body = file(token_sha256, {**filing, "reason": "x"})
    assert code == 201 and body["what"] == "pypi.org:443"


# --- 14: unknown fields are a 400 naming them, across the API -------------------------------


def test_an_unknown_field_in_an_agent_change_is_a_400_naming_it(api, acme, alice):
    agent = AgentFactory(organisation=acme, runtime_command=[])
    answer = api(alice).patch(
        f"/api/v1/agents/{agent.pk}/", {"command": ["make", "test"]}, format="json"
    )
    assert answer.status_code == 400
    (told,) = answer.json()["command"]
    assert told.startswith("Unknown field; the fields are: ")
    assert "runtime_command" in told and "created_at" not in told  # the ones it takes
    agent.refresh_from_db()
    assert agent.runtime_command == []
    # A field it shows is known: what a GET answered may be sent back.
    shown = api(alice).get(f"/api/v1/agents/{agent.pk}/").json()
    assert api(alice).put(f"/api/v1/agents/{agent.pk}/", shown, format="json").status_code == 200


def test_unknown_fields_are_refused_across_the_api(api, acme, alice):
    agent = AgentFactory(organisation=acme)
    client = api(alice)
    for url, body in (
        ("/api/v1/runs/", {"agent": agent.pk, "task": "x", "priority": 9}),
        ("/api/v1/budgets/", {"organisation": acme.pk, "amount": "5", "limit": "5"}),
        ("/api/v1/requests/", {"agent": agent.pk, "kind": "egress", "target": "a.example",
                               "reason": "x", "scope": "org"}),
        ("/api/v1/egress-tokens/", {"agent": agent.pk, "expires": 60}),
        (f"/api/v1/agents/{agent.pk}/home/mkdir/", {"path": "a", "parents": True}),
    ):  # fmt: skip
        answer = client.post(url, body, format="json")
        assert answer.status_code == 400, (url, answer.content)
        unknown = {"priority", "limit", "scope", "expires", "parents"} & set(body)
        assert set(answer.json()) >= unknown, (url, answer.json())


def request_bodies() -> list[tuple[str, Any, Any]]:
    """(method and path, view, serializer) of every operation with a body in the schema."""
    seen = []
    original = AutoSchema._get_request_body

    def recording(self: AutoSchema, direction: str = "request") -> Any:
        if self.method in ("PUT", "PATCH", "POST"):
            seen.append((f"{self.method} {self.path}", self.view, self.get_request_serializer()))
        return original(self, direction)

    with mock.patch.object(AutoSchema, "_get_request_body", recording):
        SchemaGenerator().get_schema(request=None, public=True)
    return seen


def serializer_classes(given: Any) -> list[type]:
    if isinstance(given, dict):
        return [c for value in given.values() for c in serializer_classes(value)]
    if isinstance(given, OpenApiRequest):
        return serializer_classes(given.request)
    if isinstance(given, serializers.ListSerializer):
        return serializer_classes(given.child)
    cls = given if isinstance(given, type) else type(given)
    return [cls] if issubclass(cls, serializers.Serializer) else []


def test_every_public_api_body_is_read_by_a_serializer_that_refuses_unknown_fields():
    bodies = request_bodies()
    lenient = set()
    for operation, view, given in bodies:
        # The runner protocol ignores keys it does not know (runners/protocol.py: a newer
        # runner may send more): what runners send is not held to the public API's rule.
        if isinstance(view, RunnerEndpoint | RegisterRunnerView):
            continue
        for cls in serializer_classes(given):
            writable = any(not f.read_only for f in cls().fields.values())
            if writable and not issubclass(cls, RefusesUnknownFields):
                lenient.add(f"{operation}: {cls.__module__}.{cls.__qualname__}")
    assert len(bodies) > 20  # the schema was read
    assert sorted(lenient) == []


def test_a_runner_heartbeat_with_a_field_this_control_plane_does_not_know_still_counts(runner):
    _, token = runner
    client = runner_api(APIClient(), token)
    body = {"isolation": "cooperative", "ready": True, "problem": "", "from_a_newer_runner": 1}
    assert post(client, "/api/v1/runner/", json.dumps(body)).status_code == 200
