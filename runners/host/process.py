"""The runner host as a process: start the host (its isolation, proxy checks, probes), its
threads and its status listener, take orders until stopped, then stop cleanly. With no Django:
``python -m runners.host`` runs it, and ``manage.py runner`` is a thin wrapper around it."""

import contextlib
import gc
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from allowlists.entries import split_host_port
from egress.environment import Isolation
from egress.proxy.config import ProxyConfig
from runners.host import status, worker
from runners.host.client import ControlPlaneError
from runners.host.config import HostSettings, builtin_dir
from runners.host.containers import isolation
from runners.host.identity import Identity
from runners.host.runner import RunnerHost
from runners.protocol import BUILTIN_QUEUE
from status import StatusServer

logger = logging.getLogger(__name__)
STOP_WAIT_SECONDS = 3.0  # at exit, for the host's threads to finish what they are doing


class HostError(Exception):
    """The runner host cannot start as asked; the message says why."""


@dataclass(frozen=True)
class Options:
    """What the command line says: the built-in runners or a remote runner's file, how many
    orders at once, and whether every sandbox goes at exit (make run's Ctrl-C)."""

    builtin: bool = False
    config: Path | None = None  # None: runner.json in the control plane's directory
    concurrency: int = 4
    remove_sandboxes_at_exit: bool = False


def check(settings: HostSettings) -> None:
    """HostError for settings that cannot work together or on this host."""
    try:
        Isolation.from_setting(settings.isolation_level)
    except ValueError as exc:
        raise HostError(str(exc)) from None
    try:
        settings.probe_targets.check()
    except ValueError as exc:
        raise HostError(f"COVEY_EGRESS_PROBE_*: {exc}") from None
    if problem := ProxyConfig.from_environment(settings.proxy_environment).timing_problem():
        raise HostError(f"its proxy container: {problem}")
    if settings.apt_sources is not None and not settings.apt_sources.is_file():
        raise HostError(f"COVEY_WORKPLACE_APT_SOURCES={settings.apt_sources} is not a file")


def make_host(settings: HostSettings, options: Options) -> tuple[RunnerHost, str, str]:
    """The host, the queue its orders come from, and its name in lines."""
    if options.builtin:
        directory = builtin_dir(settings.var_dir)
        host = RunnerHost.builtin(directory, settings.control_plane_url, settings)
        return host, BUILTIN_QUEUE, "builtin"
    path = options.config or settings.var_dir / "runner.json"
    if not path.exists():
        raise HostError(f"{path} does not exist: register first (runner_register)")
    identity = Identity(path)
    try:
        me = identity.client.me()
    except ControlPlaneError as exc:
        raise HostError(f"the control plane refuses this runner: {exc}") from None
    return RunnerHost({identity.id: identity}, settings), me.queue, identity.name


def serve(settings: HostSettings, options: Options, say: Callable[[str], None]) -> None:
    """Run the host until its worker stops; HostError when it cannot start as asked."""
    check(settings)
    host, queue, name = make_host(settings, options)
    # Runs whose sandboxes the last stop removed (--remove-sandboxes-at-exit): said so of
    # them at the first reconcile, rather than that their sandbox vanished.
    removed_note = settings.var_dir / f"runner-{name}-removed-at-exit.json"
    if removed_note.exists():
        host.removed_at_exit.update(json.loads(removed_note.read_text() or "{}"))
        removed_note.unlink()
    with _stopped_by_sigterm():
        start(host, name, say)
    status_server = None
    if settings.status_listen:
        status_server = status_listener(host, settings.status_listen, settings.metrics_token)
    app = worker.make_app(host, settings)
    threads = [
        threading.Thread(target=host.watch, name="covey-watch", daemon=True),
        threading.Thread(target=host.quotas.run, name="covey-quotas", daemon=True),
        threading.Thread(target=host.docker.watch, name="covey-engine", daemon=True),
        threading.Thread(
            target=host.heartbeats, args=(settings.heartbeat,), name="covey-heartbeat", daemon=True
        ),
    ]
    for thread in threads:
        thread.start()
    if status_server is not None:
        status_server.start()
        where = "http://{}:{}/".format(*status_server.address)
        say(f"covey runner {name}: status at {where} (healthz, readyz, metrics)")
    say(f"covey runner {name} taking orders from queue {queue}")
    gc.freeze()  # what the host made to start lives as long as it: no collector pass walks it
    try:
        code = worker.work(app, queue, name, options.concurrency)
        if code:
            raise HostError(f"the runner's worker stopped with code {code}")
    finally:
        host.stop()
        if status_server is not None:
            status_server.stop()
        # A heartbeat's proxy check, say, ends and removes its container (a few seconds
        # at most: whatever is left then is removed below, or at the next start).
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if options.remove_sandboxes_at_exit:
            removed = host.remove_sandboxes()
            say(f"covey runner {name}: removed {removed} sandbox(es) at exit")
            if host.removed_at_exit:
                removed_note.write_text(json.dumps(host.removed_at_exit))


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """While the host starts (its checks launch containers), SIGTERM ends it as Ctrl-C would,
    so that each check's clean-up runs and removes its container; by default the signal ends
    the process where it stands. The worker installs its own handlers afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def start(host: RunnerHost, name: str, say: Callable[[str], None]) -> None:
    """Build each runner's isolation, check its proxy, probe it, and look for the default
    image, saying what came of each: a runner that fails one starts all the same, and takes
    no work until it passes."""
    if not host.settings.hard and not host.settings.proxy:
        say(
            f"covey runner {name}: no egress proxy for sandboxes (COVEY_RUNNER_PROXY is not"
            " set): runs the control plane enforces egress for fail until it is"
        )
    for runner_id, shape in host.start_isolation().items():
        # Without a shape the runner still starts: it refuses launches until one is built.
        say(
            f"covey runner {runner_id}: sandboxes on {shape.internal_network},"
            f" their proxy at {isolation.proxy_address(shape)}"
            if shape is not None
            else f"covey runner {runner_id}: NO ISOLATION YET, launches are refused:"
            f" {host.shapes.problem(host.identity(runner_id))}"
        )
    for runner_id, problem in host.start_proxy_checks().items():
        # Loud, but the runner starts: it refuses launches until its proxy answers.
        say(
            f"covey runner {runner_id}: PROXY CHECK FAILED, launches are refused: {problem}"
            if problem
            else f"covey runner {runner_id}: sandboxes reach the egress proxy at"
            f" {host.settings.proxy}"
        )
    for runner_id, report in host.start_probes().items():
        # A runner whose probe did not pass starts all the same and takes no work.
        verdict = "no probe (see the log)"
        if report is not None:
            verdict = "passed" if report.passed else "FAILED: no work until one passes"
            for line in report.lines:
                say(f"covey runner {runner_id}: probe: {line}")
        say(f"covey runner {runner_id}: egress probe {verdict}")
    for runner_id, problem in host.missing_default_image(host.settings.default_image).items():
        # Loud, but the runner starts: agents with a workplace of their own still run.
        say(
            f"covey runner {runner_id}: THE DEFAULT IMAGE IS MISSING, runs of agents without"
            f" a workplace fail until it is here (COVEY_DEFAULT_IMAGE): {problem}"
        )


def status_listener(host: RunnerHost, listen: str, token: str) -> StatusServer:
    """The host's /healthz, /readyz and /metrics on ``listen`` (HOST:PORT)."""
    try:
        address = split_host_port(listen)
        if not address[0]:
            raise ValueError("name the host")
    except ValueError as exc:
        raise HostError(f"COVEY_RUNNER_STATUS_LISTEN must be HOST:PORT: {exc}") from None
    try:
        return status.status_server(host, address, token)
    except OSError as exc:
        raise HostError(f"cannot listen on COVEY_RUNNER_STATUS_LISTEN {listen}: {exc}") from None
