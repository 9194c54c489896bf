"""`make run`'s script on embedded defaults: SQLite, a file-system broker, no servers."""

import contextlib
import http.server
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from dnslib.server import DNSLogger, DNSServer  # type: ignore[import-untyped]

from runners.host.containers import isolation, shape
from runners.host.containers.engine import Engine
from tests.budgets.conftest import KEY, ca, vendor  # noqa: F401 - fixtures
from tests.processes import ROOT, VENV_BIN, free_port, running, wait_for
from tests.runners.isolation_support import leftovers
from tests.runners.world import (
    OFF_LIST_NAME,
    UPSTREAM_NAME,
    OneName,
    Outside,
    Upstream,
    serve,
    upstream_address,
)

pytestmark = pytest.mark.e2e  # each starts make run: the control plane, its worker, runner, proxy


def fetch(url):
    try:
        # Not short: the schema is made on its first request, slowly when the machine is busy.
        with urllib.request.urlopen(url, timeout=15) as response:  # noqa: S310 - loopback only
            return response.status, response.read()
    except OSError:
        return None, b""


RUNS = 6


def run_env(tmp_path, port: int) -> dict[str, str]:
    """`make run`'s environment: nothing configured but where to keep things and listen (only
    the proxy's port: the script finds where sandboxes reach this host)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DATABASE_URL", "CELERY_BROKER_URL", "COVEY_ADMIN_PASSWORD")
    }
    return env | {
        "COVEY_VAR_DIR": str(tmp_path / "var"),
        "COVEY_BIND": f"127.0.0.1:{port}",
        "COVEY_PROXY_PORT": str(free_port()),
        "COVEY_MODEL_GATEWAY_PORT": str(free_port()),  # never the 8002 of someone's make run
        "COVEY_DEMO_FORGE_PORT": str(free_port()),  # nor its 8003
        "COVEY_EGRESS_STREAM_PORT": str(free_port()),  # nor its 8004
        "PATH": f"{VENV_BIN}:{env['PATH']}",
        "PYTHONUNBUFFERED": "1",
    }


@contextlib.contextmanager
def admin_api(base: str, env: dict[str, str]) -> Iterator[tuple[httpx.Client, int]]:
    """An API client as make run's admin (a token made with the script's settings), and the
    organisation Acme it made."""
    token = subprocess.run(
        [str(VENV_BIN / "python"), "manage.py", "drf_create_token", "admin"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()[2]  # fmt: skip
    headers = {"Authorization": f"Token {token}"}
    with httpx.Client(base_url=base, timeout=10, headers=headers) as api:
        organisation = api.post("/api/v1/organisations/", json={"name": "Acme"}).json()
        assert "id" in organisation, organisation
        yield api, organisation["id"]


def left_behind(var: Path) -> list[str]:
    """The containers a make run kept in ``var`` left on this host's Docker engine (none
    when there is no engine)."""
    if shutil.which("docker") is None or not (var / "covey.sqlite3").exists():
        return []
    with contextlib.closing(sqlite3.connect(var / "covey.sqlite3")) as database:
        keys = [row[0] for row in database.execute("SELECT key FROM runners_installation")]
    names: list[str] = []
    for key in keys:
        names += subprocess.run(
            ["docker", "ps", "-a", "--format", "{{.Names}}", "--filter",
             f"label=covey.installation={key}"],
            capture_output=True, text=True, check=False, timeout=30,
        ).stdout.split()  # fmt: skip
    return names


def readme_block(containing: str) -> str:
    """The README's shell block that holds ``containing``."""
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    (block,) = [b for b in blocks if containing in b]
    return str(block)


def finished(api: httpx.Client, run: dict, process, log, deadline: float) -> dict:
    """The run once it has ended (by ``deadline``, and while make run still runs)."""
    while run["status"] not in ("succeeded", "failed", "cancelled", "timed_out"):
        assert time.monotonic() < deadline, (run, log.read_text()[-4000:])
        assert process.poll() is None, log.read_text()[-4000:]
        time.sleep(0.5)
        run = api.get(f"/api/v1/runs/{run['id']}/").json()
    return run


def serving(base: str, process: subprocess.Popen, log: Path) -> None:
    """Wait for make run's admin login page (failing at once, with its log, if it exits)."""

    def up() -> bool:
        assert process.poll() is None, log.read_text()
        return fetch(f"{base}/admin/login/")[0] == 200

    wait_for(up, 120, "the admin login page", log)


@pytest.mark.suite("faults")
def test_run_without_a_docker_engine_serves_all_but_sandboxes_boxes_what_to_read_stops_on_ctrl_c(
    tmp_path,
):
    """No engine: everything but sandboxes, said once (a run fails saying why; the rest goes
    on). The password, once every process is up, in a box below their start; the runner's
    heartbeats (access lines every 5 s) and beat's schedule only in var/make-run.log, which
    never holds the password; Ctrl-C: "covey stopped." and exit code 0."""
    port = free_port()
    env = run_env(tmp_path, port) | {"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    log = tmp_path / "run.log"
    file = tmp_path / "var" / "make-run.log"
    base = f"http://127.0.0.1:{port}"
    heartbeat = '"POST /api/v1/runner/ HTTP/1.1" 200'
    with running([str(ROOT / "scripts" / "run")], env, log) as process:
        rule = "─" * 20

        def boxed() -> bool:
            assert process.poll() is None, log.read_text()
            return rule in log.read_text()

        wait_for(boxed, 180, "the box", log)
        serving(base, process, log)
        with admin_api(base, env) as (api, organisation):
            agent = api.post(
                "/api/v1/agents/",
                json={"organisation": organisation, "name": "Idle", "runtime_command": ["true"]},
            ).json()
            run = api.post("/api/v1/runs/", json={"agent": agent["id"], "task": "t"}).json()
            assert "id" in run, run

            def said() -> bool:
                runner = api.get("/api/v1/runners/").json()["results"][0]
                return runner["host_ready"] is False and "Docker" in runner["host_problem"]

            wait_for(said, 60, "the built-in runner saying Docker does not answer", log)
            run = finished(api, run, process, log, time.monotonic() + 30)
            assert run["status"] == "failed", run
            assert "no sandbox can start on this host: " in run["status_detail"], run
            assert "Docker engine" in run["status_detail"], run
            assert api.get("/api/v1/agents/").status_code == 200  # the rest goes on
            assert process.poll() is None, log.read_text()[-4000:]
        wait_for(lambda: file.read_text().count(heartbeat) >= 2, 30, "two heartbeats", file)
        wait_for(lambda: "Sending due task" in file.read_text(), 30, "beat's schedule", file)
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=60) == 0
    shown = log.read_text()
    assert shown.count("covey: no Docker engine answers") == 1, shown[-4000:]
    assert "Traceback" not in shown, shown[-4000:]  # Ctrl-C included
    password = re.search(r"Created superuser 'admin' with password: (\S+)", shown)
    assert password is not None, shown
    lines = shown.splitlines()
    top, bottom = [n for n, line in enumerate(lines) if line and set(line) == {"─"}]
    boxed_lines = "\n".join(lines[top + 1 : bottom])  # between its rules: said again
    assert password.group(0) in boxed_lines
    assert f"covey: admin at http://127.0.0.1:{port}/admin/" in boxed_lines
    assert (
        "egress is cooperative" in boxed_lines and "COVEY_EGRESS_ISOLATION=network" in boxed_lines
    )
    assert any("| " in line for line in lines[:top])  # below the processes' start
    assert heartbeat not in shown and "Sending due task" not in shown
    assert shown.splitlines()[-1] == "covey stopped."
    kept = file.read_text()
    assert password.group(1) not in kept
    assert "Handling signal: term" in kept  # how web stopped: there, not on the terminal
    assert "Handling signal: term" not in shown


@pytest.mark.docker
def test_run_runs_an_agent_on_the_builtin_runner_behind_its_proxy(tmp_path, base_image):
    """Out of the box: the admin's login page, the schema and the admin's static files are
    served with a generated password for the first superuser; an organisation gets a built-in
    runner, a run gets a sandbox whose traffic goes through covey's proxy (which refuses a name
    that is not on the list); a stop leaves no container behind.

    The script finds where sandboxes reach this host by itself, also on engines that report no
    gateway for their default bridge (as this machine's does), and the runner checks that the
    proxy answers there before it takes work."""
    port = free_port()
    # A proxy that would not poll again within the test: the runs' credentials, made a moment
    # before their sandboxes ask, must work all the same.
    env = run_env(tmp_path, port) | {
        "COVEY_EGRESS_POLICY_POLL": "60",
        "COVEY_EGRESS_POLICY_GRACE": "600",  # and trusts what it has meanwhile
    }
    host_address = Engine("address").bridge_address()
    log = tmp_path / "run.log"
    base = f"http://127.0.0.1:{port}"
    with running([str(ROOT / "scripts" / "run")], env, log) as process:
        serving(base, process, log)
        status, schema = fetch(f"{base}/api/v1/schema/")
        assert status == 200
        assert b"/api/v1/agents/" in schema
        # The static files of the admin are served too.
        assert fetch(f"{base}/static/admin/css/base.css")[0] == 200
        with admin_api(base, env) as (api, organisation):
            command = [
                "sh",
                "-c",
                "echo proxy=${HTTPS_PROXY##*@};"
                " curl -s -o /dev/null -w 'connect=%{http_connect}\\n' https://not-on-the-list.test/;"
                " echo done",
            ]
            agents = [
                api.post(
                    "/api/v1/agents/",
                    json={"organisation": organisation, "name": f"Builder {n}",
                          "runtime_command": command},
                ).json()
                for n in range(RUNS)
            ]  # fmt: skip
            assert all("id" in agent for agent in agents), agents
            # Several at once (of several agents: runs of one agent take turns with its home):
            # each run's credential works on its sandbox's first request.
            queued = [
                api.post("/api/v1/runs/", json={"agent": agent["id"], "task": "hello"}).json()
                for agent in agents
            ]
            deadline = time.monotonic() + 120
            ended = [finished(api, run, process, log, deadline) for run in queued]
    output = log.read_text()
    assert "sandboxes reach the egress proxy at" in output
    assert "Created superuser 'admin' with password: " in output
    assert (tmp_path / "var" / "covey.sqlite3").exists()
    for run in ended:
        assert run["status"] == "succeeded", json.dumps(run, indent=1)
        assert run["runner"] == "builtin-acme"
        assert f"proxy={host_address}:{env['COVEY_PROXY_PORT']}" in run["log_tail"]
        # covey's proxy knew the run's credential (not 407) and refused the name: off the list.
        assert "connect=403" in run["log_tail"], run["log_tail"]
    # Stopped as it started: nothing of this installation is left on the Docker engine.
    assert left_behind(tmp_path / "var") == []


@pytest.mark.docker
def test_a_new_installation_prints_how_to_run_its_demo_agent_and_the_claude_runtime_runs_it(
    tmp_path,
    workplace_image,
    ca,  # noqa: F811 - a fixture imported above
    vendor,  # noqa: F811 - a fixture imported above
):
    """The first start's own two lines, pasted into a shell: without the organisation's
    Anthropic key the run fails at once saying where to enter it; with it, the demo agent runs
    the real Claude runtime in the default workplace image, which reaches its model (a fake
    vendor here) through the model gateway with the run's token, never the key. Ctrl-C stops
    everything and leaves none of its containers behind."""
    port = free_port()
    env = run_env(tmp_path, port) | {
        "COVEY_MODEL_GATEWAY_PORT": str(free_port()),
        "COVEY_MODEL_UPSTREAM": vendor.url,
        "COVEY_MODEL_CA_BUNDLE": str(ca.ca_file),
    }
    env.pop("COVEY_DEFAULT_IMAGE", None)  # the default: the workplace image
    log = tmp_path / "run.log"
    base = f"http://127.0.0.1:{port}"
    shell_env = {k: v for k, v in os.environ.items() if not k.startswith("COVEY_")}
    with running([str(ROOT / "scripts" / "run")], env, log) as process:
        wait_for(lambda: b"taking orders" in log.read_bytes(), 180, "the built-in runner", log)
        wait_for(lambda: fetch(f"{base}/admin/login/")[0] == 200, 60, "the control plane", log)
        printed = log.read_text().splitlines()
        export = next(line for line in printed if line.startswith("  export COVEY_"))
        start = next(line for line in printed if line.startswith("  run=$(curl"))
        follow = next(line for line in printed if "scripts/run-log" in line)
        assert any(f"{base}/admin/budgets/modelkey/add/" in line for line in printed)
        lines = f"{export.strip()}\n{start.strip()}\n{follow.strip()}\n"

        def paste() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["bash", "-c", lines], cwd=ROOT, env=shell_env, capture_output=True, text=True,
                timeout=240, check=False,
            )  # fmt: skip

        before = time.monotonic()
        without_key = paste()
        assert without_key.returncode == 1, (without_key.stdout, without_key.stderr)
        assert "failed: Demo has no Anthropic API key" in without_key.stdout
        assert "/admin/budgets/modelkey/add/" in without_key.stdout
        assert time.monotonic() - before < 15  # at once: no sandbox was built for it
        assert vendor.seen == []

        subprocess.run(
            [str(VENV_BIN / "python"), "manage.py", "shell", "-c",
             "from budgets.keys import set_model_key; from organisations.models import"
             f" Organisation; set_model_key(Organisation.objects.get(name='Demo'), {KEY!r})"],
            cwd=ROOT, env=env, check=True, timeout=60,
        )  # fmt: skip
        with_key = paste()
        assert with_key.returncode == 0, with_key.stdout + with_key.stderr + log.read_text()[-3000:]
        # What the fake vendor answered, as the runtime printed it.
        assert "Hello, world!" in with_key.stdout
        run_id = with_key.stdout.splitlines()[0].strip()
        token = export.split("COVEY_TOKEN=")[1]

        # README.md's brokered git, as written (the demo forge on this test's port; var/ here).
        forge_lines = readme_block("/api/v1/connections/").replace(
            "127.0.0.1:8003", f"127.0.0.1:{env['COVEY_DEMO_FORGE_PORT']}"
        )
        added = subprocess.run(
            ["bash", "-ec", f"{export.strip()}\n{forge_lines}"], cwd=tmp_path, env=shell_env,
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert added.returncode == 0, added.stdout + added.stderr
        pushed = paste()
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr + log.read_text()[-3000:]
        assert "refs/heads/covey/demo/hello" in pushed.stdout  # what the forge lists after
        assert "! [remote rejected] HEAD -> main (protected by covey" in pushed.stdout
        assert "GIT_CONFIG_KEY_1=http.http://" in pushed.stdout
        forge_token = (tmp_path / "var" / "demo-forge" / "token").read_text().strip()
        assert forge_token not in pushed.stdout and forge_token not in log.read_text()
        with httpx.Client(base_url=base, headers={"Authorization": f"Token {token}"}) as api:
            run = api.get(f"/api/v1/runs/{run_id}/").json()
            usage = api.get(f"/api/v1/agents/{run['agent']}/usage/").json()
            # A run still going at Ctrl-C: its sandbox goes too.
            organisation = api.get("/api/v1/organisations/").json()["results"][0]["id"]
            sleeper = api.post(
                "/api/v1/agents/",
                json={"organisation": organisation, "name": "Sleeper",
                      "runtime_command": ["sleep", "600"]},
            ).json()  # fmt: skip
            going = api.post("/api/v1/runs/", json={"agent": sleeper["id"], "task": "wait"}).json()
            wait_for(
                lambda: api.get(f"/api/v1/runs/{going['id']}/").json()["status"] == "running",
                60, "the second run running", log,
            )  # fmt: skip
        assert process.poll() is None
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=60) == 0
    workplace_id = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", workplace_image],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert run["status"] == "succeeded" and run["image_id"] == workplace_id, run
    # The runtime's default model is priced (it was charged), and the vendor saw the
    # organisation's key, never the run's token.
    assert usage["total"]["requests"] == len(vendor.seen) >= 1, usage
    assert Decimal(usage["total"]["cost"]) > 0
    assert {seen.headers.get("x-api-key") for seen in vendor.seen} == {KEY}
    assert KEY not in log.read_text()
    for ran in (run_id, going["id"]):
        left = subprocess.run(
            ["docker", "ps", "-a", "-q", "--filter", f"label=covey.run={ran}"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert left == [], log.read_text()[-3000:]
    # After Ctrl-C the terminal has one line; the log file has how each process stopped.
    assert log.read_text().splitlines()[-1] == "covey stopped."
    assert "removed 1 sandbox(es) at exit" in (tmp_path / "var" / "make-run.log").read_text()


@pytest.mark.docker
def test_run_with_network_isolation_needs_no_other_setting(tmp_path, base_image):
    """`COVEY_EGRESS_ISOLATION=network make run`: the script builds the egress image if it is
    missing and has web listen where the runner's proxy container reaches it, so a run's only
    exit is that proxy. The other settings here only stand in for the internet (the probe's
    targets, the vendor it must reach, and the resolver and address that name it)."""
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        message = "network isolation needs root and iptables"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with contextlib.ExitStack() as resources:
        host = Engine("address").bridge_address()
        Upstream.body, Upstream.seen = f"hello from upstream {time.time_ns()}".encode(), []
        upstream_host = upstream_address(resources)
        upstream = http.server.ThreadingHTTPServer((upstream_host, 80), Upstream)
        serve(resources, upstream)
        quiet = DNSLogger(log="-request,-reply,-truncated,-error", logf=lambda _message: None)
        dns = DNSServer(OneName(UPSTREAM_NAME, upstream_host), address=host, port=0, logger=quiet)
        dns.start_thread()
        resources.callback(dns.stop)
        outside = Outside(base_image)
        resources.callback(outside.close)
        port = free_port()
        env = run_env(tmp_path, port) | {
            "COVEY_EGRESS_ISOLATION": "network",
            "COVEY_EGRESS_PROBE_ALLOWED": f"{UPSTREAM_NAME}:80",
            "COVEY_EGRESS_PROBE_OFF_LIST": f"{OFF_LIST_NAME}:443",
            "COVEY_EGRESS_NAMESERVERS": f"{host}@{dns.server.server_address[1]}",
            "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": f"{host}/32,{upstream_host}/32",
            **outside.targets(),
        }
        log = tmp_path / "run.log"
        base = f"http://127.0.0.1:{port}"
        names: list[str] = []  # the built-in runners' (Demo's, then Acme's), as Docker names

        def shapes() -> list[str]:
            """The isolation shapes of this installation's runners (key: the first one's)."""
            key = names[0].rsplit("-", 1)[1]
            listed = subprocess.run(
                ["docker", "network", "ls", "--filter", f"label={shape.LABEL_ISOLATION}",
                 "--format", f'{{{{.Label "{shape.LABEL_ISOLATION}"}}}}'],
                capture_output=True, text=True, check=True, timeout=60,
            ).stdout.split()  # fmt: skip
            return sorted({name for name in listed if name.endswith(f"-{key}")})

        @resources.callback
        def remove_isolation() -> None:  # the runners keep their shapes for their next start
            for name in shapes() if names else []:
                isolation.teardown(name)
                isolation.remove_rules(name)
                names.append(name)

        with running([str(ROOT / "scripts" / "run")], env, log) as process:
            wait_for(lambda: fetch(f"{base}/admin/login/")[0] == 200, 120, "the control plane", log)
            with admin_api(base, env) as (api, organisation):
                found = re.compile(r"sandboxes on covey-internal-(\S+),")
                wait_for(lambda: found.search(log.read_text()), 120, "the isolation shape", log)
                names.append(found.search(log.read_text()).group(1))
                wait_for(lambda: "egress probe passed" in log.read_text(), 120, "the probe", log)
                script = (
                    f'echo "via proxy: $(curl -sS --max-time 10 http://{UPSTREAM_NAME}/)";'
                    f" curl -sS --noproxy '*' --connect-timeout 3 http://{upstream_host}/;"
                    ' echo "direct: exit $?"'
                )
                agent = api.post(
                    "/api/v1/agents/",
                    json={"organisation": organisation, "name": "Isolated",
                          "runtime_command": ["sh", "-c", script],
                          "allowlist": [f"{UPSTREAM_NAME}:80"]},
                ).json()  # fmt: skip
                assert "id" in agent, agent
                run = api.post("/api/v1/runs/", json={"agent": agent["id"], "task": "go"}).json()
                run = finished(api, run, process, log, time.monotonic() + 120)
                # The runners' proxy containers follow the policy stream, on the address
                # they reach this host at.
                stream = f"http://{host}:{env['COVEY_EGRESS_STREAM_PORT']}/readyz"
                ready = httpx.get(stream, timeout=10)
                assert ready.status_code == 200 and ready.json()["followers"] >= 1, ready.text
    assert run["status"] == "succeeded", json.dumps(run, indent=1)
    assert f"via proxy: {Upstream.body.decode()}" in run["log_tail"], run["log_tail"]
    # Dropped, not refused: the packets never got to the host.
    assert "direct: exit 28" in run["log_tail"], run["log_tail"]
    assert len(set(names)) == 2, names  # Demo's runner's shape and Acme's
    for name in names:
        assert leftovers(name) == [], f"runner {name}'s isolation was left behind"
