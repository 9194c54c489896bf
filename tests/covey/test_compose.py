"""compose.yaml, the single-host production install: it validates with Compose, refuses to start
without its secrets, gives the Docker socket to the runner alone and the database to no
sandbox-facing or runner service that does not need it, and, brought up on this machine from
the images built here, runs an agent end to end: web, worker, the built-in runner, the proxy
(which identifies the agent and refuses a name off its list) and a home kept on the host.

Each test's Compose project, networks and volumes carry a name of their own, and `down`
removes them, whatever happened."""

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.processes import ROOT, free_port

COMPOSE_FILE = ROOT / "compose.yaml"
IN_CI = os.environ.get("CI") == "true"
IMAGES = ("covey:latest", "covey-postgres:latest", "covey-redis:latest")


def compose_command() -> list[str]:
    """The engine's Compose plugin, else Debian's docker-compose (scripts/test-services)."""
    plugin = subprocess.run(
        ["docker", "compose", "version"], capture_output=True, timeout=30, check=False
    )
    if plugin.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    message = "no Docker Compose here: run `make services`"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def env_file(path: Path, **settings: str) -> Path:
    made = subprocess.run(
        [str(ROOT / "scripts" / "compose-env"), str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "wrote" in made.stdout and path.stat().st_mode & 0o077 == 0
    with path.open("a") as file:
        file.writelines(f"{name}={value}\n" for name, value in settings.items())
    return path


def config(compose: list[str], env: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*compose, "--file", str(COMPOSE_FILE), "--env-file", str(env), "config"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_it_validates_and_says_which_secret_is_missing(tmp_path):
    compose = compose_command()
    env = env_file(tmp_path / ".env")
    validated = config(compose, env)
    assert validated.returncode == 0, validated.stderr
    services = yaml.safe_load(validated.stdout)["services"]
    assert set(services) == {
        "postgres", "redis", "web", "worker", "runner", "proxy", "gateway", "stream",
    }  # fmt: skip
    # Health checks on each service.
    assert {name for name, service in services.items() if "healthcheck" in service} == set(services)

    def mounts(service: dict) -> list[str]:
        return [
            volume if isinstance(volume, str) else f"{volume['source']}:{volume['target']}"
            for volume in service.get("volumes", [])
        ]

    socket_holders = {
        name
        for name, service in services.items()
        if any("docker.sock" in m for m in mounts(service))
    }
    assert socket_holders == {"runner"}
    runner = services["runner"]["environment"]
    assert "DATABASE_URL" not in runner and "DJANGO_SECRET_KEY" not in runner
    assert "COVEY_ENCRYPTION_KEYS" not in runner
    # The first admin's password goes to the one service that makes the admin.
    assert {
        name
        for name, service in services.items()
        if "COVEY_ADMIN_PASSWORD" in service["environment"]
    } == {"web"}
    # What sandboxes join holds the proxy and the gateway, never the database or the broker.
    on_sandboxes = {
        name for name, service in services.items() if "sandboxes" in (service.get("networks") or {})
    }
    assert on_sandboxes == {"proxy", "gateway"}

    (tmp_path / "empty.env").write_text("")
    refused = config(compose, tmp_path / "empty.env")
    assert refused.returncode != 0
    assert "set COVEY_DB_PASSWORD in .env (scripts/compose-env)" in refused.stderr
    again = subprocess.run(
        [str(ROOT / "scripts" / "compose-env"), str(env)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert again.returncode == 1 and "exists; its keys stay" in again.stderr


class Project:
    def __init__(self, compose: list[str], name: str, env: Path) -> None:
        self.base = [*compose, "--project-name", name, "--file", str(COMPOSE_FILE)]
        self.base += ["--env-file", str(env)]
        self.name = name
        self.env = env

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    def logs(self) -> str:
        logs = self("logs", "--no-color", "--tail", "60", timeout=60)
        return logs.stdout[-6000:]


@pytest.fixture
def project(tmp_path, workplace_image) -> Iterator[tuple[Project, str, Path]]:
    compose = compose_command()
    for image in IMAGES:
        inspect = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
        if inspect.returncode != 0:
            message = f"no image {image}: run `make control-plane-image service-images`"
            if IN_CI:
                pytest.fail(message)
            pytest.skip(message)
    name = f"covey-test-{uuid.uuid4().hex[:10]}"
    port = free_port()
    homes = tmp_path / "homes"
    homes.mkdir()
    env = env_file(
        tmp_path / ".env",
        COVEY_HTTP_PUBLISH=f"127.0.0.1:{port}",
        COVEY_STREAM_PUBLISH=f"127.0.0.1:{free_port()}",
        COVEY_HOMES_DIR=str(homes),
        COVEY_SANDBOX_NETWORK=f"{name}-sandboxes",
    )
    up = Project(compose, name, env)
    try:
        yield up, f"http://127.0.0.1:{port}", homes
    finally:
        down = up("down", "--volumes", "--remove-orphans", "--timeout", "20")
        left = subprocess.run(
            ["docker", "ps", "--all", "--quiet", "--filter",
             f"label=com.docker.compose.project={name}"],
            capture_output=True, text=True, check=False,
        ).stdout.split()  # fmt: skip
        if left:
            subprocess.run(["docker", "rm", "--force", *left], capture_output=True, check=False)
        assert down.returncode == 0, down.stderr
        assert not left


@pytest.mark.docker
def test_it_comes_up_and_runs_an_agent_end_to_end(project):
    up, base, homes = project
    started = up("up", "--detach", timeout=600)
    assert started.returncode == 0, started.stderr + up.logs()

    with httpx.Client(base_url=base, timeout=10) as api:
        deadline = time.monotonic() + 180
        while True:
            try:
                ready = api.get("/readyz")
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, up.logs()
            time.sleep(1)
        assert ready.json()["checks"] == {"database": "ok", "broker": "ok"}
        made = up("exec", "-T", "web", "python", "manage.py", "drf_create_token", "admin")
        assert made.returncode == 0, made.stderr
        api.headers["Authorization"] = f"Token {made.stdout.split()[2]}"
        organisation = api.post("/api/v1/organisations/", json={"name": "Acme"}).json()
        assert "id" in organisation, organisation
        command = [
            "sh",
            "-c",
            "echo proxy=${HTTPS_PROXY##*@};"
            " curl -s -o /dev/null -w 'connect=%{http_connect}\\n' https://not-on-the-list.test/;"
            " echo kept > note.txt; echo done",
        ]
        agent = api.post(
            "/api/v1/agents/",
            json={
                "organisation": organisation["id"],
                "name": "Builder",
                "runtime_command": command,
            },
        ).json()
        assert "id" in agent, agent
        run = api.post("/api/v1/runs/", json={"agent": agent["id"], "task": "hello"}).json()
        assert "id" in run, run
        deadline = time.monotonic() + 240
        while run["status"] not in ("succeeded", "failed", "cancelled", "timed_out"):
            assert time.monotonic() < deadline, (run, up.logs())
            time.sleep(1)
            run = api.get(f"/api/v1/runs/{run['id']}/").json()
        assert run["status"] == "succeeded", json.dumps(run, indent=1) + up.logs()
        assert run["runner"] == "builtin-acme"
        # Told to use the proxy service, which knew the run's credential (not 407) and refused
        # the name: off the list. The decision is the control plane's record.
        assert "proxy=proxy:3128" in run["log_tail"] and "connect=403" in run["log_tail"]
        # The proxy writes its decisions in batches (every half second, retried when the
        # database is busy): the record may come a moment after the run's end.
        deadline = time.monotonic() + 30
        while True:
            decisions = api.get("/api/v1/egress-decisions/", params={"agent": agent["id"]})
            hosts = {(d["host"], d["allowed"], d["proxy"]) for d in decisions.json()["results"]}
            if ("not-on-the-list.test", False, "proxy") in hosts:  # its name, not its host's
                break
            assert time.monotonic() < deadline, (decisions.json(), up.logs())
            time.sleep(0.5)
        # The home is on the host, and the runner serves it to the API.
        home = api.get(f"/api/v1/agents/{agent['id']}/home/").json()
        assert home["runner_online"] and home["files"] == 1, home
    # The backup docs/deployment.md gives restores (into a scratch database, here).
    dump = subprocess.run(
        [*up.base, "exec", "-T", "postgres", "pg_dump", "--username", "covey", "--format",
         "custom", "covey"],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert dump.returncode == 0 and dump.stdout.startswith(b"PGDMP"), dump.stderr
    assert (
        up("exec", "-T", "postgres", "createdb", "--username", "covey", "scratch").returncode == 0
    )
    restored = subprocess.run(
        [*up.base, "exec", "-T", "postgres", "pg_restore", "--username", "covey", "--dbname",
         "scratch", "--clean", "--if-exists"],
        input=dump.stdout, capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert restored.returncode == 0, restored.stderr
    count = up(
        "exec", "-T", "postgres", "psql", "--username", "covey", "--dbname", "scratch",
        "--tuples-only", "--command", "SELECT count(*) FROM agents_agent",
    )  # fmt: skip
    assert count.stdout.strip() == "1", count.stdout + count.stderr
    kept = list(homes.glob("*/*/note.txt"))
    assert [path.read_text() for path in kept] == ["kept\n"]
    # The database's password is in no service's log.
    password = next(
        line.split("=", 1)[1]
        for line in up.env.read_text().splitlines()
        if line.startswith("COVEY_DB_PASSWORD=")
    )
    assert password not in up("logs", "--no-color", timeout=60).stdout
