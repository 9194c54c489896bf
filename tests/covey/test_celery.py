"""The Celery app boots a real worker against the Redis broker and answers it."""

import os
import sys

import pytest

from covey.celery import app
from tests.processes import running, wait_for


@pytest.mark.redis
def test_a_worker_starts_on_the_redis_broker_and_answers_a_ping(tmp_path):
    hostname = f"covey-test-{os.getpid()}@localhost"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [
        sys.executable,
        "-m",
        "celery",
        "--app",
        "covey",
        "worker",
        "--pool",
        "solo",
        "--hostname",
        hostname,
        "--without-mingle",
        "--without-gossip",
    ]
    log = tmp_path / "worker.log"
    with running(args, env, log) as worker:

        def answered():
            assert worker.poll() is None, log.read_text()
            replies = app.control.ping(destination=[hostname], timeout=0.5)
            return any(hostname in reply for reply in replies)

        wait_for(answered, 60, "a ping reply from the worker", log)
