"""Fault injection on real processes: PostgreSQL stopped for 10 s under API load, on a database
server of the test's own (initdb in its folder), under the real web process.

What must hold: while it is down every answer is a 503 saying so (never a 500), nothing is
half-written (each organisation the API said it made exists whole, with its built-in runner,
and no other does), and once it is back the API answers again by itself, with no restart.

(More fault cases of this suite live beside what they break: the proxy failing closed when its
policy source is gone, a runner killed mid-launch, a proxy container stopped and replaced, a
Docker engine missing under make run, a bridge without a gateway; they carry the marker too.)
"""

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from bench.control_plane import pg_binaries as bench_pg_binaries
from bench.support import BenchError
from tests.processes import ROOT, VENV_BIN, control_plane, free_port, wait_for

pytestmark = [pytest.mark.suite("faults"), pytest.mark.redis, pytest.mark.e2e]

DOWN_SECONDS = 10


def pg_binaries() -> Path:
    try:
        return bench_pg_binaries()
    except BenchError as exc:
        pytest.fail(str(exc))


class Postgres:
    """A PostgreSQL server of the test's own, which it may stop and start again."""

    def __init__(self) -> None:
        # Its own folder, which the server's user can reach (pytest's is root's alone).
        self.folder = Path(tempfile.mkdtemp(prefix="covey-faults-pg-"))
        self.folder.chmod(0o711)
        self.data, self.port, self.bin = self.folder / "pg", free_port(), pg_binaries()
        self.runas: list[str] = []
        if os.geteuid() == 0:  # initdb and postgres refuse root
            self.runas = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
            self.data.mkdir()
            shutil.chown(self.data, "nobody", "nogroup")
        subprocess.run(
            [*self.runas, str(self.bin / "initdb"), "-D", str(self.data), "-U", "covey",
             "--auth", "trust", "--no-sync"],
            capture_output=True, check=True, timeout=120,
        )  # fmt: skip
        self.log = self.folder / "postgres.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.args(), env={"PATH": "/usr/bin:/bin"}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        wait_for(lambda: _listening(self.port), 60, "PostgreSQL listening", self.log)

    def stop(self) -> None:
        """Fast shutdown (its clients are cut off), as a crash or a restart would do."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"postgres://covey@127.0.0.1:{self.port}/postgres"

    def args(self) -> list[str]:
        return [
            *self.runas, str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.data}",
            "-c", "fsync=off",
        ]  # fmt: skip


def answers(url: str, headers: dict[str, str], stop: threading.Event, seen: list) -> None:
    """Reads and writes as fast as they come back, each noted with its status and body."""
    n = 0
    with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
        while not stop.is_set():
            n += 1
            for method, path, body in (
                ("GET", "/api/v1/agents/", None),
                ("POST", "/api/v1/organisations/", {"name": f"Load {n}"}),
            ):
                try:
                    response = api.request(method, path, json=body)
                except httpx.HTTPError as exc:
                    seen.append((time.monotonic(), method, 0, str(exc), body))
                    continue
                seen.append((time.monotonic(), method, response.status_code, response.text, body))
            time.sleep(0.05)


def test_the_database_down_under_load_is_503_then_back_by_itself(tmp_path, cases):
    pg = Postgres()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("COVEY_", "DJANGO_", "DATABASE"))
    } | {
        "DATABASE_URL": pg.url,
        "COVEY_VAR_DIR": str(tmp_path / "var"),
        "COVEY_ADMIN_PASSWORD": "faults-" + "x" * 20,
        "COVEY_BUILTIN_RUNNER": "true",
    }
    manage = [str(VENV_BIN / "python"), "manage.py"]
    pg.start()
    try:
        for command in (["migrate", "--no-input"], ["ensure_admin"]):
            subprocess.run([*manage, *command], cwd=ROOT, env=env, check=True, timeout=300,
                           capture_output=True)  # fmt: skip
        token = subprocess.run(
            [*manage, "drf_create_token", "admin"],
            cwd=ROOT, env=env, check=True, timeout=60, capture_output=True, text=True,
        ).stdout.split()[2]  # fmt: skip
        seen: list = []
        stop = threading.Event()
        headers = {"Authorization": f"Token {token}"}
        with control_plane(tmp_path, pg.url, **env) as url:
            load = threading.Thread(target=answers, args=(url, headers, stop, seen))
            load.start()
            try:
                wait_for(lambda: sum(1 for s in seen if s[2] == 201) >= 3, 30, "writes going")
                pg.stop()
                down_at = time.monotonic()
                time.sleep(DOWN_SECONDS)
                up_at = time.monotonic()
                pg.start()
                wait_for(
                    lambda: any(s[0] > up_at and s[2] == 201 for s in seen), 30,
                    "a write answered again after the database came back",
                )  # fmt: skip
            finally:
                stop.set()
                load.join(60)
        statuses = Counter(s[2] for s in seen)
        cases.add(len(seen))
        cases.note(
            f"database down {DOWN_SECONDS} s under load: {len(seen)} requests, answers "
            + ", ".join(f"{status}: {n}" for status, n in sorted(statuses.items()))
        )
        during = [s for s in seen if down_at < s[0] < up_at]
        assert during, "no request was answered while the database was down"
        assert statuses[500] == 0 and statuses[0] == 0, statuses
        assert all(s[2] == 503 and "database does not answer" in s[3] for s in during), {
            (s[2], s[3][:100]) for s in during if s[2] != 503
        }
        made = {s[4]["name"] for s in seen if s[1] == "POST" and s[2] == 201}
        check = subprocess.run(
            [*manage, "shell", "-c", SHOW_ORGANISATIONS],
            cwd=ROOT, env=env, check=True, timeout=60, capture_output=True, text=True,
        )  # fmt: skip
        stored = dict(line.split("\t") for line in check.stdout.splitlines() if "\t" in line)
        assert set(stored) >= made, made - set(stored)
        assert all(stored[name] == "1" for name in stored), stored  # each with its runner
    finally:
        pg.remove()


SHOW_ORGANISATIONS = """
from organisations.models import Organisation
for o in Organisation.objects.filter(name__startswith="Load "):
    print(f"{o.name}\\t{o.runners.filter(builtin=True).count()}")
"""


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
