"""A control plane (gunicorn), its API client, and runner processes with no database, for the
end-to-end run tests; everything it starts is stopped and removed by close()."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from rest_framework.authtoken.models import Token

from agents import services as agent_services
from runners.host.identity import docker_name
from runners.models import Runner
from runners.services import create_registration_token, installation_key, register_runner
from runs.models import Run
from tests.egress.conftest import subprocess_database_url
from tests.processes import control_plane, free_port, running, wait_for

# A runner host's start: at hard isolation it builds its network, starts the proxy container
# and probes it, about 7 s alone and four times that when the suite's workers share two cores.
START_SECONDS = 90


def docker(*args: str) -> str:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=30, check=True
    ).stdout


def containers_of(runner: Runner) -> list[str]:
    return docker(
        "ps",
        "--all",
        "--quiet",
        "--filter",
        f"label=covey.runner={docker_name(runner.pk, installation_key())}",
    ).split()


@dataclass
class RunnerProcess:
    runner: Runner
    config: Path
    var: Path
    log: Path
    process: subprocess.Popen

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_started(self) -> None:
        wait_for(
            lambda: "taking orders" in self.output(), START_SECONDS, "the runner starting", self.log
        )


class Stack:
    """A control plane, its API client, and runner processes, all cleaned up afterwards."""

    def __init__(self, tmp_path: Path, base_image: str, **control_plane_env: str) -> None:
        self.tmp = tmp_path
        self.base_image = base_image
        self.port = free_port()
        # Sandboxes of agents without a workplace: the minimal base image unless a test says
        # otherwise (the default workplace image is for the tests of it).
        self.env = {
            "COVEY_EGRESS_ENFORCE": "false",
            "COVEY_DEFAULT_IMAGE": base_image,
            **control_plane_env,
        }
        self.stack = ExitStack()
        self._control_plane: ExitStack | None = None
        self.runners: list[RunnerProcess] = []
        self.start_control_plane()

    def start_control_plane(self) -> None:
        self._control_plane = ExitStack()
        self.url = self._control_plane.enter_context(
            control_plane(self.tmp, subprocess_database_url(), port=self.port, **self.env)
        )

    def stop_control_plane(self) -> None:
        assert self._control_plane is not None
        self._control_plane.close()

    def close(self) -> None:
        for runner in self.runners:
            left = containers_of(runner.runner)
            if left:
                docker("rm", "--force", *left)
        self.stack.close()
        if self._control_plane is not None:
            self._control_plane.close()

    def api(self, user) -> httpx.Client:
        token, _ = Token.objects.get_or_create(user=user)
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Token {token.key}"}, timeout=10
        )

    def register(self, organisation, name: str, labels=()) -> tuple[Runner, Path]:
        _, secret = create_registration_token(organisation)
        runner, token = register_runner(secret, name, labels)
        config = self.tmp / f"runner-{runner.pk}.json"
        config.write_text(
            json.dumps({"url": self.url, "id": runner.pk, "name": name, "token": token})
        )
        return runner, config

    @contextmanager
    def runner(self, runner: Runner, config: Path, **env: str) -> Iterator[RunnerProcess]:
        """``manage.py runner`` for a registered runner, with no database settings at all."""
        var = self.tmp / f"runner-var-{runner.pk}"
        environment = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        environment.update(
            COVEY_VAR_DIR=str(var),
            COVEY_RUNNER_HOMES=str(self.tmp / "homes"),
            COVEY_RUNNER_HEARTBEAT_SECONDS="0.5",
            PYTHONUNBUFFERED="1",
            **env,
        )
        log = self.tmp / f"runner-{runner.pk}-{time.monotonic_ns()}.log"
        args = [sys.executable, "manage.py", "runner", "--config", str(config)]
        with running(args, environment, log) as process:
            handle = RunnerProcess(runner, config, var, log, process)
            if handle not in self.runners:
                self.runners.append(handle)
            handle.wait_started()
            yield handle
        # It never had a database: nothing made one where the default would be.
        assert not (var / "covey.sqlite3").exists()

    @contextmanager
    def builtin(self, organisation, **env: str) -> Iterator[RunnerProcess]:
        """``manage.py runner --builtin``, as on the control-plane host: the built-in runners
        of every organisation (``organisation``'s is the one handed back), from the identities
        the control plane (this process) wrote, with no database settings."""
        from django.conf import settings

        environment = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        environment.update(
            COVEY_VAR_DIR=str(settings.VAR_DIR),
            COVEY_CONTROL_PLANE_URL=self.url,
            COVEY_RUNNER_HOMES=str(self.tmp / "homes"),
            COVEY_RUNNER_HEARTBEAT_SECONDS="0.5",
            PYTHONUNBUFFERED="1",
            **env,
        )
        log = self.tmp / f"runner-builtin-{time.monotonic_ns()}.log"
        args = [sys.executable, "manage.py", "runner", "--builtin"]
        with running(args, environment, log) as process:
            runner = Runner.objects.get(organisation=organisation, builtin=True)
            handle = RunnerProcess(runner, Path(), Path(settings.VAR_DIR), log, process)
            self.runners.append(handle)
            handle.wait_started()

            def heard_from() -> bool:  # its first heartbeat (it may serve others before it)
                runner.refresh_from_db()
                return runner.online

            wait_for(heard_from, 30, f"{runner.name} of {organisation} heard from", log)
            yield handle

    def home(self, runner: Runner, agent) -> Path:
        """Where an agent's home is on this stack's runner hosts (COVEY_RUNNER_HOMES)."""
        return self.tmp / "homes" / str(runner.pk) / str(agent.pk)

    def agent(self, organisation, name: str, command: list[str], **fields):
        return agent_services.create_agent(organisation, name, runtime_command=command, **fields)

    def wait(self, run: Run, *statuses: str, timeout: float = 30) -> Run:
        def reached() -> bool:
            run.refresh_from_db()
            return run.status in statuses

        try:
            wait_for(reached, timeout, f"run {run.pk} reaching {', '.join(statuses)}")
        except AssertionError as exc:
            logs = "\n".join(f"--- {r.log.name}\n{r.output()[-4000:]}" for r in self.runners)
            raise AssertionError(f"{exc}: {run.status} {run.status_detail!r}\n{logs}") from None
        return run
