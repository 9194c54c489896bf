"""Admin flows in a real browser: Debian's Chromium driven by Playwright (headless, no browser
download), against a live server with the test database."""

import os
from collections.abc import Iterator

import pytest
from django.utils import timezone
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import expect, sync_playwright

from organisations.models import Membership, Organisation, Role
from runners.models import Runner
from runs import output
from runs import services as runs
from tests.factories import AgentFactory, UserFactory, WorkplaceFactory

CHROMIUM = os.environ.get("COVEY_TEST_CHROMIUM", "/usr/bin/chromium")
PASSWORD = "a-browser-password-1"
WINDOW = {"width": 1280, "height": 800}

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not os.access(CHROMIUM, os.X_OK):
        message = f"no Chromium at {CHROMIUM} (scripts/test-services installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    # Playwright's sync API keeps an event loop on this thread; the ORM calls of the test and
    # its fixtures are still plain synchronous calls, which Django refuses beside a loop.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            # Nothing of Chromium's own may reach out: this machine has no internet.
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()
    del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]


def signed_in(context, username: str):
    """A page of the browser context, signed in to the admin through its own form; what goes
    wrong in it (its script errors, its failed requests) is kept in ``page.problems``."""
    page = context.new_page()
    page.problems = []
    page.on("pageerror", lambda error: page.problems.append(f"script error: {error}"))
    page.on("requestfailed", lambda request: page.problems.append(f"failed: {request.url}"))
    page.goto("/admin/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")
    return page


# The admin's prepopulate script can fill the slug: its keyup handler is on the name, and the
# URLify it calls is loaded.
PREPOPULATE_READY = """() => !!(window.django && django.jQuery && typeof URLify === "function"
    && (django.jQuery._data(document.getElementById("id_name"), "events") || {}).keyup)"""


def type_name_and_see_slug(page, name: str, slug: str) -> None:
    """Type a form's name as a person does, once the admin's script can fill its slug from it,
    and see the slug filled. On a busy machine the slug was seen to stay empty after typing,
    twice, and not again alone: a failure says what the page's scripts and requests said."""
    try:
        page.wait_for_function(PREPOPULATE_READY, timeout=20_000)
        page.locator("#id_name").press_sequentially(name)
        expect(page.locator("#id_slug")).to_have_value(slug, timeout=20_000)
    except (AssertionError, PlaywrightError) as exc:  # the wait times out with the latter
        problems = getattr(page, "problems", "not collected")
        raise AssertionError(f"{exc}\nwhat went wrong in the page: {problems}") from None


@pytest.fixture
def page(browser, live_server):
    """A signed-in operator (a superuser) on the admin."""
    UserFactory(username="operator", is_staff=True, is_superuser=True, password=PASSWORD)
    context = browser.new_context(base_url=live_server.url)
    yield signed_in(context, "operator")
    context.close()


@pytest.fixture
def window(browser, live_server):
    """A signed-in operator (a superuser) on the admin, in a window 1280 pixels wide: what
    matters on each list must fit it."""
    UserFactory(username="operator", is_staff=True, is_superuser=True, password=PASSWORD)
    context = browser.new_context(base_url=live_server.url, viewport=WINDOW)
    yield signed_in(context, "operator")
    context.close()


def hidden_columns(page, columns: list[str]) -> dict[str, str]:
    """The named columns of a list that are not whole in view without scrolling, each with
    where it ends and where the view does (the window's edge, or the list's own, which
    scrolls sideways beside its filters)."""
    return page.evaluate(
        """(columns) => {
            const view = document.querySelector("#changelist .results").getBoundingClientRect();
            const limit = Math.min(window.innerWidth, view.right);
            const hidden = {};
            for (const column of columns) {
                const cell = document.querySelector("#result_list th.column-" + column);
                const right = cell ? cell.getBoundingClientRect().right : Infinity;
                if (right > limit) hidden[column] = `ends at ${right}, the view at ${limit}`;
            }
            return hidden;
        }""",
        columns,
    )


def test_an_organisation_added_in_the_browser_is_ready_to_run_agents(page, settings):
    settings.COVEY_EGRESS_BASE_ALLOWLIST = ["api.anthropic.com"]
    page.goto("/admin/organisations/organisation/add/")
    assert page.input_value("#id_base_allowlist") == "api.anthropic.com"
    type_name_and_see_slug(page, "Initech", "initech")
    page.click("input[name=_save]")
    page.wait_for_url("**/admin/organisations/organisation/")
    assert "was added successfully" in page.content()
    organisation = Organisation.objects.get(slug="initech")
    assert organisation.base_allowlist == ["api.anthropic.com"]
    assert Runner.objects.filter(organisation=organisation, builtin=True).exists()
    membership = Membership.objects.get(organisation=organisation)
    assert (membership.user.username, membership.role) == ("operator", Role.ADMIN)


def test_a_runs_output_opens_from_its_page_in_the_browser(page, acme, orders):
    runner = Runner.objects.get(organisation=acme, builtin=True)
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=timezone.now())
    run = runs.queue_run(AgentFactory(organisation=acme, name="Builder"), "build it")
    runs.start(str(run.pk), runner)
    output.append_output(str(run.pk), runner, 0, "compiling…\n")
    page.goto(f"/admin/runs/run/{run.pk}/change/")
    assert "acme/builder" in page.title()
    with page.expect_navigation():
        page.click("text=the output so far")
    assert page.inner_text("body").strip() == "compiling…"


def test_an_agents_history_button_opens_its_versions(page, acme):
    from agents import services

    agent = services.create_agent(acme, "Builder", allowlist=["one.example"])
    services.update_agent(agent, allowlist=["one.example", "two.example"])
    page.goto(f"/admin/agents/agent/{agent.pk}/change/")
    with page.expect_navigation():
        page.click("a.historylink")
    assert "/admin/agents/agentversion/" in page.url
    assert "two.example" in page.inner_text("#result_list")


def test_the_add_form_asks_only_what_can_be_set_and_names_values_for_people(window, acme):
    window.goto("/admin/agents/agent/add/")
    form = window.inner_text("#agent_form")
    for label in ("CPUs:", "Memory (MiB):", "Home quota (MiB):", "Run timeout (seconds):"):
        assert label in form, form
    assert "Memory mb" not in form and "Cpus" not in form
    # What comes with the agent once saved is not on the form that makes it.
    for later in ("Version", "Effective allowlist", "Recent runs", "Browse the home", "Spent"):
        assert f"{later}:" not in form, later
    assert window.locator("#versions-group").count() == 0
    empty = window.locator("#id_workplace option[value='']").inner_text()
    assert empty == "the default workplace"

    window.select_option("#id_organisation", str(acme.pk))
    type_name_and_see_slug(window, "Builder", "builder")
    window.click("input[name=_continue]")
    window.wait_for_selector("text=was added successfully")
    page = window.inner_text("#agent_form")
    assert "Effective allowlist:" in page and "Version:" in page  # on the saved agent's page


def test_a_viewer_reads_an_agent_without_a_workplace_as_on_the_default_one(client, acme, vera):
    from agents import services

    agent = services.create_agent(acme, "Builder", allowlist=["one.example"])
    services.update_agent(agent, workplace=WorkplaceFactory(organisation=acme))
    services.update_agent(agent, workplace=None)
    client.force_login(vera)
    page = client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert "the default workplace" in page
    versions = client.get(f"/admin/agents/agentversion/?agent__id__exact={agent.pk}")
    assert "the default workplace" in versions.content.decode()
    assert "&quot;id&quot;" not in versions.content.decode()  # the workplace by name
