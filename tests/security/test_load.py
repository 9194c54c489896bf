"""Load, the short version CI runs: from a second process on loopback, 16 clients for 15 s each
at the runs API (queueing runs) and at the proxies' policy endpoint (a poll that finds nothing
changed), on the real web process with PostgreSQL. What must hold: no server error at all (a
load it cannot take is 429 or waits in line, never a 500); the throughput and tail latency are
the suite's figures (COVEY_LOAD_SECONDS runs it longer)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rest_framework.authtoken.models import Token

from agents import services as agent_services
from tests.egress.conftest import subprocess_database_url
from tests.factories import online_runner
from tests.processes import ROOT, control_plane

pytestmark = [
    pytest.mark.e2e,  # a control plane of its own: among the first to run
    pytest.mark.suite("load"),
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.django_db(transaction=True),
]

SECONDS = float(os.environ.get("COVEY_LOAD_SECONDS", "5"))  # 15 in make security-report
CLIENTS = 16
CLIENT = Path(__file__).with_name("load_client.py")


def load(url: str, method: str, header: str, body: dict | None = None) -> dict:
    args = [sys.executable, str(CLIENT), url, method, str(SECONDS), str(CLIENTS), header]
    if body is not None:
        args.append(json.dumps(body))
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=SECONDS + 120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def figures(said: dict) -> str:
    latencies = said["latencies"]
    done = len(latencies)

    def p(q: float) -> float:
        return latencies[min(done - 1, int(q * done))] if done else float("nan")

    return (
        f"{done / said['seconds']:.0f} req/s, p50 {p(0.5):.0f} ms, p99 {p(0.99):.0f} ms,"
        f" answers {said['statuses']}"
    )


def test_the_runs_api_and_the_policy_poll_take_sustained_load_without_a_server_error(
    tmp_path, acme, alice, cases
):
    agents = [
        agent_services.create_agent(acme, f"loaded {n}", runtime_command=["true"]) for n in range(4)
    ]
    token = Token.objects.create(user=alice).key
    _, runner = online_runner(acme)
    env = {"COVEY_BUILTIN_RUNNER": "false"}  # the runs wait in line: nobody takes them
    with control_plane(tmp_path, subprocess_database_url(), WEB_CONCURRENCY="2", **env) as url:
        runs = load(
            f"{url}/api/v1/runs/", "POST", f"Authorization: Token {token}",
            {"agent": agents[0].pk, "task": "under load"},
        )  # fmt: skip
        policy = load(f"{url}/api/v1/egress/policy/", "GET", f"Authorization: Runner {runner}")
    for name, said in (("runs API, POST", runs), ("policy poll, GET", policy)):
        cases.add(len(said["latencies"]))
        cases.note(f"{name}, {CLIENTS} clients for {SECONDS:.0f} s: {figures(said)}")
        errors = {s: n for s, n in said["statuses"].items() if not s.isdigit() or s >= "500"}
        assert errors == {}, (name, said["statuses"])
    assert set(runs["statuses"]) <= {"201", "429"}, runs["statuses"]
    assert set(policy["statuses"]) <= {"200", "304", "429"}, policy["statuses"]
