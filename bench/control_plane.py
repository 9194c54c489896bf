"""Benchmark what bounds one control plane: how many runners, proxies and runs it serves.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/control_plane.py            # about 2 min: 20 s per load
    .venv/bin/python bench/control_plane.py --quick    # about 1 min: 8 s per load
    COVEY_DB_CONN_MAX_AGE=0 .venv/bin/python bench/control_plane.py   # a connection per request

Everything runs on this machine: a PostgreSQL and a Redis of the bench's own (initdb in its
temporary folder, loopback ports), the control plane as production runs it (gunicorn,
``COVEY_WEB_WORKERS`` 2 workers of 32 threads, PostgreSQL, Redis), an organisation with 50
registered runners and 50 agents. Then, for each load, 16 clients in threads of this process
send requests one after another (each waits for its answer) for a fixed time:

1. the floor: ``GET /healthz`` (Django's request cycle, no database), the baseline of the run;
2. heartbeats: ``POST /api/v1/runner/`` with the runners' tokens in turn (what every runner
   sends every ``COVEY_RUNNER_HEARTBEAT_SECONDS``, 5 s);
3. policy polls: ``GET /api/v1/egress/policy/`` with a runner's token and the current ETag,
   answered 304 (what a runner host's proxy sends every ``COVEY_EGRESS_POLICY_POLL``, 0.25 s);
4. runs: ``POST /api/v1/runs/`` for the agents in turn, each placed on an online runner and its
   order sent to Redis (no runner consumes them here: the runner's side of a run is
   ``bench/runs.py``'s).

It prints each load's answers per second, p50 and p99, its ratio to the floor's rate, and what
that bounds at half the capacity (the other half for everything else: the admin, the API's
users, the worker's beat): runners by their heartbeats, proxies by their polls, and runs per
minute, each run costing its POST and three runner calls (start, output, report) of about a
heartbeat's cost. The clients share the machine's cores with the server: the figures are a
lower bound of what a control plane on a host of its own serves. Every process it starts is
stopped by its id and its temporary folder (with the database) is removed; the whole run is
bounded in time (an alarm; SIGTERM stops it cleanly).
"""

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
# Run as a script, this folder would come first on sys.path and bench/egress.py would shadow the
# project's ``egress`` package: the project root goes there instead.
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR)]

from bench.support import (  # noqa: E402 - after the path is set
    BenchError,
    Processes,
    covey_env,
    django_here,
    free_port,
    percentile,
    ratio,
    run_bench,
    start_redis,
    step,
    verdict,
    wait_listening,
)

RUNNERS = 50
AGENTS = 50
CLIENTS = 16
GUNICORN_WORKERS = 2
HEARTBEAT_SECONDS = 5.0  # COVEY_RUNNER_HEARTBEAT_SECONDS' default
POLICY_POLL_SECONDS = 0.25  # COVEY_EGRESS_POLICY_POLL's default
RUNNER_CALLS_PER_RUN = 3  # start, output, report
HEADROOM = 0.5  # the share of the capacity the bounds use


@dataclass
class Load:
    name: str
    path: str
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] | None = None

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def pg_binaries() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise BenchError("no PostgreSQL here (apt-get install postgresql, or make services)")
    return Path(initdb).parent


def start_postgres(processes: Processes, work: Path) -> int:
    """A PostgreSQL of the bench's own, in its folder (as a user that may run it)."""
    binaries = pg_binaries()
    data = work / "pg"
    runas: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse root
        runas = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
        data.mkdir()
        shutil.chown(data, "nobody", "nogroup")
    subprocess.run(  # noqa: S603 - PostgreSQL's own initdb
        [*runas, str(binaries / "initdb"), "-D", str(data), "-U", "covey", "--auth", "trust"],
        capture_output=True, check=True, timeout=120,
    )  # fmt: skip
    port = free_port()
    args = [*runas, str(binaries / "postgres"), "-D", str(data), "-p", str(port)]
    args += ["-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={data}"]
    args += ["-c", "fsync=off", "-c", "max_connections=200"]
    process = processes.start("postgres", args, {"PATH": "/usr/bin:/bin"})
    wait_listening(processes, process, "postgres", port, "PostgreSQL listening", 60)
    return port


def bench_env(work: Path, pg_port: int, redis_port: int) -> dict[str, str]:
    """The covey processes' environment: the bench's own PostgreSQL and Redis."""
    env = covey_env(
        work / "var",
        DATABASE_URL=f"postgres://covey@127.0.0.1:{pg_port}/postgres",
        CELERY_BROKER_URL=f"redis://127.0.0.1:{redis_port}/0",
        COVEY_BUILTIN_RUNNER="false",  # only the bench's registered runners
        COVEY_EGRESS_ENFORCE="false",
    )
    if "COVEY_DB_CONN_MAX_AGE" in os.environ:
        env["COVEY_DB_CONN_MAX_AGE"] = os.environ["COVEY_DB_CONN_MAX_AGE"]
    return env


@dataclass
class Seeded:
    user_token: str
    runner_tokens: list[str]
    agents: list[int]


def seed(env: dict[str, str], work: Path, runners: int = RUNNERS) -> Seeded:
    django_here(env, work / "var")
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connections
    from rest_framework.authtoken.models import Token

    from agents import services
    from organisations import services as organisations
    from runners.services import create_registration_token, register_runner

    call_command("migrate", verbosity=0, interactive=False)
    user = get_user_model().objects.create_superuser("bench", "", secrets.token_urlsafe(24))
    organisation = organisations.create_organisation("Bench", base_allowlist=[])
    tokens = []
    for n in range(runners):
        _, secret = create_registration_token(organisation)
        tokens.append(register_runner(secret, f"runner-{n}", [])[1])
    agents = [
        services.create_agent(organisation, f"agent {n}", runtime_command=["true"]).pk
        for n in range(AGENTS)
    ]
    seeded = Seeded(Token.objects.create(user=user).key, tokens, agents)
    connections.close_all()
    return seeded


def start_control_plane(processes: Processes, env: dict[str, str]) -> str:
    port = free_port()
    gunicorn = str(Path(sys.executable).parent / "gunicorn")
    args = [gunicorn, "covey.wsgi", "--bind", f"127.0.0.1:{port}"]
    args += ["--workers", str(GUNICORN_WORKERS)]
    process = processes.start("control-plane", args, env)
    wait_listening(processes, process, "control-plane", port, "the control plane listening", 60)
    return f"http://127.0.0.1:{port}"


def drive(
    base: str, load: Load, seconds: float, send: Callable[[httpx.Client, int], httpx.Response]
) -> Load:
    """CLIENTS threads, each sending ``send(client, n)`` one after another for ``seconds``;
    a non-2xx/304 answer or a transport error counts as an error."""
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(10**9))
    stop = time.monotonic() + seconds

    def client_loop() -> None:
        mine: list[float] = []
        errors = 0
        with httpx.Client(base_url=base, timeout=30) as client:
            while time.monotonic() < stop:
                with lock:
                    n = next(counter)
                began = time.perf_counter()
                try:
                    answer = send(client, n)
                    ok = answer.status_code < 300 or answer.status_code == 304
                except httpx.HTTPError:
                    ok = False
                mine.append(time.perf_counter() - began)
                errors += not ok
        with lock:
            latencies.extend(mine)
            load.errors += errors

    threads = [threading.Thread(target=client_loop) for _ in range(CLIENTS)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    load.seconds = time.monotonic() - began
    load.requests = len(latencies)
    load.latencies = latencies
    return load


def loads(base: str, seeded: Seeded, seconds: float) -> Iterator[Load]:
    def runner_headers(n: int) -> dict[str, str]:
        return {"Authorization": f"Runner {seeded.runner_tokens[n % RUNNERS]}"}

    user = {"Authorization": f"Token {seeded.user_token}"}
    with httpx.Client(base_url=base, timeout=30) as warm:
        for n in range(RUNNERS):  # every runner online, and the policy's current ETag
            warm.post("/api/v1/runner/", headers=runner_headers(n), json={}).raise_for_status()
        etag = warm.get("/api/v1/egress/policy/", headers=runner_headers(0)).headers["ETag"]

    step("floor: GET /healthz")
    yield drive(base, Load("floor", "GET /healthz"), seconds, lambda c, n: c.get("/healthz"))
    step("heartbeats: POST /api/v1/runner/")
    yield drive(
        base,
        Load("heartbeats", "POST /api/v1/runner/"),
        seconds,
        lambda c, n: c.post("/api/v1/runner/", headers=runner_headers(n), json={}),
    )
    step("policy polls: GET /api/v1/egress/policy/ (304)")
    yield drive(
        base,
        Load("policy polls", "GET /api/v1/egress/policy/ → 304"),
        seconds,
        lambda c, n: c.get(
            "/api/v1/egress/policy/", headers={**runner_headers(n), "If-None-Match": etag}
        ),
    )
    step("runs: POST /api/v1/runs/")
    yield drive(
        base,
        Load("runs", "POST /api/v1/runs/"),
        seconds,
        lambda c, n: c.post(
            "/api/v1/runs/",
            headers=user,
            json={"agent": seeded.agents[n % AGENTS], "task": f"bench {n}"},
        ),
    )


def report(measured: dict[str, Load]) -> None:
    floor = measured.get("floor")
    print()
    print("| load | requests/s | p50 / p99 | errors | vs the floor |")
    print("| --- | --- | --- | --- | --- |")
    for load in measured.values():
        latencies = [1000 * s for s in (load.latencies or [0.0])]
        print(
            f"| {load.path} | {load.rate:.0f} | {percentile(latencies, 50):.1f} /"
            f" {percentile(latencies, 99):.1f} ms | {load.errors} |"
            f" {ratio(load.rate, floor.rate if floor else None)} |"
        )
    heartbeats, polls, runs = (measured.get(k) for k in ("heartbeats", "policy polls", "runs"))
    print()
    print(f"At {HEADROOM:.0%} of each capacity, one control plane with {GUNICORN_WORKERS} workers:")
    if heartbeats and heartbeats.rate:
        runners = heartbeats.rate * HEADROOM * HEARTBEAT_SECONDS
        print(f"- runners, a heartbeat every {HEARTBEAT_SECONDS:g} s: {runners:.0f}")
    if polls and polls.rate:
        proxies = polls.rate * HEADROOM * POLICY_POLL_SECONDS
        print(f"- runner hosts' proxies, a poll every {POLICY_POLL_SECONDS:g} s: {proxies:.0f}")
    if runs and runs.rate and heartbeats and heartbeats.rate:
        per_run = 1 / runs.rate + RUNNER_CALLS_PER_RUN / heartbeats.rate  # seconds of capacity
        print(
            f"- runs per minute (a POST and {RUNNER_CALLS_PER_RUN} runner calls each):"
            f" {60 * HEADROOM / per_run:.0f}"
        )


# --- the fleet: N runner hosts at once, their proxies following the stream or polling --------

FLEET = 1000
# Today's polling beside it: 44 hosts polling every 0.25 s (the default), and 175 every 1 s,
# which the same control plane holds at its poll capacity.
POLLING = ((44, 0.25), (175, 1.0))
CHANGES = 20
TARGET_P50, TARGET_P99 = 0.250, 1.0  # seconds from the API call to every proxy
TARGET_IDLE_CPU = 0.10  # of one core, the control plane's while idle with N connected
TARGET_INGEST = 5000  # decision rows per second, on PostgreSQL


def start_stream(processes: Processes, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = [sys.executable, "manage.py", "policy_stream", "--listen", f"127.0.0.1:{port}"]
    process = processes.start("stream", args, env)
    wait_listening(processes, process, "stream", port, "the policy stream listening", 60)
    return process, f"http://127.0.0.1:{port}/api/v1/egress/policy/stream/"


@dataclass
class FleetRun:
    """What bench/fleet.py reports of one run (its JSON)."""

    mode: str
    hosts: int
    connect_seconds: float
    idle_cpu: dict[str, float]  # process → share of one core
    change_latencies: list[float]  # seconds, for each proxy and each change
    hold_cpu: dict[str, float]
    hold_seconds: float
    stream_drops: int
    policy_errors: int
    heartbeats: int
    heartbeat_errors: int
    heartbeat_p50: float
    heartbeat_p99: float
    polls: int
    errors_seen: list[str]
    ingest: dict[str, float] | None = None

    @property
    def errors(self) -> int:
        return self.stream_drops + self.policy_errors + self.heartbeat_errors

    def latency(self, q: float) -> float:
        return percentile(self.change_latencies, q)


def generate(processes: Processes, work: Path, mode: str, hosts: int, **flags: object) -> FleetRun:
    """Run bench/fleet.py (a process of its own) and return its report."""
    args = [sys.executable, str(BENCH_DIR / "fleet.py"), "--mode", mode, "--hosts", str(hosts)]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    log = work / f"fleet-{mode}-{hosts}.log"
    with log.open("wb") as out:
        finished = subprocess.run(  # noqa: S603 - our own load generator
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=out, timeout=1800, check=False
        )
    if finished.returncode != 0:
        raise BenchError(f"the load generator failed:\n{log.read_text()[-3000:]}")
    return FleetRun(**json.loads(finished.stdout.decode().strip().splitlines()[-1]))


def fleet(work: Path, processes: Processes, quick: bool) -> list[FleetRun]:
    step("starting PostgreSQL and Redis of the bench's own")
    redis_port, _ = start_redis(processes, work)
    postgres_port = start_postgres(processes, work)
    postgres = processes.started[-1]
    env = bench_env(work, postgres_port, redis_port)
    step(f"migrating; an organisation, {FLEET} runners and {AGENTS} agents")
    seeded = seed(env, work, runners=FLEET)
    tokens = work / "tokens.json"
    tokens.write_text(json.dumps(seeded.runner_tokens))
    stream_process, stream = start_stream(processes, env)
    base = start_control_plane(processes, {**env, "COVEY_EGRESS_STREAM_URL": stream})
    web = processes.started[-1]
    pids = json.dumps({"web": web.pid, "stream": stream_process.pid, "postgres": postgres.pid})
    common = {
        "base": base, "tokens": tokens, "user": seeded.user_token, "agent": seeded.agents[0],
        "pids": pids, "changes": CHANGES, "idle": 10 if quick else 30,
    }  # fmt: skip
    hold = 60 if quick else 300
    step(f"stream: {FLEET} hosts, held {hold} s with heartbeats, then decision ingest")
    runs = [
        generate(processes, work, "stream", FLEET, stream=stream, hold=hold, ingest=10, **common)
    ]
    for hosts, every in POLLING:
        step(f"polling as before: {hosts} hosts every {every:g} s")
        hold = 30 if quick else 60
        runs.append(generate(processes, work, "poll", hosts, poll=every, hold=hold, **common))
    for name in ("control-plane", "stream"):
        if "Traceback" in processes.log(name):
            raise BenchError(f"the {name} logged an exception:\n{processes.log(name)[-3000:]}")
    return runs


def report_fleet(runs: list[FleetRun]) -> None:
    print()
    print(
        "| proxies get policy by | hosts | all connected in | a change at every proxy,"
        " p50 / p99 / max | CPU while idle: web + stream + PostgreSQL | held | errors |"
        " heartbeats p50 / p99 | web's CPU, held |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        how = "the stream" if run.mode == "stream" else "polls"
        idle = run.idle_cpu
        print(
            f"| {how} | {run.hosts} | {run.connect_seconds:.1f} s |"
            f" {1000 * run.latency(50):.0f} / {1000 * run.latency(99):.0f} /"
            f" {1000 * max(run.change_latencies):.0f} ms |"
            f" {100 * sum(idle.values()):.1f}% ({100 * idle['web']:.1f} +"
            f" {100 * idle['stream']:.1f} + {100 * idle['postgres']:.1f}) |"
            f" {run.hold_seconds:.0f} s | {run.errors} |"
            f" {1000 * run.heartbeat_p50:.0f} / {1000 * run.heartbeat_p99:.0f} ms |"
            f" {100 * run.hold_cpu['web']:.0f}% |"
        )
    stream = runs[0]
    idle_total = sum(stream.idle_cpu.values())
    print()
    print(f"Targets, {stream.hosts} hosts following the stream:")
    print(
        f"- a change through the API enforced at all: p50 {1000 * stream.latency(50):.0f} ms"
        f" (≤ {1000 * TARGET_P50:.0f}): {verdict(stream.latency(50) <= TARGET_P50)};"
        f" p99 {1000 * stream.latency(99):.0f} ms (≤ {1000 * TARGET_P99:.0f}):"
        f" {verdict(stream.latency(99) <= TARGET_P99)}"
    )
    print(
        f"- the control plane's CPU while idle with all connected: {100 * idle_total:.1f}% of"
        f" one core (≤ {100 * TARGET_IDLE_CPU:.0f}%): {verdict(idle_total <= TARGET_IDLE_CPU)}"
    )
    print(
        f"- held {stream.hold_seconds:.0f} s, each host's heartbeat every {HEARTBEAT_SECONDS:g}"
        f" s: {stream.errors} errors{' ' + str(stream.errors_seen) if stream.errors else ''}:"
        f" {verdict(stream.errors == 0)}"
    )
    if stream.ingest:
        rate = stream.ingest["rows_per_second"]
        print(
            f"- decision ingest on PostgreSQL: {rate:.0f} rows/s (≥ {TARGET_INGEST}):"
            f" {verdict(rate >= TARGET_INGEST)}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 s per load instead of 20 s")
    parser.add_argument(
        "--fleet",
        action="store_true",
        help=f"{FLEET} runner hosts following the policy stream, beside polling as before",
    )
    options = parser.parse_args()
    seconds = 8.0 if options.quick else 20.0
    measured: dict[str, Load] = {}
    if options.fleet:
        runs: list[FleetRun] = []

        def fleet_body(work: Path, processes: Processes, stack: contextlib.ExitStack) -> None:
            runs.extend(fleet(work, processes, options.quick))

        failed = run_bench("covey-bench-fleet-", 900 if options.quick else 1800, fleet_body)
        if runs:
            report_fleet(runs)
        return 1 if failed else 0

    def body(work: Path, processes: Processes, stack: contextlib.ExitStack) -> None:
        step("starting PostgreSQL and Redis of the bench's own")
        redis_port, _ = start_redis(processes, work)
        env = bench_env(work, start_postgres(processes, work), redis_port)
        step(f"migrating; an organisation, {RUNNERS} runners and {AGENTS} agents")
        seeded = seed(env, work)
        base = start_control_plane(processes, env)
        step(f"control plane at {base}; {CLIENTS} clients per load, {seconds:g} s each")
        for load in loads(base, seeded, seconds):
            measured[load.name] = load
            step(f"  {load.rate:.0f} requests/s, {load.errors} errors")
        if "Traceback" in processes.log("control-plane"):
            raise BenchError(
                "the control plane logged an exception:\n" + processes.log("control-plane")[-3000:]
            )

    failed = run_bench("covey-bench-control-plane-", 300 if options.quick else 600, body)
    report(measured)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
