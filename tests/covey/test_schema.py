"""The OpenAPI schema and its docs page, served without any outside host."""

import pytest
import yaml

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
