"""Faults while runs go: a runner killed during a run, the control plane gone while runs end,
the broker restarted with orders queued, a full disk under one agent's home. Each test states
what must hold and checks it, on the real control plane (gunicorn), real runner processes with
no database, real sandboxes, and a broker of the test's own where it is the broker that fails."""

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from django.db.models import F

from covey.celery import app
from covey.var import broker_folder
from runs import services as run_services
from runs.models import FINISHED, Run, RunStatus
from tests.processes import free_port, running, wait_for
from tests.runners.isolation_support import unavailable
from tests.runners.stack import Stack, containers_of, docker

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
    pytest.mark.suite("faults"),
]

# Writes its run's id to a file in its home and shows the file: a run launched twice would
# show its id twice (each agent has one run here, so the file is that run's alone).
ONCE = ["sh", "-c", 'echo "$COVEY_RUN" >> ~/launched; cat ~/launched']


def history(run: Run) -> list[str]:
    return list(run.events.values_list("status", flat=True))


def sandbox_state(run: Run) -> str:
    (container,) = docker("ps", "--all", "--quiet", "--filter", f"label=covey.run={run.pk}").split()
    return json.loads(docker("inspect", container))[0]["State"]["Status"]


def test_a_runner_killed_during_a_run_takes_it_up_again_and_reports_it_once(stack, acme):
    """The sandbox outlives its runner; the runner started again follows it to its end and
    reports it truthfully, with its whole log, once; nothing is left behind."""
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Steady", ["sh", "-c", "echo begun; sleep 4; echo ended"])
    with stack.runner(runner, config) as first:
        run = stack.wait(run_services.queue_run(agent, "outlive"), RunStatus.RUNNING)
        os.killpg(first.process.pid, signal.SIGKILL)  # no goodbye, no report
        first.process.wait()
    assert sandbox_state(run) == "running"
    with stack.runner(runner, config):
        stack.wait(run, *FINISHED, timeout=60)
        # Removed once reported: while the runner still runs (stopping it may cut that short).
        wait_for(lambda: not containers_of(runner), 15, "the sandbox removed")
    assert run.status == RunStatus.SUCCEEDED, run.status_detail
    assert run.log_tail.split() == ["begun", "ended"]
    assert history(run) == ["queued", "placed", "starting", "running", "succeeded"]


def test_a_run_that_ends_while_the_control_plane_is_down_is_reported_when_it_returns(stack, acme):
    """Nothing reported is lost: the runner keeps the ended sandbox until its report lands."""
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Alone", ["sh", "-c", "echo begun; sleep 2; echo ended; exit 3"])
    with stack.runner(runner, config) as process:
        run = stack.wait(run_services.queue_run(agent, "unheard"), RunStatus.RUNNING)
        stack.stop_control_plane()
        wait_for(lambda: sandbox_state(run) == "exited", 30, "the sandbox ending", process.log)
        seen = len(process.output())
        wait_for(lambda: len(process.output()) > seen, 30, "the runner failing to report it")
        run.refresh_from_db()
        assert run.status == RunStatus.RUNNING  # nobody could have been told
        stack.start_control_plane()
        stack.wait(run, *FINISHED, timeout=60)
    assert (run.status, run.exit_code, run.status_detail) == (RunStatus.FAILED, 3, "exit code 3")
    assert run.log_tail.split() == ["begun", "ended"]
    assert not containers_of(runner)


@contextmanager
def redis_server(tmp_path: Path, port: int) -> Iterator[subprocess.Popen]:
    """A Redis of the test's own, keeping nothing on disk (as the test services' does)."""
    args = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    args += ["--appendonly", "no", "--dir", str(tmp_path)]
    with running(args, dict(os.environ), tmp_path / f"redis-{port}.log") as process:
        client = redis.Redis(port=port)
        wait_for(lambda: _answers(client), 10, "Redis answering")
        yield process


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@contextmanager
def orders_through(monkeypatch: pytest.MonkeyPatch, url: str, options: dict) -> Iterator[None]:
    """This process's orders go to ``url`` (and the runner processes it starts take it from
    there: they inherit the environment)."""
    monkeypatch.setenv("CELERY_BROKER_URL", url)
    monkeypatch.setattr(app.conf, "broker_url", url)
    monkeypatch.setitem(app.conf, "broker_transport_options", options)
    _forget_connections()
    try:
        yield
    finally:
        _forget_connections()


def _forget_connections() -> None:
    """Celery keeps its producers' pool: the next order makes one for the broker now named
    (the pools stay kombu's, by URL: closing one would close it for whoever comes back)."""
    app._pool = None
    app.amqp._producer_pool = None


def _queue_while_away(stack: Stack, runner, config: Path, count: int) -> list[Run]:
    """Runs placed on a runner that was killed (so still counted online) before it took their
    orders: they wait in the broker."""
    with stack.runner(runner, config) as process:
        os.killpg(process.process.pid, signal.SIGKILL)
        process.process.wait()
    runs = [
        run_services.queue_run(stack.agent(runner.organisation, f"Once-{n}", ONCE), "once")
        for n in range(count)
    ]
    for run in runs:
        run.refresh_from_db()
        assert run.status == RunStatus.PLACED, run.status_detail
    return runs


def _as_if_long_ago(runs: list[Run]) -> None:
    """Their orders were placed long enough ago for the runner to launch them without one
    (runners.host.runner.RELAUNCH_AFTER_SECONDS): what a lost order looks like a minute on."""
    ids = [run.pk for run in runs]
    Run.objects.filter(pk__in=ids).update(placed_at=F("placed_at") - timedelta(minutes=5))


def _each_ran_once(stack: Stack, runner, runs: list[Run]) -> None:
    for run in runs:
        stack.wait(run, *FINISHED, timeout=90)
        assert run.status == RunStatus.SUCCEEDED, run.status_detail
        assert run.log_tail.split() == [str(run.pk)], "launched more than once"
        assert history(run) == ["queued", "placed", "starting", "running", "succeeded"]
    # A run is reported finished before its sandbox is removed.
    wait_for(lambda: not containers_of(runner), 10, "the sandboxes removed")


def test_orders_lost_with_a_redis_restart_are_launched_once_all_the_same(
    stack, acme, monkeypatch, tmp_path
):
    """Redis keeps orders in memory only: restarted, it has lost them. The runner launches
    the runs placed on it that never came (after RELAUNCH_AFTER_SECONDS), each once."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    runner, config = stack.register(acme, "edge-1")
    with orders_through(monkeypatch, url, {}), redis_server(tmp_path, port):
        runs = _queue_while_away(stack, runner, config, 3)
        assert redis.Redis(port=port).llen(runner.queue) == len(runs)
    with orders_through(monkeypatch, url, {}), redis_server(tmp_path, port):
        assert redis.Redis(port=port).llen(runner.queue) == 0  # the orders are gone
        _as_if_long_ago(runs)
        with stack.runner(runner, config, CELERY_BROKER_URL=url):
            _each_ran_once(stack, runner, runs)


def test_orders_queued_in_the_file_system_broker_are_launched_once_after_a_restart(
    stack, acme, monkeypatch
):
    """The file-system broker (make run's) keeps orders on disk: after the restart they are
    taken, and the runner's own relaunch of the same runs, racing them, launches none twice."""
    runner, config = stack.register(acme, "edge-1")
    var = stack.tmp / f"runner-var-{runner.pk}"  # the runner's COVEY_VAR_DIR (Stack.runner)
    options = {
        key: str(broker_folder(var, name))
        for key, name in [
            ("data_folder_in", "queue"),
            ("data_folder_out", "queue"),
            ("processed_folder", "processed"),
            ("control_folder", "control"),
        ]
    }
    for folder in set(options.values()):
        Path(folder).mkdir(parents=True, exist_ok=True)
    options |= {"store_processed": False, "polling_interval": 0.05}
    with orders_through(monkeypatch, "filesystem://", options):
        runs = _queue_while_away(stack, runner, config, 3)
        waiting = list(Path(options["data_folder_in"]).glob(f"*.{runner.queue}.msg"))
        assert len(waiting) == len(runs)
        _as_if_long_ago(runs)
        with stack.runner(runner, config, CELERY_BROKER_URL="filesystem://"):
            _each_ran_once(stack, runner, runs)


def test_a_full_disk_under_a_home_fails_that_run_saying_so_and_no_other(stack, acme):
    if os.geteuid() != 0:
        unavailable("filling a disk of its own needs root (mount -t tmpfs)")
    runner, config = stack.register(acme, "edge-1")
    write = ["sh", "-c", "head -c 4194304 /dev/zero > ~/big && echo wrote"]
    filler, other = stack.agent(acme, "Filler", write), stack.agent(acme, "Other", write)
    home = stack.home(runner, filler)
    home.mkdir(parents=True)
    # A file system of 2 MiB under the filler's home alone: the other's is on the big disk.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "covey-test", home], check=True)
    try:
        with stack.runner(runner, config):
            full = run_services.queue_run(filler, "fill")
            fine = run_services.queue_run(other, "fill too")
            stack.wait(full, *FINISHED, timeout=60)
            stack.wait(fine, *FINISHED, timeout=60)
    finally:
        subprocess.run(["umount", str(home)], check=True)
    assert full.status == RunStatus.FAILED
    assert full.status_detail.startswith("exit code 1: the file system holding its home is full")
    assert full.status_detail.endswith("on edge-1: make room there")
    assert "No space left on device" in full.log_tail
    assert (fine.status, fine.log_tail.strip()) == (RunStatus.SUCCEEDED, "wrote")
    assert not containers_of(runner)
