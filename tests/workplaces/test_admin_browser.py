"""Workplaces in the admin, in a real browser (Debian's Chromium driven by Playwright): made,
changed into a new version, a bad change refused with its message, and the history read."""

import json

import pytest

from tests.agents.test_admin_browser import browser, page  # noqa: F401 (fixtures)
from workplaces.models import Workplace

pytestmark = pytest.mark.django_db(transaction=True)

DB = [
    {
        "name": "db",
        "image": "postgres:16",
        "environment": {"POSTGRES_PASSWORD": "test"},
        "ready": {"command": ["pg_isready"], "timeout": 30},
    }
]


def test_a_workplace_is_made_changed_and_its_versions_read_in_the_admin(page, acme):  # noqa: F811
    page.goto("/admin/workplaces/workplace/add/")
    page.select_option("#id_organisation", str(acme.pk))
    page.fill("#id_name", "dev")
    page.fill("#id_image", "covey-base:trixie")
    page.fill("#id_packages_apt", "jq\nhello\n")
    page.click("input[name=_save]")
    page.wait_for_selector("text=was added successfully")
    workplace = Workplace.objects.get(name="dev")
    assert (workplace.version, workplace.packages) == (1, {"apt": ["hello", "jq"]})

    page.goto(f"/admin/workplaces/workplace/{workplace.pk}/change/")
    assert page.input_value("#id_packages_apt") == "hello\njq"
    page.fill("#id_services", '[{"name": "localhost", "image": "postgres:16"}]')
    page.click("input[name=_continue]")
    assert "the name localhost is reserved" in page.inner_text(".field-services")
    workplace.refresh_from_db()
    assert workplace.version == 1  # nothing was saved

    page.fill("#id_services", json.dumps(DB))
    page.fill("#id_packages_apt", "hello")
    page.fill("#id_packages_pip", "requests @ https://evil.example/r.whl")
    page.click("input[name=_continue]")
    assert "names a URL" in page.inner_text(".field-packages_pip")  # under its own field
    workplace.refresh_from_db()
    assert workplace.version == 1
    page.fill("#id_packages_pip", "PyYAML==6.0.2")
    page.fill("#id_packages_npm", "typescript@5.6.3")
    page.click("input[name=_continue]")
    page.wait_for_selector("text=was changed successfully")
    workplace.refresh_from_db()
    assert workplace.version == 2
    assert workplace.packages == {
        "apt": ["hello"],
        "pip": ["pyyaml==6.0.2"],
        "npm": ["typescript@5.6.3"],
    }
    assert workplace.services[0]["ready"]["interval"] == 1.0
    assert json.loads(page.input_value("#id_services"))[0]["name"] == "db"
    history = page.inner_text("#versions-group")
    # One row per changed setting, with its before and after.
    assert "packages apt\thello, jq\thello" in history
    assert "pg_isready" in history

    page.click("text=History")
    page.wait_for_selector(f"text=Versions of {workplace}")
    rows = page.locator("#result_list > tbody > tr")
    assert rows.count() == 2, page.inner_text("#result_list")
