"""The Docker seam: builds, watches and removes sandboxes, one container per run of an agent.

The only covey module that imports docker. Pure Python (no Django): it runs on runner hosts,
which have no database.

What the rest of covey must know:

- The task reaches the process twice: as the variable ``COVEY_TASK`` and as the file
  ``/run/covey/task`` (named by ``COVEY_TASK_FILE``). The root filesystem is read-only and a tmpfs
  starts empty, so the file is written on the host, to
  ``<home's parent>/.covey-runs/<run id>/task``, and that directory is bind-mounted read-only at
  ``/run/covey``. ``remove()`` deletes it.
- The home (``spec.home``) is created when missing (mode 0700) and its top directory is given to
  the numeric uid:gid of ``spec.user``, so the runner must run as root (or as that user). What is
  inside the home is left as it is: a recursive chown would be slow and would follow the agent's
  own files.
- Images are never pulled: the image must already be on the host.
"""

import contextlib
import ipaddress
import math
import os
import re
import shutil
import socket
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import docker
import psutil
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import LogConfig, Mount

from runners.host.containers import companions
from runners.protocol import ServiceRecord, ServiceSpec

LABEL_RUN = "covey.run"  # run id
LABEL_AGENT = "covey.agent"  # agent id
LABEL_RUNNER = "covey.runner"  # runner name: other runners' containers are never touched
LABEL_INSTALLATION = "covey.installation"  # nor other installations' on the same engine
LABEL_TIMEOUT = "covey.timeout"  # seconds the run may take, so a restarted runner still knows

HOME = "/home/agent"
TASK_DIR = "/run/covey"
TASK_FILE = f"{TASK_DIR}/task"
RUNS_DIR = ".covey-runs"  # next to the homes, never inside one: the agent cannot rewrite its task
EVENTS = frozenset({"start", "die", "oom", "destroy"})

# Docker's container-name grammar; the run id is also a host directory name, so no '/'.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_USER = re.compile(r"^(\d+):(\d+)$")
_SERVICE_NAME = re.compile(r"[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?")
_RESERVED_ENV = frozenset({"HOME", "COVEY_TASK", "COVEY_TASK_FILE"})
# The kernel refuses to exec with one environment string longer than MAX_ARG_STRLEN.
_MAX_ENV_STRING = 128 * 1024
_DOCKER_SOCKETS = (Path("/var/run/docker.sock"), Path("/run/docker.sock"))
_MIN_MEMORY_MB = 6  # Docker refuses less


class EngineError(Exception):
    """The Docker engine could not do what was asked; the message says what and why."""


class SandboxNotFound(EngineError):
    """No container of this runner carries the run id."""


class ServiceNotReady(EngineError):
    """A companion service could not be started or was not ready in time; ``record`` has
    the end of its log."""

    def __init__(self, message: str, record: ServiceRecord) -> None:
        super().__init__(message)
        self.record = record


@dataclass(frozen=True)
class SandboxSpec:
    """Everything needed to build the sandbox of one run."""

    run_id: str
    agent_id: int
    image: str
    command: Sequence[str]  # argv, after the image's ENTRYPOINT if it has one
    task: str
    environment: Mapping[str, str]  # extra variables: egress credential, proxy variables…
    home: Path  # host directory mounted at /home/agent, the only persistent path
    cpus: float = 1.0
    memory_mb: int = 1024
    pids: int = 256
    tmp_mb: int = 256  # size of the /tmp tmpfs
    network: str | None = None  # None: the engine's default bridge
    user: str = "1000:1000"
    timeout: int | None = None  # seconds; recorded on the container, enforced by the runner
    # Under hard isolation (sandbox_network_options, runners/host/containers/isolation.py): the
    # resolvers Docker's embedded DNS forwards to, resolv.conf options, and kernel settings.
    dns: Sequence[str] = ()
    dns_opt: Sequence[str] = ()
    sysctls: Mapping[str, str] | None = None
    # Companion services, started beside it and ready before it starts (companions.py).
    services: Sequence[ServiceSpec] = ()


@dataclass(frozen=True)
class Sandbox:
    """What the engine knows of one covey container."""

    run_id: str
    agent_id: int
    container_id: str
    status: str  # Docker's: created, running, exited, dead…
    exit_code: int | None  # None until the process has exited
    started_at: datetime | None
    finished_at: datetime | None
    timeout: int | None = None
    # Made by a covey from before installation keys (only the runner's old name on it): it may
    # be another installation's, so it is taken care of only for a run the control plane knows.
    legacy: bool = False
    image_id: str = ""


class LogStream:
    """A sandbox's output as it comes, in chunks of bytes; close() ends it from any thread."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        try:
            for chunk in self._stream:
                yield bytes(chunk)
        except (OSError, ValueError, DockerException):
            return  # closed underneath, or the engine went away: the whole log comes later

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()


# The make targets that build covey's own images.
_BUILT_BY = {
    "covey-base:trixie": "make base-image",
    "covey-workplace:latest": "make workplace-image",
}


class Engine:
    """The sandboxes of one runner on one Docker engine."""

    def __init__(
        self,
        runner: str,
        client: docker.DockerClient | None = None,
        *,
        installation: str = "",
        legacy_runner: str = "",
    ) -> None:
        if not runner:
            raise ValueError("the runner name must not be empty")
        self.runner = runner
        self.installation = installation
        # Only what carries both: this runner's name and this installation's key.
        self._labels = [f"{LABEL_RUNNER}={runner}"]
        if installation:
            self._labels.append(f"{LABEL_INSTALLATION}={installation}")
        # The runner's name before installation keys: its sandboxes, if any are left, are seen
        # (as legacy) when they carry no installation key at all.
        self._legacy_label = f"{LABEL_RUNNER}={legacy_runner}" if legacy_runner else ""
        self._ready: dict[str, dict[str, ServiceRecord]] = {}  # launched here: services' records
        try:
            self._client = client if client is not None else docker.from_env()
        except DockerException as exc:
            raise EngineError(f"cannot reach the Docker engine: {exc}") from exc

    def launch(self, spec: SandboxSpec) -> Sandbox:
        """Create and start the sandbox of a run and return at once; a second call returns it."""
        home = check_spec(spec)
        if (container := self._container(spec.run_id)) is not None:
            return self._started(container)
        self._check_image(spec.image)
        for service in spec.services:
            self._check_image(service.image, f"service {service.name}'s ")
        uid, gid = _ids(spec.user)
        _prepare_home(home, uid, gid)
        run_dir = _write_task(home, spec.run_id, spec.task)
        network = self._network_options(spec)
        if spec.services:
            network = self._start_services(spec, network, run_dir)
        try:
            container = self._client.containers.create(
                spec.image, list(spec.command), **self._options(spec, home, run_dir), **network
            )
        except APIError as exc:
            if exc.status_code == 409:  # name taken: a concurrent launch of the same run won
                if (container := self._container(spec.run_id)) is not None:
                    return self._started(container)
                raise EngineError(
                    f"a container named covey-run-{spec.run_id} exists but is not this runner's"
                ) from exc
            shutil.rmtree(run_dir, ignore_errors=True)
            self._remove_parts(spec.run_id)
            raise EngineError(
                f"cannot create the sandbox of run {spec.run_id}: {_explain(exc)}"
            ) from exc
        return self._started(container)

    def _start_services(
        self, spec: SandboxSpec, network: dict[str, Any], run_dir: Path
    ) -> dict[str, Any]:
        """Start the run's network holder and services, wait until every service is ready,
        and return the sandbox's network options: the holder's namespace."""
        self._remove_parts(spec.run_id)  # what a launch that died left
        labels = {
            companions.LABEL_PART_OF: spec.run_id,
            companions.LABEL_PART_RUNNER: self.runner,
            **({LABEL_INSTALLATION: self.installation} if self.installation else {}),
        }
        try:
            holder = self._start_holder(spec, network, labels)
            records = companions.start_services(
                self._client, spec.run_id, holder, labels, spec.services
            )
        except BaseException as exc:
            self._remove_parts(spec.run_id)
            shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(exc, companions.ServiceFailed):
                raise ServiceNotReady(str(exc), exc.record) from exc
            raise
        self._ready[spec.run_id] = {record.name: record for record in records}
        return {"network_mode": f"container:{holder.id}"}

    def _start_holder(
        self, spec: SandboxSpec, network: dict[str, Any], labels: dict[str, str]
    ) -> Any:
        """The run's network holder, on the run's own network when the sandbox's would be the
        default bridge every sandbox shares."""
        try:
            if spec.network is None:
                own = companions.own_network(self._client, spec.run_id, labels)
                network = {**network, "network": own}
            return companions.start_holder(
                self._client, spec.run_id, spec.image, labels, network, spec.services
            )
        except (APIError, DockerException) as exc:
            raise EngineError(
                f"cannot make the network of run {spec.run_id}'s services: {_explain(exc)}"
            ) from exc

    def services(self, run_id: str, logs: bool = False) -> list[ServiceRecord]:
        """The run's services as they run (image ID, seconds until ready as this process saw
        it), with the end of each one's log when ``logs``."""
        found = []
        ready = self._ready.get(run_id, {})
        for container in companions.parts(self._client, self._labels_of_parts(), run_id):
            name = container.labels.get(companions.LABEL_SERVICE)
            if not name:
                continue
            known = ready.get(name)
            found.append(
                ServiceRecord(
                    name=name,
                    image_id=str(container.attrs.get("Image") or ""),
                    ready_seconds=known.ready_seconds if known else None,
                    log=companions.service_log(container) if logs else "",
                )
            )
        return sorted(found, key=lambda record: record.name)

    def runs_with_parts(self) -> set[str]:
        """Runs that have a network holder or services of this runner (with or without a
        sandbox: a launch that died leaves them)."""
        labels = self._labels_of_parts()
        found = [
            *companions.parts(self._client, labels),
            *companions.networks(self._client, labels),
        ]
        return {companions.run_of(part) for part in found}

    def _labels_of_parts(self) -> list[str]:
        labels = [f"{companions.LABEL_PART_RUNNER}={self.runner}"]
        if self.installation:
            labels.append(f"{LABEL_INSTALLATION}={self.installation}")
        return labels

    def remove_services(self, run_id: str) -> None:
        """Remove the run's services, their network holder and the run's own network (what a
        launch that died left); the sandbox, if there is one, is left alone."""
        self._remove_parts(run_id)

    def _remove_parts(self, run_id: str) -> None:
        self._ready.pop(run_id, None)
        labels = self._labels_of_parts()
        try:
            companions.remove(
                companions.parts(self._client, labels, run_id),
                companions.networks(self._client, labels, run_id),
            )
        except (APIError, DockerException) as exc:
            raise EngineError(f"cannot remove the services of run {run_id}: {exc}") from exc

    def get(self, run_id: str) -> Sandbox | None:
        """The sandbox of a run, or None when this runner has no container for it."""
        container = self._container(run_id)
        return None if container is None else self._as_sandbox(container)

    def sandboxes(self) -> list[Sandbox]:
        """Every container of this runner, in any state, ordered by run id."""
        containers = self._client.containers.list(
            all=True, filters={"label": list(self._labels)}, ignore_removed=True
        )
        legacy = self._legacy_containers()
        if not legacy:
            # None left from before installation keys, and no covey makes them any more: stop
            # asking (a second listing on every sweep otherwise).
            self._legacy_label = ""
        found = [self._as_sandbox(c) for c in [*containers, *legacy]]
        return sorted(found, key=lambda s: s.run_id)

    def address(self, run_id: str, network: str | None = None) -> str:
        """The sandbox's IPv4 address on a network (None: Docker's default bridge); '' when it
        has none there."""
        container = self._existing(run_id)
        networks = (container.attrs.get("NetworkSettings") or {}).get("Networks") or {}
        return str((networks.get(network or "bridge") or {}).get("IPAddress") or "")

    def gateway(self, network: str | None = None) -> str:
        """The host's address on a network (None: Docker's default bridge); '' when unknown."""
        try:
            return self.bridge_address(network)
        except EngineError:
            return ""

    def bridge_address(self, network: str | None = None) -> str:
        """The host's IPv4 address on a bridge network (None: Docker's default bridge), where
        sandboxes on it reach the host: see :func:`bridge_address`."""
        name = network or "bridge"
        try:
            attrs = self._client.api.inspect_network(name)
        except NotFound:
            raise EngineError(f"the Docker network {name!r} does not exist") from None
        except (APIError, DockerException) as exc:
            raise EngineError(f"cannot inspect the Docker network {name!r}: {exc}") from exc
        return bridge_address(attrs, _interface_addresses())

    def logs(self, run_id: str, tail: int | None = None) -> str:
        """Standard output and error of a run, interleaved as written."""
        container = self._existing(run_id)
        output = container.logs(stdout=True, stderr=True, tail="all" if tail is None else tail)
        return bytes(output).decode("utf-8", errors="replace")

    def follow_logs(self, run_id: str) -> "LogStream":
        """Output of a run as it is written, from the start, until its process ends (or the
        stream is closed)."""
        container = self._existing(run_id)
        return LogStream(container.logs(stdout=True, stderr=True, stream=True, follow=True))

    def stop(self, run_id: str, timeout: float = 10) -> None:
        """Send SIGTERM, then SIGKILL after ``timeout`` seconds; a run that is gone is fine."""
        if (container := self._container(run_id)) is None:
            return
        with contextlib.suppress(NotFound):
            # The API takes whole seconds.
            container.stop(timeout=max(0, math.ceil(timeout)))

    def remove(self, run_id: str) -> None:
        """Force-remove the run's container, its services and task directory; a run that is
        gone is fine."""
        if (container := self._container(run_id)) is not None:
            self._discard(container)
        self._remove_parts(run_id)

    def wait(self, run_id: str, timeout: float) -> Sandbox:
        """Block until the run's process has exited; TimeoutError after ``timeout`` seconds."""
        container = self._existing(run_id)
        try:
            container.wait(timeout=timeout)
        except OSError as exc:
            # requests' read timeout is an OSError; whatever ended the request, ask the state.
            sandbox = self._sandbox_of(run_id)
            if sandbox.status in ("running", "created", "restarting"):
                raise TimeoutError(f"run {run_id} still running after {timeout} s") from exc
            return sandbox
        return self._sandbox_of(run_id)

    def events(
        self, since: float | None = None, until: float | None = None
    ) -> Generator[tuple[str, str], None, None]:
        """(run id, action) for this runner's containers: start, die, oom, destroy.

        Without ``until`` the stream never ends; close the iterator to stop it.
        """
        stream = self._client.events(
            decode=True,
            since=since,
            until=until,
            filters={"label": list(self._labels), "type": "container"},
        )
        try:
            for event in stream:
                action = event.get("Action")
                run_id = event.get("Actor", {}).get("Attributes", {}).get(LABEL_RUN)
                if action in EVENTS and run_id:
                    yield run_id, action
        finally:
            stream.close()

    def _options(self, spec: SandboxSpec, home: Path, run_dir: Path) -> dict[str, Any]:
        """The create options that make a container a sandbox."""
        memory = f"{spec.memory_mb}m"
        return {
            "name": f"covey-run-{spec.run_id}",
            "labels": {
                LABEL_RUN: spec.run_id,
                LABEL_AGENT: str(spec.agent_id),
                LABEL_RUNNER: self.runner,
                **({LABEL_INSTALLATION: self.installation} if self.installation else {}),
                **({LABEL_TIMEOUT: str(spec.timeout)} if spec.timeout is not None else {}),
            },
            "environment": {
                **spec.environment,
                "HOME": HOME,
                "COVEY_TASK_FILE": TASK_FILE,
                "COVEY_TASK": spec.task,
            },
            "user": spec.user,
            "working_dir": HOME,
            "mounts": [
                Mount(HOME, str(home), type="bind", read_only=False),
                Mount(TASK_DIR, str(run_dir), type="bind", read_only=True),
            ],
            # Docker adds noexec to a tmpfs unless told otherwise; the home is executable
            # anyway, so noexec would only break build tools.
            "tmpfs": {"/tmp": f"rw,exec,nosuid,nodev,size={spec.tmp_mb}m"},  # noqa: S108
            "read_only": True,
            "privileged": False,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "pids_limit": spec.pids,
            "nano_cpus": int(spec.cpus * 1e9),
            "mem_limit": memory,
            "memswap_limit": memory,  # equal to the memory limit: no swap
            "init": True,  # reaps zombies and forwards SIGTERM, so stop() is not a SIGKILL
            "auto_remove": False,  # the runner reads the exit code and logs, then removes
            "stdin_open": False,
            "tty": False,
            # Bounded, so a chatty sandbox cannot fill the disk.
            "log_config": LogConfig(
                type=LogConfig.types.JSON, config={"max-size": "10m", "max-file": "2"}
            ),
        }

    def _network_options(self, spec: SandboxSpec) -> dict[str, Any]:
        """Where the sandbox's network is (or its services' network holder's)."""
        return {
            "network": spec.network,
            **({"dns": list(spec.dns)} if spec.dns else {}),
            **({"dns_opt": list(spec.dns_opt)} if spec.dns_opt else {}),
            **({"sysctls": dict(spec.sysctls)} if spec.sysctls else {}),
        }

    def open_events(self) -> Iterator[Any]:
        """A stream of the engine's own events, held open: iterating it ends (or raises) when
        the engine stops or restarts. Close it to let go. EngineError when the engine does not
        answer."""
        try:
            stream: Iterator[Any] = self._client.events(decode=True, filters={"type": "daemon"})
        except Exception as exc:  # the SDK's errors and requests' (a socket that is gone)
            raise EngineError(f"the Docker engine does not answer: {exc}") from exc
        # The SDK hands back an error answer as a stream too (it raises only when read): an
        # engine going down, or a socket proxy that forbids events while it lets pings by.
        response = getattr(stream, "_response", None)
        if response is not None and response.status_code >= 400:
            said = f"{response.status_code} {response.text[:200]}"
            with contextlib.suppress(Exception):
                stream.close()  # type: ignore[attr-defined]
            raise EngineError(f"the Docker engine refuses its event stream: {said}")
        return stream

    def problem(self) -> str:
        """'' when the Docker engine answers, else why not (readiness: a host's /readyz)."""
        try:
            self._client.ping()
        except Exception as exc:  # the SDK's errors and requests' (a socket that is gone)
            return f"the Docker engine does not answer: {exc}"
        return ""

    def missing_image(self, image: str) -> str:
        """'' when ``image`` is on this host, else why a sandbox of it cannot start."""
        try:
            self._check_image(image)
        except EngineError as exc:
            return str(exc)
        return ""

    def _check_image(self, image: str, whose: str = "") -> None:
        try:
            self._client.images.get(image)
        except ImageNotFound as exc:
            if whose:
                raise EngineError(
                    f"{whose}image {image} is not on this host (images are never pulled):"
                    " load it on the runner host (docker load, or docker pull there)"
                ) from exc
            how = _BUILT_BY.get(image, "docker build, or docker pull there")
            raise EngineError(
                f"image {image} is not on this host: build it ({how}) or load it (docker load)"
            ) from exc
        except DockerException as exc:
            raise EngineError(f"cannot reach the Docker engine: {exc}") from exc

    def _started(self, container: Any) -> Sandbox:
        """Start a container that was only created; never leave one behind that fails to."""
        if container.status == "created":
            try:
                container.start()
            except APIError as exc:
                run_id = container.labels.get(LABEL_RUN, container.name)
                self._discard(container)
                raise EngineError(
                    f"cannot start the sandbox of run {run_id}: {_explain(exc)}"
                ) from exc
            container.reload()
        return self._as_sandbox(container)

    def _discard(self, container: Any) -> None:
        """Force-remove a container and its task directory."""
        run_dir = _task_dir(container)
        try:
            container.remove(force=True)
        except NotFound:
            pass
        except APIError as exc:
            if exc.status_code != 409:  # 409: a removal already in progress
                raise
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _container(self, run_id: str) -> Any:
        """This runner's container for a run, or None."""
        found = self._client.containers.list(
            all=True,
            filters={"label": [*self._labels, f"{LABEL_RUN}={run_id}"]},
            ignore_removed=True,
        )
        if not found:
            found = self._legacy_containers(run_id)
        return found[0] if found else None

    def _legacy_containers(self, run_id: str | None = None) -> list[Any]:
        if not self._legacy_label:
            return []
        labels = [self._legacy_label, *([f"{LABEL_RUN}={run_id}"] if run_id else [])]
        found = self._client.containers.list(
            all=True, filters={"label": labels}, ignore_removed=True
        )
        return [c for c in found if LABEL_INSTALLATION not in c.attrs["Config"]["Labels"]]

    def _existing(self, run_id: str) -> Any:
        if (container := self._container(run_id)) is None:
            raise SandboxNotFound(f"runner {self.runner} has no sandbox for run {run_id}")
        return container

    def _sandbox_of(self, run_id: str) -> Sandbox:
        return self._as_sandbox(self._existing(run_id))

    def _as_sandbox(self, container: Any) -> Sandbox:
        legacy = bool(self._legacy_label) and (
            LABEL_INSTALLATION not in container.attrs["Config"]["Labels"]
        )
        return _sandbox(container, legacy=legacy)


def check_spec(spec: SandboxSpec) -> Path:
    """Refuse a spec that would build an unsafe or broken sandbox; return the resolved home."""
    if not _RUN_ID.match(spec.run_id):
        raise ValueError(
            f"run id {spec.run_id!r} must be 1 to 100 letters, digits, '_', '.' or '-',"
            " starting with a letter or digit"
        )
    if not spec.image:
        raise ValueError("the image must not be empty")
    if isinstance(spec.command, str) or not spec.command:
        raise ValueError("the command must be a non-empty list of arguments")
    if not all(isinstance(arg, str) for arg in spec.command):
        raise ValueError("every argument of the command must be a string")
    if "\0" in spec.task:
        raise ValueError("the task must not contain NUL characters")
    if len(f"COVEY_TASK={spec.task}\0".encode()) > _MAX_ENV_STRING:
        raise ValueError(f"the task is longer than the {_MAX_ENV_STRING} bytes a variable holds")
    for name, value in spec.environment.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ValueError(f"{name!r} is not a valid environment variable")
        if name in _RESERVED_ENV:
            raise ValueError(f"{name} is set by the engine and cannot be overridden")
    for field, limit, least in (
        ("cpus", spec.cpus, 0.01),
        ("memory_mb", spec.memory_mb, _MIN_MEMORY_MB),
        ("pids", spec.pids, 1),
        ("tmp_mb", spec.tmp_mb, 1),
    ):
        if not limit >= least:  # also refuses NaN
            raise ValueError(f"{field} must be at least {least}, not {limit}")
    if _USER.match(spec.user) is None:
        raise ValueError(f"user {spec.user!r} must be numeric uid:gid, e.g. 1000:1000")
    if _ids(spec.user)[0] == 0:
        raise ValueError("a sandbox never runs as root (uid 0)")
    if spec.timeout is not None and spec.timeout < 1:
        raise ValueError(f"timeout must be at least 1 second, not {spec.timeout}")
    if spec.network is not None and not spec.network:
        raise ValueError("the network must be a name or None")
    names = [service.name for service in spec.services]
    for name in names:
        if not _SERVICE_NAME.fullmatch(name) or names.count(name) > 1:
            raise ValueError(f"service name {name!r} is not one distinct DNS label")
    return _check_home(spec.home)


def _check_home(home: Path) -> Path:
    if not home.is_absolute():
        raise ValueError(f"home {home} must be an absolute path")
    resolved = home.resolve()
    if resolved == Path("/"):
        raise ValueError(f"home {home} is the host's root directory")
    for docker_socket in _DOCKER_SOCKETS:
        for path in (docker_socket, docker_socket.resolve()):  # /var/run is a link to /run
            if resolved == path or resolved in path.parents:
                raise ValueError(f"home {home} would expose the Docker socket {docker_socket}")
    if resolved.exists() and not resolved.is_dir():
        raise ValueError(f"home {home} exists and is not a directory")
    return resolved


def sandbox_owner() -> tuple[int, int]:
    """(uid, gid) a sandbox runs as, unless its spec says otherwise: what is put in a home
    from outside belongs to it."""
    return _ids(SandboxSpec.user)


def _ids(user: str) -> tuple[int, int]:
    uid, gid = user.split(":")
    return int(uid), int(gid)


def _prepare_home(home: Path, uid: int, gid: int) -> None:
    """Create the home if missing and give it to the sandbox's user, who must write in it."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = home.stat()
    if (status.st_uid, status.st_gid) != (uid, gid):
        try:
            os.chown(home, uid, gid)
        except PermissionError as exc:
            raise EngineError(
                f"cannot give home {home} to {uid}:{gid}: run the runner as root,"
                " or create the home owned by that user"
            ) from exc


def _write_task(home: Path, run_id: str, task: str) -> Path:
    """Write the task file in the run's host directory (mounted at /run/covey) and return it."""
    runs = home.parent / RUNS_DIR
    runs.mkdir(mode=0o700, exist_ok=True)  # other host users need not read tasks
    run_dir = runs / run_id
    run_dir.mkdir(exist_ok=True)
    run_dir.chmod(0o755)  # becomes /run/covey: the sandbox's user must enter it
    task_file = run_dir / "task"
    task_file.write_text(task, encoding="utf-8")
    task_file.chmod(0o644)
    return run_dir


def _task_dir(container: Any) -> Path | None:
    """The host directory mounted at /run/covey, if it is one the engine made."""
    for mount in container.attrs.get("Mounts") or []:
        if mount.get("Destination") == TASK_DIR:
            source = Path(mount["Source"])
            if source.parent.name == RUNS_DIR:
                return source
    return None


def _sandbox(container: Any, *, legacy: bool = False) -> Sandbox:
    labels = container.attrs["Config"]["Labels"]
    state = container.attrs["State"]
    status = state["Status"]
    started_at, finished_at = _time(state.get("StartedAt")), _time(state.get("FinishedAt"))
    if started_at and finished_at and finished_at < started_at:
        # Docker stamps the start once the process runs and the end when it exits: a process
        # that exits at once can end a fraction of a millisecond before it "started".
        finished_at = started_at
    return Sandbox(
        run_id=labels[LABEL_RUN],
        agent_id=int(labels[LABEL_AGENT]),
        container_id=container.id,
        status=status,
        exit_code=state["ExitCode"] if status in ("exited", "dead") else None,
        started_at=started_at,
        finished_at=finished_at,
        timeout=int(labels[LABEL_TIMEOUT]) if labels.get(LABEL_TIMEOUT, "").isdigit() else None,
        legacy=legacy,
        image_id=str(container.attrs.get("Image") or ""),
    )


def _time(value: str | None) -> datetime | None:
    """Docker's RFC 3339 time, or None for its zero time (never happened)."""
    if not value or value.startswith("0001-01-01"):
        return None
    return datetime.fromisoformat(value)


def bridge_address(attrs: Mapping[str, Any], interfaces: Mapping[str, Sequence[str]]) -> str:
    """The host's IPv4 address on a Docker bridge network, from ``docker network inspect``
    and the host's interfaces (name → IPv4 addresses).

    The gateway Docker reports, when it reports one. An engine that found its bridge interface
    already configured when it started (docker0 made by an earlier engine, or by hand) reports
    a subnet and no gateway; the address is then the one the bridge interface named in the
    network's options (``com.docker.network.bridge.name``; ``br-<id>`` by default) has inside
    that subnet. EngineError, saying what was looked at, when neither gives one.
    """
    name = str(attrs.get("Name") or attrs.get("Id", "")[:12])
    configs = [c for c in (attrs.get("IPAM") or {}).get("Config") or [] if c]
    for config in configs:
        gateway = str(config.get("Gateway") or "").split("/")[0]
        if gateway and _is_ipv4(gateway):
            return gateway
    if attrs.get("Driver") not in (None, "bridge"):
        raise EngineError(
            f"the Docker network {name!r} is a {attrs.get('Driver')} network: sandboxes on it"
            " reach no address of this host; use a bridge network"
        )
    options = attrs.get("Options") or {}
    interface = options.get("com.docker.network.bridge.name") or f"br-{attrs.get('Id', '')[:12]}"
    subnets = []
    for config in configs:
        with contextlib.suppress(ValueError):
            subnet = ipaddress.ip_network(str(config.get("Subnet") or ""), strict=False)
            if subnet.version == 4:
                subnets.append(subnet)
    addresses = [a for a in interfaces.get(interface, ()) if _is_ipv4(a)]
    for address in addresses:
        if not subnets or any(ipaddress.ip_address(address) in s for s in subnets):
            return address
    found = ", ".join(addresses) or "no IPv4 address"
    raise EngineError(
        f"cannot tell this host's address on the Docker network {name!r}: Docker reports no"
        f" gateway, and its bridge interface {interface} has {found}"
        f" in {', '.join(map(str, subnets)) or 'no subnet'}"
    )


def _is_ipv4(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 4
    except ValueError:
        return False


def _interface_addresses() -> dict[str, list[str]]:
    """This host's network interfaces and their IPv4 addresses."""
    return {
        name: [a.address for a in addresses if a.family == socket.AF_INET]
        for name, addresses in psutil.net_if_addrs().items()
    }


def _explain(exc: APIError) -> str:
    return str(exc.explanation or exc)
