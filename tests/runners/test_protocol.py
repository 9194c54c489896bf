"""The runner protocol (runners/protocol.py): every message survives its JSON round-trip, a
message that does not fit is refused saying where, and the OpenAPI schema describes what
runners send and get."""

import re
from datetime import UTC, datetime

import pytest

from runners.protocol import (
    ActiveRun,
    ActiveRuns,
    ActiveStatus,
    EgressGrant,
    LaunchSpec,
    OutputAnswer,
    OutputChunk,
    ProbePlan,
    ProbeStatusAnswer,
    ProtocolError,
    ReportState,
    RunnerInfo,
    RunReport,
    RunStatusAnswer,
)
from runs.models import ACTIVE

SPEC = LaunchSpec(
    run="0b6f6f2e-6c1c-4b7e-9d0c-1f0e5b7c9a11",
    agent=7,
    image="covey-base:trixie",
    command=("sh", "-c", "make test"),
    task="fix the build ✓",
    cpus=0.5,
    memory_mb=512,
    pids=64,
    timeout=3600,
    egress=EgressGrant(enforce=True, credentials="acme-builder:secret"),
)

MESSAGES = [
    SPEC,
    ActiveRuns(
        runs=(
            ActiveRun("r1", ActiveStatus.RUNNING, False, 1.5, 10),
            ActiveRun("r2", ActiveStatus.PLACED, True, 0.0, 0),
        )
    ),
    RunReport(
        ReportState.EXITED, exit_code=3, detail="", started_at=datetime(2026, 1, 1, tzinfo=UTC)
    ),
    RunReport(ReportState.BUILT, detail="no such image"),
    RunStatusAnswer("r1", "failed"),
    ProbePlan(
        probe="p1", image="i", services=("db:5432",), allowed="a.test:443", credentials="u:t"
    ),
    ProbePlan(probe="p2", error="the probe cannot run"),
    ProbeStatusAnswer("p1", "passed"),
    OutputChunk(0, "é\n"),
    OutputAnswer(3),
    RunnerInfo(1, "edge-1", 2, ("eu", "gpu"), False, False, "runner.1", "network", "abc123"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_round_trip(message):
    assert type(message).from_json(message.to_json()) == message


def test_an_integer_is_a_float_where_a_float_is_wanted_and_extra_keys_are_ignored():
    data = SPEC.to_json() | {"cpus": 2, "from_a_newer_control_plane": True}
    assert LaunchSpec.from_json(data).cpus == 2.0


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"agent": "7"}, "LaunchSpec.agent: expected int, got str"),
        ({"agent": True}, "LaunchSpec.agent: expected int, got bool"),
        ({"command": "make test"}, "LaunchSpec.command: expected a list"),
        ({"command": ["sh", 1]}, "LaunchSpec.command[1]: expected str, got int"),
        ({"egress": {"enforce": True}}, "LaunchSpec.egress.credentials: missing"),
        ({"cpus": None}, "LaunchSpec.cpus: expected float, got NoneType"),
    ],
)
def test_a_spec_that_does_not_fit_is_refused_saying_where(change, words):
    with pytest.raises(ProtocolError, match=re.escape(words)):
        LaunchSpec.from_json(SPEC.to_json() | change)


def test_a_missing_field_and_an_unknown_state_are_refused():
    data = SPEC.to_json()
    del data["image"]
    with pytest.raises(ProtocolError, match=r"LaunchSpec\.image: missing"):
        LaunchSpec.from_json(data)
    with pytest.raises(ProtocolError, match="'lost' is not one of running, exited, built"):
        RunReport.from_json({"state": "lost"})
    with pytest.raises(ProtocolError, match="not an ISO 8601 time"):
        RunReport.from_json({"state": "running", "started_at": "yesterday"})
    with pytest.raises(ProtocolError, match="expected an object"):
        LaunchSpec.from_json(["not", "an", "object"])


def test_the_credentials_never_show_in_a_messages_repr():
    assert "secret" not in repr(SPEC)
    assert "u:t" not in repr(MESSAGES[5])


@pytest.mark.django_db
def test_the_schema_describes_what_runners_send_and_get(client):
    schema = client.get("/api/v1/schema/internal/", {"format": "json"}).json()
    components = schema["components"]["schemas"]
    for name in ("LaunchSpec", "EgressGrant", "ActiveRuns", "RunReport", "ProbePlan", "RunnerInfo"):
        assert name in components, sorted(components)
    assert set(components["RunReport"]["properties"]) >= {"state", "exit_code", "started_at"}
    paths = schema["paths"]
    start = paths["/api/v1/runner/runs/{run_id}/start/"]["post"]["responses"]
    assert start["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/LaunchSpec")
    # No runner endpoint answers with an undescribed object any more.
    for path, operations in paths.items():
        if not path.startswith("/api/v1/runner/"):
            continue
        for operation in operations.values():
            for code, answer in operation.get("responses", {}).items():
                for content in answer.get("content", {}).values():
                    assert content["schema"] != {"type": "object", "additionalProperties": {}}, (
                        path,
                        code,
                    )


def test_a_run_the_runner_should_have_is_in_one_of_the_active_statuses_of_a_run():
    """The protocol's ActiveStatus and the control plane's ACTIVE run statuses are one list."""
    assert {status.value for status in ActiveStatus} == {str(status) for status in ACTIVE}


def test_a_runner_refuses_active_runs_in_a_status_it_does_not_know():
    data = {
        "runs": [
            {"run": "r1", "status": "queued", "cancel": False, "waited": 0.0, "output_size": 0}
        ]
    }
    with pytest.raises(
        ProtocolError, match=r"ActiveRuns\.runs\[0\]\.status: 'queued' is not one of"
    ):
        ActiveRuns.from_json(data)
