"""The decision log in a real browser (Debian's Chromium driven by Playwright): what matters
of each decision fits a window 1280 pixels wide."""

import pytest

from tests.agents.test_admin_browser import browser, hidden_columns, window  # noqa: F401
from tests.factories import AgentFactory, decision_event, record_events

pytestmark = pytest.mark.django_db(transaction=True)


def test_whether_and_why_each_decision_went_fit_the_window(window, acme, orders):  # noqa: F811
    agent = AgentFactory(organisation=acme, name="Continuous integration builder")
    refused = decision_event(
        agent,
        host="objects.githubusercontent-mirror.example.com",
        address="2001:db8:85a3::8a2e:370:7334",
        allowed=False,
        reason="not-on-allowlist",
    )
    allowed = decision_event(agent, host="pypi.org")
    closed = {"event": "close", "id": allowed["id"], "at": allowed["at"] + 5}
    record_events([refused, allowed, {**closed, "bytes_up": 1_234_567, "bytes_down": 987_654_321}])
    window.goto("/admin/egress/decision/")
    assert hidden_columns(window, ["decided_shown", "allowed", "reason", "destination"]) == {}
    listed = window.inner_text("#result_list")
    assert "objects.githubusercontent-mirror.example.com:443" in listed
    assert "1.2 MiB / 941.9 MiB" in listed  # bytes for people
