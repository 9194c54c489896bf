"""`make run`'s script on embedded defaults: SQLite, a file-system broker, no servers."""

import os
import urllib.request

from tests.processes import ROOT, VENV_BIN, free_port, running, wait_for


def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback only
            return response.status, response.read()
    except OSError:
        return None, b""


def test_run_serves_the_admin_login_and_the_schema_and_prints_a_generated_password(tmp_path):
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DATABASE_URL", "CELERY_BROKER_URL", "COVEY_ADMIN_PASSWORD")
    }
    env |= {
        "COVEY_VAR_DIR": str(tmp_path / "var"),
        "COVEY_BIND": f"127.0.0.1:{port}",
        "PATH": f"{VENV_BIN}:{env['PATH']}",
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / "run.log"
    base = f"http://127.0.0.1:{port}"
    with running([str(ROOT / "scripts" / "run")], env, log) as process:

        def up():
            assert process.poll() is None, log.read_text()
            return fetch(f"{base}/admin/login/")[0] == 200

        wait_for(up, 120, "the admin login page", log)
        status, schema = fetch(f"{base}/api/v1/schema/")
        assert status == 200
        assert b"/api/v1/agents/" in schema
        # The static files of the admin are served too.
        assert fetch(f"{base}/static/admin/css/base.css")[0] == 200
        wait_for(lambda: b"celery@" in log.read_bytes(), 60, "the Celery worker start", log)
    output = log.read_text()
    assert "Created superuser 'admin' with password: " in output
    assert (tmp_path / "var" / "covey.sqlite3").exists()
