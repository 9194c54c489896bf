"""Run this host as a runner: take orders from the queue, build sandboxes, watch, report."""

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from allowlists.entries import split_host_port
from egress.environment import Isolation
from runners.host import runner as runner_host
from runners.host import status
from runners.host.client import ControlPlaneError
from runners.host.containers import isolation
from runners.host.identity import Identity
from runners.models import BUILTIN_QUEUE
from runners.probe import host as probing
from runners.services import builtin_dir
from status import StatusServer

logger = logging.getLogger(__name__)
STOP_WAIT_SECONDS = 3.0  # at exit, for the host's threads to finish what they are doing


class Command(BaseCommand):
    help = (
        "Serve as a runner (no database needed): the remote runner registered in --config, or"
        " with --builtin the control-plane host's built-in runners."
    )
    requires_system_checks: list[str] = []  # a runner host has no database to check

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--builtin", action="store_true", help="Serve the built-in runners.")
        parser.add_argument(
            "--config",
            default=str(settings.VAR_DIR / "runner.json"),
            help="The remote runner's file from runner_register (URL, id, token).",
        )
        parser.add_argument("--concurrency", type=int, default=4, help="Orders at once.")
        parser.add_argument(
            "--remove-sandboxes-at-exit",
            action="store_true",
            help="At exit, remove every sandbox, running or not (make run's Ctrl-C); without"
            " it, runs go on and the runner takes them up again when it restarts.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        targets = probing.Targets(
            internet=settings.COVEY_EGRESS_PROBE_INTERNET,
            private=settings.COVEY_EGRESS_PROBE_PRIVATE,
            metadata=settings.COVEY_EGRESS_PROBE_METADATA,
            resolvers=settings.COVEY_EGRESS_PROBE_RESOLVERS,
            ipv6=settings.COVEY_EGRESS_PROBE_IPV6,
        )
        try:
            targets.check()
        except ValueError as exc:
            raise CommandError(f"COVEY_EGRESS_PROBE_*: {exc}") from None
        host_settings = runner_host.HostSettings(
            homes=Path(settings.COVEY_RUNNER_HOMES),
            proxy=settings.COVEY_RUNNER_PROXY,
            network=settings.COVEY_RUNNER_NETWORK or None,
            isolation=Isolation.from_setting(settings.COVEY_EGRESS_ISOLATION),
            proxy_image=settings.COVEY_RUNNER_PROXY_IMAGE,
            proxy_control_plane_url=settings.COVEY_RUNNER_PROXY_CONTROL_PLANE_URL,
            proxy_environment=proxy_environment(),
            probe_targets=targets,
            probe_retry=settings.COVEY_RUNNER_PROBE_RETRY_SECONDS,
            check_image=settings.COVEY_PROBE_IMAGE,
            proxy_wait=settings.COVEY_RUNNER_PROXY_WAIT_SECONDS,
            apt_sources=Path(settings.COVEY_WORKPLACE_APT_SOURCES)
            if settings.COVEY_WORKPLACE_APT_SOURCES
            else None,
            build_network=settings.COVEY_WORKPLACE_BUILD_NETWORK or None,
            pip_index_url=settings.COVEY_WORKPLACE_PIP_INDEX_URL,
            npm_registry=settings.COVEY_WORKPLACE_NPM_REGISTRY,
        )
        if host_settings.apt_sources is not None and not host_settings.apt_sources.is_file():
            raise CommandError(
                f"COVEY_WORKPLACE_APT_SOURCES={host_settings.apt_sources} is not a file"
            )
        if options["builtin"]:
            host = runner_host.RunnerHost.builtin(
                builtin_dir(), settings.COVEY_CONTROL_PLANE_URL, host_settings
            )
            queue, name = BUILTIN_QUEUE, "builtin"
        else:
            path = Path(options["config"])
            if not path.exists():
                raise CommandError(f"{path} does not exist: register first (runner_register)")
            identity = Identity(path)
            try:
                me = identity.client.me()
            except ControlPlaneError as exc:
                raise CommandError(f"the control plane refuses this runner: {exc}") from None
            host = runner_host.RunnerHost({identity.id: identity}, host_settings)
            queue, name = me.queue, identity.name
        # Runs whose sandboxes the last stop removed (--remove-sandboxes-at-exit): said so of
        # them at the first reconcile, rather than that their sandbox vanished.
        removed_note = Path(settings.VAR_DIR) / f"runner-{name}-removed-at-exit.json"
        if removed_note.exists():
            host.removed_at_exit.update(json.loads(removed_note.read_text() or "{}"))
            removed_note.unlink()
        if not host_settings.hard and not host_settings.proxy:
            self.stdout.write(
                f"covey runner {name}: no egress proxy for sandboxes (COVEY_RUNNER_PROXY is not"
                " set): runs the control plane enforces egress for fail until it is"
            )
        for runner_id, shape in host.start_isolation().items():
            # Without a shape the runner still starts: it refuses launches until one is built.
            self.stdout.write(
                f"covey runner {runner_id}: sandboxes on {shape.internal_network},"
                f" their proxy at {isolation.proxy_address(shape)}"
                if shape is not None
                else f"covey runner {runner_id}: NO ISOLATION YET, launches are refused:"
                f" {host.shapes.problem(host.identity(runner_id))}"
            )
        for runner_id, problem in host.start_proxy_checks().items():
            # Loud, but the runner starts: it refuses launches until its proxy answers.
            self.stdout.write(
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
                    self.stdout.write(f"covey runner {runner_id}: probe: {line}")
            self.stdout.write(f"covey runner {runner_id}: egress probe {verdict}")
        for runner_id, problem in host.missing_default_image(settings.COVEY_DEFAULT_IMAGE).items():
            # Loud, but the runner starts: agents with a workplace of their own still run.
            self.stdout.write(
                f"covey runner {runner_id}: THE DEFAULT IMAGE IS MISSING, runs of agents without"
                f" a workplace fail until it is here (COVEY_DEFAULT_IMAGE): {problem}"
            )
        status_server = None
        if settings.COVEY_RUNNER_STATUS_LISTEN:
            status_server = self._status_server(host, settings.COVEY_RUNNER_STATUS_LISTEN)
        runner_host.set_current(host)
        threads = [
            threading.Thread(target=host.watch, name="covey-watch", daemon=True),
            threading.Thread(target=host.quotas, name="covey-quotas", daemon=True),
            threading.Thread(target=host.watch_engine, name="covey-engine", daemon=True),
            threading.Thread(
                target=host.heartbeats,
                args=(settings.COVEY_RUNNER_HEARTBEAT_SECONDS,),
                name="covey-heartbeat",
                daemon=True,
            ),
        ]
        for thread in threads:
            thread.start()
        if status_server is not None:
            status_server.start()
            where = "http://{}:{}/".format(*status_server.address)
            self.stdout.write(f"covey runner {name}: status at {where} (healthz, readyz, metrics)")
        self.stdout.write(f"covey runner {name} taking orders from queue {queue}")
        self.stdout.flush()
        try:
            self._work(queue, name, options["concurrency"])
        finally:
            host.stop()
            if status_server is not None:
                status_server.stop()
            # A heartbeat's proxy check, say, ends and removes its container (a few seconds
            # at most: whatever is left then is removed below, or at the next start).
            deadline = time.monotonic() + STOP_WAIT_SECONDS
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            runner_host.set_current(None)
            if options["remove_sandboxes_at_exit"]:
                removed = host.remove_sandboxes()
                self.stdout.write(f"covey runner {name}: removed {removed} sandbox(es) at exit")
                if host.removed_at_exit:
                    removed_note.write_text(json.dumps(host.removed_at_exit))

    def _status_server(self, host: runner_host.RunnerHost, listen: str) -> StatusServer:
        try:
            address = split_host_port(listen)
            if not address[0]:
                raise ValueError("name the host")
        except ValueError as exc:
            raise CommandError(f"COVEY_RUNNER_STATUS_LISTEN must be HOST:PORT: {exc}") from None
        try:
            return status.status_server(host, address, settings.COVEY_METRICS_TOKEN)
        except OSError as exc:
            raise CommandError(
                f"cannot listen on COVEY_RUNNER_STATUS_LISTEN {listen}: {exc}"
            ) from None

    def _work(self, queue: str, name: str, concurrency: int) -> None:
        from covey.celery import app

        # The file-system broker of `make run` has no broadcast; runners need none.
        app.conf.worker_enable_remote_control = False
        # Celery's Django fix-up runs the model checks, which open a database connection.
        os.environ["CELERY_SKIP_CHECKS"] = "true"
        worker = app.Worker(
            queues=[queue],
            pool="threads",
            concurrency=concurrency,
            hostname=f"runner-{name}-{os.getpid()}@{socket.gethostname()}",
            prefetch_multiplier=1,
            without_gossip=True,
            without_mingle=True,
            without_heartbeat=True,
            loglevel=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        )
        worker.start()
        if worker.exitcode:
            raise CommandError(f"the runner's worker stopped with code {worker.exitcode}")


def proxy_environment() -> dict[str, str]:
    """What the proxy container takes from this host's settings: it resolves and connects
    from here, so where it asks for names and which private ranges it may reach are the
    runner host's to say, as is how long it trusts a policy whose source went silent and how
    long a client has to send a request head; and the token its /metrics answers (on its
    status port, which sandboxes cannot reach)."""
    environment = {
        "COVEY_EGRESS_POLICY_GRACE": f"{settings.COVEY_EGRESS_POLICY_GRACE:g}",
        "COVEY_EGRESS_HEAD_TIMEOUT": f"{settings.COVEY_EGRESS_HEAD_TIMEOUT:g}",
    }
    for name in ("COVEY_EGRESS_NAMESERVERS", "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS"):
        if values := getattr(settings, name):
            environment[name] = ",".join(values)
    if settings.COVEY_METRICS_TOKEN:
        environment["COVEY_METRICS_TOKEN"] = settings.COVEY_METRICS_TOKEN
    return environment
