"""The admin's titles: its header and every page's browser title say covey."""

import re

import pytest
from django.test import Client

from tests.factories import AgentFactory

pytestmark = pytest.mark.django_db


def title(page: bytes) -> str:
    found = re.search(r"<title>(.*?)</title>", page.decode(), re.S)
    assert found is not None
    return found.group(1).strip()


def test_the_admins_pages_say_covey(operator_client, acme):
    login = Client().get("/admin/login/").content  # not signed in
    assert title(login) == "Log in | covey"
    index = operator_client.get("/admin/").content
    assert title(index) == "Dashboard | covey"
    assert b'<div id="site-name"><a href="/admin/">covey administration</a></div>' in index
    agent = AgentFactory(organisation=acme, name="Builder")
    page = operator_client.get(f"/admin/agents/agent/{agent.pk}/change/").content
    assert title(page).endswith("| covey") and "Django" not in title(page)
    listed = operator_client.get("/admin/runners/runner/").content
    assert title(listed) == "Select runner to change | covey"
