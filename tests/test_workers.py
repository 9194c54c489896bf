"""Test processes side by side (tests/workers.py): their own Redis database and loopback
block, and the lock over the host's firewall."""

import subprocess
import sys

import pytest

from tests import workers
from tests.processes import ROOT


def test_a_worker_gets_a_redis_database_of_its_own(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    assert workers.broker_url("redis://127.0.0.1:56379/0") == "redis://127.0.0.1:56379/3"
    assert workers.broker_url("redis://127.0.0.1:56379") == "redis://127.0.0.1:56379/3"
    assert workers.broker_url("filesystem://") == "filesystem://"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw15")
    with pytest.raises(ValueError, match="Redis database 16; Redis has 16: run fewer workers"):
        workers.broker_url("redis://127.0.0.1:56379/0")


def test_without_workers_the_broker_is_as_given(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert workers.broker_url("redis://127.0.0.1:56379/0") == "redis://127.0.0.1:56379/0"


HOLD = """
import os, sys
os.environ["PYTEST_XDIST_WORKER"] = "gw0"
from tests import workers
print(workers.loopback_block(), flush=True)
sys.stdin.read()  # until told to go
"""


def test_two_processes_never_hold_the_same_loopback_block():
    def hold() -> tuple[subprocess.Popen, int]:
        process = subprocess.Popen(
            [sys.executable, "-c", HOLD],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout is not None
        return process, int(process.stdout.readline())

    first, a = hold()
    second, b = hold()
    try:
        assert a != b and 1 <= a <= 254 and 1 <= b <= 254
    finally:
        for process in (first, second):
            process.communicate("")
    third, c = hold()  # the first two let go when they ended: it takes one of theirs again
    third.communicate("")
    assert c <= max(a, b)


WAIT_FOR_EXCLUSIVE = """
import sys, time
from tests.workers import MachineLock
started = time.monotonic()
with MachineLock(sys.argv[1]).exclusive():
    print(round(time.monotonic() - started, 1), flush=True)
"""


def test_the_exclusive_lock_waits_for_every_shared_holder(tmp_path):
    name = f"test-{tmp_path.name}"
    lock = workers.MachineLock(name)
    try:
        with lock.shared():
            with lock.shared():  # again, in the same process
                waiter = subprocess.Popen(
                    [sys.executable, "-c", WAIT_FOR_EXCLUSIVE, name],
                    cwd=ROOT, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                with pytest.raises(subprocess.TimeoutExpired):
                    waiter.wait(1.5)  # held: it waits
            with pytest.raises(subprocess.TimeoutExpired):
                waiter.wait(0.5)  # still held once
        waited = float(waiter.communicate(timeout=30)[0])
        assert waited >= 1.5
    finally:
        lock.path.unlink(missing_ok=True)


def test_a_process_takes_the_exclusive_lock_inside_its_own_shared_one(tmp_path):
    lock = workers.MachineLock(f"test-{tmp_path.name}")
    try:
        with lock.shared():
            with lock.exclusive():
                pass
            with lock.shared():
                pass
    finally:
        lock.path.unlink(missing_ok=True)
