"""The reliability and security suites, counted (docs/security.md's table comes from this).

A test belongs to a suite by its marker, ``@pytest.mark.suite("hostile-proxy")``; what it
tries is one case unless it says more through the ``cases`` fixture (a property test counts
each example, a fuzzer each request). When ``COVEY_SUITE_RESULTS`` names a file, the session
writes there, per suite, the cases tried and passed and the tests that failed: a test that
fails counts none of its cases as passed. ``scripts/security-report`` runs the suites so and
writes the table; nobody edits it by hand.
"""

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

SUITES = {
    "faults": "Fault injection: parts killed, stopped or filled while covey works",
    "api-fuzz": "API fuzzing from the OpenAPI schema (schemathesis), as every kind of caller",
    "properties": "Property-based tests (hypothesis): entries, addresses, home paths",
    "hostile-proxy": "Malformed and hostile traffic against the real proxy",
    "boundaries": "Tenant and privilege boundaries of every API resource and runner endpoint",
    "secrets": "Secrets shown once: never in logs, pages, history or later responses",
    "admin": "The admin: CSRF, clickjacking, cookies, deployment checks, stored XSS",
    "load": "Load: the runs API and the proxy's policy under sustained load (short in CI)",
}


@dataclass
class Cases:
    """What one test tried (1 unless it says more)."""

    tried: int = 0
    notes: list[str] = field(default_factory=list)

    def add(self, count: int = 1) -> None:
        self.tried += count

    def note(self, text: str) -> None:
        """A figure the report shows beside the suite (a latency under attack, say)."""
        self.notes.append(text)


@dataclass
class Tally:
    tried: int = 0
    passed: int = 0
    tests: int = 0
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


_tallies: dict[str, Tally] = defaultdict(Tally)
_cases: dict[str, Cases] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "suite(name): counted in a reliability and security suite (tests/suites.py)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("suite")
        if marker is not None and marker.args[0] not in SUITES:
            raise pytest.UsageError(f"{item.nodeid}: no suite named {marker.args[0]!r}")


@pytest.fixture
def cases(request: pytest.FixtureRequest) -> Cases:
    """Count what this test tries (its suite's cases)."""
    return _cases.setdefault(request.node.nodeid, Cases())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    marker = item.get_closest_marker("suite")
    if marker is None:
        return report
    name = marker.args[0]
    counted = report.when == "call" or (report.when == "setup" and report.failed)
    if not counted and not (report.when == "teardown" and report.failed):
        return report
    tally = _tallies[name]
    said = _cases.get(item.nodeid, Cases())
    if report.when == "teardown":  # passed its call, then failed cleaning up
        tally.passed -= max(said.tried, 1)
        tally.failed.append(item.nodeid)
        return report
    tried = max(said.tried, 1)
    tally.tests += 1
    tally.tried += tried
    tally.notes += said.notes
    if report.passed:
        tally.passed += tried
    elif not report.skipped:
        tally.failed.append(item.nodeid)
    else:
        tally.tried -= tried  # skipped: not tried
        tally.tests -= 1
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get("COVEY_SUITE_RESULTS")
    if not target:
        return
    results = {
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "suites": {
            name: {
                "title": SUITES[name],
                "tests": tally.tests,
                "tried": tally.tried,
                "passed": tally.passed,
                "failed": tally.failed,
                "notes": tally.notes,
            }
            for name, tally in sorted(_tallies.items())
        },
    }
    Path(target).write_text(json.dumps(results, indent=2) + "\n")
