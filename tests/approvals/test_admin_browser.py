"""Deciding requests in the admin, in a real browser (Debian's Chromium driven by Playwright):
the index counts what waits, the pending list leads to each, and a decision needs a note; the
decision is confirmed once made, its button fits the window, and only who may decide sees it."""

import pytest

from agents.models import Agent
from approvals import services
from approvals.models import Request
from tests.agents.test_admin_browser import browser, hidden_columns, page, window  # noqa: F401
from tests.factories import AgentFactory, WorkplaceFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_approver_decides_requests_in_the_admin(page, acme):  # noqa: F811
    workplace = WorkplaceFactory(organisation=acme)
    agent = AgentFactory(organisation=acme, name="Builder", workplace=workplace)
    route = services.file_egress(agent, "registry.example.org", reason="the <b>SDK</b> lives there")
    package = services.file_package(agent, "apt", "jq", reason="to parse JSON")

    page.goto("/admin/")
    assert "2 pending requests to decide" in page.inner_text("#pending-requests")
    page.click("#pending-requests a")
    page.wait_for_selector("#result_list")
    rows = page.locator("#result_list > tbody > tr")
    assert rows.count() == 2
    assert "the <b>SDK</b> lives there" in page.inner_text("#result_list")  # escaped, as text

    page.goto(f"/admin/approvals/request/{route.pk}/decide/")
    assert "registry.example.org:443" in page.inner_text("#request-summary")
    page.check("input[name=decision][value=approve]")
    page.click("#request-decision input[type=submit]")  # no note: the browser holds it back
    assert page.eval_on_selector("textarea[name=note]", "e => e.validity.valueMissing")
    assert Request.objects.get(pk=route.pk).status == "pending"
    page.fill("textarea[name=note]", "the vendor's registry")
    page.select_option("select[name=scope]", "workplace")
    page.click("#request-decision input[type=submit]")
    page.wait_for_selector("text=Approved: registry.example.org:443 for acme/builder.")
    assert page.locator("#result_list > tbody > tr").count() == 1  # the package waits

    page.goto(f"/admin/approvals/request/{package.pk}/decide/")
    assert "a new workplace version" in page.inner_text("#request-decision")
    page.check("input[name=decision][value=reject]")
    page.fill("textarea[name=note]", "use the image's python instead")
    page.click("#request-decision input[type=submit]")
    page.wait_for_selector("text=Rejected: apt jq for acme/builder.")
    page.goto("/admin/")
    assert page.locator("#pending-requests").count() == 0

    page.goto(f"/admin/approvals/request/{route.pk}/change/")
    assert "approved by operator" in page.inner_text("#content")
    assert "the vendor's registry" in page.inner_text("#content")

    decided = Request.objects.get(pk=route.pk)
    assert (decided.status, decided.decided_by.username, decided.scope) == (
        "approved", "operator", "workplace",
    )  # fmt: skip
    assert "registry.example.org" in Agent.objects.get(pk=agent.pk).allowlist
    assert Request.objects.get(pk=package.pk).status == "rejected"


def test_the_decision_is_confirmed_once_made_with_the_requests_record(window, acme):  # noqa: F811
    agent = AgentFactory(organisation=acme, name="Builder")
    route = services.file_egress(agent, "registry.example.org", reason="the SDK lives there")
    window.goto(f"/admin/approvals/request/{route.pk}/")
    window.click("#decide-request")  # the request's own page has the button
    window.wait_for_selector("#request-decision")
    assert window.title() == "Decide: registry.example.org:443 for acme/builder | covey"
    # Laid out as the admin's own forms: aligned rows in modules, a submit row.
    assert window.locator("#request-summary.module.aligned .form-row").count() >= 5
    assert window.locator("#request-decision fieldset.module.aligned").count() == 1
    assert window.locator("#request-decision .submit-row input[type=submit]").count() == 1
    window.check("input[name=decision][value=approve]")
    window.fill("textarea[name=note]", "the vendor's registry")
    window.click("#request-decision input[type=submit]")
    said = window.locator(".messagelist .success")
    said.wait_for()
    text = said.inner_text()
    assert "Approved: registry.example.org:443 for acme/builder." in text
    assert "What it changed: agent acme/builder v2." in text
    with window.expect_navigation():
        said.locator("a").click()  # the request's record
    assert "approved by operator" in window.inner_text("#content")
    assert window.locator("#decide-request").count() == 0  # decided: nothing to decide


def test_the_decide_button_fits_the_window_beside_a_long_reason(window, acme):  # noqa: F811
    workplace = WorkplaceFactory(organisation=acme)
    agent = AgentFactory(
        organisation=acme, name="Continuous integration builder", workplace=workplace
    )
    services.file_egress(
        agent,
        "objects.githubusercontent-mirror.example.com",
        reason="the release assets of every dependency we vendor are served from there " * 3,
    )
    services.file_package(agent, "npm", "typescript", reason="to type-check the front end")
    window.goto("/admin/approvals/request/")
    assert hidden_columns(window, ["what", "decide_link", "agent"]) == {}
    assert window.locator("#result_list a.button:has-text('Decide')").count() == 2


def test_who_may_not_decide_sees_no_decide_button(client, acme, vera):
    agent = AgentFactory(organisation=acme, name="Builder")
    route = services.file_egress(agent, "registry.example.org", reason="the SDK lives there")
    vera.is_staff = True  # not what lets her in (her membership does), nor what she may do
    vera.save()
    client.force_login(vera)  # a viewer: reads requests, decides none
    listed = client.get("/admin/approvals/request/?status__exact=pending").content.decode()
    assert "registry.example.org:443" in listed
    assert ">Decide</a>" not in listed and "pending" in listed
    one = client.get(f"/admin/approvals/request/{route.pk}/change/").content.decode()
    assert 'id="decide-request"' not in one
    index = client.get("/admin/").content.decode()
    assert f"/admin/approvals/request/{route.pk}/change/" in index  # to read it, not decide
    assert f"/admin/approvals/request/{route.pk}/decide/" not in index
