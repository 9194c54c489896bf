"""Runs end to end: the real control plane (gunicorn), a real runner process with no database
(its Celery worker on Redis), real sandboxes on the Docker engine, a real HTTP client."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from uuid import uuid4

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from approvals import services as approvals
from runners.host.containers.engine import Engine, SandboxSpec
from runners.host.identity import docker_name
from runners.services import (
    installation_key,
    renew_runner_tokens,
)
from runs import services as run_services
from runs.models import FINISHED, Run, RunStatus
from tests.processes import free_port, wait_for
from tests.runners.stack import Stack, containers_of, docker
from workplaces.services import create_workplace

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
]


def history(run: Run) -> list[str]:
    return list(run.events.values_list("status", flat=True))


def test_a_run_goes_from_the_api_to_a_sandbox_and_back(stack, acme, alice):
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(
        acme,
        "Builder",
        ["sh", "-c", 'echo "hello from $COVEY_RUN as $(id -u)"; cat "$COVEY_TASK_FILE"'],
    )
    with stack.runner(runner, config), stack.api(alice) as api:
        response = api.post("/api/v1/runs/", json={"agent": agent.pk, "task": "fix the build"})
        assert response.status_code == 201, response.text
        run = Run.objects.get(pk=response.json()["id"])
        stack.wait(run, *FINISHED)
        assert run.status == RunStatus.SUCCEEDED, run.status_detail
        body = api.get(f"/api/v1/runs/{run.pk}/").json()
        log = api.get(f"/api/v1/runs/{run.pk}/log/").text
    assert body["exit_code"] == 0
    assert body["runner"] == "edge-1" and body["agent_version"] == 1
    assert f"hello from {run.pk} as 1000" in body["log_tail"]
    assert "fix the build" in log
    assert [e["status"] for e in body["events"]] == [
        "queued",
        "placed",
        "starting",
        "running",
        "succeeded",
    ]
    assert run.egress_token.revoked_at is not None  # the run's credential ended with it
    wait_for(lambda: not containers_of(runner), 10, "the sandbox removed")


def test_failures_and_timeouts_are_told_apart(stack, acme):
    runner, config = stack.register(acme, "edge-1")
    failing = stack.agent(acme, "Failing", ["sh", "-c", "echo broken >&2; exit 3"])
    slow = stack.agent(acme, "Slow", ["sleep", "600"], run_timeout=2)
    with stack.runner(runner, config):
        failed = run_services.queue_run(failing, "fail")
        timed_out = run_services.queue_run(slow, "never ends")
        stack.wait(failed, *FINISHED)
        stack.wait(timed_out, *FINISHED)
    assert (failed.status, failed.exit_code) == (RunStatus.FAILED, 3)
    assert "broken" in failed.log_tail
    assert timed_out.status == RunStatus.TIMED_OUT
    assert timed_out.finished_at - timed_out.started_at < timedelta(seconds=20)


def test_a_running_sandbox_has_the_agents_limits_and_can_be_cancelled(stack, acme, alice):
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Sleeper", ["sleep", "600"], cpus="0.5", memory_mb=256, pids_limit=64)
    with stack.runner(runner, config), stack.api(alice) as api:
        run = run_services.queue_run(agent, "wait")
        stack.wait(run, RunStatus.RUNNING)
        (container,) = containers_of(runner)
        host = json.loads(docker("inspect", container))[0]["HostConfig"]
        assert (host["NanoCpus"], host["Memory"], host["PidsLimit"]) == (5e8, 256 << 20, 64)
        assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"]
        assert api.post(f"/api/v1/runs/{run.pk}/cancel/").status_code == 200
        stack.wait(run, *FINISHED, timeout=20)
    assert run.status == RunStatus.CANCELLED
    assert history(run)[-1] == "cancelled"
    assert not containers_of(runner)


def test_the_home_survives_runs_and_nothing_else_does(stack, acme):
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(
        acme,
        "Keeper",
        [
            "sh",
            "-c",
            'cat ~/kept 2>/dev/null || echo "no home yet"; [ -e /tmp/gone ] || echo "tmp is fresh";'
            " touch /etc/x 2>/dev/null || echo 'root is read-only';"
            " echo kept > ~/kept; echo gone > /tmp/gone",
        ],
    )
    with stack.runner(runner, config):
        first = stack.wait(run_services.queue_run(agent, "one"), *FINISHED)
        second = stack.wait(run_services.queue_run(agent, "two"), *FINISHED)
    assert "no home yet" in first.log_tail
    assert second.log_tail.split("\n")[:3] == ["kept", "tmp is fresh", "root is read-only"]
    agent.refresh_from_db()
    assert agent.home_runner == runner


@pytest.mark.suite("faults")
def test_a_runner_killed_mid_launch_leaves_no_orphan_when_it_comes_back(stack, acme):
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Patient", ["sh", "-c", "sleep 2; echo done"])
    with stack.runner(runner, config) as first:
        run = run_services.queue_run(agent, "survive")
        wait_for(lambda: containers_of(runner), 20, "the sandbox being created")
        os.killpg(first.process.pid, signal.SIGKILL)  # no goodbye, no report
        first.process.wait()
    with stack.runner(runner, config):
        stack.wait(run, *FINISHED, timeout=90)  # a relaunch, on a machine busy with others
        assert run.status == RunStatus.SUCCEEDED, run.status_detail
        assert "done" in run.log_tail
        wait_for(lambda: not containers_of(runner), 10, "the sandbox removed")
        # A sandbox whose run is over is removed when the runner reconciles.
        cancelled = run_services.queue_run(agent, "cancel me")
        stack.wait(cancelled, RunStatus.RUNNING)
    run_services.cancel(cancelled)  # while the runner is down: the order waits in its queue
    with stack.runner(runner, config):
        stack.wait(cancelled, *FINISHED)
        wait_for(lambda: not containers_of(runner), 15, "the leftover sandbox removed")
    assert cancelled.status == RunStatus.CANCELLED


def test_pause_lets_running_work_finish_and_holds_new_work_until_resume(stack, acme, alice):
    runner, config = stack.register(acme, "edge-1")
    # Running until the test lets it end (a file in its home): runner_pause is a Django start
    # of its own, seconds long on a machine busy with other tests.
    gate = "until [ -e $HOME/go ]; do sleep 0.2; done; echo finished"
    agent = stack.agent(acme, "Worker", ["sh", "-c", gate])
    with stack.runner(runner, config) as process, stack.api(alice) as api:
        running_run = stack.wait(run_services.queue_run(agent, "first"), RunStatus.RUNNING)
        paused = subprocess.run(
            [sys.executable, "manage.py", "runner_pause", "--config", str(config)],
            env={k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
            | {"COVEY_VAR_DIR": str(process.var)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert paused.returncode == 0 and "is paused" in paused.stdout, paused.stderr
        waiting = run_services.queue_run(agent, "second")
        assert waiting.status_detail.startswith(f"waiting for run {running_run.pk} of this agent")
        (stack.home(runner, agent) / "go").touch()
        stack.wait(running_run, *FINISHED)
        assert running_run.status == RunStatus.SUCCEEDED

        def says_paused() -> bool:  # once the first has ended, the second waits for the runner
            waiting.refresh_from_db()
            return "paused" in waiting.status_detail

        wait_for(says_paused, 10, "the waiting run saying its runner is paused")
        assert waiting.status == RunStatus.QUEUED
        assert api.post(f"/api/v1/runners/{runner.pk}/resume/").json()["paused"] is False
        stack.wait(waiting, *FINISHED)
    assert waiting.status == RunStatus.SUCCEEDED


def test_runs_go_only_to_runners_with_the_labels_and_of_the_organisation(stack, acme, globex):
    gpu, gpu_config = stack.register(acme, "gpu-1", ["gpu"])
    plain, plain_config = stack.register(acme, "plain-1")
    needs_gpu = stack.agent(acme, "Trainer", ["true"], required_labels=["gpu"])
    elsewhere = stack.agent(globex, "Other", ["true"])
    with stack.runner(gpu, gpu_config), stack.runner(plain, plain_config):
        trained = stack.wait(run_services.queue_run(needs_gpu, "train"), *FINISHED)
        foreign = run_services.queue_run(elsewhere, "not on acme's runners")
        time.sleep(1)
        foreign.refresh_from_db()
    assert trained.runner == gpu and trained.status == RunStatus.SUCCEEDED
    assert foreign.status == RunStatus.QUEUED and foreign.runner is None
    # Globex's only runner is its built-in one, which no process serves here.
    assert foreign.status_detail == "no runner can take it now: builtin-globex offline"


def test_runner_tokens_are_renewed_when_the_control_plane_starts(stack, acme, settings):
    settings.COVEY_BUILTIN_RUNNER = False  # no built-in identity files from this process
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Builder", ["echo", "still works"])
    old_token = json.loads(config.read_text())["token"]
    with stack.runner(runner, config):
        stack.stop_control_plane()
        renew_runner_tokens()  # what scripts/run does before the web server starts
        stack.start_control_plane()
        refused = httpx.get(
            f"{stack.url}/api/v1/runner/", headers={"Authorization": f"Runner {old_token}"}
        )
        assert refused.status_code == 401
        wait_for(
            lambda: json.loads(config.read_text())["token"] != old_token,
            20,
            "the runner taking its renewed token",
        )
        run = stack.wait(run_services.queue_run(agent, "after renewal"), *FINISHED)
    assert run.status == RunStatus.SUCCEEDED and "still works" in run.log_tail


def test_a_reconcile_that_listed_sandboxes_too_early_does_not_call_a_run_vanished(stack, acme):
    from runners.host.identity import Identity
    from runners.host.runner import HostSettings, RunnerHost

    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Sleeper", ["sleep", "60"])
    with stack.runner(runner, config):
        run = stack.wait(run_services.queue_run(agent, "stay"), RunStatus.RUNNING)
        identity = Identity(config, stack.url)
        host = RunnerHost({identity.id: identity}, HostSettings(homes=stack.tmp / "homes"))
        host.reconcile(identity, sandboxes=[])  # as if listed just before the launch
        run.refresh_from_db()
        assert run.status == RunStatus.RUNNING
        run_services.cancel(run)
        stack.wait(run, *FINISHED, timeout=20)
    assert run.status == RunStatus.CANCELLED


class FakeProxy:
    """Something that answers like an HTTP proxy on an address sandboxes reach (it refuses
    every CONNECT): enough for the runner's check that its proxy answers."""

    def __init__(self, host: str, port: int) -> None:
        self.server = socket.create_server((host, port))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with client:
                client.settimeout(5)
                with contextlib.suppress(OSError):
                    client.recv(4096)
                    client.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")

    def close(self) -> None:
        self.server.close()


def test_a_runner_without_the_default_image_says_so_at_start(acme, tmp_path, base_image):
    stack = Stack(tmp_path, base_image)
    try:
        runner, config = stack.register(acme, "edge-1")
        with stack.runner(runner, config, COVEY_DEFAULT_IMAGE="covey-none-such:latest") as process:
            said = process.output()
        with stack.runner(runner, config, COVEY_DEFAULT_IMAGE=base_image) as process:
            quiet = process.output()
    finally:
        stack.close()
    assert "THE DEFAULT IMAGE IS MISSING" in said
    assert "covey-none-such:latest is not on this host" in said and "docker load" in said
    assert "THE DEFAULT IMAGE IS MISSING" not in quiet


def test_a_runner_whose_proxy_does_not_answer_refuses_launches_saying_why(
    acme, tmp_path, base_image
):
    """Sandboxes told of a proxy nothing answers at would fail every request silently: the
    runner checks from the sandbox network at start, refuses launches with a status that says
    what is wrong, and takes work again once a later check passes (issue 9, item 1). Its
    status listener and its heartbeats say the same meanwhile."""
    stack = Stack(tmp_path, base_image, COVEY_EGRESS_ENFORCE="true")
    address = Engine("address").bridge_address()
    port = free_port()
    status = f"http://127.0.0.1:{free_port()}"
    proxy = None
    try:
        runner, config = stack.register(acme, "edge-1")
        agent = stack.agent(acme, "Quiet", ["sh", "-c", 'echo "proxy=$HTTPS_PROXY" | cut -d@ -f2'])
        # A launch would wait this long for the proxy to come up: not at all here.
        env = {
            "COVEY_RUNNER_PROXY": f"{address}:{port}",
            "COVEY_RUNNER_PROXY_WAIT_SECONDS": "0",
            "COVEY_RUNNER_STATUS_LISTEN": status.removeprefix("http://"),
            "COVEY_METRICS_TOKEN": "metrics-" + "m" * 24,
        }
        with stack.runner(runner, config, **env) as process:
            assert "PROXY CHECK FAILED, launches are refused" in process.output()
            assert f"status at {status}/" in process.output()
            not_ready = httpx.get(f"{status}/readyz")
            assert not_ready.status_code == 503
            problem = not_ready.json()["runners"][str(runner.pk)]["checks"]["egress"]
            assert f"the egress proxy at {address}:{port} does not answer" in problem

            def said_so() -> bool:  # its next heartbeat
                runner.refresh_from_db()
                return runner.host_ready is False and problem in runner.host_problem

            wait_for(said_so, 10, "the heartbeat saying why the runner is not ready")
            refused = stack.wait(run_services.queue_run(agent, "one"), *FINISHED)
            assert refused.status == RunStatus.FAILED
            assert f"the egress proxy at {address}:{port} does not answer" in (
                refused.status_detail
            )
            assert not containers_of(runner)
            proxy = FakeProxy(address, port)
            time.sleep(10.5)  # PROXY_RECHECK_SECONDS: a failed check is repeated after it
            ran = stack.wait(run_services.queue_run(agent, "two"), *FINISHED)
            assert ran.status == RunStatus.SUCCEEDED, ran.status_detail
            assert f"{address}:{port}" in ran.log_tail
            assert f"sandboxes reach the egress proxy at {address}:{port} again" in (
                process.output()
            )
            assert httpx.get(f"{status}/readyz").status_code == 200
            scraped = httpx.get(
                f"{status}/metrics",
                headers={"Authorization": f"Bearer {env['COVEY_METRICS_TOKEN']}"},
            )
            figures = {
                (s.name, s.labels.get("outcome", "")): s.value
                for family in text_string_to_metric_families(scraped.text)
                for s in family.samples
            }
            assert figures["covey_runner_host_ready", ""] == 1
            assert figures["covey_runner_host_launches_total", "refused"] == 1
            assert figures["covey_runner_host_launches_total", "started"] == 1
            wait_for(lambda: runner.refresh_from_db() or runner.host_ready, 10, "ready said")
    finally:
        if proxy is not None:
            proxy.close()
        stack.close()


def test_a_running_runs_output_arrives_while_it_runs(stack, acme, alice):
    """Output is sent about every second while the sandbox runs; the API follows it by offset,
    and the whole log replaces it at the end (issue 9, item 4)."""
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(
        acme,
        "Talker",
        ["sh", "-c", "echo first; sleep 3; echo second; sleep 30; echo never"],
    )
    with stack.runner(runner, config), stack.api(alice) as api:
        run = run_services.queue_run(agent, "talk")
        stack.wait(run, RunStatus.RUNNING)

        def has(text: str) -> bool:
            return text in api.get(f"/api/v1/runs/{run.pk}/log/").text

        wait_for(lambda: has("first\n"), 10, "the first line while the run goes")
        first = api.get(f"/api/v1/runs/{run.pk}/log/")
        assert first.text == "first\n" and first.headers["X-Covey-Log-Complete"] == "false"
        offset = first.headers["X-Covey-Log-Size"]
        wait_for(lambda: has("second"), 10, "the second line")
        more = api.get(f"/api/v1/runs/{run.pk}/log/", params={"offset": offset})
        assert more.text == "second\n"
        run.refresh_from_db()
        assert run.status == RunStatus.RUNNING and run.log_tail == "first\nsecond\n"
        assert api.post(f"/api/v1/runs/{run.pk}/cancel/").status_code == 200
        stack.wait(run, *FINISHED, timeout=30)
        done = api.get(f"/api/v1/runs/{run.pk}/log/")
    assert done.text == "first\nsecond\n" and done.headers["X-Covey-Log-Complete"] == "true"
    assert not run.output.exists()


def test_the_claude_runtime_missing_from_the_image_fails_the_run_saying_what_to_do(stack, acme):
    """Issue 9, item 5, end to end: the base image has no claude."""
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Default", [])
    with stack.runner(runner, config):
        run = stack.wait(run_services.queue_run(agent, "fix the bug"), *FINISHED)
    assert run.status == RunStatus.FAILED and run.exit_code == 127
    assert f"the image {stack.base_image} has no Claude runtime" in run.status_detail
    assert "covey: this image has no Claude runtime" in run.log_tail


def test_a_runner_removes_only_leftovers_of_its_own_installation(stack, acme, tmp_path):
    """Another installation on the same engine has runners with the same ids: a runner's
    reconcile removes leftover sandboxes that carry its name and its installation's key, and
    never one of another installation's, even under the same runner name (issue 9, item 6)."""
    runner, config = stack.register(acme, "edge-1")
    name = docker_name(runner.pk, installation_key())
    ours = Engine(name, installation=installation_key())
    theirs = Engine(name, installation="another0000")
    spec = SandboxSpec(
        run_id="", agent_id=1, image=stack.base_image, command=["sleep", "600"], task="",
        environment={}, home=tmp_path / "foreign-home",
    )  # fmt: skip
    leftover, foreign = (replace(spec, run_id=f"r-{uuid4().hex[:12]}") for _ in range(2))
    try:
        ours.launch(leftover)  # a sandbox of ours that no run knows
        theirs.launch(foreign)
        with stack.runner(runner, config):
            wait_for(lambda: ours.get(leftover.run_id) is None, 30, "our leftover removed")
        assert theirs.get(foreign.run_id).status == "running"
        labels = json.loads(docker("inspect", theirs.get(foreign.run_id).container_id))[0]
        assert labels["Config"]["Labels"]["covey.installation"] == "another0000"
    finally:
        ours.remove(leftover.run_id)
        theirs.remove(foreign.run_id)


def test_a_home_keeps_what_a_run_changed_its_usage_and_its_quota(stack, acme):
    """The runner's own view of the home, end to end: what the run changed and what the home
    holds come back with its exit; past its quota the next run is refused before it is built,
    and a run that fills it is stopped (issue 11)."""
    runner, config = stack.register(acme, "edge-1")
    write = "echo edited > notes.md; mkdir -p src; head -c 1500000 /dev/zero > src/data.bin"
    agent = stack.agent(acme, "Writer", ["sh", "-c", f"cd $HOME && {write}"], home_quota_mb=1)
    with stack.runner(runner, config):
        run = stack.wait(run_services.queue_run(agent, "write"), *FINISHED)
        assert run.status == RunStatus.SUCCEEDED, run.status_detail
        assert run.home_changes["added"] == ["notes.md", "src", "src/data.bin"]
        agent.refresh_from_db()
        assert (agent.home_bytes, agent.home_files) == (1_500_007, 2)
        refused = stack.wait(run_services.queue_run(agent, "again"), *FINISHED)
        assert refused.status == RunStatus.FAILED
        assert "the home holds 1.4 MiB, more than its quota of 1.0 MiB" in refused.status_detail
        assert containers_of(runner) == []

        grower = stack.agent(
            acme, "Grower", ["sh", "-c", "head -c 2000000 /dev/zero > $HOME/big; sleep 60"],
            home_quota_mb=1,
        )  # fmt: skip
        stopped = stack.wait(run_services.queue_run(grower, "fill"), *FINISHED, timeout=45)
        assert stopped.status == RunStatus.FAILED
        assert stopped.status_detail.startswith("stopped: its home passed its quota (1.9 MiB")


def test_a_workplace_gives_its_runs_their_packages_and_services(
    stack, acme, apt_repository, pip_index, root
):
    """A workplace end to end (issue 12): packages approved for it (a Debian package and a Python
    one, from the test's own repository and index) installed in an image built for its new
    version, its service ready beside the sandbox and reached by name, both on the run's record;
    a service that is never ready fails the run naming it."""
    runner, config = stack.register(acme, "edge-1")
    ready = "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/')"
    web = {
        "name": "web",
        "image": stack.base_image,
        "command": ["python3", "-m", "http.server", "8080"],
        "ready": {"command": ["python3", "-c", ready], "interval": 0.2, "timeout": 30},
        "memory_mb": 64,
    }
    workplace = create_workplace(acme, "dev", stack.base_image, services=[web])
    fetch = "curl --silent --show-error --max-time 5 http://web:8080/ >/dev/null && echo fetched"
    script = f"hello; covey-greet; {fetch}"
    agent = stack.agent(acme, "Builder", ["sh", "-c", script], workplace=workplace)
    asked = approvals.file_package(agent, "apt", "hello", reason="it greets")
    approved = approvals.approve(asked, by=root, note="harmless")
    assert approved.produced == {"workplace_version": 2}
    asked = approvals.file_package(agent, "pip", "covey-greeting", reason="it greets too")
    assert approvals.approve(asked, by=root, note="ok").produced == {"workplace_version": 3}
    broken = create_workplace(
        acme,
        "broken",
        stack.base_image,
        services=[{**web, "name": "db", "ready": {"command": ["false"], "timeout": 1}}],
    )
    waiting = stack.agent(acme, "Waiting", ["true"], workplace=broken)
    build = {
        "COVEY_WORKPLACE_APT_SOURCES": str(apt_repository),
        "COVEY_WORKPLACE_PIP_INDEX_URL": pip_index.url,
    }
    with stack.runner(runner, config, COVEY_WORKPLACE_BUILD_NETWORK="host", **build):
        run = stack.wait(run_services.queue_run(agent, "use them"), *FINISHED, timeout=240)
        assert run.status == RunStatus.SUCCEEDED, run.status_detail
        assert "Hello, world!\nhello from pip, dep 2.0\nfetched" in run.log_tail
        assert run.image_id.startswith("sha256:")
        (service,) = run.services
        assert service["name"] == "web" and service["image_id"].startswith("sha256:")
        assert '"GET / HTTP/1.1" 200' in service["log"]
        assert run.workplace_version.number == 3  # the version the approvals made
        failed = stack.wait(run_services.queue_run(waiting, "wait"), *FINISHED, timeout=60)
        assert failed.status == RunStatus.FAILED
        assert failed.status_detail.startswith(
            "the sandbox could not be built: service db did not become ready within 1 s"
        )
        assert failed.services[0]["name"] == "db"
        wait_for(lambda: not containers_of(runner), 10, "the sandboxes removed")
    # The image built for the workplace (the test's own: its content is the test repository's).
    subprocess.run(["docker", "rmi", "--force", run.image_id], capture_output=True, check=False)


def test_a_sandbox_asks_for_a_route_through_its_cooperative_proxy(acme, tmp_path, base_image, root):
    """Issue 12 at the cooperative level: the sandbox is told of the proxy (the real
    ``manage.py egress_proxy`` on the host, policy and requests from the database, as `make run`
    runs it) and covey-request goes through it to its desk; the answer reaches the sandbox."""
    from approvals.models import Request, Status
    from tests.processes import running
    from tests.runners.stack import subprocess_database_url

    stack = Stack(tmp_path, base_image, COVEY_EGRESS_ENFORCE="true")
    address = Engine("address").bridge_address()
    port = free_port()
    env = {**os.environ, "DATABASE_URL": subprocess_database_url(), "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "manage.py", "egress_proxy", "--listen", f"{address}:{port}"]
    log = tmp_path / "proxy.log"
    try:
        with running(args, env, log):
            wait_for(lambda: "listening" in log.read_text(), 30, "the proxy listening", log)
            runner, config = stack.register(acme, "edge-1")
            script = (
                "covey-request egress registry.example.org --reason 'the SDK' --wait 60;"
                ' echo "asked: exit $?"'
            )
            agent = stack.agent(acme, "Asking", ["sh", "-c", script])
            with stack.runner(runner, config, COVEY_RUNNER_PROXY=f"{address}:{port}"):
                run = run_services.queue_run(agent, "ask")
                pending = Request.objects.filter(agent=agent, status=Status.PENDING)
                wait_for(pending.exists, 60, "the sandbox's request", log)
                request = pending.get()
                assert request.requesters.get().run_id == run.pk
                approvals.reject(request, by=root, note="use the internal mirror")
                run = stack.wait(run, *FINISHED, timeout=60)
        assert run.status == RunStatus.SUCCEEDED, (run.status_detail, run.log_tail)
        assert '"note": "use the internal mirror"' in run.log_tail
        assert "asked: exit 1" in run.log_tail  # rejected
    finally:
        stack.close()
