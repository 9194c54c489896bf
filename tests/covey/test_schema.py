"""The OpenAPI schemas (the public API, and apart what runners and proxies call) and their docs
pages, served without any outside host."""

import pytest
import yaml

from covey.urls import internal_api, public_api
from runners.auth import RunnerEndpoint

pytestmark = pytest.mark.django_db


def test_the_schema_lists_every_resource(client):
    response = client.get("/api/v1/schema/")
    assert response.status_code == 200
    schema = yaml.safe_load(response.content)
    paths = schema["paths"]
    for resource in ("organisations", "agents", "allowlist-templates", "workplaces"):
        assert f"/api/v1/{resource}/" in paths
    assert "/api/v1/agents/{id}/versions/" in paths
    assert "/api/v1/agents/{id}/effective-allowlist/" in paths


def test_the_docs_page_loads_its_assets_from_this_installation(client):
    response = client.get("/api/v1/docs/")
    assert response.status_code == 200
    assert b"https://" not in response.content


INTERNAL = ("/api/v1/runner/", "/api/v1/egress/policy/", "/api/v1/egress/decisions/")


def views(patterns):
    """The view classes behind URL patterns, included ones too."""
    for pattern in patterns:
        if hasattr(pattern, "url_patterns"):
            yield from views(pattern.url_patterns)
        else:
            yield getattr(pattern.callback, "cls", None)


def paths_of(client, url: str) -> dict:
    return client.get(url, {"format": "json"}).json()


def test_the_public_schema_leaves_out_what_runners_and_proxies_call(client):
    public = paths_of(client, "/api/v1/schema/")
    assert public["info"]["title"] == "covey API"
    assert "/api/v1/docs/internal/" in public["info"]["description"]
    paths = public["paths"]
    assert "/api/v1/runs/" in paths and "/api/v1/egress-decisions/" in paths
    assert "/api/v1/agents/{agent_id}/home/entries/" in paths
    assert "/api/v1/runners/" in paths  # the runners people list: public
    assert not [p for p in paths if p.startswith(INTERNAL) or p == "/api/v1/runners/register/"]


def test_the_internal_schema_holds_only_what_runners_and_proxies_call(client):
    internal = paths_of(client, "/api/v1/schema/internal/")
    assert internal["info"]["title"] == "covey internal API: runners and egress proxies"
    paths = set(internal["paths"])
    assert {"/api/v1/runner/runs/{run_id}/start/", "/api/v1/egress/policy/"} <= paths
    assert {"/api/v1/egress/decisions/", "/api/v1/runners/register/"} <= paths
    assert all(p.startswith(INTERNAL) or p == "/api/v1/runners/register/" for p in paths)
    # Each runner-token endpoint is documented here and only here.
    assert all(
        issubclass(v, RunnerEndpoint)
        for v in views(internal_api)
        if v.__name__ != "RegisterRunnerView"
    )
    assert not [
        v for v in views(public_api) if isinstance(v, type) and issubclass(v, RunnerEndpoint)
    ]


def test_the_internal_docs_page_serves_the_internal_schema(client):
    page = client.get("/api/v1/docs/internal/").content.decode()
    assert "/api/v1/schema/internal/" in page and "https://" not in page
    assert "covey internal API" in page
    assert "/api/v1/schema/internal/" not in client.get("/api/v1/docs/").content.decode()


def test_the_internal_schema_describes_the_proxys_bodies_from_their_dataclasses(client):
    internal = paths_of(client, "/api/v1/schema/internal/")
    schemas = internal["components"]["schemas"]
    policy = internal["paths"]["/api/v1/egress/policy/"]["get"]["responses"]["200"]
    assert policy["content"]["application/json"]["schema"]["$ref"].endswith("/Policy")
    forms = [ref["$ref"].rsplit("/", 1)[1] for ref in schemas["Policy"]["anyOf"]]
    assert forms == ["PolicySnapshot", "PolicySnapshotV1"]
    agent = schemas["AgentSnapshot"]["properties"]
    assert {"id", "username", "enabled", "budget_exhausted", "lists", "own", "tokens"} <= set(agent)
    assert "lists" in schemas["PolicySnapshot"]["properties"]
    batch = internal["paths"]["/api/v1/egress/decisions/"]["post"]["requestBody"]
    assert batch["content"]["application/json"]["schema"]["$ref"].endswith("/DecisionBatch")
    events = schemas["DecisionBatch"]["properties"]["events"]
    assert events["type"] == "array"
    proxy_event = schemas["ProxyEvent"]
    assert proxy_event["discriminator"]["propertyName"] == "event"
    assert set(proxy_event["discriminator"]["mapping"]) == {"decision", "close", "start", "stop"}
    decision = schemas["DecisionEvent"]["properties"]
    assert {"id", "kind", "host", "port", "allowed", "reason", "at", "boot", "seq"} <= set(decision)
    reason = schemas[decision["reason"]["$ref"].rsplit("/", 1)[1]]
    assert "not-on-allowlist" in reason["enum"]  # a StrEnum: its values, listed
