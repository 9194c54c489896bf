"""Deciding requests in the admin, in a real browser (Debian's Chromium driven by Playwright):
the index counts what waits, the pending list leads to each, and a decision needs a note."""

import pytest

from agents.models import Agent
from approvals import services
from approvals.models import Request
from tests.agents.test_admin_browser import browser, page  # noqa: F401 (fixtures)
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
