"""A run's companion services: containers beside its sandbox, reachable from it by name and
from nothing else.

A run with services gets a *network holder* first: a container that does nothing but own the
run's network namespace, made with exactly the network options the sandbox would have had (the
runner's internal network under hard isolation: no route out but the proxy; ICC off and the
host firewall keep other sandboxes out). Each service and then the sandbox join that namespace
(``network_mode=container:<holder>``), so they share one loopback, and the holder's
``/etc/hosts`` names every service ``127.0.0.1``: the sandbox reaches ``db:5432`` on its own
loopback. No other container shares it, so no other run sees the services, and nothing outside
reaches them (the holder publishes no port). Services of one run therefore listen on distinct
ports, and the sandbox cannot listen on theirs.

Where the sandbox would have been on Docker's default bridge (the cooperative level without
COVEY_RUNNER_NETWORK), which every sandbox shares with inter-container traffic on, the holder
is put on a bridge network of the run's own instead, so another sandbox cannot reach the
services at the holder's address. On a network the runner names (COVEY_RUNNER_NETWORK) it goes
there, and that network's own rules decide what its containers reach of each other.

The sandbox is started only when every service is ready: its readiness check (a command run in
it) succeeded, each within its own timeout. A service that exits or is not ready in time fails
the launch naming it, with the end of its log.

The docker SDK; no Django (runner hosts have no database).
"""

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from docker.errors import APIError, DockerException, NotFound
from docker.types import LogConfig

from runners.protocol import MAX_SERVICE_LOG_CHARS, ServiceRecord, ServiceSpec

LABEL_PART_OF = "covey.part-of"  # run id: the holder and services of a run (never covey.run)
LABEL_PART_RUNNER = "covey.part-runner"  # runner name
LABEL_PART = "covey.part"  # network or service
LABEL_SERVICE = "covey.service"  # the service's name
HOLDER_USER = "65534:65534"  # nobody: the holder runs nothing but sleep
LOG_LINES = 20  # lines of a failed service's log in the run's status
SERVICE_CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID", "NET_BIND_SERVICE"]


class ServiceFailed(Exception):
    """A service could not be started or did not become ready; ``record`` has its log."""

    def __init__(self, message: str, record: ServiceRecord) -> None:
        super().__init__(message)
        self.record = record


def holder_name(run_id: str) -> str:
    """The holder's (and the run's own network's) name: a service's name has no '_'."""
    return f"covey-run-{run_id}_net"


def service_name(run_id: str, name: str) -> str:
    return f"covey-run-{run_id}-{name}"


def own_network(client: Any, run_id: str, labels: Mapping[str, str]) -> str:
    """Create the run's own bridge network and return its name."""
    name = holder_name(run_id)
    client.networks.create(name, driver="bridge", labels={**labels, LABEL_PART: "network"})
    return name


def start_holder(
    client: Any,
    run_id: str,
    image: str,
    labels: Mapping[str, str],
    network: Mapping[str, Any],
    services: Sequence[ServiceSpec],
) -> Any:
    """Create and start the run's network holder (``network``: the sandbox's network options:
    network, dns, dns_opt, sysctls)."""
    container = client.containers.create(
        image,
        ["sleep", "infinity"],
        name=holder_name(run_id),
        labels={**labels, LABEL_PART: "network"},
        extra_hosts={service.name: "127.0.0.1" for service in services},
        user=HOLDER_USER,
        read_only=True,
        privileged=False,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        pids_limit=16,
        mem_limit="32m",
        memswap_limit="32m",
        init=True,
        log_config=LogConfig(type=LogConfig.types.JSON, config={"max-size": "1m"}),
        **network,
    )
    container.start()
    return container


def start_services(
    client: Any,
    run_id: str,
    holder: Any,
    labels: Mapping[str, str],
    services: Sequence[ServiceSpec],
    clock: Callable[[], float] = time.monotonic,
) -> list[ServiceRecord]:
    """Start every service in the holder's namespace and wait until each is ready (all at
    once, each against its own timeout). ServiceFailed for the first that is not."""
    records: dict[str, ServiceRecord] = {}
    started: dict[str, Any] = {}
    given_up = threading.Event()  # one failed: the others stop waiting

    def start_and_wait(service: ServiceSpec) -> ServiceRecord:
        try:
            started[service.name] = _create(client, run_id, holder, labels, service)
        except (APIError, DockerException) as exc:
            raise ServiceFailed(
                f"service {service.name} could not be started: {_explain(exc)}",
                ServiceRecord(name=service.name),
            ) from exc
        try:
            return _wait_ready(client, started[service.name], service, clock, given_up)
        except (APIError, DockerException) as exc:
            raise ServiceFailed(
                f"service {service.name} could not be watched: {_explain(exc)}",
                ServiceRecord(name=service.name),
            ) from exc

    # Not a with block: leaving one waits for every thread, and a hung check would hold the
    # launch (removing its container ends it).
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=len(services), thread_name_prefix=f"covey-ready-{run_id[:8]}"
    )
    try:
        futures = {pool.submit(start_and_wait, s): s for s in services}
        # A check that hangs past its service's timeout is given up on here.
        longest = max((s.ready.start_period + s.ready.timeout if s.ready else 0) for s in services)
        done, pending = concurrent.futures.wait(
            futures, timeout=longest + 30, return_when=concurrent.futures.FIRST_EXCEPTION
        )
        failed = [f.exception() for f in done if f.exception() is not None]
        if failed:
            # Let the others see it and stop, so that every container is made before the
            # caller removes them (none is left behind, half-made).
            given_up.set()
            concurrent.futures.wait(pending, timeout=30)
            raise failed[0]  # type: ignore[misc]
        for future in done:
            record = future.result()
            records[record.name] = record
        if pending:
            service = futures[next(iter(pending))]
            container = started.get(service.name)
            raise ServiceFailed(
                f"service {service.name} did not become ready: its start or readiness check hung",
                ServiceRecord(name=service.name, log=service_log(container) if container else ""),
            )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [records[s.name] for s in services]


def _create(
    client: Any, run_id: str, holder: Any, labels: Mapping[str, str], service: ServiceSpec
) -> Any:
    memory = f"{service.memory_mb}m"
    container = client.containers.create(
        service.image,
        list(service.command) or None,
        name=service_name(run_id, service.name),
        labels={**labels, LABEL_PART: "service", LABEL_SERVICE: service.name},
        environment=list(service.environment),
        network_mode=f"container:{holder.id}",
        privileged=False,
        # What a database or web server's entrypoint needs to take its files and drop to its
        # own user (and bind a low port), and nothing else.
        cap_drop=["ALL"],
        cap_add=SERVICE_CAPABILITIES,
        security_opt=["no-new-privileges"],
        pids_limit=1024,
        nano_cpus=int(service.cpus * 1e9),
        mem_limit=memory,
        memswap_limit=memory,
        log_config=LogConfig(type=LogConfig.types.JSON, config={"max-size": "10m"}),
    )
    container.start()
    return container


def _wait_ready(
    client: Any,
    container: Any,
    service: ServiceSpec,
    clock: Callable[[], float],
    given_up: threading.Event,
) -> ServiceRecord:
    """Until the service's readiness check succeeds (or it fails, or its time is up, or
    another service failed: ``given_up``)."""
    began = clock()
    image_id = str(container.attrs.get("Image") or "")
    ready = service.ready
    if ready is not None:
        deadline = began + ready.start_period + ready.timeout
        if given_up.wait(ready.start_period):
            raise ServiceFailed(f"service {service.name}: given up", ServiceRecord(service.name))
        said = ""
        while True:
            _still_running(container, service)
            code, said = _check(client, container, ready.command)
            if code == 0:
                break
            if clock() + ready.interval > deadline:
                raise ServiceFailed(
                    f"service {service.name} did not become ready within"
                    f" {ready.start_period + ready.timeout:g} s (its check"
                    f" {' '.join(ready.command)!r} last exited {code}"
                    f"{': ' + said if said else ''}){_tail(container)}",
                    ServiceRecord(name=service.name, image_id=image_id, log=service_log(container)),
                )
            if given_up.wait(ready.interval):
                raise ServiceFailed(
                    f"service {service.name}: given up", ServiceRecord(service.name)
                )
    else:
        _still_running(container, service)
    return ServiceRecord(name=service.name, image_id=image_id, ready_seconds=clock() - began)


def _still_running(container: Any, service: ServiceSpec) -> None:
    container.reload()
    state = container.attrs.get("State") or {}
    if state.get("Status") != "running":
        raise ServiceFailed(
            f"service {service.name} exited (code {state.get('ExitCode')}) before it was"
            f" ready{_tail(container)}",
            ServiceRecord(
                name=service.name,
                image_id=str(container.attrs.get("Image") or ""),
                log=service_log(container),
            ),
        )


def _check(client: Any, container: Any, command: Sequence[str]) -> tuple[int, str]:
    """Run a readiness check in the service: its exit code and the end of what it said."""
    try:
        created = client.api.exec_create(container.id, list(command), stdout=True, stderr=True)
        output = client.api.exec_start(created["Id"])
        code = client.api.exec_inspect(created["Id"]).get("ExitCode")
    except (APIError, DockerException) as exc:
        return -1, _explain(exc)[:200]
    text = bytes(output or b"").decode("utf-8", errors="replace").strip()
    return (code if isinstance(code, int) else -1), text[-200:]


def service_log(container: Any) -> str:
    """The end of a service's output, interleaved as written."""
    try:
        data = bytes(container.logs(stdout=True, stderr=True, tail=2000))
    except (APIError, DockerException):
        return ""
    return data.decode("utf-8", errors="replace")[-MAX_SERVICE_LOG_CHARS:]


def _tail(container: Any) -> str:
    lines = [line for line in service_log(container).splitlines() if line.strip()]
    return ("; its log ends: " + " / ".join(lines[-LOG_LINES:])) if lines else "; it logged nothing"


def _wanted(labels: Sequence[str], run_id: str | None) -> list[str]:
    return [*labels, *([f"{LABEL_PART_OF}={run_id}"] if run_id else [LABEL_PART_OF])]


def parts(client: Any, labels: Sequence[str], run_id: str | None = None) -> list[Any]:
    """The holders and services carrying ``labels`` (of one run, when given)."""
    wanted = _wanted(labels, run_id)
    return list(client.containers.list(all=True, filters={"label": wanted}, ignore_removed=True))


def networks(client: Any, labels: Sequence[str], run_id: str | None = None) -> list[Any]:
    """The runs' own networks carrying ``labels`` (of one run, when given)."""
    return list(client.networks.list(filters={"label": _wanted(labels, run_id)}))


def remove(containers: Sequence[Any], own_networks: Sequence[Any] = ()) -> None:
    """Force-remove services first, then the holder whose namespace they share, then the
    run's own network."""
    ordered = sorted(containers, key=lambda c: c.labels.get(LABEL_PART) == "network")
    removals = [lambda c=c: c.remove(force=True) for c in ordered]
    removals += [network.remove for network in own_networks]
    for removal in removals:
        with contextlib.suppress(NotFound):
            try:
                removal()
            except APIError as exc:
                if exc.status_code != 409:  # a removal already in progress
                    raise


def run_of(part: Any) -> str:
    """The run a holder, service or network is part of."""
    labels = part.attrs.get("Labels") or (part.attrs.get("Config") or {}).get("Labels") or {}
    return str(labels.get(LABEL_PART_OF, ""))


def _explain(exc: Exception) -> str:
    return str(getattr(exc, "explanation", None) or exc)
