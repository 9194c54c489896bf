"""Runners in the admin, in a real browser (Debian's Chromium driven by Playwright): whether
each works (online, last seen, its last egress probe) fits a window 1280 pixels wide, and two
organisations' built-in runners are told apart by name."""

import pytest
from django.utils import timezone

from runners.models import Probe, ProbeStatus, Runner
from tests.agents.test_admin_browser import browser, hidden_columns, window  # noqa: F401
from tests.factories import OrganisationFactory, online_runner

pytestmark = pytest.mark.django_db(transaction=True)


def test_whether_each_runner_works_fits_the_window(window, acme):  # noqa: F811
    edge, _ = online_runner(acme, "edge-continuous-delivery-1", labels=["gpu", "large-disk"])
    Runner.objects.filter(pk=edge.pk).update(
        isolation="network", host_ready=False, host_problem="the egress proxy does not answer"
    )
    probe = Probe.objects.create(
        runner=edge,
        isolation="network",
        status=ProbeStatus.PASSED,
        reason="admin",
        finished_at=timezone.now(),
    )
    Runner.objects.filter(pk=edge.pk).update(last_probe=probe)
    OrganisationFactory(name="Globex Corporation")  # its built-in runner too
    window.goto("/admin/runners/runner/")
    assert hidden_columns(window, ["name", "online", "last_seen_shown", "last_probe_status"]) == {}
    listed = window.inner_text("#result_list")
    assert "builtin-acme" in listed and "builtin-globex-corporation" in listed
    assert "never" in listed  # a built-in runner not heard from yet
