"""The runner host's Celery worker: an app of its own, with no Django fix-up, whose order tasks
act for the one host they are made for (no module-level current host). The task names are the
protocol's (runners/protocol.py), so the control plane's orders reach them unchanged.

A launch is acknowledged only once done, so a worker killed mid-launch gets it again (launching
is idempotent per run). The pool is threads: orders are short, and the host's state is shared.
"""

import logging
import os
import socket
from typing import TYPE_CHECKING

from celery import Celery

import logs
from runners.host import broker
from runners.host.client import ControlPlaneError
from runners.host.config import HostSettings
from runners.protocol import CANCEL, HOME, LAUNCH, PROBE, RENEW, Order

if TYPE_CHECKING:
    from runners.host.runner import RunnerHost

# The control plane may be restarting: try again a few times, a little later each time.
RETRY = {"autoretry_for": (ControlPlaneError,), "retry_backoff": 1, "max_retries": 6}
LATE = {"acks_late": True, "reject_on_worker_lost": True}
# Tasks of this app only (not shared with every app in the process, as Celery does by default).
MINE = {"shared": False}


def make_app(host: "RunnerHost", settings: HostSettings) -> Celery:
    """A Celery app whose tasks carry out ``host``'s orders, on the broker ``settings`` name."""
    app = Celery("covey-runner", fixups=[], set_as_current=False)
    options: dict[str, object] = {}
    if settings.broker_url.startswith("filesystem://"):
        broker.install()  # messages that appear whole (runners/host/broker.py)
        options = broker.transport_options(settings.var_dir)
        for name in broker.FOLDERS:  # kombu makes only the control folder itself
            broker.folder(settings.var_dir, name).mkdir(parents=True, exist_ok=True)
    app.conf.update(
        broker_url=settings.broker_url,
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
        # The file-system broker of `make run` has no broadcast; runners need none.
        worker_enable_remote_control=False,
        # In JSON, lines go through covey's log configuration; in text, Celery's own format.
        worker_hijack_root_logger=settings.log_format != "json",
    )

    @app.task(name=LAUNCH, **LATE, **RETRY, **MINE)
    def launch(runner_id: int, run_id: str) -> None:
        order = Order.from_args(LAUNCH, runner_id, run_id)
        with logs.bound(task=LAUNCH, runner_id=order.runner, run_id=order.subject):
            host.launch(order.runner, order.subject)

    @app.task(name=CANCEL, **LATE, **RETRY, **MINE)
    def cancel(runner_id: int, run_id: str) -> None:
        order = Order.from_args(CANCEL, runner_id, run_id)
        with logs.bound(task=CANCEL, runner_id=order.runner, run_id=order.subject):
            host.cancel(order.runner, order.subject)

    @app.task(name=RENEW, **LATE, **MINE)
    def renew_token(runner_id: int, sealed: str) -> None:
        order = Order.from_args(RENEW, runner_id, sealed)
        with logs.bound(task=RENEW, runner_id=order.runner):
            host.renew_token(order.runner, order.subject)

    @app.task(name=PROBE, **LATE, **RETRY, **MINE)
    def probe(runner_id: int, probe_id: str) -> None:
        order = Order.from_args(PROBE, runner_id, probe_id)
        with logs.bound(task=PROBE, runner_id=order.runner):
            host.probe(order.runner, order.subject)

    # Not acknowledged late: the person asking waits seconds, not for a redelivery.
    @app.task(name=HOME, **MINE)
    def home(runner_id: int, operation_id: str) -> None:
        order = Order.from_args(HOME, runner_id, operation_id)
        with logs.bound(task=HOME, runner_id=order.runner):
            host.home(order.runner, order.subject)

    return app


def work(app: Celery, queue: str, name: str, concurrency: int) -> int:
    """Take orders from ``queue`` until the worker is stopped (a signal); its exit code."""
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
    return int(worker.exitcode or 0)
