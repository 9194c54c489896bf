"""Start and stop the real processes integration tests need; each is stopped by its own id."""

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from covey import var

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """Run a command in its own process group; stop that group (and only it) afterwards."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def wait_for(condition, timeout: float, what: str, log: Path | None = None) -> None:
    """Poll until condition() is true, or fail saying what never happened (with the log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise AssertionError(f"{what} did not happen within {timeout} s\n{tail}")


@contextmanager
def control_plane(
    tmp_path: Path, database_url: str, *, port: int | None = None, **env_overrides: str
) -> Iterator[str]:
    """The control plane's web server (gunicorn) on a loopback port (a free one unless given);
    yields its URL. One worker unless the overrides give ``WEB_CONCURRENCY`` (its 32 threads
    serve a test; each worker costs two CPU seconds to boot, and tests start dozens)."""
    port = port or free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        "COVEY_VAR_DIR": str(tmp_path / "control-plane-var"),
        "WEB_CONCURRENCY": "1",  # gunicorn's workers
        **env_overrides,
    }
    var.prepare(Path(env["COVEY_VAR_DIR"]))  # as make run does: a key before workers boot
    args = [str(VENV_BIN / "gunicorn"), "covey.wsgi", "--bind", f"127.0.0.1:{port}"]
    log = tmp_path / f"control-plane-{port}-{time.monotonic_ns()}.log"
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        """Answering, not only listening: a worker has booted (and loaded the URLs)."""
        try:
            return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    with running(args, env, log):
        wait_for(up, 60, "the control plane answering /healthz", log)
        yield url


@contextmanager
def policy_stream(
    tmp_path: Path, database_url: str, *, port: int | None = None, **env_overrides: str
) -> Iterator[str]:
    """The policy stream (``manage.py policy_stream``) on a loopback port; yields its URL, once
    it hears the database's notices."""
    port = port or free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "PYTHONUNBUFFERED": "1",
        "COVEY_VAR_DIR": str(tmp_path / "control-plane-var"),
        **env_overrides,
    }
    args = [str(VENV_BIN / "python"), "manage.py", "policy_stream", "--listen", f"127.0.0.1:{port}"]
    log = tmp_path / f"policy-stream-{port}-{time.monotonic_ns()}.log"
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    with running(args, env, log):
        wait_for(ready, 60, "the policy stream ready", log)
        yield f"{base}/api/v1/egress/policy/stream/"
