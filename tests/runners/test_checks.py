"""The runners' system checks (runners/checks.py) against the settings they guard."""

import pytest

from runners.auth import SEEN_EVERY_SECONDS
from runners.checks import check_runner_staleness


@pytest.mark.parametrize(("stale", "heartbeat"), [(5, 5), (10, 5), (15, 5), (10, 0.5)])
def test_a_staleness_healthy_runners_would_flap_across_stops_start_up(settings, stale, heartbeat):
    """A runner's calls mark it seen at most every 10 s: a staleness of 10 s or less (or not
    more than that and a heartbeat) takes healthy runners for offline between two marks."""
    settings.COVEY_RUNNER_STALE_SECONDS = stale
    settings.COVEY_RUNNER_HEARTBEAT_SECONDS = heartbeat
    (error,) = check_runner_staleness()
    assert error.id == "runners.E002"
    assert f"COVEY_RUNNER_STALE_SECONDS is {stale:g}" in error.msg
    assert f"at most every {SEEN_EVERY_SECONDS} s" in error.msg and "flap offline" in error.msg


@pytest.mark.parametrize(("stale", "heartbeat"), [(30, 5), (15.5, 5), (11, 0.5)])
def test_a_staleness_past_a_mark_and_a_heartbeat_is_fine(settings, stale, heartbeat):
    settings.COVEY_RUNNER_STALE_SECONDS = stale
    settings.COVEY_RUNNER_HEARTBEAT_SECONDS = heartbeat
    assert check_runner_staleness() == []
