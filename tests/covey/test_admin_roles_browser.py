"""The admin as each member of Acme uses it, in a real browser (Debian's Chromium driven by
Playwright), with Globex beside it: a viewer, an approver and an admin sign in by being members
(no staff flag, no Django permission), every page they reach from the index renders in the
admin's style and shows nothing of Globex (lists, filters, choices, autocompletes), and what
their role does not allow is a styled 403 that names the role it takes."""

import re
from collections.abc import Iterator
from decimal import Decimal

import pytest
from django.utils import timezone

from agents import services as agent_services
from approvals import services as approvals
from approvals.models import Request, Status
from budgets.models import Budget
from connections import services as connections
from connections.models import CredentialedRequest
from organisations.models import Membership, Role
from runs import services as runs
from tests.agents.test_admin_browser import PASSWORD, browser, signed_in  # noqa: F401
from tests.factories import (
    AgentFactory,
    OrganisationFactory,
    UserFactory,
    WorkplaceFactory,
    decision_event,
    online_runner,
    record_events,
)

pytestmark = pytest.mark.django_db(transaction=True)

# What only Globex has: none of it may reach a page an Acme member sees.
RANDOM = re.compile(r'name="csrfmiddlewaretoken" value="[^"]*"|csrftoken=[^;"]*')
GLOBEX = ("Globex", "globex", "Spy", "their-edge", "their.example.test", "GlobexPlace", "gary")


@pytest.fixture
def world(orders):
    """Acme with something on every page; Globex with the same, which Acme never sees."""
    acme, globex = OrganisationFactory(name="Acme"), OrganisationFactory(name="Globex")
    people = {}
    for name, role in (("alice", Role.ADMIN), ("april", Role.APPROVER), ("vera", Role.VIEWER)):
        people[role] = UserFactory(username=name, password=PASSWORD)
        Membership.objects.create(organisation=acme, user=people[role], role=role)
    gary = UserFactory(username="gary", password=PASSWORD)
    Membership.objects.create(organisation=globex, user=gary, role=Role.ADMIN)
    for organisation, agent_name, place, edge, host, slug in (
        (acme, "Builder", "AcmePlace", "edge-1", "evil.example.test", "acme"),
        (globex, "Spy", "GlobexPlace", "their-edge", "their.example.test", "globex"),
    ):
        workplace = WorkplaceFactory(organisation=organisation, name=place)
        agent = AgentFactory(organisation=organisation, name=agent_name, workplace=workplace)
        approvals.file_egress(agent, host, reason="it needs it")
        run = runs.queue_run(agent, f"work of {agent_name}")
        forge = connections.create_connection(
            organisation, f"{edge}-forge", "token", "t0ken-of-the-test", git_url=f"https://{host}"
        )
        agent_services.update_agent(
            agent, credential_grants=[{"connection": forge.name, "repositories": [f"{slug}/app"]}]
        )
        CredentialedRequest.objects.create(
            organisation=organisation, agent=agent, run=run, connection=forge, at=timezone.now(),
            method="POST", host=host, repository=f"{slug}/app", service="git-receive-pack",
            status=200, refused="protected by covey: the default branch (HEAD) is never pushed to",
            refs=[{"ref": "refs/heads/main", "old": "1" * 40, "new": "2" * 40, "refused": "x"}],
        )  # fmt: skip
        online_runner(organisation, edge)
        Budget.objects.create(organisation=organisation, agent=agent, amount=Decimal(10))
        record_events([decision_event(agent, host=host, allowed=False, reason="not-on-allowlist")])
    return {"acme": acme, "globex": globex, "people": people}


@pytest.fixture
def sign_in(browser, live_server) -> Iterator[object]:  # noqa: F811
    """Signs a person in through the admin's own form, in a 1280-pixel window."""
    contexts = []

    def sign_in_as(username: str) -> object:
        context = browser.new_context(
            base_url=live_server.url, viewport={"width": 1280, "height": 900}
        )
        contexts.append(context)
        return signed_in(context, username)

    yield sign_in_as
    for context in contexts:
        context.close()


def assert_styled_and_tenant_clean(page, url: str) -> None:
    """The page is the admin's (its stylesheet, header and title) and names nothing of
    Globex, in its text, its filters, its choices or its markup."""
    assert page.locator("link[href*='admin/css/base.css']").count() == 1, url
    assert page.locator("#header").is_visible(), url
    assert page.title().endswith("| covey"), (url, page.title())
    # Random tokens (CSRF) are left out: "Spy" turns up in one now and then by chance.
    html = RANDOM.sub("", page.content())
    leaked = [word for word in GLOBEX if word in html]
    assert not leaked, (url, leaked)


def reachable(page) -> list[str]:
    """Every list the index offers the person (each app's page and each model's list)."""
    links = page.locator("#content-main caption a.section, #content-main th[scope=row] a")
    hrefs = links.evaluate_all("found => found.map(a => a.getAttribute('href'))")
    return sorted(set(hrefs))


def visit_everything(page) -> list[str]:
    """Each list the index offers, and the first row of each, checked; what was visited."""
    visited = ["/admin/"]
    assert_styled_and_tenant_clean(page, "/admin/")
    for listing in reachable(page):
        answer = page.goto(listing)
        assert answer.status == 200, listing
        assert_styled_and_tenant_clean(page, listing)
        visited.append(listing)
        first = page.locator("#result_list tbody tr th a, #result_list tbody tr td a").first
        if first.count():
            href = first.get_attribute("href")
            answer = page.goto(href)
            assert answer.status == 200, href
            assert_styled_and_tenant_clean(page, href)
            visited.append(href)
    return visited


def refused(page, url: str, role_words: str) -> None:
    answer = page.goto(url)
    assert answer.status == 403, url
    assert page.locator("link[href*='admin/css/base.css']").count() == 1
    said = page.inner_text("#content-main")
    assert role_words in said, (url, said)


def autocomplete_names(page, query: str) -> str:
    answer = page.request.get(f"/admin/autocomplete/?{query}")
    assert answer.status == 200, query  # every member may look their organisations up
    return answer.text()


def test_a_viewer_reads_every_page_of_acme_and_nothing_of_globex(sign_in, world):
    page = sign_in("vera")
    visited = visit_everything(page)
    for listing in ("/admin/agents/agent/", "/admin/runs/run/", "/admin/approvals/request/",
                    "/admin/budgets/budget/", "/admin/runners/runner/", "/admin/egress/decision/",
                    "/admin/homes/home/", "/admin/workplaces/workplace/",
                    "/admin/connections/connection/",
                    "/admin/connections/credentialedrequest/"):  # fmt: skip
        assert listing in visited, (listing, visited)
    # From the run's page to its credentialed requests, the refused push in red; from the
    # organisation's page to its credential history.
    run = world["acme"].agents.get().runs.get()
    page.goto(f"/admin/runs/run/{run.pk}/change/")
    page.click("text=1 request(s), 1 refused")
    assert "refused: protected by covey" in page.inner_text("#result_list")
    assert_styled_and_tenant_clean(page, "the run's credentialed requests")
    page.goto(f"/admin/organisations/organisation/{world['acme'].pk}/change/")
    page.click("text=their history, and grants'")
    history = page.inner_text("#credential-history")
    assert "connection edge-1-forge made" in history and "grants of Builder" in history
    assert_styled_and_tenant_clean(page, "Acme's credential history")
    page.goto("/admin/agents/agent/")
    assert "Builder" in page.inner_text("#result_list")
    # The requests list: no decide button for a viewer, and nothing of Globex in its filters.
    page.goto("/admin/approvals/request/?status__exact=pending")
    assert "evil.example.test" in page.inner_text("#result_list")
    assert page.locator("#result_list a.button").count() == 0
    agent = world["acme"].agents.get()
    refused(page, "/admin/agents/agent/add/", "takes the admin role")
    refused(page, f"/admin/agents/agent/{agent.pk}/delete/", "takes the admin role in Acme")
    assert "you are a viewer of Acme" in page.inner_text("#content-main")
    request = Request.objects.get(organisation=world["acme"])
    page.goto(f"/admin/approvals/request/{request.pk}/decide/")
    assert "only approvers and admins" in page.inner_text("#content-main")
    assert page.locator("#request-decision input[type=submit]").count() == 0
    # Another organisation's row is not found, and not named.
    theirs = world["globex"].agents.get()
    page.goto(f"/admin/agents/agent/{theirs.pk}/change/")
    assert "doesn’t exist" in page.inner_text("#content") or page.url.endswith("/admin/")
    assert_styled_and_tenant_clean(page, "another organisation's agent")
    names = autocomplete_names(
        page, "app_label=organisations&model_name=membership&field_name=organisation&term="
    )
    assert "Acme" in names and "Globex" not in names


def test_an_approver_decides_and_changes_nothing_else(sign_in, world):
    page = sign_in("april")
    visit_everything(page)
    request = Request.objects.get(organisation=world["acme"])
    page.goto("/admin/approvals/request/?status__exact=pending")
    page.click("#result_list a.button")  # the decide button, in a 1280-pixel window
    page.check("input[name=decision][value=reject]")
    page.fill("textarea[name=note]", "not this host")
    page.click("#request-decision input[type=submit]")
    page.wait_for_selector("text=Rejected: evil.example.test:443 for acme/builder.")
    assert Request.objects.get(pk=request.pk).status == Status.REJECTED
    refused(page, "/admin/agents/agent/add/", "takes the admin role")
    assert "you are an approver of Acme" in page.inner_text("#content-main")
    runner = world["acme"].runners.get(name="edge-1")
    answer = page.goto(f"/admin/runners/runner/{runner.pk}/change/")
    assert answer.status == 200
    assert page.locator("input[name=_save]").count() == 0  # read, not changed


def test_an_admin_changes_acme_and_sees_nothing_of_globex(sign_in, world):
    page = sign_in("alice")
    visit_everything(page)
    agent = world["acme"].agents.get()
    page.goto(f"/admin/agents/agent/{agent.pk}/change/")
    assert page.locator("input[name=_save]").count() == 1
    page.goto("/admin/agents/agent/add/")
    options = page.locator("#id_organisation option").all_inner_texts()
    assert "Acme" in options and "Globex" not in options
    assert_styled_and_tenant_clean(page, "/admin/agents/agent/add/")
    # Making organisations is the platform team's; so is changing the shipped templates.
    refused(page, "/admin/organisations/organisation/add/", "for the platform team")
    page.goto("/admin/organisations/membership/add/")
    assert page.locator("#id_organisation option").all_inner_texts().count("Globex") == 0
    names = autocomplete_names(
        page, "app_label=organisations&model_name=membership&field_name=organisation&term=ac"
    )
    assert "Acme" in names and "Globex" not in names


def test_a_person_of_no_organisation_is_told_why_they_cannot_sign_in(browser, live_server, db):  # noqa: F811
    UserFactory(username="newcomer", password=PASSWORD)
    context = browser.new_context(base_url=live_server.url)
    page = context.new_page()
    page.goto("/admin/login/")
    page.fill("#id_username", "newcomer")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector(".errornote")
    assert "belongs to no organisation yet" in page.inner_text("#content")
    context.close()
