"""What the benches share: their own processes (started in sessions of their own and stopped
by pid), the environment of the covey processes they start, starting a control plane and a
runner, polling, a time limit for the whole run, and the figures' arithmetic and format."""

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# Settings from the caller's shell that the benches' own covey processes must not inherit.
OTHER_SETTINGS = ("COVEY_", "DJANGO_", "DATABASE_", "CELERY_")


class BenchError(Exception):
    """Something the benchmark needs did not work."""


class BenchStop(SystemExit):
    """The run must stop now: its time is up, or SIGTERM. A SystemExit, so that no handler on
    the way swallows it: socket errors (TimeoutError is an OSError) are counted, and asyncio
    keeps other exceptions raised in its callbacks and tasks."""


class Processes:
    """Every process this run starts; ``stop_all`` stops them by pid (and their own group)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(  # noqa: S603 - our own fixed command lines
                list(args),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(process)
        return process

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        for process in reversed(self.started):
            stop_process(process)


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process, SIGKILL it after 20 s; then its descendants still left over."""
    # Each process runs in a session of its own, so its group id is its pid: a leftover still
    # in that group is one of ours (a recycled pid would not be).
    members = process_tree(process.pid)[1:] if process.poll() is None else []
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(5)
    for member in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(member) == process.pid:
                os.kill(member, signal.SIGKILL)


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, log: Callable[[], str]
) -> None:
    """Poll condition() every 0.1 s; fail with the end of log() when it stays false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise BenchError(f"{what} did not happen within {timeout:.0f} s\n{log()[-3000:]}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def alive(process: subprocess.Popen[bytes], name: str, processes: Processes) -> bool:
    if process.poll() is not None:
        raise BenchError(f"{name} exited with {process.returncode}\n{processes.log(name)[-3000:]}")
    return True


def wait_listening(
    processes: Processes,
    process: subprocess.Popen[bytes],
    name: str,
    port: int,
    what: str,
    timeout: float = 60,
) -> None:
    """Wait until ``process`` (started as ``name``) accepts connections on loopback ``port``;
    fail with the end of its log if it exits or does not within ``timeout``."""
    wait_until(
        lambda: alive(process, name, processes) and accepts(port),
        timeout,
        what,
        lambda: processes.log(name),
    )


def percentile(values: Sequence[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def step(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise BenchStop in the main thread after ``seconds``, or on SIGTERM."""

    def expire(signum: int, frame: FrameType | None) -> None:
        raise BenchStop(f"the benchmark ran over its {seconds} s limit")

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise BenchStop(f"stopped by signal {signum}")

    previous = signal.signal(signal.SIGALRM, expire), signal.signal(signal.SIGTERM, terminate)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT MET")


def run_bench(
    prefix: str, limit: int, body: Callable[[Path, Processes, contextlib.ExitStack], None]
) -> bool:
    """Run ``body`` in a temporary folder of its own (mode 0711: other users' processes, such as
    Squid's or a sandbox's, must reach into it) within ``limit`` seconds, then stop every process
    it started and remove the folder. Returns whether it failed (it says why on stderr)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    work.chmod(0o711)
    try:
        # The alarm ends before the clean-up starts; each clean-up step is bounded itself.
        with contextlib.ExitStack() as stack, time_limit(limit):
            stack.callback(shutil.rmtree, work, ignore_errors=True)
            processes = Processes(work)
            stack.callback(processes.stop_all)
            body(work, processes, stack)
    except BenchStop as exc:
        print(f"benchmark stopped: {exc}", file=sys.stderr, flush=True)
        return True
    except Exception:
        traceback.print_exc()
        print("benchmark failed; figures below are what was measured", file=sys.stderr)
        return True
    return False


def django_here(env: dict[str, str], var_dir: Path) -> None:
    """Set up Django in this process with the settings of the bench's covey processes
    (``env``), after their secret key and broker folders are made in ``var_dir``."""
    for key in [k for k in os.environ if k.startswith(OTHER_SETTINGS)]:
        del os.environ[key]  # this process's Django must read the same settings
    os.environ.update(env)
    from covey import var

    var.prepare(var_dir)  # its secret key and broker folders, before any process reads them
    import django

    django.setup()


def start_redis(processes: Processes, work: Path) -> tuple[int, str]:
    """A redis-server of the bench's own on a loopback port, no persistence; its port and
    version."""
    binary = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin")
    if binary is None:
        raise BenchError("redis-server is not installed (apt-get install redis-server)")
    directory = work / "redis"
    directory.mkdir()
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    args += ["no", "--dir", str(directory), "--daemonize", "no"]
    process = processes.start("redis", args, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    wait_listening(processes, process, "redis", port, "redis-server listening", 30)
    version = subprocess.run(  # noqa: S603 - the redis-server found above
        [binary, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()
    return port, next((v[2:] for v in version if v.startswith("v=")), "?")


def covey_env(var_dir: Path, **settings: str) -> dict[str, str]:
    """The environment of a bench's covey processes: none of the caller's own covey, Django,
    database or broker settings, the bench's var folder (its SQLite database and broker
    folders unless ``settings`` say otherwise), loopback only, and ``settings``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(OTHER_SETTINGS)}
    env.update(
        COVEY_VAR_DIR=str(var_dir),
        DJANGO_ALLOWED_HOSTS="127.0.0.1",
        DJANGO_SETTINGS_MODULE="covey.settings",
        PYTHONUNBUFFERED="1",
    )
    env.update(settings)
    return env


def broker_env(env: dict[str, str], broker: str, redis_port: int | None) -> dict[str, str]:
    """``env`` for a stack on ``broker``: Redis on the bench's own server, or the filesystem
    broker (CELERY_BROKER_URL unset: filesystem:// under COVEY_VAR_DIR/broker)."""
    if broker == "redis":
        return {**env, "CELERY_BROKER_URL": f"redis://127.0.0.1:{redis_port}/0"}
    return env


def superuser_token() -> str:
    """Migrate the database this process's Django uses (:func:`django_here`) and make a
    superuser; its API token."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token

    call_command("migrate", verbosity=0, interactive=False)
    user = get_user_model().objects.create_superuser(
        "bench", "bench@example.test", secrets.token_urlsafe(24)
    )
    return str(Token.objects.create(user=user).key)


def start_gunicorn(
    processes: Processes, env: dict[str, str], name: str, port: int, workers: int, what: str
) -> subprocess.Popen[bytes]:
    """The control plane's web process (gunicorn, ``workers`` of them) on loopback ``port``,
    once it accepts connections."""
    gunicorn = str(Path(sys.executable).parent / "gunicorn")
    args = [gunicorn, "covey.wsgi", "--bind", f"127.0.0.1:{port}", "--workers", str(workers)]
    process = processes.start(name, args, env)
    wait_listening(processes, process, name, port, what, 60)
    return process


def start_runner(
    processes: Processes,
    env: dict[str, str],
    name: str,
    identity: dict[str, Any],
    work: Path,
    *,
    heartbeat_seconds: float,
    what: str,
    args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``manage.py runner`` with its ``identity`` (url, id, name, token) in a file of its own
    and no database settings at all, once it takes orders."""
    config = work / f"{name}.json"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with open(os.open(config, flags, 0o600), "w") as file:
        json.dump(identity, file)
    env = {
        **env,
        "COVEY_RUNNER_HOMES": str(work / "homes"),
        "COVEY_RUNNER_HEARTBEAT_SECONDS": str(heartbeat_seconds),
    }
    if "DATABASE_URL" in env:
        raise BenchError("the runner must run without DATABASE_URL")
    command = [sys.executable, "manage.py", "runner", "--config", str(config), *args]
    process = processes.start(name, command, env)
    wait_until(  # Celery says "ready." once it consumes its queue
        lambda: alive(process, name, processes) and " ready." in processes.log(name),
        60,
        what,
        lambda: processes.log(name),
    )
    return process


def api_client(url: str, token: str, timeout: httpx.Timeout | float) -> httpx.Client:
    """A client of covey's API at ``url`` with an API token, and no proxy of the caller's."""
    return httpx.Client(
        base_url=url, headers={"Authorization": f"Token {token}"}, timeout=timeout, trust_env=False
    )


def fmt(value: float | None, digits: int = 0) -> str:
    """A figure for the tables ('-' when there is none)."""
    return "-" if value is None else f"{value:.{digits}f}"


def signed(value: float | None, digits: int = 0) -> str:
    """A difference for the tables, with its sign ('-' when there is none)."""
    return "-" if value is None else f"{value:+.{digits}f}"


@dataclass
class Stack:
    """One broker's control plane and runner, and the runner's registration (the runs and
    homes benches bring one up a broker); each bench adds what its database holds."""

    broker: str
    port: int
    runner_id: int = 0
    runner_token: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def runner_name(self) -> str:
        return f"runner-{self.broker}"

    @property
    def identity(self) -> dict[str, Any]:
        """What its runner is told in its file (``manage.py runner --config``)."""
        return {
            "url": self.url,
            "id": self.runner_id,
            "name": self.runner_name,
            "token": self.runner_token,
        }

    def register(self) -> Any:
        """An organisation of the stack's own, and its runner registered in it (this process's
        Django: :func:`django_here`); the organisation and the runner."""
        from organisations import services as organisations
        from runners.services import create_registration_token, register_runner

        organisation = organisations.create_organisation(f"Bench {self.broker}", base_allowlist=[])
        _, secret = create_registration_token(organisation)
        runner, self.runner_token = register_runner(secret, self.runner_name, [])
        self.runner_id = runner.pk
        return organisation, runner
