"""A runner host's /healthz, /readyz and /metrics (runners/host/status.py), and the readiness
its heartbeats carry, on the in-memory seams of test_runner_logic.py but through the real
status listener over HTTP. The control plane's side (what it stores and shows) is in
tests/runners/test_readiness.py; the real runner process serves the same in test_runs.py."""

import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import status as shared_status
from egress.environment import Isolation
from runners.host import status
from runners.host.engine_watch import HOST_ENGINE_NAME
from runners.host.runner import HEARTBEAT_SILENCE_SECONDS
from runners.host.trust import ProbeState
from tests.fakes import Clock
from tests.runners.test_runner_logic import Host, proxy_check, spec

TOKEN = "metrics-token-for-the-test"


@pytest.fixture
def served(tmp_path):
    """A cooperative host whose sandboxes are told of a proxy, its status listener, its URL."""
    clock = Clock(1000.0)
    host = Host(tmp_path, clock=clock, proxy="172.17.0.1:3128")
    server = status.status_server(host.host, ("127.0.0.1", 0), TOKEN)
    server.start()
    yield host, clock, "http://{}:{}".format(*server.address)
    server.stop()


def ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/readyz", timeout=10)


class Figures(dict):
    """Samples by name and labels: ``figures["name", {"runner": "edge-1"}]``."""

    def __getitem__(self, key: tuple[str, dict[str, str]]) -> float:
        name, labels = key
        return super().__getitem__((name, frozenset(labels.items())))


def scrape(url: str) -> Figures:
    answer = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    return Figures(
        ((sample.name, frozenset(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    )


def test_a_host_is_ready_once_its_proxy_answered_and_the_control_plane_its_heartbeat(served):
    host, _, url = served
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    before = ready(url)
    assert before.status_code == 503
    assert before.json()["runners"]["1"]["checks"] == {
        "docker": "ok",
        "egress": "the egress proxy at 172.17.0.1:3128 has not been checked yet",
        "heartbeat": "no heartbeat answered yet",
    }

    host.host.start_proxy_checks()  # as at start: the proxy answers the sandboxes' network
    host.host.beat()
    after = ready(url)
    assert after.status_code == 200, after.text
    body = after.json()
    assert body["status"] == "ready" and body["checks"] == {"docker": "ok"}
    assert body["runners"]["1"] == {
        "name": "edge-1",
        "isolation": "cooperative",
        "ready": True,
        "checks": {"docker": "ok", "egress": "ok", "heartbeat": "ok"},
        "heartbeat_age_seconds": 0.0,
    }
    assert host.control.problems == [""]  # the heartbeat said it can take work


def test_what_stops_a_runner_goes_to_readyz_and_to_the_control_plane(served):
    host, _, url = served
    host.host.start_proxy_checks()
    host.host.docker_problem()  # makes the engine that asks Docker (it owns no container)
    down = "the Docker engine does not answer: connection refused"
    host.engines[HOST_ENGINE_NAME].down = down
    host.host.beat()
    answer = ready(url)
    assert answer.status_code == 503
    assert answer.json()["checks"] == {"docker": down}
    assert answer.json()["runners"]["1"]["checks"]["docker"] == down
    assert host.control.problems == [down]
    assert scrape(url)["covey_runner_host_docker_up", {}] == 0


@pytest.mark.suite("faults")
def test_a_proxy_that_stopped_answering_makes_the_runner_not_ready(tmp_path):
    clock = Clock(1000.0)
    refused = proxy_check(1, b"ConnectionRefusedError: Connection refused")
    host = Host(tmp_path, refused, clock=clock, proxy="172.17.0.1:3128")
    host.host.start_proxy_checks()
    host.host.beat()
    ok, body = status.readiness(host.host)
    assert not ok
    assert "does not answer" in body["runners"]["1"]["checks"]["egress"]
    assert "does not answer" in host.control.problems[-1]


def test_heartbeats_the_control_plane_stops_answering_make_it_not_ready_after_a_while(served):
    host, clock, url = served
    host.host.start_proxy_checks()
    host.host.heartbeat_every = 5.0
    host.host.beat()
    host.control.unreachable = True
    clock.now += HEARTBEAT_SILENCE_SECONDS  # silent, but not for long enough yet
    host.host.beat()
    assert ready(url).status_code == 200
    clock.now += 1
    answer = ready(url)
    assert answer.status_code == 503
    assert answer.json()["runners"]["1"]["checks"]["heartbeat"] == (
        "the control plane has not answered a heartbeat for 31 s: the control plane does not answer"
    )
    assert answer.json()["runners"]["1"]["heartbeat_age_seconds"] == 31


def test_under_hard_isolation_a_runner_is_ready_only_with_its_shape_and_a_passed_probe(tmp_path):
    clock = Clock(1000.0)
    host = Host(tmp_path, clock=clock, isolation=Isolation.NETWORK)
    host.host.beat()
    ok, body = status.readiness(host.host)
    assert not ok
    assert body["runners"]["1"]["isolation"] == "network"
    assert body["runners"]["1"]["checks"] == {
        "docker": "ok",
        "isolation": "its isolation has not been built yet",
        "egress": "this runner has not passed an egress probe yet",
        "heartbeat": "ok",
    }
    assert host.control.problems == [
        "its isolation has not been built yet; this runner has not passed an egress probe yet"
    ]
    # A failed probe says what it saw (the probe itself runs for real in test_probe.py).
    host.host.trust._probes[1] = ProbeState(False, clock(), "host: tcp 10.0.0.1:22 connected")
    clock.now += 12
    _, body = status.readiness(host.host)
    assert body["runners"]["1"]["checks"]["egress"] == (
        "this runner's last egress probe failed: host: tcp 10.0.0.1:22 connected"
    )
    assert body["runners"]["1"]["last_probe"] == {
        "passed": False,
        "age_seconds": 12,
        "summary": "host: tcp 10.0.0.1:22 connected",
    }


def test_metrics_say_readiness_sandboxes_and_launches_to_the_token_only(served):
    host, _, url = served
    assert httpx.get(f"{url}/metrics").status_code == 401
    wrong = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "Bearer <token>" in wrong.json()["detail"]

    host.host.start_proxy_checks()
    host.host.beat()
    host.order(spec())
    host.engine.refuse = "no room"
    host.order(spec(run="0b6f6f2e-6c1c-4b7e-9d0c-1f0e5b7c9a12"))
    figures = scrape(url)
    assert figures["covey_runner_host_docker_up", {}] == 1
    assert figures["covey_runner_host_ready", {"runner": "edge-1"}] == 1
    assert figures["covey_runner_host_heartbeat_age_seconds", {"runner": "edge-1"}] == 0
    assert figures["covey_runner_host_sandboxes", {"runner": "edge-1", "state": "running"}] == 1
    assert (
        figures["covey_runner_host_launches_total", {"runner": "edge-1", "outcome": "started"}] == 1
    )
    assert (
        figures["covey_runner_host_launches_total", {"runner": "edge-1", "outcome": "refused"}] == 1
    )

    probe = figures["covey_runner_host_probe_passed", {"runner": "edge-1"}]
    assert probe != probe  # NaN: a cooperative runner is never probed


def test_metrics_are_refused_to_everyone_without_a_token(tmp_path):
    host = Host(tmp_path)
    server = status.status_server(host.host, ("127.0.0.1", 0), "")
    server.start()
    try:
        url = "http://{}:{}".format(*server.address)
        answer = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer x"})
        assert answer.status_code == 403 and "COVEY_METRICS_TOKEN" in answer.json()["detail"]
        assert httpx.get(f"{url}/runs").status_code == 404
    finally:
        server.stop()


def test_a_client_that_sends_nothing_is_dropped_and_others_are_answered(tmp_path, monkeypatch):
    """Each idle connection holds a thread: they do not pile up for ever."""
    monkeypatch.setattr(shared_status, "READ_TIMEOUT_SECONDS", 0.5)
    server = status.status_server(Host(tmp_path).host, ("127.0.0.1", 0), "")
    server.start()
    idle = socket.create_connection(server.address)  # connects and says nothing
    try:
        url = "http://{}:{}".format(*server.address)
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        idle.settimeout(5)
        assert idle.recv(1) == b""  # closed by the listener, not by the 5 s here
    finally:
        idle.close()
        server.stop()


def test_the_listener_takes_an_ipv6_address(tmp_path):
    host = Host(tmp_path)
    try:
        server = status.status_server(host.host, ("::1", 0), "")
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    server.start()
    try:
        answer = httpx.get(f"http://[::1]:{server.address[1]}/healthz")
        assert answer.status_code == 200
    finally:
        server.stop()
