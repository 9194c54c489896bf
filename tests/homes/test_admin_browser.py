"""The home's file browser in a real browser (Debian's Chromium driven by Playwright, headless)
against the real control plane (gunicorn) and a runner process with no database, which holds
the home on disk."""

import pytest

from homes.models import HomeChange
from tests.agents.test_admin_browser import PASSWORD, browser  # noqa: F401 (a fixture)
from tests.factories import server_user

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
]


def test_a_person_uploads_renames_downloads_and_deletes_a_file_in_a_home(
    browser,  # noqa: F811 (the fixture imported above)
    stack,
    acme,
    tmp_path,
):
    server_user("operator", PASSWORD, is_staff=True, is_superuser=True)
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Keeper", ["true"])
    upload = tmp_path / "report.txt"
    upload.write_text("what the agent should read\n")
    context = browser.new_context(base_url=stack.url, accept_downloads=True)
    page = context.new_page()
    try:
        with stack.runner(runner, config):
            page.goto("/admin/login/")
            page.fill("#id_username", "operator")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/")

            page.goto(f"/admin/agents/agent/{agent.pk}/change/")
            page.click("text=list, download, upload, move, delete")  # the agent's home link
            page.wait_for_selector("#home-listing")
            assert "Empty." in page.inner_text("#home-listing")

            page.set_input_files("#home-upload input[name=files]", str(upload))
            page.click("#home-upload input[type=submit]")
            page.wait_for_selector("tr[data-name='report.txt']")
            assert "Uploaded report.txt" in page.content()
            assert "27 bytes of 10.0 GiB (1 file)" in page.inner_text("#home-usage")

            page.click("tr[data-name='report.txt'] >> text=rename")
            page.fill("input[name=target]", "read-me.txt")
            page.click("#home-confirm input[type=submit]")
            page.wait_for_selector("tr[data-name='read-me.txt']")
            assert page.locator("tr[data-name='report.txt']").count() == 0

            with page.expect_download() as downloading:
                page.click("tr[data-name='read-me.txt'] >> text=download")
            downloaded = downloading.value
            assert downloaded.suggested_filename == "read-me.txt"
            with open(downloaded.path()) as file:
                assert file.read() == "what the agent should read\n"

            page.click("tr[data-name='read-me.txt'] >> text=delete")
            assert "This cannot be undone" in page.inner_text("#home-confirm")
            page.click("#home-confirm input[type=submit]")
            page.wait_for_selector("text=Deleted read-me.txt")
            assert page.locator("tr[data-name='read-me.txt']").count() == 0
            assert "0 bytes of 10.0 GiB (0 files)" in page.inner_text("#home-usage")
            assert "operator" in page.inner_text("#home-changes")
        home = stack.home(runner, agent)
        assert list(home.iterdir()) == []
    finally:
        context.close()
    assert [c.operation for c in HomeChange.objects.order_by("at")] == ["write", "move", "delete"]
