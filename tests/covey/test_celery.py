"""The Celery app boots a real worker against the Redis broker and answers it."""

import json
import os
import queue
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


def test_the_file_system_broker_never_hands_out_a_message_still_being_written(
    tmp_path, monkeypatch
):
    """kombu's own transport wrote a message under its final name and filled it afterwards: a
    worker listing the folder in between took it empty and stopped (celery/kombu#1551)."""
    from kombu import Connection
    from kombu.transport import TRANSPORT_ALIASES

    from runners.host import broker

    # What a process on the file-system broker installs (settings, the runner host), whatever
    # broker this test process was given; undone after.
    monkeypatch.setitem(TRANSPORT_ALIASES, "filesystem", TRANSPORT_ALIASES["filesystem"])
    broker.install()
    folder = tmp_path / "broker"
    folder.mkdir()
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder)}
    with Connection("filesystem://", transport_options=options) as connection:
        assert isinstance(connection.transport, broker.Transport)
        channel = connection.default_channel
        (folder / f"1_x.jobs.msg{broker.DRAFT}").write_bytes(b"")  # being written
        with pytest.raises(queue.Empty):
            channel._get("jobs")  # kombu's own took it, and failed to decode it
        listed_while_writing: list[str] = []

        def encoding(payload):  # while the message is being written: what could a reader take?
            listed_while_writing.extend(p.name for p in folder.iterdir() if p.suffix == ".msg")
            return json.dumps(payload)

        monkeypatch.setattr(broker, "dumps", encoding)
        channel._put("jobs", {"body": "whole"})
        assert listed_while_writing == []  # kombu's own had the message there, empty
        assert channel._get("jobs") == {"body": "whole"}
        assert sorted(p.name for p in folder.iterdir()) == [f"1_x.jobs.msg{broker.DRAFT}"]
