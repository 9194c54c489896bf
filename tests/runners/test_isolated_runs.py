"""Runs under hard isolation end to end (COVEY_EGRESS_ISOLATION=network on the runner host):
the control plane, a runner process with no database, its proxy container from the real image,
real sandboxes on the runner's internal network. What the proxy reaches on the host (a relay
to the control plane, a DNS server, the upstream) is made by tests/runners/world.py."""

import io
import ipaddress
import json
import re
import subprocess
from collections.abc import Iterator
from uuid import uuid4

import pytest
from django.core.management import CommandError, call_command

from approvals import services as approvals
from approvals.models import Request, Status
from egress.models import Decision, EgressToken, ProxySession
from runners.host.containers import isolation
from runners.host.identity import docker_name
from runners.services import installation_key, renew_runner_tokens
from runs import services as run_services
from runs.models import FINISHED, Run, RunStatus
from tests.processes import wait_for
from tests.runners.stack import containers_of, docker
from tests.runners.world import (
    OFF_LIST_NAME,
    OUTSIDE_LABEL,
    UPSTREAM_NAME,
    Upstream,
    World,
    runner_ids_apart,
)
from tests.workers import FIREWALL

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def world(tmp_path, base_image, egress_image) -> Iterator[World]:
    runner_ids_apart()
    built = World(tmp_path, base_image, egress_image)
    yield built
    built.close()


def test_a_sandbox_reaches_its_upstream_through_the_proxy_and_nothing_directly(world, acme):
    runner, config = world.register(acme, "isolated-1")
    name = docker_name(runner.pk, installation_key())
    with world.stack.runner(runner, config, **world.runner_env()) as process:
        assert f"sandboxes on {isolation.internal_network_name(name)}" in process.output()
        internal = json.loads(docker("network", "inspect", isolation.internal_network_name(name)))
        gateway = internal[0]["IPAM"]["Config"][0]["Gateway"]  # the host, on the sandbox's side
        script = f"""
echo "proxy=$HTTP_PROXY" | sed 's|//.*@|//***@|'
echo "via proxy: $(curl -sS --max-time 10 http://{UPSTREAM_NAME}/)"
curl -sS --max-time 10 -o /dev/null -D - http://{OFF_LIST_NAME}/ | tr -d '\\r' | grep -i -e '^HTTP/' -e '^x-covey-deny-reason'
curl -sS --noproxy '*' --connect-timeout 3 {world.direct}; echo "direct upstream: exit $?"
curl -sS --noproxy '*' --connect-timeout 3 http://{gateway}:{world.relay_port}/; echo "direct host: exit $?"
"""  # noqa: E501
        agent = world.stack.agent(
            acme, "Isolated", ["sh", "-c", script], allowlist=[f"{UPSTREAM_NAME}:80"]
        )
        run = world.stack.wait(run_services.queue_run(agent, "fetch"), *FINISHED, timeout=60)
        assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
        log = run.log_tail
        proxy_ip = str(ipaddress.ip_network(internal[0]["IPAM"]["Config"][0]["Subnet"])[2])

        # A rule removed behind the runner's back: the next launch's preflight repairs it.
        isolation.remove_rules(name)
        again = world.stack.wait(run_services.queue_run(agent, "again"), *FINISHED, timeout=60)
        assert again.status == RunStatus.SUCCEEDED, (again.status_detail, again.log_tail)
        assert re.search(r"isolation preflight: .*missing .*; repairing", process.output())

        # Several at once, each asking through the proxy at its first instant: every run's
        # credential works from the first byte (the proxy looks up a token it has not seen).
        # Five agents: runs of one agent take turns with its home.
        eager = [
            world.stack.agent(
                acme,
                f"Eager {i}",
                [
                    "sh",
                    "-c",
                    f"curl -sS --max-time 10 -w ' status=%{{http_code}}' http://{UPSTREAM_NAME}/",
                ],
                allowlist=[f"{UPSTREAM_NAME}:80"],
            )
            for i in range(5)
        ]
        burst = [run_services.queue_run(agent, f"burst {i}") for i, agent in enumerate(eager)]
        for one in burst:
            world.stack.wait(one, *FINISHED, timeout=90)
        assert [(r.status, r.log_tail.split()[-1]) for r in burst] == [
            (RunStatus.SUCCEEDED, "status=200")
        ] * 5, [r.log_tail for r in burst]

    # (a) Through the proxy, which the sandbox is told of although COVEY_EGRESS_ENFORCE is off.
    assert f"proxy=http://***@{proxy_ip}:3128\n" in log, log
    assert f"via proxy: {world.body}" in log
    assert Upstream.seen.count(UPSTREAM_NAME) == 2 + 5  # both runs and the burst
    # (c) A name off the allowlist: the proxy refuses it.
    assert re.search(r"^HTTP/1\.1 403", log, re.M), log
    assert re.search(r"^x-covey-deny-reason: not-on-allowlist$", log, re.M | re.I), log
    # (b) Nothing directly: the upstream's address and the host time out (dropped; a
    # connection refused would mean the packets got there).
    assert "direct upstream: exit 28" in log, log
    assert "direct host: exit 28" in log, log
    assert f"via proxy: {world.body}" in again.log_tail
    assert not containers_of(runner)


def test_a_runner_whose_isolation_cannot_be_built_gets_no_work(world, acme):
    runner, config = world.register(acme, "isolated-2")
    missing = f"covey-egress-missing-{uuid4().hex[:8]}:none"
    agent = world.stack.agent(acme, "Refused", ["echo", "must not run"])
    env = world.runner_env(COVEY_RUNNER_PROXY_IMAGE=missing)
    with world.stack.runner(runner, config, **env) as process:
        run = run_services.queue_run(agent, "nope")

        def held() -> bool:
            run.refresh_from_db()
            return "isolated-2 failed its egress probe" in run.status_detail

        wait_for(held, 30, "the run held back for the failed probe")
        assert not containers_of(runner)  # no sandbox was ever created

        def said_why() -> bool:  # its heartbeats tell the control plane, for the admin
            runner.refresh_from_db()
            return runner.host_ready is False and f"image {missing}" in runner.host_problem

        wait_for(said_why, 10, "the heartbeat saying why the runner is not ready")
        output = process.output()
    runner.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert f"image {missing} is not on this host" in run.status_detail
    assert (runner.isolation, runner.trusted) == ("network", False)
    assert runner.last_probe.status == "error"
    # The runner kept running: it said so at start, once, and took no work.
    assert f"NO ISOLATION YET, launches are refused: image {missing} is not on this host" in output
    assert "egress probe FAILED: no work until one passes" in output
    assert output.count(f"isolation: image {missing} is not on this host") == 1, output
    run_services.cancel(run)


def test_a_launch_the_preflight_cannot_vouch_for_is_refused(world, acme):
    """Another container takes the proxy's name: the runner says it cannot take work, and the
    control plane holds the run; a launch sent anyway (placed a moment before the host said
    so) is refused by the runner's preflight before any sandbox is built."""
    from django.utils import timezone

    from runners import dispatch

    runner, config = world.register(acme, "isolated-4")
    name = docker_name(runner.pk, installation_key())
    proxy = isolation.proxy_container_name(name)
    agent = world.stack.agent(acme, "Refused", ["echo", "must not run"])
    why = f"a container named {proxy} exists and covey did not make it"
    with world.stack.runner(runner, config, **world.runner_env()) as process:
        runner.refresh_from_db()
        assert runner.trusted, runner.last_probe and runner.last_probe.summary

        # Something else takes the proxy's name: the runner may not remove it, so the launch's
        # repair fails and the preflight cannot vouch for the shape.
        def taken() -> bool:
            # The runner's reconcile may put its proxy back between the two: try again.
            subprocess.run(["docker", "rm", "--force", proxy], capture_output=True)
            impostor = ["docker", "create", "--name", proxy, "--label", OUTSIDE_LABEL]
            created = subprocess.run(
                [*impostor, world.stack.base_image, "true"], capture_output=True
            )
            return created.returncode == 0

        wait_for(taken, 30, "another container under the proxy's name")
        try:

            def said() -> bool:  # its proxy does not answer; or, once it tried, why not
                runner.refresh_from_db()
                return runner.host_ready is False

            wait_for(said, 30, "the runner saying it cannot take work", process.log)
            held = run_services.queue_run(agent, "held")
            held.refresh_from_db()
            assert held.status == RunStatus.QUEUED, held.status
            assert f"{runner.name} cannot take work now: " in held.status_detail
            Run.objects.filter(pk=held.pk).update(
                status=RunStatus.PLACED, runner=runner, placed_at=timezone.now()
            )
            dispatch.send_launch(runner, str(held.pk))
            run = world.stack.wait(held, *FINISHED, timeout=60)
            assert not containers_of(runner)
        finally:
            docker("rm", "--force", proxy)
    assert run.status == RunStatus.FAILED
    assert run.status_detail.startswith(
        "the sandbox could not be built: isolation preflight failed: "
    ), run.status_detail
    assert why in run.status_detail
    assert "must not run" not in run.log_tail


def test_egress_probe_proves_the_runner_and_a_failed_probe_stops_its_work(world, acme, alice):
    runner, config = world.register(acme, "isolated-5")
    agent = world.stack.agent(
        acme,
        "Fetcher",
        ["sh", "-c", f"curl -sS --max-time 10 http://{UPSTREAM_NAME}/"],
        allowlist=[f"{UPSTREAM_NAME}:80"],
    )
    bridge = isolation.bridge_name(docker_name(runner.pk, installation_key()))
    hole = ["INPUT", "-i", bridge, "-m", "comment", "--comment", OUTSIDE_LABEL, "-j", "ACCEPT"]
    with world.stack.runner(runner, config, **world.runner_env()) as process:
        # At start: probed as the agent that may reach the vendor, and trusted.
        runner.refresh_from_db()
        assert runner.last_probe.status == "passed", runner.last_probe.checks
        assert runner.last_probe.agent == agent
        assert "egress probe passed" in process.output()

        out = io.StringIO()
        call_command("egress_probe", "--runner", str(runner.pk), stdout=out)
        printed = out.getvalue()
        assert f"egress probe of runner isolated-5 ({acme}), network isolation" in printed
        assert re.search(r"^  ok +allowed +via proxy ", printed, re.M), printed
        assert re.search(r"^  ok +host +tcp ", printed, re.M), printed
        assert "passed: " in printed

        # A hole ahead of covey's rules: the preflight before the probe puts them back first.
        with FIREWALL.exclusive():  # no other test process sees it (tests/workers.py)
            subprocess.run(["iptables", "-w", "10", "-I", *hole[:1], "1", *hole[1:]], check=True)
            try:
                call_command("egress_probe", "--runner", str(runner.pk), stdout=io.StringIO())
                chain = subprocess.run(
                    ["iptables", "-w", "10", "-S", "INPUT"], capture_output=True, text=True
                ).stdout
                covey = chain.index(f"covey:{docker_name(runner.pk, installation_key())}")
                assert covey < chain.index(OUTSIDE_LABEL), chain
                assert "comes before covey's rules; repairing" in process.output()
            finally:
                subprocess.run(["iptables", "-w", "10", "-D", *hole], check=True)

        # The vendor out of reach (its name now resolves to loopback, which the proxy refuses):
        # the probe fails, and the runner gets no work until one passes.
        world.names.address = "127.0.0.1"
        try:
            out = io.StringIO()
            with pytest.raises(CommandError) as failed:
                call_command("egress_probe", "--runner", f"{acme.slug}/isolated-5", stdout=out)
            assert failed.value.returncode == 1
            assert re.search(
                r"^  FAIL +allowed +via proxy .* 403 non-public-address$", out.getvalue(), re.M
            ), out.getvalue()
            run = run_services.queue_run(agent, "after the failure")
            run.refresh_from_db()
            assert run.status == RunStatus.QUEUED
            assert "isolated-5 failed its egress probe" in run.status_detail
            assert "1 failed; first: allowed" in run.status_detail
        finally:
            world.names.address = world.upstream_host

        # Closed again: the next probe passes and the waiting run goes.
        call_command("egress_probe", "--runner", str(runner.pk), stdout=io.StringIO())
        run = world.stack.wait(run, *FINISHED, timeout=60)
        with world.stack.api(alice) as api:
            body = api.get(f"/api/v1/runners/{runner.pk}/").json()
            probes = api.get(f"/api/v1/runners/{runner.pk}/probes/").json()
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
    assert (body["isolation"], body["trusted"], body["last_probe"]["status"]) == (
        "network",
        True,
        "passed",
    )
    statuses = [p["status"] for p in probes["results"]]
    assert statuses == ["passed", "failed", "passed", "passed", "passed"], statuses
    assert any(line.startswith("FAIL") for line in probes["results"][1]["lines"])
    # The probes' credentials ended with them.
    assert not EgressToken.objects.filter(purpose__startswith="egress probe").live().exists()


def test_a_renewed_token_reaches_the_proxy_container(world, acme, settings):
    settings.COVEY_BUILTIN_RUNNER = False  # no built-in identity files from this process
    runner, config = world.register(acme, "isolated-3")
    proxy = isolation.proxy_container_name(docker_name(runner.pk, installation_key()))
    agent = world.stack.agent(
        acme,
        "Fetcher",
        ["sh", "-c", f"curl -sS --max-time 10 http://{UPSTREAM_NAME}/"],
        allowlist=[f"{UPSTREAM_NAME}:80"],
    )
    with world.stack.runner(runner, config, **world.runner_env()):
        before = json.loads(docker("inspect", proxy))[0]["Id"]
        world.stack.stop_control_plane()
        renew_runner_tokens()
        world.stack.start_control_plane()

        def renewed() -> bool:
            try:  # between its removal and its successor, there is no proxy to inspect
                environment = json.loads(docker("inspect", proxy))[0]["Config"]["Env"]
            except subprocess.CalledProcessError:
                return False
            return f"COVEY_RUNNER_TOKEN={json.loads(config.read_text())['token']}" in environment

        wait_for(renewed, 30, "the proxy recreated with the renewed token")
        run = world.stack.wait(run_services.queue_run(agent, "after"), *FINISHED, timeout=60)
    assert json.loads(docker("inspect", proxy))[0]["Id"] != before
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
    assert run.log_tail == world.body
    # The replaced proxy's life in the log ended, and is admitted not whole: it was stopped
    # (as tests/egress/test_egress_image.py's is, whole), but its token had been renewed
    # already, so what it had left to write could not be.
    sessions = ProxySession.objects.filter(proxy=runner.name, organisation=acme)
    lives = [(s.end, s.gap) for s in sessions.order_by("started_at")]
    assert len(lives) >= 2 and lives[0][0] == ProxySession.End.LOST and lives[0][1], lives


@pytest.mark.suite("faults")
def test_a_proxy_without_its_policy_makes_its_runner_not_ready_and_says_why(world, acme, settings):
    settings.COVEY_BUILTIN_RUNNER = False
    runner, config = world.register(acme, "isolated-blind")
    environment = world.runner_env(
        COVEY_RUNNER_PROXY_CONTROL_PLANE_URL="http://host.docker.internal:9",  # nothing there
        COVEY_EGRESS_POLICY_GRACE="1",  # the proxy listens a second on, with no policy
    )
    with world.stack.runner(runner, config, **environment) as process:

        def said() -> bool:
            runner.refresh_from_db()
            return runner.host_ready is False and "the proxy is not ready" in runner.host_problem

        wait_for(said, 60, "the runner saying its proxy is not ready", process.log)
    assert "(policy: none yet)" in runner.host_problem, runner.host_problem
    assert process.output().count("the proxy is not ready (policy: none yet)") == 1  # said once


def test_a_sandbox_asks_for_a_route_through_its_proxy_and_gets_it_live(world, acme, root):
    """Issue 12: under hard isolation the proxy is the only host a sandbox reaches, and it
    takes the sandbox's request (covey-request, through its desk, on to the control plane with
    the runner's token); once a person approves, the same route works from the same sandbox."""
    runner, config = world.register(acme, "isolated-1")
    script = f"""
curl -sS --max-time 10 -o /dev/null -w 'before: %{{http_code}}\\n' http://{UPSTREAM_NAME}/
covey-request egress {UPSTREAM_NAME}:80 --reason "the upstream serves the data" --wait 60
echo "asked: exit $?"
for i in $(seq 30); do
  body=$(curl -sS --max-time 5 http://{UPSTREAM_NAME}/ 2>/dev/null) && break; sleep 0.1
done
echo "after: $body (try $i)"
"""
    agent = world.stack.agent(acme, "Asking", ["sh", "-c", script])
    with world.stack.runner(runner, config, **world.runner_env()):
        run = run_services.queue_run(agent, "fetch")
        pending = Request.objects.filter(agent=agent, status=Status.PENDING)
        wait_for(pending.exists, 90, "the sandbox's request")
        request = pending.get()
        (asked,) = request.requesters.all()
        assert (asked.run_id, asked.reason) == (run.pk, "the upstream serves the data")
        assert request.target == f"{UPSTREAM_NAME}:80"
        approvals.approve(request, by=root, note="the test's upstream")
        run = world.stack.wait(run, *FINISHED, timeout=60)
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
    log = run.log_tail
    assert "before: 403" in log
    assert '"decision": "approved"' in log and "asked: exit 0" in log
    after = re.search(r"after: (.*) \(try (\d+)\)", log)
    assert after is not None and after.group(1) == world.body, log
    assert int(after.group(2)) <= 10, log  # within a second of the answer


@pytest.mark.suite("faults")
def test_a_proxy_killed_mid_transfer_cuts_it_opens_nothing_and_comes_back(world, acme):
    """The sandbox loses egress with its proxy and gains no path around it; the runner brings
    the proxy back (its reconcile), at the same address, and new connections work. The log
    admits what the killed proxy had not written yet."""
    runner, config = world.register(acme, "isolated-cut")
    proxy = isolation.proxy_container_name(docker_name(runner.pk, installation_key()))
    script = f"""
curl -sS --max-time 60 -o /dev/null http://{UPSTREAM_NAME}/slow; echo "cut: exit $?"
curl -sS --noproxy '*' --connect-timeout 3 {world.direct}; echo "direct upstream: exit $?"
for i in $(seq 90); do
    out=$(curl -sS --max-time 3 http://{UPSTREAM_NAME}/ 2>/dev/null) && break; sleep 1
done
echo "after: $out"
"""
    agent = world.stack.agent(acme, "Cut", ["sh", "-c", script], allowlist=[f"{UPSTREAM_NAME}:80"])
    with world.stack.runner(runner, config, **world.runner_env()):
        before = json.loads(docker("inspect", proxy))[0]
        run = run_services.queue_run(agent, "download")
        wait_for(lambda: "/slow" in Upstream.seen, 60, "the transfer beginning")
        docker("kill", proxy)
        world.stack.wait(run, *FINISHED, timeout=150)
        after = json.loads(docker("inspect", proxy))[0]
    assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
    log = run.log_tail
    assert re.search(r"^cut: exit (18|52|56)$", log, re.M), log  # partial, empty, or reset
    assert "direct upstream: exit 28" in log, log  # dropped: no path while the proxy is gone
    assert f"after: {world.body}" in log, log
    assert after["Id"] != before["Id"]
    assert (
        after["NetworkSettings"]["Networks"].keys() == before["NetworkSettings"]["Networks"].keys()
    )
    assert not containers_of(runner)
    sessions = ProxySession.objects.filter(proxy=runner.name, organisation=acme)
    lives = [(s.end, s.made, s.recorded) for s in sessions.order_by("started_at")]
    assert len(lives) >= 2 and lives[0][0] == ProxySession.End.LOST, lives
    assert "ended without a clean stop" in sessions.order_by("started_at")[0].gap
    assert sum(s.recorded for s in sessions) == Decision.objects.filter(proxy=runner.name).count()


def addresses(container: dict) -> dict[str, str]:
    return {name: n["IPAddress"] for name, n in container["NetworkSettings"]["Networks"].items()}
