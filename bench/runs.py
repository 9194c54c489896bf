"""Benchmark covey's runs: queue-to-running latency against ``docker run``; 20 runs at once.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/runs.py            # about 5 min: 50 runs per path, 20 at once
    .venv/bin/python bench/runs.py --quick    # about 2 min: 10 runs per path, 20 at once

Everything runs on this machine, on the Docker engine ``docker`` talks to, with the image
``covey-base:trixie`` (``make base-image``; nothing is pulled). The bench makes a temporary
directory with a SQLite database (``manage.py migrate``), a superuser and its API token, and for
each Celery broker an organisation with one remote runner (registration token, ``runner.json``)
and its agents. For each broker it starts a control plane (gunicorn, 2 workers,
``COVEY_EGRESS_ENFORCE=false`` so sandboxes need no proxy, ``COVEY_BUILTIN_RUNNER=false``) and a
``manage.py runner --concurrency 4`` with no ``DATABASE_URL`` (heartbeat every second). The
brokers: ``filesystem``, kombu's file-system transport that covey uses when ``CELERY_BROKER_URL``
is unset (folders under ``COVEY_VAR_DIR``, shared by the control plane and the runner), and
``redis``, a ``redis-server`` of the bench's own on loopback (what production uses). Both
stacks share the database; each runner serves its own organisation. It measures:

1. queue-to-running latency: from just before ``POST /api/v1/runs/`` until the sandbox's
   process has started, N runs one after another on a warm runner (after a few warm-up runs),
   each after a random pause of up to 1 s so that none lands on the same phase of the runner's
   polling loops (the file-system broker is polled every second).
   The agent's command is ``sh -c 'date +%s%N'``: the first thing the process does is print the
   wall clock in ns (containers share the host's clock); the bench reads it back from the run's
   log (``GET /api/v1/runs/{id}/log/``, once the run has succeeded) and subtracts
   ``time.time_ns()`` taken before the POST. p50 and p95.
2. the floor, measured the same way (time before the call to the printed time) and interleaved
   with the covey runs so that drift hits all alike: a bare ``docker run --rm covey-base:trixie
   sh -c 'date +%s%N'`` (the docker CLI), and a second, fairer floor with the options covey's
   engine gives a sandbox (``runners/host/containers/engine.py``: init, read-only root, every
   capability dropped, no-new-privileges, a tmpfs /tmp, uid 1000:1000, CPU, memory and process
   limits, a bind-mounted home and task folder, bounded json logs).
   Where the time goes: the run's events (queued, placed, starting), the moment the runner's
   Celery worker logged the order as received (its log), and the container's ``create`` and
   ``start`` events (``docker events``, run by the bench) split each covey run into segments.
3. 20 runs (``sh -c 'sleep 2; echo ok'``) on one runner, twice per broker: POSTed at once
   (20 threads), and queued while the runner is paused then released at once by one resume
   (the runner gets 20 orders at once without the control plane taking 20 POSTs at once): API
   calls refused, runs that did not succeed, the time until the last sandbox started, exited
   and was recorded as ended, the peak number of running sandboxes (``docker ps`` filtered on
   the runner's label, every 0.2 s), and the exceptions in the control plane's log.

It ends with a table of the figures, the differences and ratios against both floors, and the
targets: p50 queue-to-running within 300 ms of a bare ``docker run``'s p50; 20 concurrent runs on
one runner without failures. Every process it starts is stopped by its id, every container it
or its runners made is removed (by labels only its own runners and samples carry), its
temporary directory is removed, and the whole run is bounded in time (an alarm; SIGTERM stops it
cleanly).
"""

import argparse
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
# Run as a script, this folder would come first on sys.path and bench/egress.py would shadow the
# project's ``egress`` package: the project root goes there instead.
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR)]

from bench import support  # noqa: E402 - after the path is set
from bench.support import (  # noqa: E402 - after the path is set
    BenchError,
    Processes,
    broker_env,
    covey_env,
    django_here,
    fmt,
    free_port,
    percentile,
    ratio,
    run_bench,
    signed,
    start_gunicorn,
    start_redis,
    step,
    superuser_token,
    verdict,
)
from runners.host.identity import docker_name  # noqa: E402 - after the path is set

IMAGE = "covey-base:trixie"
CLOCK = "date +%s%N"  # prints the wall clock in ns: the process has started
CLOCK_COMMAND = ["sh", "-c", CLOCK]
SLEEP_COMMAND = ["sh", "-c", "sleep 2; echo ok"]
TASK = "what-time-is-it"
CONCURRENT_RUNS = 20
RUNNER_CONCURRENCY = 4
HEARTBEAT_SECONDS = 1
GUNICORN_WORKERS = 2
RUN_TIMEOUT = 120  # the agents' run_timeout (s)
SEQUENTIAL_WAIT = 60.0  # one run, from the POST to its end (s)
BURST_WAIT = 180.0  # 20 runs at once, until the last ends (s)
REMOVAL_WAIT = 20.0  # a finished run's sandbox removed by its runner (s)
FIRST_POLL = 1.0  # s after the POST before the bench first asks how the run is doing
POLL = 0.1
PEAK_POLL = 0.2
# A random pause before each sample, at least as long as the runner's periodic loops (the
# file-system broker is polled every 1 s, Docker every 0.5 s): one after another, samples would
# otherwise lock onto one phase of those loops and always wait the same part of a period.
JITTER = 1.0
# The options Engine._options (runners/host/containers/engine.py) gives a sandbox, as docker
# CLI flags.
AGENT_CPUS, AGENT_MEMORY_MB, AGENT_PIDS, TMP_MB = 1, 2048, 512, 256
PATHS = ("docker", "secured", "filesystem", "redis")  # the columns: two floors, two brokers
FLOORS = ("docker", "secured")
BROKERS = ("filesystem", "redis")

# Targets
SLACK_MS = 300.0  # covey's p50 within this of a bare docker run's p50


@dataclass(frozen=True)
class Plan:
    """How many samples to take."""

    samples: int  # per path, one after another
    warmup: int  # per path, untimed
    time_limit: int  # seconds for the whole run

    @classmethod
    def make(cls, quick: bool) -> "Plan":
        if quick:
            return cls(samples=10, warmup=3, time_limit=600)
        return cls(samples=50, warmup=5, time_limit=1200)


# --------------------------------------------------------------------------------------------
# Processes: started in their own session, stopped by their id
# --------------------------------------------------------------------------------------------


def docker(*args: str, timeout: float = 60) -> str:
    """The docker CLI's standard output; BenchError when it fails."""
    try:
        done = subprocess.run(  # noqa: S603 - the docker CLI with our own arguments
            [shutil.which("docker") or "docker", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchError(f"docker {args[0]}: {exc}") from exc
    if done.returncode != 0:
        raise BenchError(f"docker {' '.join(args[:2])}: {done.stderr.strip()[:500]}")
    return done.stdout


def containers(label: str, *, running: bool = False) -> list[str]:
    """Ids of the containers carrying the label (key=value), running ones only if asked."""
    args = ["ps", "--quiet", "--filter", f"label={label}"]
    args += ["--filter", "status=running"] if running else ["--all"]
    return docker(*args, timeout=30).split()


# --------------------------------------------------------------------------------------------
# covey: database, control planes, runners
# --------------------------------------------------------------------------------------------


def django_env(var_dir: Path) -> dict[str, str]:
    """The environment of every covey process: the bench's SQLite database and broker folders."""
    return covey_env(
        var_dir,
        COVEY_EGRESS_ENFORCE="false",  # the sandbox needs no proxy
        COVEY_BUILTIN_RUNNER="false",  # only the bench's remote runners
        TZ="UTC",  # the runner's log times (Django sets it too)
    )


@dataclass
class Stack(support.Stack):
    """One broker's control plane and runner, and what the database holds for it."""

    installation: str = ""
    clock_agent: int = 0
    sleep_agents: list[int] = field(default_factory=list)  # one per run of a burst: runs of one
    # agent take turns with its home

    @property
    def label(self) -> str:
        """The label the runner's engine puts on its containers."""
        return f"covey.runner={docker_name(self.runner_id, self.installation)}"


def prepare_database(var_dir: Path, stacks: Sequence[Stack]) -> str:
    """Migrate the SQLite database; a superuser and its API token (returned), and for each
    stack an organisation, a registered runner and its agents (a clock, and a sleeper per run
    of a burst)."""
    django_here(django_env(var_dir), var_dir)
    from django.db import connections

    from agents import services
    from runners.services import installation_key

    token = superuser_token()
    for stack in stacks:
        organisation, _ = stack.register()
        # Its containers carry this database's installation key: another covey on this Docker
        # engine (the test suite, make run) never shares their label.
        stack.installation = installation_key()
        clock = services.create_agent(
            organisation, "clock", runtime_command=CLOCK_COMMAND, run_timeout=RUN_TIMEOUT
        )
        stack.clock_agent = clock.pk
        stack.sleep_agents = [
            services.create_agent(
                organisation, f"sleeper {n}", runtime_command=SLEEP_COMMAND, run_timeout=RUN_TIMEOUT
            ).pk
            for n in range(CONCURRENT_RUNS)
        ]
    connections.close_all()
    return token


def start_control_plane(processes: Processes, env: dict[str, str], stack: Stack) -> None:
    name, what = f"control-plane-{stack.broker}", f"the {stack.broker} control plane listening"
    start_gunicorn(processes, env, name, stack.port, GUNICORN_WORKERS, what)


def start_runner(processes: Processes, env: dict[str, str], stack: Stack, work: Path) -> None:
    """``manage.py runner`` for the stack's runner, with no database settings at all."""
    support.start_runner(
        processes,
        env,
        runner_log(stack),
        stack.identity,
        work,
        heartbeat_seconds=HEARTBEAT_SECONDS,
        what=f"the {stack.broker} runner taking orders",
        args=["--concurrency", str(RUNNER_CONCURRENCY)],
    )


def runner_log(stack: Stack) -> str:
    return f"runner-{stack.broker}"


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One run, covey's or a bare docker run: all times in ns on the host's clock."""

    key: str  # covey: the run id; a floor: the bench's sample label
    sent: int  # just before the POST, or the docker CLI call
    printed: int  # the time the sandbox's process printed
    answered: int | None = None  # covey: the POST's answer arrived
    events: dict[str, int] = field(default_factory=dict)  # covey: the run's events

    @property
    def latency_ms(self) -> float:
        return (self.printed - self.sent) / 1e6


def iso_ns(value: str) -> int:
    """An API time (ISO 8601, microseconds) in ns since the epoch."""
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1e6) * 1000


def printed_time(output: str) -> int:
    """The wall clock the sandbox printed (the first line that is all digits)."""
    for line in output.splitlines():
        if line.strip().isdigit():
            return int(line.strip())
    raise BenchError(f"no time in the output: {output[:200]!r}")


def api_client(stack: Stack, token: str) -> httpx.Client:
    return support.api_client(stack.url, token, 30)


def wait_finished(api: httpx.Client, run_id: str, timeout: float) -> dict[str, Any]:
    """GET the run until it has ended (first after FIRST_POLL s, then every POLL s)."""
    deadline = time.monotonic() + timeout
    time.sleep(FIRST_POLL)
    while True:
        response = api.get(f"/api/v1/runs/{run_id}/")
        if response.status_code != 200:
            raise BenchError(f"GET run {run_id}: {response.status_code} {response.text[:300]}")
        body: dict[str, Any] = response.json()
        if body["finished_at"] is not None:
            return body
        if time.monotonic() > deadline:
            raise BenchError(
                f"run {run_id} still {body['status']} after {timeout:.0f} s: "
                f"{body['status_detail']!r}"
            )
        time.sleep(POLL)


def wait_removed(label: str, timeout: float = REMOVAL_WAIT) -> None:
    """Until no container carries the label: the next sample starts on a quiet engine."""
    deadline = time.monotonic() + timeout
    while containers(label):
        if time.monotonic() > deadline:
            raise BenchError(f"containers with {label} still there after {timeout:.0f} s")
        time.sleep(0.1)


def covey_run(api: httpx.Client, stack: Stack) -> Sample:
    """Queue one run of the clock agent through the API; its latency once it has succeeded."""
    sent = time.time_ns()
    response = api.post("/api/v1/runs/", json={"agent": stack.clock_agent, "task": TASK})
    answered = time.time_ns()
    if response.status_code != 201:
        raise BenchError(f"POST run answered {response.status_code}")
    run_id = str(response.json()["id"])
    body = wait_finished(api, run_id, SEQUENTIAL_WAIT)
    if body["status"] != "succeeded":
        raise BenchError(f"run {run_id} ended {body['status']}: {body['status_detail']!r}")
    log = api.get(f"/api/v1/runs/{run_id}/log/")
    if log.status_code != 200:
        raise BenchError(f"GET run {run_id} log: {log.status_code}")
    sample = Sample(run_id, sent, printed_time(log.text), answered)
    for event in body["events"]:
        sample.events.setdefault(event["status"], iso_ns(event["at"]))
    wait_removed(f"covey.run={run_id}")
    return sample


def floor_args(path: str, key: str, work: Path, bench_label: str) -> list[str]:
    """``docker run`` of the clock command: bare, or with the options covey gives a sandbox."""
    labels = ["--label", bench_label, "--label", f"covey-bench.sample={key}"]
    if path == "docker":
        return ["run", "--rm", *labels, IMAGE, "sh", "-c", CLOCK]
    home, task_dir, memory = work / "floor-home", work / "floor-task", f"{AGENT_MEMORY_MB}m"
    secured = (  # Engine._options, flag by flag (no space inside a value)
        f"--name covey-bench-{key} --init --read-only --cap-drop ALL"
        " --security-opt no-new-privileges"
        f" --tmpfs /tmp:rw,exec,nosuid,nodev,size={TMP_MB}m"
        " --user 1000:1000 --workdir /home/agent"
        f" --mount type=bind,source={home},target=/home/agent"
        f" --mount type=bind,source={task_dir},target=/run/covey,readonly"
        f" --env HOME=/home/agent --env COVEY_TASK_FILE=/run/covey/task --env COVEY_TASK={TASK}"
        f" --env COVEY_RUN={key}"
        f" --pids-limit {AGENT_PIDS} --cpus {AGENT_CPUS} --memory {memory} --memory-swap {memory}"
        " --log-driver json-file --log-opt max-size=10m --log-opt max-file=2"
    )
    return ["run", "--rm", *labels, *secured.split(), IMAGE, "sh", "-c", CLOCK]


def prepare_floor(work: Path) -> None:
    """The secured floor's home (owned by 1000:1000, as the engine makes it) and task folder."""
    home, task_dir = work / "floor-home", work / "floor-task"
    home.mkdir(mode=0o700)
    os.chown(home, 1000, 1000)
    task_dir.mkdir()
    task_dir.chmod(0o755)
    (task_dir / "task").write_text(TASK)


def floor_run(path: str, work: Path, bench_label: str) -> Sample:
    key = secrets.token_hex(6)
    args = floor_args(path, key, work, bench_label)
    sent = time.time_ns()
    output = docker(*args)
    return Sample(key, sent, printed_time(output))


# --------------------------------------------------------------------------------------------
# Where the time goes: docker events and the runner's log
# --------------------------------------------------------------------------------------------


def start_docker_events(processes: Processes) -> None:
    """``docker events`` for container create and start, as JSON lines in the bench's log."""
    args = [shutil.which("docker") or "docker", "events", "--format", "{{json .}}"]
    args += ["--filter", "type=container", "--filter", "event=create", "--filter", "event=start"]
    processes.start("docker-events", args, dict(os.environ))


def container_events(processes: Processes) -> dict[str, dict[str, int]]:
    """{run id or sample key: {"create": ns, "start": ns}} from the events seen so far."""
    found: dict[str, dict[str, int]] = {}
    for line in processes.log("docker-events").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        attributes = (event.get("Actor") or {}).get("Attributes") or {}
        key = attributes.get("covey.run") or attributes.get("covey-bench.sample")
        action = event.get("Action") or event.get("status")
        if key and action in ("create", "start") and "timeNano" in event:
            found.setdefault(key, {}).setdefault(action, int(event["timeNano"]))
    return found


RECEIVED = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): \w+/[^\]]*\] "
    r"Task covey\.runner\.launch\[[0-9a-f-]+\] received",
    re.MULTILINE,
)


def orders_received(log: str) -> list[int]:
    """When the runner's Celery worker received each launch order (ms precision, UTC), in ns."""
    times = []
    for match in RECEIVED.finditer(log):
        moment = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
        times.append(int(moment.timestamp()) * 10**9 + int(match.group(2)) * 10**6)
    return sorted(times)


def attach_details(
    samples: Sequence[Sample], events: Mapping[str, Mapping[str, int]], received: Sequence[int]
) -> None:
    """Add the container's create/start events and the order's receipt to each sample."""
    for sample in samples:
        for action, moment in events.get(sample.key, {}).items():
            sample.events[action] = moment
        placed, starting = sample.events.get("placed"), sample.events.get("starting")
        if placed is None or starting is None:
            continue
        # Logged in whole ms: at most 1 ms before the placement's (µs) time can be the same.
        window = [t for t in received if placed - 10**6 <= t <= starting]
        if window:
            sample.events["received"] = window[0]


# Segments of a run, as (label, from, to); "sent" and "printed" are the sample's own times.
# Docker's "start" event comes once the start call returns, after the process already runs: it
# is no boundary here (the burst uses it for when the last sandbox started).
SEGMENTS = (
    ("POST -> run queued (API)", "sent", "queued"),
    ("queued -> placed on the runner", "queued", "placed"),
    ("placed -> order received (Celery log)", "placed", "received"),
    ("received -> starting (runner's start call)", "received", "starting"),
    ("starting / docker CLI -> container created", "starting", "create"),
    ("container created -> process printed", "create", "printed"),
)


def moment(sample: Sample, name: str) -> int | None:
    if name == "sent":
        return sample.sent
    if name == "printed":
        return sample.printed
    return sample.events.get(name)


def segment_ms(sample: Sample, start: str, end: str, floor: bool) -> float | None:
    if floor:  # a docker run: the CLI call is its "starting"
        if start in ("queued", "placed", "received") or end in ("queued", "placed", "received"):
            return None
        start = "sent" if start == "starting" else start
    a, b = moment(sample, start), moment(sample, end)
    return None if a is None or b is None else (b - a) / 1e6


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


@dataclass
class Latency:
    samples: list[Sample] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    server_errors: Counter[str] = field(default_factory=Counter)  # the control plane's log

    def ms(self) -> list[float]:
        return [s.latency_ms for s in self.samples]

    def p(self, q: float) -> float | None:
        return percentile(self.ms(), q) if self.samples else None


def measure_latency(
    paths: Sequence[str],
    run_one: Callable[[str], Sample],
    plan: Plan,
    budget: float,
) -> dict[str, Latency]:
    """Warm every path up, then N samples each, one after another, the paths interleaved."""
    results = {path: Latency() for path in paths}
    random = secrets.SystemRandom()
    for path in paths:
        for _ in range(plan.warmup):
            run_one(path)  # a failure here is a broken setup: stop
    deadline = time.monotonic() + budget
    for i in range(plan.samples):
        if time.monotonic() > deadline:
            print(f"  latency: time is up after {i} rounds", flush=True)
            break
        for path in (*paths[i % len(paths) :], *paths[: i % len(paths)]):
            time.sleep(random.uniform(0, JITTER))
            try:
                results[path].samples.append(run_one(path))
            except (BenchError, httpx.HTTPError) as exc:
                results[path].errors[f"{type(exc).__name__}: {str(exc)[:100]}"] += 1
        if (i + 1) % 10 == 0:
            done = ", ".join(
                f"{path} {percentile(r.ms(), 50):.0f}" for path, r in results.items() if r.samples
            )
            print(f"  {i + 1}/{plan.samples} rounds; p50 ms so far: {done}", flush=True)
    return results


@dataclass
class Burst:
    """20 runs queued at once on one runner."""

    queued: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    queue_seconds: float | None = None  # until every POST was answered
    last_start_seconds: float | None = None  # until the last sandbox started (docker event)
    exited_seconds: float | None = None  # until the last sandbox exited (the runs' finished_at)
    finished_seconds: float | None = None  # until the last run was recorded ended (final event)
    peak_running: int = 0
    server_errors: Counter[str] = field(default_factory=Counter)  # from the control plane's log
    leftover: str = ""  # sandboxes the runner did not remove in time
    run_ids: list[str] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(self.errors.values()) + sum(
            n for status, n in self.statuses.items() if status != "succeeded"
        )


EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.*)$", re.MULTILINE)


def exceptions_logged(log: str) -> Counter[str]:
    """The exceptions a log shows (the last line of each traceback), counted."""
    return Counter(f"{name}: {message[:80]}" for name, message in EXCEPTION.findall(log))


def measure_burst(
    stack: Stack, token: str, processes: Processes, count: int, released: bool
) -> Burst:
    """``count`` runs of the sleeper on one runner; follow them to the end.

    Queued at once (``released`` false): ``count`` POSTs at the same moment, a thread and a
    connection each. Released at once: the runner is paused, the runs are queued one after
    another (they wait), and the resume places them all in one request: the runner gets
    ``count`` orders at once without the control plane taking ``count`` POSTs at once.
    """
    result = Burst()
    stop = threading.Event()
    log_name = f"control-plane-{stack.broker}"
    log_before = len(processes.log(log_name))

    def watch_peak() -> None:
        while not stop.is_set():
            with contextlib.suppress(BenchError):
                running = len(containers(stack.label, running=True))
                result.peak_running = max(result.peak_running, running)
            stop.wait(PEAK_POLL)

    def post(i: int) -> str:
        with api_client(stack, token) as api:
            response = api.post(
                "/api/v1/runs/",
                json={
                    "agent": stack.sleep_agents[i % len(stack.sleep_agents)],
                    "task": f"sleep {i}",
                },
            )
        if response.status_code != 201:
            raise BenchError(f"POST run answered {response.status_code}")
        return str(response.json()["id"])

    def runner_action(api: httpx.Client, action: str) -> None:
        """Pause or resume; a failure is counted (a failed resume's update may have committed,
        and the heartbeat places what waits)."""
        response = api.post(f"/api/v1/runners/{stack.runner_id}/{action}/")
        if response.status_code != 200:
            result.errors[f"{action} answered {response.status_code}"] += 1

    watcher = threading.Thread(target=watch_peak, name="bench-peak", daemon=True)
    watcher.start()
    try:
        with api_client(stack, token) as api:
            if released:
                runner_action(api, "pause")
                for i in range(count):
                    try:
                        result.run_ids.append(post(i))
                    except (BenchError, httpx.HTTPError) as exc:
                        result.errors[f"{type(exc).__name__}: {str(exc)[:100]}"] += 1
                sent = time.time_ns()
                runner_action(api, "resume")
            else:
                sent = time.time_ns()
                with ThreadPoolExecutor(max_workers=count) as pool:
                    futures = [pool.submit(post, i) for i in range(count)]
                    for future in futures:
                        try:
                            result.run_ids.append(future.result(timeout=60))
                        except Exception as exc:  # every kind of failure is counted
                            result.errors[f"{type(exc).__name__}: {str(exc)[:100]}"] += 1
            result.queue_seconds = (time.time_ns() - sent) / 1e9
            result.queued = len(result.run_ids)
            finished: dict[str, dict[str, Any]] = {}
            deadline = time.monotonic() + BURST_WAIT
            while len(finished) < len(result.run_ids) and time.monotonic() < deadline:
                time.sleep(0.5)
                for run_id in result.run_ids:
                    if run_id not in finished:
                        body = api.get(f"/api/v1/runs/{run_id}/").json()
                        if body["finished_at"] is not None:
                            finished[run_id] = body
        for run_id in result.run_ids:
            body = finished.get(run_id, {"status": "unfinished", "status_detail": ""})
            status = body["status"]
            if status != "succeeded" and body["status_detail"]:
                status = f"{status} ({body['status_detail'][:120]})"  # say why
            result.statuses[status] += 1
        if finished:
            exited = max(iso_ns(body["finished_at"]) for body in finished.values())
            result.exited_seconds = (exited - sent) / 1e9
            recorded = max(iso_ns(e["at"]) for body in finished.values() for e in body["events"])
            result.finished_seconds = (recorded - sent) / 1e9
        try:
            wait_removed(stack.label, REMOVAL_WAIT + count)
        except BenchError as exc:
            result.leftover = str(exc)
    finally:
        stop.set()
        watcher.join(5)
    result.server_errors = exceptions_logged(processes.log(log_name)[log_before:])
    events = container_events(processes)
    starts = [events[r]["start"] for r in result.run_ids if "start" in events.get(r, {})]
    if starts:
        result.last_start_seconds = (max(starts) - sent) / 1e9
    return result


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass
class Results:
    quick: bool = False
    brokers: tuple[str, ...] = BROKERS
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    load: float | None = None
    latency: dict[str, Latency] = field(default_factory=dict)
    bursts: dict[str, Burst] = field(default_factory=dict)


COLUMN = {
    "docker": "docker run",
    "secured": "secured run",
    "filesystem": "covey fs",
    "redis": "covey redis",
}


def report(results: Results) -> str:
    out: list[str] = []
    add = out.append
    lat = results.latency
    p50 = {path: lat[path].p(50) if path in lat else None for path in PATHS}
    p95 = {path: lat[path].p(95) if path in lat else None for path in PATHS}
    add("")
    add("=" * 100)
    add(
        "covey runs: queue-to-running vs docker run, on one runner"
        + (" (--quick)" if results.quick else "")
    )
    for key, value in results.versions.items():
        add(f"  {key:<14} {value}")
    if results.load is not None:
        add(f"  {'machine':<14} {os.cpu_count()} cores, load average {results.load:.2f} at start")
    for note in results.notes:
        add(f"  {note}")
    add("")
    head = f"{'metric':<46}" + "".join(f"{COLUMN[p]:>13}" for p in PATHS)
    add(head)
    add("-" * len(head))

    def row(label: str, values: Mapping[str, str]) -> None:
        add(f"{label:<46}" + "".join(f"{values.get(p, '-'):>13}" for p in PATHS))

    counts = "/".join(str(len(lat[p].samples)) if p in lat else "0" for p in PATHS)
    row(f"queue -> process started p50 (ms, n={counts})", {p: fmt(v) for p, v in p50.items()})
    row("queue -> process started p95 (ms)", {p: fmt(v) for p, v in p95.items()})
    for name, floor in (("docker run", "docker"), ("secured run", "secured")):
        row(
            f"  p50 minus {name}'s (ms)",
            {p: signed(none_sub(p50[p], p50[floor])) for p in PATHS if p != floor},
        )
        row(f"  p50 / {name}'s", {p: ratio(p50[p], p50[floor]) for p in PATHS if p != floor})
    row(
        "  p95 minus docker run's (ms)",
        {p: signed(none_sub(p95[p], p95["docker"])) for p in PATHS if p != "docker"},
    )
    answered = {
        p: fmt(statistics.median(values))
        for p in BROKERS
        if p in lat
        and (values := [(s.answered - s.sent) / 1e6 for s in lat[p].samples if s.answered])
    }
    row("POST answered, p50 (ms)", answered)
    running = {
        p: fmt(statistics.median(values))
        for p in BROKERS
        if p in lat
        and (
            values := [
                (s.events["running"] - s.sent) / 1e6
                for s in lat[p].samples
                if "running" in s.events
            ]
        )
    }
    row("queue -> API says running, p50 (ms)", running)
    row("errors", {p: str(sum(lat[p].errors.values())) for p in PATHS if p in lat})

    add("")
    add("where the time goes: p50 / mean per segment (ms); the means add up to the mean total")
    add(head.replace("metric", "segment", 1))
    add("-" * len(head))
    for label, start, end in SEGMENTS:
        cells = {}
        for path in PATHS:
            if path not in lat:
                continue
            values = [
                v
                for s in lat[path].samples
                if (v := segment_ms(s, start, end, path in FLOORS)) is not None
            ]
            if values:
                cells[path] = f"{statistics.median(values):.0f} / {statistics.mean(values):.0f}"
        row(label, cells)
    row(
        "total",
        {
            p: f"{statistics.median(lat[p].ms()):.0f} / {statistics.mean(lat[p].ms()):.0f}"
            for p in PATHS
            if p in lat and lat[p].samples
        },
    )
    add(
        "  (covey: 'received' is the runner's Celery log line, whole ms; the floors start at "
        "the CLI call)"
    )

    bursts = results.bursts
    if bursts:
        add("")
        add(
            f"{CONCURRENT_RUNS} runs of sh -c 'sleep 2; echo ok' on one runner "
            f"(--concurrency {RUNNER_CONCURRENCY}): POSTed at once, or queued while the runner "
            "was paused and released at once by the resume"
        )
        keys = list(bursts)
        bhead = f"{'metric':<46}" + "".join(f"{burst_column(k):>16}" for k in keys)
        add(bhead)
        add("-" * len(bhead))

        def brow(label: str, cell: Callable[[Burst], str]) -> None:
            add(f"{label:<46}" + "".join(f"{cell(bursts[k]):>16}" for k in keys))

        brow("runs queued (POST answered 201)", lambda b: str(b.queued))
        brow("POSTs refused or failed", lambda b: str(sum(b.errors.values())))
        brow("runs succeeded", lambda b: str(b.statuses.get("succeeded", 0)))
        brow(
            "runs queued that did not succeed",
            lambda b: str(b.failures - sum(b.errors.values())),
        )
        brow("POSTs / resume answered (s)", lambda b: fmt(b.queue_seconds, 2))
        brow("last sandbox started (s)", lambda b: fmt(b.last_start_seconds, 2))
        brow("last sandbox exited (s, the runs' finished_at)", lambda b: fmt(b.exited_seconds, 2))
        brow("last run recorded as ended (s, final event)", lambda b: fmt(b.finished_seconds, 2))
        brow("peak running sandboxes (docker ps)", lambda b: str(b.peak_running))
        add("  (seconds from the first POST, or from the resume)")
        for key, burst in bursts.items():
            where = burst_column(key).strip()
            for status, n in burst.statuses.items():
                if status != "succeeded":
                    add(f"  {where}: {n} x {status}")
            for error, n in burst.errors.most_common(3):
                add(f"  {where}: {n} x {error}")
            for error, n in burst.server_errors.most_common(3):
                add(f"  {where}: control plane log, {n} line(s): {error}")
            if burst.leftover:
                add(f"  {where}: {burst.leftover}")

    add("")
    add("targets")

    def target(name: str, figures: str, ok: bool | None) -> None:
        add(f"  {name:<52}{figures:<38}{verdict(ok)}")

    for broker in results.brokers:
        gap = none_sub(p50.get(broker), p50["docker"])
        target(
            f"p50 within {SLACK_MS:.0f} ms of docker run's ({broker})",
            f"{fmt(p50.get(broker))} vs {fmt(p50['docker'])} ms: {signed(gap)} ms",
            None if gap is None else gap <= SLACK_MS,
        )
    for key, seen in bursts.items():
        target(
            f"{CONCURRENT_RUNS} concurrent runs, no failures ({burst_column(key).strip()})",
            f"{seen.statuses.get('succeeded', 0)}/{CONCURRENT_RUNS} succeeded, "
            f"{sum(seen.errors.values())} API call(s) failed",
            seen.failures == 0 and seen.queued == CONCURRENT_RUNS,
        )
    for path, result in lat.items():
        for error, count in result.errors.most_common(3):
            add(f"  {path}, latency: {count} x {error}")
        for error, count in result.server_errors.most_common(3):
            add(f"  {path}, latency: control plane log, {count} line(s): {error}")
    add("=" * 100)
    return "\n".join(out)


def burst_column(key: str) -> str:
    broker, _, mode = key.partition(" ")
    return f"{'fs' if broker == 'filesystem' else broker} {mode}"


def none_sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def remove_containers(labels: Sequence[str]) -> None:
    """Force-remove the containers carrying any of these labels (only the bench's own)."""
    for label in labels:
        with contextlib.suppress(BenchError):
            left = containers(label)
            if left:
                print(f"removing {len(left)} container(s) left with {label}", flush=True)
                docker("rm", "--force", *left)


def check_docker() -> str:
    try:
        version = docker("version", "--format", "{{.Server.Version}}", timeout=30).strip()
    except BenchError as exc:
        raise BenchError(f"the Docker engine does not answer ({exc}): run make services") from exc
    try:
        docker("image", "inspect", "--format", "{{.Id}}", IMAGE, timeout=30)
    except BenchError:
        raise BenchError(f"the image {IMAGE} is missing: build it with make base-image") from None
    return version


def run(
    plan: Plan,
    results: Results,
    work: Path,
    processes: Processes,
    stack: contextlib.ExitStack,
) -> None:
    results.load = os.getloadavg()[0]
    step(f"working in {work}; load average {results.load:.2f} on {os.cpu_count()} cores")
    docker_version = check_docker()
    bench_label = f"covey-bench.run={work.name}"
    stacks = [Stack(broker, free_port()) for broker in results.brokers]

    def clean_up() -> None:  # the runners first: a runner mid-launch could still make one
        processes.stop_all()
        remove_containers([bench_label, *(s.label for s in stacks)])

    stack.callback(clean_up)

    step("migrating a SQLite database; organisations, runners and agents")
    var_dir = work / "var"
    token = prepare_database(var_dir, stacks)
    env = django_env(var_dir)
    redis_port, redis_version = None, "-"
    if "redis" in results.brokers:
        redis_port, redis_version = start_redis(processes, work)
        step(f"redis-server {redis_version} on 127.0.0.1:{redis_port}")
    start_docker_events(processes)
    for each in stacks:
        own = broker_env(env, each.broker, redis_port)
        start_control_plane(processes, own, each)
        start_runner(processes, own, each, work)
        step(f"{each.broker}: control plane on {each.url}, runner {each.label} ready")
    prepare_floor(work)

    from importlib.metadata import version

    from django.conf import settings

    results.versions = {
        "python": platform.python_version(),
        "docker engine": f"{docker_version}, image {IMAGE}",
        "control plane": f"gunicorn {version('gunicorn')}, {GUNICORN_WORKERS} workers, "
        f"Django {version('django')}, SQLite",
        "runner": f"manage.py runner --concurrency {RUNNER_CONCURRENCY}, Celery "
        f"{version('celery')} (threads), heartbeat {HEARTBEAT_SECONDS} s, polls Docker every 0.5 s",
        "brokers": f"filesystem (kombu {version('kombu')}'s file-system transport)"
        + (f"; redis (redis-server {redis_version}, loopback)" if redis_port else ""),
        "egress": f"COVEY_EGRESS_ENFORCE={settings.COVEY_EGRESS_ENFORCE} (no proxy)",
    }

    clients = {each.broker: api_client(each, token) for each in stacks}
    for client in clients.values():
        stack.callback(client.close)
    by_broker = {each.broker: each for each in stacks}

    def run_one(path: str) -> Sample:
        if path in FLOORS:
            return floor_run(path, work, bench_label)
        return covey_run(clients[path], by_broker[path])

    paths = [*FLOORS, *results.brokers]
    step(
        f"1-2. queue-to-running: {plan.warmup} warm-up and {plan.samples} measured runs per "
        f"path ({', '.join(paths)}), interleaved"
    )
    results.latency = measure_latency(paths, run_one, plan, budget=plan.time_limit * 0.6)
    events = container_events(processes)
    for path, latency in results.latency.items():
        if path in BROKERS:
            latency.server_errors = exceptions_logged(processes.log(f"control-plane-{path}"))
        received = (
            [] if path in FLOORS else orders_received(processes.log(runner_log(by_broker[path])))
        )
        attach_details(latency.samples, events, received)
    for each in stacks:
        for mode in ("at once", "released"):
            step(f"3. {CONCURRENT_RUNS} runs on the {each.broker} runner, {mode}")
            results.bursts[f"{each.broker} {mode}"] = measure_burst(
                each, token, processes, CONCURRENT_RUNS, released=mode == "released"
            )
    step("done; stopping everything")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument(
        "--broker",
        choices=(*BROKERS, "both"),
        default="both",
        help="the Celery broker(s) to measure covey with (default: both)",
    )
    args = parser.parse_args(argv)
    plan = Plan.make(args.quick)
    results = Results(
        quick=args.quick, brokers=BROKERS if args.broker == "both" else (args.broker,)
    )
    failed = run_bench(
        "covey-bench-runs-",
        plan.time_limit,
        lambda work, processes, stack: run(plan, results, work, processes, stack),
    )
    print(report(results), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
