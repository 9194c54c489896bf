"""Benchmark agents' homes from outside: listing, transfers against ``cp``, memory, kept usage.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/homes.py            # about 5 min: 1 GiB transfers, 30 samples
    .venv/bin/python bench/homes.py --quick    # about 3 min: 256 MiB transfers, 10 samples

Everything runs on this machine, on loopback, in a temporary directory (one filesystem: the
homes, the control plane's spool and the client's files are on the same disk). The bench makes a
SQLite database there (``manage.py migrate``), a superuser and its API token, and for each
Celery broker an organisation with one remote runner (registration token, ``runner.json``) and
three agents whose home is on that runner (``Agent.home_runner`` set in the database). For each
broker it starts a control plane (gunicorn, 2 workers, from the project root so that
``gunicorn.conf.py``'s threaded workers are used; ``COVEY_BUILTIN_RUNNER=false``,
``COVEY_EGRESS_ENFORCE=false``; its own ``COVEY_HOME_SPOOL``) and a ``manage.py runner`` with no
``DATABASE_URL`` (heartbeat every second; it watches the local Docker engine as every runner
host does, but no sandbox is started). The brokers: ``filesystem``, kombu's file-system
transport covey uses when ``CELERY_BROKER_URL`` is unset (polled every 50 ms), and ``redis``, a
``redis-server`` of the bench's own on loopback (what production uses). Every home operation is
ordered over the broker to the runner, which takes it and answers through the runner API; bytes
go through the spool. Files are made directly on disk in the home directories
(``$COVEY_RUNNER_HOMES/<runner>/<agent>``), as the runner host would find them, and the disk is
synced before each measurement. For each broker it measures, with ``httpx`` on one keep-alive
connection (transfers: ``curl``), each time from just before the request until the response
is read (and parsed):

1. listing: 10,000 small files in ``big/``; ``GET /api/v1/agents/{id}/home/entries/?path=big
   &limit=1000``, N times: p50 and p95. Target: p50 < 300 ms. The floor, interleaved with it
   (one each in turn, after a few untimed warm-ups of both): the same page made by the runner
   host's own code, ``runners.host.homes.Home.listing``, in the bench's process (no API, no
   broker, no JSON).
2. transfers of one file of 1 GiB of random bytes (256 MiB with ``--quick``), interleaved with
   ``cp`` of a file of the same size on the same disk, each round twice over: between the disks
   (the target's sense: the page cache emptied before each, as root, through
   ``/proc/sys/vm/drop_caches``, so each source is read from disk (the whole machine's cache:
   whatever else runs slows for a moment); each copy ends on disk: ``cp``
   then ``sync FILE``, a download then ``sync FILE``, an upload answered once the runner has
   fsynced it), then in memory (each source read once beforehand, nothing synced). A round:
   ``cp`` (the home's file to the client's folder), download (``curl -o`` of ``GET
   …/home/download/?path=``), ``cp`` (the client's file into the home's folder), upload (``curl
   -T`` to ``PUT …/home/file/?path=``: streamed with its length, answered once the runner has
   written, fsynced and renamed the file). ``curl`` is the client a person would use, and it
   takes little of the two cores. Then the floor, in memory: the same file through two loopback
   hops and a spool file with no HTTP (``sendfile`` into the first connection, ``recv`` into
   the spool, ``sendfile`` from the spool into the second as it grows, ``recv`` into the
   target, on threads of this process): what any design relaying through the control plane
   can reach here. 3 rounds; medians, in MiB/s (1 MiB = 1,048,576 bytes), and the ratio to
   ``cp``'s median (its 6 copies) of the same kind. Every transfer is verified: the sha256 of
   what arrived (the downloaded file, the file in the home on disk) against the source's.
   Target: each direction at least 50% of ``cp``'s throughput between the disks (not judged
   when the page cache cannot be emptied: the bench says so).
3. memory: the RSS of every covey process (the gunicorn master and its workers, the runner and
   any child of it) sampled every 0.1 s on a thread (psutil) throughout the transfers; per
   process, its peak minus its RSS just before the first transfer. Target: < 64 MiB each. Where
   the time goes: the CPU time (user + system) each process spent during the downloads and
   during the uploads, per GiB moved.
4. usage: 100,000 small files in another agent's home (100 directories of 1,000). First
   ``GET …/home/usage/`` once, which has the runner walk the whole home and the control plane
   keep the figure: its time end to end is the walk's cost (the runner's own measure of the
   walk is shown too). Then ``GET /api/v1/agents/{id}/home/`` (the summary, which reads the kept
   figure and asks no runner), N times: p50 and p95; each must say 100,000 files. Target: p50 <
   100 ms. The floor, interleaved: ``GET /api/v1/agents/{id}/``, the same agent through the API.

N is 30 (10 with ``--quick``). It ends with a table of the figures and the targets, met or not,
and says what went wrong: failed requests, exceptions in the covey processes' logs, files left
in the spool, operations not answered. Every process it starts is stopped by its id, its
temporary directory is removed, and the whole run is bounded in time (an alarm; SIGTERM stops it
cleanly).
"""

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
# Run as a script, this folder would come first on sys.path and bench/egress.py would shadow the
# project's ``egress`` package: the project root goes there instead.
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR)]

from bench import support  # noqa: E402 - after the path is set
from bench.runs import django_env, exceptions_logged, start_redis  # noqa: E402 - after the path
from bench.support import (  # noqa: E402 - after the path is set
    BenchError,
    Processes,
    broker_env,
    django_here,
    fmt,
    free_port,
    percentile,
    ratio,
    run_bench,
    signed,
    start_gunicorn,
    step,
    superuser_token,
    verdict,
)
from runners.host.homes import Home  # noqa: E402 - after the path is set

BROKERS = ("filesystem", "redis")
GUNICORN_WORKERS = 2
HEARTBEAT_SECONDS = 1
LISTED_FILES = 10_000  # in the lister's big/
LIST_LIMIT = 1000
USAGE_DIRECTORIES, USAGE_PER_DIRECTORY = 100, 1000  # the hoarder's 100,000 files
SMALL_FILE = b"covey bench: a small file in a home\n" * 3  # 108 bytes
CHUNK = 1024 * 1024
MIB = 1024 * 1024
RSS_POLL = 0.1
TRANSFER_TIMEOUT = httpx.Timeout(600.0, connect=5.0)

# Targets
LIST_P50_MS = 300.0
SUMMARY_P50_MS = 100.0
TRANSFER_SHARE = 0.5  # of cp's throughput
RSS_GROWTH_MIB = 64.0


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    samples: int  # listings and summaries, each
    warmup: int  # untimed, before them
    rounds: int  # of cp, download, cp, upload
    size: int  # bytes of the file transferred
    time_limit: int  # seconds for the whole run

    @classmethod
    def make(cls, quick: bool) -> "Plan":
        if quick:
            return cls(samples=10, warmup=2, rounds=3, size=256 * MIB, time_limit=600)
        return cls(samples=30, warmup=3, rounds=3, size=1024 * MIB, time_limit=900)


# --------------------------------------------------------------------------------------------
# covey: database, control planes, runners
# --------------------------------------------------------------------------------------------


@dataclass
class Stack(support.Stack):
    """One broker's control plane and runner, and what the database holds for it."""

    lister: int = 0  # the agent whose home has 10,000 files in big/
    carrier: int = 0  # the agent whose home the transfers go from and to
    hoarder: int = 0  # the agent whose home has 100,000 files
    control_plane: Any = None  # subprocess.Popen: gunicorn's master
    runner: Any = None  # subprocess.Popen: manage.py runner

    @property
    def short(self) -> str:
        return "fs" if self.broker == "filesystem" else self.broker

    def home(self, work: Path, agent: int) -> Path:
        """Where the runner keeps the agent's home (runners/host/runner.py)."""
        return work / "homes" / str(self.runner_id) / str(agent)

    def spool(self, work: Path) -> Path:
        return work / f"spool-{self.broker}"


def prepare_database(var_dir: Path, stacks: Sequence[Stack]) -> str:
    """Migrate the SQLite database; a superuser and its API token (returned), and for each
    stack an organisation, a registered runner and three agents whose home is on it."""
    django_here(django_env(var_dir), var_dir)
    from django.db import connections

    from agents import services
    from agents.models import Agent

    token = superuser_token()
    for stack in stacks:
        organisation, runner = stack.register()
        stack.lister, stack.carrier, stack.hoarder = (
            services.create_agent(organisation, name, runtime_command=["true"]).pk
            for name in ("lister", "carrier", "hoarder")
        )
        Agent.objects.filter(pk__in=[stack.lister, stack.carrier, stack.hoarder]).update(
            home_runner=runner
        )
    connections.close_all()
    return token


def start_control_plane(
    processes: Processes, env: dict[str, str], stack: Stack, work: Path
) -> None:
    name, what = f"control-plane-{stack.broker}", f"the {stack.broker} control plane listening"
    env = {**env, "COVEY_HOME_SPOOL": str(stack.spool(work))}
    stack.control_plane = start_gunicorn(processes, env, name, stack.port, GUNICORN_WORKERS, what)


def start_runner(processes: Processes, env: dict[str, str], stack: Stack, work: Path) -> None:
    """``manage.py runner`` for the stack's runner, with no database settings at all."""
    stack.runner = support.start_runner(
        processes,
        env,
        stack.runner_name,
        stack.identity,
        work,
        heartbeat_seconds=HEARTBEAT_SECONDS,
        what=f"the {stack.broker} runner taking orders",
    )


def api_client(stack: Stack, token: str) -> httpx.Client:
    return support.api_client(stack.url, token, httpx.Timeout(60.0, connect=5.0))


def home_api(agent: int, endpoint: str = "") -> str:
    return f"/api/v1/agents/{agent}/home/{endpoint}"


def wait_online(api: httpx.Client, stack: Stack) -> None:
    """Until the summary says the runner holding the homes is online (its first heartbeat)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        response = api.get(home_api(stack.lister))
        if response.status_code == 200 and response.json()["runner_online"]:
            return
        time.sleep(0.2)
    raise BenchError(f"runner {stack.runner_name} not online after 30 s")


# --------------------------------------------------------------------------------------------
# Files on disk
# --------------------------------------------------------------------------------------------


def make_small_files(directory: Path, count: int, per_directory: int | None = None) -> None:
    """``count`` small files in ``directory`` (or in subdirectories of ``per_directory``)."""
    directory.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    folder = directory
    for n in range(count):
        if per_directory and n % per_directory == 0:
            folder = directory / f"d{n // per_directory:03d}"
            folder.mkdir()
        fd = os.open(folder / f"f{n:06d}.txt", flags, 0o644)
        try:
            os.write(fd, SMALL_FILE)
        finally:
            os.close(fd)


def make_random_file(path: Path, size: int) -> str:
    """A file of ``size`` random bytes; its sha256."""
    digest = hashlib.sha256()
    with path.open("xb") as file:
        left = size
        while left > 0:
            data = os.urandom(min(CHUNK, left))
            digest.update(data)
            file.write(data)
            left -= len(data)
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while data := file.read(CHUNK):
            digest.update(data)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


@dataclass
class Timings:
    ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def p(self, q: float) -> float | None:
        return percentile(self.ms, q) if self.ms else None


def timed_get(
    api: httpx.Client,
    path: str,
    params: dict[str, str | int],
    check: Callable[[dict[str, Any]], str],
    into: Timings,
) -> None:
    """One GET: ms from before the request to the parsed JSON, or the reason it failed.
    ``check`` says what is wrong with an answer ('' when nothing)."""
    started = time.perf_counter()
    try:
        response = api.get(path, params=params)
        body = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        into.errors[f"{type(exc).__name__}: {str(exc)[:100]}"] += 1
        return
    elapsed = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        into.errors[f"{response.status_code}: {str(body)[:100]}"] += 1
    elif wrong := check(body):
        into.errors[wrong] += 1
    else:
        into.ms.append(elapsed)


def timed_local(doing: Callable[[], object], into: Timings) -> None:
    started = time.perf_counter()
    doing()
    into.ms.append((time.perf_counter() - started) * 1000)


def interleaved(
    plan: Plan,
    measured: Callable[[Timings], None],
    floor: Callable[[Timings], None],
    into: tuple[Timings, Timings],
) -> None:
    """Warm both up (untimed), then N samples of each, one after the other."""
    for _ in range(plan.warmup):
        measured(Timings())
        floor(Timings())
    for _ in range(plan.samples):
        floor(into[1])
        measured(into[0])


@dataclass
class Process:
    role: str
    pid: int
    before: int | None = None  # RSS just before the transfers (bytes)
    peak: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds in downloads, uploads

    @property
    def growth_mib(self) -> float | None:
        return None if self.before is None else (self.peak - self.before) / MIB


def child_role(role: str, child: psutil.Process) -> str:
    if role == "gunicorn master":
        return "gunicorn worker"
    return f"{role}'s child {child.name()}"


class Watch:
    """The RSS of every process in the trees of the given roots (role: pid), every RSS_POLL s
    on a thread: for each process (children found as they come), its RSS before the start and
    its peak; and the CPU time each spends in what :meth:`cpu` is asked to count."""

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = roots
        self.seen: dict[int, Process] = {}
        self.samples = 0
        self._handles: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-rss", daemon=True)

    def _sample(self, first: bool) -> None:
        with self._lock:
            for role, pid in self.roots.items():
                try:
                    root = psutil.Process(pid)
                    tree = [(role, root)] + [
                        (child_role(role, child), child) for child in root.children(recursive=True)
                    ]
                except psutil.Error:
                    continue
                for name, process in tree:
                    try:
                        rss = process.memory_info().rss
                    except psutil.Error:
                        continue
                    seen = self.seen.setdefault(process.pid, Process(name, process.pid))
                    self._handles.setdefault(process.pid, process)
                    if first:
                        seen.before = rss
                    seen.peak = max(seen.peak, rss)
            self.samples += 1

    def _cpu(self) -> dict[int, float]:
        times = {}
        with self._lock:
            for pid, process in self._handles.items():
                with contextlib.suppress(psutil.Error):
                    used = process.cpu_times()
                    times[pid] = used.user + used.system
        return times

    @contextlib.contextmanager
    def cpu(self, kind: str) -> Iterator[None]:
        """Count the CPU time each process uses meanwhile as spent in ``kind``."""
        self._sample(first=False)  # a child that came since is counted from now
        before = self._cpu()
        try:
            yield
        finally:
            for pid, seconds in self._cpu().items():
                process = self.seen[pid]
                used = seconds - before.get(pid, seconds)
                process.cpu[kind] = process.cpu.get(kind, 0.0) + used

    def _watch(self) -> None:
        while not self._stop.wait(RSS_POLL):
            self._sample(first=False)

    def __enter__(self) -> "Watch":
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample(first=False)


@dataclass
class Transfers:
    """Seconds of each copy and transfer. Between the disks (the target's sense): from a
    source out of the page cache (dropped before each) to a file synced to disk; in memory:
    from the page cache to the page cache. ``cold``: whether the page cache could be dropped."""

    cold: bool = True
    cp_disk: list[float] = field(default_factory=list)  # cp, then sync FILE
    download_disk: list[float] = field(default_factory=list)  # curl, then sync FILE
    upload_disk: list[float] = field(default_factory=list)  # curl (the runner fsyncs)
    cp: list[float] = field(default_factory=list)
    download: list[float] = field(default_factory=list)
    upload: list[float] = field(default_factory=list)
    relay: list[float] = field(default_factory=list)  # the floor of two hops, in memory
    intact: int = 0
    corrupt: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    processes: list[Process] = field(default_factory=list)
    rss_samples: int = 0

    def transfers(self) -> int:
        return sum(
            len(x) for x in (self.download_disk, self.upload_disk, self.download, self.upload)
        )


CURL = shutil.which("curl") or "/usr/bin/curl"
SYNC = shutil.which("sync") or "/bin/sync"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_caches() -> bool:
    """Write everything to disk and empty the page cache (root only): the next read of any
    file comes from the disk. False when not allowed."""
    os.sync()
    try:
        with DROP_CACHES.open("w") as file:
            file.write("3\n")
    except OSError:
        return False
    return True


def warm(path: Path) -> None:
    """Read the file into the page cache (untimed), then let the disk settle."""
    with path.open("rb", buffering=0) as file:
        while file.read(8 * CHUNK):
            pass
    os.sync()


def timed(command: list[str], then_sync: Path | None = None) -> float:
    """Seconds a command takes, and a ``sync FILE`` of what it wrote when asked."""
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=600)  # noqa: S603
    if then_sync is not None:
        subprocess.run([SYNC, str(then_sync)], check=True, timeout=600)  # noqa: S603
    return time.perf_counter() - started


def copy(source: Path, target: Path, *, sync: bool) -> float:
    """``cp`` (then ``sync FILE`` when ``sync``): its seconds."""
    return timed(
        [shutil.which("cp") or "/bin/cp", str(source), str(target)], target if sync else None
    )


def download(
    stack: Stack, headers: Path, agent: int, path: str, target: Path, *, sync: bool
) -> float:
    """``curl`` a file of the home into ``target`` (then ``sync FILE`` when ``sync``): seconds
    from its start to its end."""
    url = f"{stack.url}{home_api(agent, 'download/')}?path={path}"
    return timed(
        [CURL, "-sSf", "-H", f"@{headers}", "-o", str(target), url], target if sync else None
    )


def upload(stack: Stack, headers: Path, agent: int, source: Path, path: str, size: int) -> float:
    """``curl -T`` a file into the home (streamed, with its length): seconds from its start to
    the answer (the runner has written, fsynced and renamed the file)."""
    answer = source.with_name("answer.json")
    command = [
        CURL, "-sSf", "-H", f"@{headers}", "-H", "Content-Type: application/octet-stream",
        "-T", str(source), "-o", str(answer),
        "--request-target", f"{home_api(agent, 'file/')}?path={path}", f"{stack.url}/",
    ]  # fmt: skip
    seconds = timed(command)
    said = json.loads(answer.read_text())
    if said.get("size") != size:
        raise BenchError(f"upload answered a size of {said.get('size')}, not {size}")
    return seconds


def relay(source: Path, spool: Path, target: Path, size: int) -> float:
    """The floor of a transfer through a control plane: two loopback hops through a spool
    file, with no HTTP and no Python per chunk beyond a system call (the source by sendfile
    into the first connection; received into the spool; sendfile from the spool into the
    second as it grows; received into the target), on threads of this process."""
    import socket

    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    grown = threading.Condition()
    have = [0, 0]  # bytes in the spool, and whether the first hop has ended

    def runner() -> None:
        with socket.create_connection(listeners[0].getsockname()) as sock, source.open("rb") as f:
            sock.sendfile(f)

    def middle(first: socket.socket, second: socket.socket) -> None:
        buffer = bytearray(CHUNK)
        # Written and read through files of their own: sendfile moves its file's position.
        with spool.open("wb", buffering=0) as written, spool.open("rb", buffering=0) as file:

            def receive() -> None:
                while n := first.recv_into(buffer):
                    written.write(memoryview(buffer)[:n])
                    with grown:
                        have[0] += n
                        grown.notify()
                with grown:
                    have[1] = 1
                    grown.notify()

            receiver = threading.Thread(target=receive)
            receiver.start()
            sent = 0
            while True:
                with grown:
                    while have[0] == sent and not have[1]:
                        grown.wait()
                    upto, ended = have[0], have[1]
                if upto > sent:
                    sent += second.sendfile(file, sent, upto - sent)
                elif ended:
                    break
            receiver.join()
        second.close()

    def client() -> None:
        buffer = bytearray(CHUNK)
        with socket.create_connection(listeners[1].getsockname()) as sock, target.open("wb") as f:
            while n := sock.recv_into(buffer):
                f.write(memoryview(buffer)[:n])

    started = time.perf_counter()
    threads = [threading.Thread(target=runner), threading.Thread(target=client)]
    for thread in threads:
        thread.start()
    first, _ = listeners[0].accept()
    second, _ = listeners[1].accept()
    middle(first, second)
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    first.close()
    for listener in listeners:
        listener.close()
    spool.unlink()
    if target.stat().st_size != size:
        raise BenchError(f"the relay moved {target.stat().st_size} bytes of {size}")
    return seconds


def measure_transfers(
    stack: Stack, work: Path, source: Path, digest: str, plan: Plan, token: str
) -> Transfers:
    """Rounds of cp, download, cp, upload of ``plan.size`` bytes between the disks, then the
    same in memory, then the floor, with the RSS and CPU of every covey process watched."""
    result = Transfers()
    home = stack.home(work, stack.carrier)
    client = work / "client"
    headers = client / "headers"
    headers.write_text(f"Authorization: Token {token}\n")  # not on curl's command line
    headers.chmod(0o600)
    shutil.copyfile(source, home / "big.bin")  # the file to download, in the home
    os.sync()  # what came before is on disk: the first round starts on a quiet disk
    roots = {"gunicorn master": stack.control_plane.pid, "runner": stack.runner.pid}

    def attempt(what: str, doing: Callable[[], None]) -> None:
        try:
            doing()
        except (BenchError, OSError, ValueError, subprocess.SubprocessError) as exc:
            result.errors[f"{what}: {type(exc).__name__}: {str(exc)[:100]}"] += 1

    def check(what: str, path: Path) -> None:
        if sha256_of(path) == digest:
            result.intact += 1
        else:
            result.corrupt.append(what)

    def ready(before: Path, disk: bool) -> None:
        """Each measure starts from the disk (between the disks) or the page cache."""
        if disk:
            result.cold = drop_caches() and result.cold
        else:
            warm(before)

    def cp_once(source: Path, target: Path, disk: bool) -> None:
        ready(source, disk)
        try:
            (result.cp_disk if disk else result.cp).append(copy(source, target, sync=disk))
        finally:
            target.unlink(missing_ok=True)

    def download_once(n: int, disk: bool) -> None:
        target = client / "down.bin"
        ready(home / "big.bin", disk)
        try:
            seconds = download(stack, headers, stack.carrier, "big.bin", target, sync=disk)
            (result.download_disk if disk else result.download).append(seconds)
            check(f"download {n}", target)
        finally:
            target.unlink(missing_ok=True)

    def upload_once(n: int, disk: bool) -> None:
        name = f"up-{n}.bin"
        ready(source, disk)
        seconds = upload(stack, headers, stack.carrier, source, name, plan.size)
        (result.upload_disk if disk else result.upload).append(seconds)
        check(f"upload {n}", home / name)
        (home / name).unlink()  # as a delete through the API would (timed elsewhere: no)

    def relay_once() -> None:
        warm(home / "big.bin")
        target = client / "relayed.bin"
        try:
            result.relay.append(relay(home / "big.bin", client / "relay.spool", target, plan.size))
        finally:
            target.unlink(missing_ok=True)

    with Watch(roots) as watch:
        for n in range(1, plan.rounds + 1):
            for disk in (True, False):
                attempt("cp", lambda: cp_once(home / "big.bin", client / "cp.bin", disk))  # noqa: B023
                with watch.cpu("download"):
                    attempt("download", lambda: download_once(n, disk))  # noqa: B023
                attempt("cp", lambda: cp_once(source, home / "cp.bin", disk))  # noqa: B023
                with watch.cpu("upload"):
                    attempt("upload", lambda: upload_once(n, disk))  # noqa: B023
            attempt("relay", relay_once)
            print(
                f"  round {n}/{plan.rounds}, MiB/s between the disks: cp "
                f"{mib_s(plan.size, result.cp_disk[-2:])}, download "
                f"{mib_s(plan.size, result.download_disk[-1:])}, upload "
                f"{mib_s(plan.size, result.upload_disk[-1:])}; in memory: cp "
                f"{mib_s(plan.size, result.cp[-2:])}, download "
                f"{mib_s(plan.size, result.download[-1:])}, upload "
                f"{mib_s(plan.size, result.upload[-1:])}, the floor "
                f"{mib_s(plan.size, result.relay[-1:])}",
                flush=True,
            )
    result.processes = sorted(watch.seen.values(), key=lambda p: (p.role, p.pid))
    result.rss_samples = watch.samples
    return result


def mib_s(size: int, seconds: Sequence[float]) -> str:
    return "-" if not seconds else f"{size / MIB / statistics.median(seconds):.0f}"


@dataclass
class Usage:
    walk_ms: float | None = None  # GET usage/, end to end
    runner_walk_ms: float | None = None  # the runner's own measure of its walk
    files: int | None = None
    summary: Timings = field(default_factory=Timings)
    agent: Timings = field(default_factory=Timings)  # GET /api/v1/agents/{id}/, the floor


def measure_usage(api: httpx.Client, stack: Stack, plan: Plan) -> Usage:
    result = Usage()
    started = time.perf_counter()
    response = api.get(home_api(stack.hoarder, "usage/"), timeout=TRANSFER_TIMEOUT)
    body = response.json()
    result.walk_ms = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        raise BenchError(f"GET usage/ answered {response.status_code}: {str(body)[:300]}")
    result.files, result.runner_walk_ms = body["files"], body["seconds"] * 1000
    files = USAGE_DIRECTORIES * USAGE_PER_DIRECTORY
    if result.files != files:
        raise BenchError(f"GET usage/ counted {result.files} files, not {files}")

    def said(b: dict[str, Any]) -> str:
        return "" if b["files"] == files else f"the summary said {b['files']} files"

    interleaved(
        plan,
        lambda into: timed_get(api, home_api(stack.hoarder), {}, said, into),
        lambda into: timed_get(api, f"/api/v1/agents/{stack.hoarder}/", {}, lambda b: "", into),
        (result.summary, result.agent),
    )
    return result


@dataclass
class Outcome:
    """One broker's figures."""

    listing: Timings = field(default_factory=Timings)
    listing_floor: Timings = field(default_factory=Timings)  # Home.listing in this process
    usage: Usage = field(default_factory=Usage)
    transfers: Transfers = field(default_factory=Transfers)
    log_errors: Counter[str] = field(default_factory=Counter)  # the covey processes' logs
    spool_left: int = 0
    unanswered: Counter[str] = field(default_factory=Counter)  # operations by state


def leftovers(stack: Stack, work: Path, outcome: Outcome, processes: Processes) -> None:
    """What the run left behind: exceptions logged, spool files, operations not answered."""
    for name in (f"control-plane-{stack.broker}", f"runner-{stack.broker}"):
        outcome.log_errors += exceptions_logged(processes.log(name))
    spool = stack.spool(work)
    outcome.spool_left = len(list(spool.iterdir())) if spool.exists() else 0
    from django.db import connections

    from homes.models import HomeOperation, OperationState

    rows = HomeOperation.objects.filter(runner_id=stack.runner_id).exclude(
        state=OperationState.ANSWERED
    )
    outcome.unanswered = Counter(
        f"{kind} {state}" for kind, state in rows.values_list("kind", "state")
    )
    connections.close_all()


def measure(
    stack: Stack,
    token: str,
    work: Path,
    source: Path,
    digest: str,
    plan: Plan,
    outcome: Outcome,
) -> None:
    with api_client(stack, token) as api:
        wait_online(api, stack)
        step(f"{stack.broker}: making {LISTED_FILES:,} files in the lister's big/ on disk")
        make_small_files(stack.home(work, stack.lister) / "big", LISTED_FILES)
        os.sync()  # on disk before the listing is timed
        step(f"{stack.broker}: 1. listing big/ (limit {LIST_LIMIT}), {plan.samples} times")
        home = Home(stack.home(work, stack.lister))

        def listed(b: dict[str, Any]) -> str:
            if b["total"] == LISTED_FILES and len(b["entries"]) == LIST_LIMIT:
                return ""
            return f"the listing had {b['total']} in all, {len(b['entries'])} listed"

        interleaved(
            plan,
            lambda into: timed_get(
                api,
                home_api(stack.lister, "entries/"),
                {"path": "big", "limit": LIST_LIMIT},
                listed,
                into,
            ),
            lambda into: timed_local(lambda: home.listing("big", limit=LIST_LIMIT), into),
            (outcome.listing, outcome.listing_floor),
        )
        total = USAGE_DIRECTORIES * USAGE_PER_DIRECTORY
        step(f"{stack.broker}: making {total:,} files in the hoarder's home on disk")
        make_small_files(stack.home(work, stack.hoarder), total, USAGE_PER_DIRECTORY)
        os.sync()
        step(f"{stack.broker}: 4. the usage walk, then the summary {plan.samples} times")
        outcome.usage = measure_usage(api, stack, plan)
        step(
            f"{stack.broker}: 2-3. {plan.rounds} rounds of cp, download, cp, upload of "
            f"{plan.size // MIB} MiB, RSS watched"
        )
        (stack.home(work, stack.carrier)).mkdir(parents=True, exist_ok=True)
        outcome.transfers = measure_transfers(stack, work, source, digest, plan, token)


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass
class Results:
    quick: bool = False
    brokers: tuple[str, ...] = BROKERS
    size: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    load: float | None = None
    outcomes: dict[str, Outcome] = field(default_factory=dict)


def throughput(size: int, seconds: Sequence[float]) -> float | None:
    return None if not seconds else size / MIB / statistics.median(seconds)


COLUMN = {"filesystem": "covey fs", "redis": "covey redis"}


def report(results: Results) -> str:
    out: list[str] = []
    add = out.append
    outcomes = results.outcomes
    brokers = [b for b in results.brokers if b in outcomes]
    size_mib = results.size // MIB
    add("")
    add("=" * 100)
    add(
        "covey homes from outside: listing, transfers vs cp, memory, kept usage; one remote "
        "runner" + (" (--quick)" if results.quick else "")
    )
    for key, value in results.versions.items():
        add(f"  {key:<14} {value}")
    if results.load is not None:
        add(f"  {'machine':<14} {os.cpu_count()} cores, load average {results.load:.2f} at start")
    add("")
    head = f"{'metric':<58}" + "".join(f"{COLUMN[b]:>14}" for b in brokers)
    add(head)
    add("-" * len(head))

    def row(label: str, cell: Callable[[Outcome], str]) -> None:
        add(f"{label:<58}" + "".join(f"{cell(outcomes[b]):>14}" for b in brokers))

    def counts(values: Callable[[Outcome], Sequence[object]]) -> str:
        return "/".join(str(len(values(outcomes[b]))) for b in brokers)

    listed = counts(lambda o: o.listing.ms)
    row(
        f"list {LISTED_FILES:,} files, limit {LIST_LIMIT}: p50 (ms, n={listed})",
        lambda o: fmt(o.listing.p(50)),
    )
    row("  p95 (ms)", lambda o: fmt(o.listing.p(95)))
    row(
        f"  floor: Home.listing here, p50 (ms, n={counts(lambda o: o.listing_floor.ms)})",
        lambda o: fmt(o.listing_floor.p(50)),
    )
    row("  floor p95 (ms)", lambda o: fmt(o.listing_floor.p(95)))
    row("  p50 / the floor's", lambda o: ratio(o.listing.p(50), o.listing_floor.p(50)))
    files = USAGE_DIRECTORIES * USAGE_PER_DIRECTORY
    row(f"usage walk of {files:,} files, GET usage/ (ms)", lambda o: fmt(o.usage.walk_ms))
    row("  the runner's walk, as it measured it (ms)", lambda o: fmt(o.usage.runner_walk_ms))
    row(
        f"summary GET home/ (kept figure): p50 (ms, n={counts(lambda o: o.usage.summary.ms)})",
        lambda o: fmt(o.usage.summary.p(50), 1),
    )
    row("  p95 (ms)", lambda o: fmt(o.usage.summary.p(95), 1))
    row(
        f"  floor: GET /api/v1/agents/{{id}}/, p50 (ms, n={counts(lambda o: o.usage.agent.ms)})",
        lambda o: fmt(o.usage.agent.p(50), 1),
    )
    row("  floor p95 (ms)", lambda o: fmt(o.usage.agent.p(95), 1))
    row("  p50 / the floor's", lambda o: ratio(o.usage.summary.p(50), o.usage.agent.p(50)))

    def rate(o: Outcome, kind: str) -> float | None:
        return throughput(results.size, getattr(o.transfers, kind))

    def extremes(o: Outcome, kind: str) -> str:
        seconds: list[float] = getattr(o.transfers, kind)
        return f"{max(seconds):.2f}, {min(seconds):.2f}" if seconds else "-"

    for place, suffix, note in (
        ("between the disks", "_disk", "from the disk (page cache dropped), then synced"),
        ("in memory", "", "from the page cache, not synced"),
    ):
        cp_kind = f"cp{suffix}"
        add(f"{place}: {note}")
        row(
            f"  cp {size_mib} MiB, median (MiB/s, n={counts(partial(kind_of, cp_kind))})",
            partial(cell_speed, rate, cp_kind),
        )
        row("    slowest, fastest (s)", partial(extremes, kind=cp_kind))
        kinds = [f"download{suffix}", f"upload{suffix}"] + ([] if suffix else ["relay"])
        for kind in kinds:
            taken = counts(partial(kind_of, kind))
            what = KIND_LABEL[kind.removesuffix("_disk")]
            row(f"  {what}, median (MiB/s, n={taken})", partial(cell_speed, rate, kind))
            row("    / cp", partial(cell_ratio, rate, kind, cp_kind))
            row("    slowest, fastest (s)", partial(extremes, kind=kind))
    if any(not outcomes[b].transfers.cold for b in brokers):
        add("  (the page cache could not be dropped (not root?): 'between the disks' was read")
        add("  from memory, and its targets are not judged)")
    row(
        "transfers intact (sha256 of both ends)",
        lambda o: f"{o.transfers.intact}/{o.transfers.transfers()}",
    )
    row(
        "requests failed (listing, summary, transfers)",
        lambda o: str(
            sum(o.listing.errors.values())
            + sum(o.usage.summary.errors.values())
            + sum(o.transfers.errors.values())
        ),
    )
    row("exceptions in the covey processes' logs", lambda o: str(sum(o.log_errors.values())))
    row("files left in the spool", lambda o: str(o.spool_left))
    row("home operations not answered", lambda o: str(sum(o.unanswered.values())))

    add("")
    add(
        "each covey process during the transfers: RSS growth (peak minus just before, MiB), "
        "and CPU seconds per GiB moved"
    )
    phead = (
        f"  {'process':<34}{'RSS growth':>11}{'before -> peak':>18}{'CPU down':>10}{'CPU up':>10}"
    )
    for broker in brokers:
        t = outcomes[broker].transfers
        add(f"{COLUMN[broker]} ({t.rss_samples} samples, every {RSS_POLL} s)")
        add(phead)
        gib = {
            kind: (len(getattr(t, kind)) + len(getattr(t, f"{kind}_disk")))
            * results.size
            / (1024 * MIB)
            for kind in ("download", "upload")
        }
        for process in t.processes:
            before = "-" if process.before is None else f"{process.before / MIB:.1f}"
            cpu = {
                kind: fmt(process.cpu[kind] / gib[kind], 2)
                if gib[kind] and kind in process.cpu
                else "-"
                for kind in gib
            }
            who, rss = f"{process.role} {process.pid}", f"{before} -> {process.peak / MIB:.1f}"
            add(
                f"  {who:<34}{signed(process.growth_mib, 1):>11}{rss:>18}"
                f"{cpu['download']:>10}{cpu['upload']:>10}"
            )

    add("")
    add("targets")

    def target(name: str, figures: str, ok: bool | None) -> None:
        add(f"  {name:<56}{figures:<36}{verdict(ok)}")

    for broker in brokers:
        o = outcomes[broker]
        column = COLUMN[broker]
        p50 = o.listing.p(50)
        target(
            f"list {LISTED_FILES:,}: p50 < {LIST_P50_MS:.0f} ms ({column})",
            f"{fmt(p50)} ms",
            None if p50 is None else p50 < LIST_P50_MS,
        )
        cp = throughput(results.size, o.transfers.cp_disk)
        for kind in ("download", "upload"):
            speed = throughput(results.size, getattr(o.transfers, f"{kind}_disk"))
            ok = None
            if speed is not None and cp is not None and o.transfers.cold:
                ok = speed >= TRANSFER_SHARE * cp
            target(
                f"{kind} >= {TRANSFER_SHARE:.0%} of cp, between the disks ({column})",
                f"{fmt(speed)} vs {fmt(cp)} MiB/s: {ratio(speed, cp)}",
                ok,
            )
        intact = o.transfers.intact == o.transfers.transfers()
        target(
            f"transfers intact ({column})",
            f"{o.transfers.intact} intact, {len(o.transfers.corrupt)} not",
            intact and not o.transfers.corrupt and bool(o.transfers.intact),
        )
        growths = [g for p in o.transfers.processes if (g := p.growth_mib) is not None]
        worst = max(growths) if growths else None
        target(
            f"RSS growth < {RSS_GROWTH_MIB:.0f} MiB, every process ({column})",
            f"at most {fmt(worst, 1)} MiB",
            None if worst is None else worst < RSS_GROWTH_MIB,
        )
        p50 = o.usage.summary.p(50)
        target(
            f"summary of {files:,} files: p50 < {SUMMARY_P50_MS:.0f} ms ({column})",
            f"{fmt(p50, 1)} ms",
            None if p50 is None else p50 < SUMMARY_P50_MS,
        )
    for broker in brokers:
        o = outcomes[broker]
        problems: Counter[str] = Counter()
        for where, errors in (
            ("listing", o.listing.errors),
            ("summary", o.usage.summary.errors),
            ("transfers", o.transfers.errors),
            ("log", o.log_errors),
        ):
            for error, n in errors.items():
                problems[f"{where}: {error}"] += n
        for state, n in o.unanswered.items():
            problems[f"operation left {state}"] += n
        for what in o.transfers.corrupt:
            problems[f"{what}: sha256 differs"] += 1
        for problem, n in problems.most_common(8):
            add(f"  {COLUMN[broker]}: {n} x {problem}")
    add("=" * 100)
    return "\n".join(out)


KIND_LABEL = {
    "download": "download (curl)",
    "upload": "upload (curl -T; the runner writes, fsyncs, renames)",
    "relay": "floor: two hops through a spool, no HTTP",
}


def kind_of(kind: str, o: Outcome) -> Sequence[object]:
    seconds: list[float] = getattr(o.transfers, kind)
    return seconds


def cell_speed(speed: Callable[[Outcome, str], float | None], kind: str, o: Outcome) -> str:
    return fmt(speed(o, kind))


def cell_ratio(
    speed: Callable[[Outcome, str], float | None], kind: str, floor: str, o: Outcome
) -> str:
    return ratio(speed(o, kind), speed(o, floor))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def gunicorn_threads() -> str:
    """What gunicorn.conf.py says of its workers (the file the control plane reads)."""
    try:
        text = (ROOT / "gunicorn.conf.py").read_text()
    except OSError:
        return "?"
    kind = re.search(r"^worker_class\s*=\s*[\"'](\w+)[\"']", text, re.MULTILINE)
    threads = re.search(r"^threads\s*=\s*(\d+)", text, re.MULTILINE)
    return f"{kind.group(1) if kind else 'sync'}, {threads.group(1) if threads else 1} threads"


def curl_version() -> str:
    try:
        said = subprocess.run(  # noqa: S603 - curl with our own arguments
            [CURL, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "curl ?"
    return " ".join(said.split()[:2])


def code_version() -> str:
    """The commit measured, and how many tracked files differ from it."""
    git = shutil.which("git")
    if git is None:
        return "?"
    try:
        head = subprocess.run(  # noqa: S603 - git with our own arguments
            [git, "log", "-1", "--format=%h %cd", "--date=format:%Y-%m-%d %H:%M"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(  # noqa: S603 - git with our own arguments
            [git, "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return f"{head}" + (f", {len(changed)} tracked file(s) changed since" if changed else "")


def run(
    plan: Plan,
    results: Results,
    work: Path,
    processes: Processes,
    stack: contextlib.ExitStack,
) -> None:
    results.load = os.getloadavg()[0]
    step(f"working in {work}; load average {results.load:.2f} on {os.cpu_count()} cores")
    needed = plan.size * 6  # the source, its copy in the home, one transfer, the spool, slack
    free = shutil.disk_usage(work).free
    if free < needed:
        raise BenchError(f"{free // MIB} MiB free in {work}: the bench needs {needed // MIB}")
    stacks = [Stack(broker, free_port()) for broker in results.brokers]

    step("migrating a SQLite database; organisations, runners and agents")
    var_dir = work / "var"
    token = prepare_database(var_dir, stacks)
    env = django_env(var_dir)
    redis_port, redis_version = None, "-"
    if "redis" in results.brokers:
        redis_port, redis_version = start_redis(processes, work)
        step(f"redis-server {redis_version} on 127.0.0.1:{redis_port}")
    for each in stacks:
        own = broker_env(env, each.broker, redis_port)
        start_control_plane(processes, own, each, work)
        start_runner(processes, own, each, work)
        step(f"{each.broker}: control plane on {each.url}, runner {each.runner_name} ready")

    from importlib.metadata import version

    results.versions = {
        "code": code_version(),
        "python": platform.python_version(),
        "control plane": f"gunicorn {version('gunicorn')}, {GUNICORN_WORKERS} workers, "
        f"gunicorn.conf.py's threads ({gunicorn_threads()}), Django {version('django')}, SQLite",
        "runner": f"manage.py runner, Celery {version('celery')} (threads), "
        f"heartbeat {HEARTBEAT_SECONDS} s",
        "brokers": "filesystem (kombu's file-system transport, polled every 50 ms)"
        + (f"; redis (redis-server {redis_version}, loopback)" if redis_port else ""),
        "client": f"httpx {version('httpx')}, one keep-alive connection per broker; transfers:"
        f" {curl_version()}",
        "disk": f"{work} ({free // (1024 * MIB)} GiB free at start), one filesystem for all",
    }

    client = work / "client"
    client.mkdir()
    source = client / "up.bin"
    step(f"writing {plan.size // MIB} MiB of random bytes to {source}")
    digest = make_random_file(source, plan.size)
    for each in stacks:
        outcome = results.outcomes.setdefault(each.broker, Outcome())
        try:
            measure(each, token, work, source, digest, plan, outcome)
        finally:
            leftovers(each, work, outcome, processes)
        shutil.rmtree(work / "homes" / str(each.runner_id), ignore_errors=True)  # its disk back
    step("done; stopping everything")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument(
        "--quick", action="store_true", help="256 MiB transfers, 10 samples (a smoke run)"
    )
    parser.add_argument(
        "--broker",
        choices=(*BROKERS, "both"),
        default="both",
        help="the Celery broker(s) to measure covey with (default: both)",
    )
    args = parser.parse_args(argv)
    plan = Plan.make(args.quick)
    results = Results(
        quick=args.quick,
        brokers=BROKERS if args.broker == "both" else (args.broker,),
        size=plan.size,
    )
    failed = run_bench(
        "covey-bench-homes-",
        plan.time_limit,
        lambda work, processes, stack: run(plan, results, work, processes, stack),
    )
    print(report(results), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
