"""Homes from outside, end to end: the real control plane (gunicorn, threaded), a real runner
process with no database (the built-in one, and a registered one), a real home on disk, a real
HTTP client; with no sandbox running, while a run is active, over quota, and offline."""

import hashlib
import io
import os
import tarfile
from contextlib import contextmanager

import pytest

from homes.models import HomeChange
from runners.models import Runner
from runs import services as run_services
from runs.models import FINISHED, RunStatus
from tests.processes import wait_for

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.docker,
    pytest.mark.django_db(transaction=True),
]


@contextmanager
def served(stack, organisation, kind):
    """A runner process holding the organisation's homes: its built-in runner, or one
    registered (a remote runner)."""
    if kind == "builtin":
        with stack.builtin(organisation) as process:
            yield process.runner
    else:
        runner, config = stack.register(organisation, "edge-1")
        with stack.runner(runner, config):
            yield runner


@pytest.mark.parametrize("kind", ["builtin", "remote"])
def test_every_operation_on_a_home_with_no_sandbox_running(stack, acme, alice, kind):
    agent = stack.agent(acme, "Keeper", ["true"])
    with served(stack, acme, kind) as runner, stack.api(alice) as api:
        base = f"/api/v1/agents/{agent.pk}/home"
        made = api.post(f"{base}/mkdir/", json={"path": "notes/drafts"})
        assert made.status_code == 201, made.text
        data = os.urandom(3 * 1024 * 1024 + 17)
        put = api.put(f"{base}/file/", params={"path": "notes/drafts/a.bin"}, content=data)
        assert put.status_code == 201, put.text
        assert put.json()["size"] == len(data)
        again = api.put(f"{base}/file/", params={"path": "notes/drafts/a.bin"}, content=b"x")
        assert again.status_code == 409 and "say replace" in again.json()["detail"]
        agent.refresh_from_db()
        assert agent.home_runner_id == runner.pk
        assert (agent.home_bytes, agent.home_files) == (len(data), 1)
        on_disk = stack.home(runner, agent) / "notes" / "drafts" / "a.bin"
        assert on_disk.read_bytes() == data

        listed = api.get(f"{base}/entries/", params={"path": "notes/drafts"}).json()
        assert listed["total"] == 1 and listed["entries"][0]["name"] == "a.bin"
        assert api.get(f"{base}/stat/", params={"path": "notes"}).json()["type"] == "directory"
        head = api.head(f"{base}/download/", params={"path": "notes/drafts/a.bin"})
        assert head.status_code == 200 and head.headers["content-length"] == str(len(data))
        assert 'filename="a.bin"' in head.headers["content-disposition"] and not head.content
        got = api.get(f"{base}/download/", params={"path": "notes/drafts/a.bin"})
        assert got.status_code == 200 and got.headers["content-length"] == str(len(data))
        assert hashlib.sha256(got.content).digest() == hashlib.sha256(data).digest()

        os.symlink("/etc/passwd", on_disk.parent / "planted")
        refused = api.get(f"{base}/download/", params={"path": "notes/drafts/planted"})
        assert refused.status_code == 400 and "link" in refused.json()["detail"]
        archive = api.get(f"{base}/download/", params={"path": "notes"})
        assert archive.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            names = tar.getnames()
            assert tar.extractfile("notes/drafts/a.bin").read() == data
            skipped = tar.extractfile("notes/covey-skipped.txt").read().decode()
        assert "notes/drafts/planted" not in names and "drafts/planted" in skipped
        outside = api.get(f"{base}/entries/", params={"path": "../.."})
        assert outside.status_code == 400

        moved = api.post(
            f"{base}/move/", json={"path": "notes/drafts/a.bin", "target": "notes/final.bin"}
        )
        assert moved.status_code == 200 and moved.json()["name"] == "final.bin"
        usage = api.get(f"{base}/usage/").json()
        assert usage["bytes"] == len(data) + len("/etc/passwd")
        assert usage["largest_files"][0] == {
            "path": "notes/final.bin", "bytes": len(data), "usable": True,
        }  # fmt: skip
        deleted = api.post(f"{base}/delete/", json={"path": "notes"})
        assert deleted.status_code == 204, deleted.text
        assert api.get(f"{base}/entries/").json()["total"] == 0
        summary = api.get(f"{base}/").json()
        assert (summary["bytes"], summary["files"], summary["runner"]) == (0, 0, runner.name)
        audit = api.get(f"{base}/changes/").json()["results"]
    assert [(c["operation"], c["status"]) for c in reversed(audit)] == [
        ("mkdir", 201),
        ("write", 201),
        ("write", 409),
        ("move", 200),
        ("delete", 200),
    ]
    assert audit[0]["bytes"] == len(data) + len("/etc/passwd") and audit[0]["by_name"] == "alice"
    assert not list((stack.tmp / "control-plane-var" / "spool").iterdir())  # nothing left over


def test_changes_wait_for_a_run_reads_do_not_and_quota_and_roles_are_kept(stack, acme, alice, vera):
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Sleeper", ["sh", "-c", "echo hi > $HOME/seen; sleep 60"])
    agent.home_quota_mb = 1
    agent.save()
    with stack.runner(runner, config), stack.api(alice) as api, stack.api(vera) as viewer:
        base = f"/api/v1/agents/{agent.pk}/home"
        run = stack.wait(run_services.queue_run(agent, "sleep"), RunStatus.RUNNING)
        wait_for(lambda: (stack.home(runner, agent) / "seen").exists(), 10, "the run writing")
        assert api.get(f"{base}/entries/").json()["entries"][0]["name"] == "seen"
        assert api.get(f"{base}/download/", params={"path": "seen"}).content == b"hi\n"
        busy = api.post(f"{base}/mkdir/", json={"path": "x"})
        assert busy.status_code == 409 and str(run.pk) in busy.json()["detail"]
        assert not (stack.home(runner, agent) / "x").exists()
        run_services.cancel(run)
        stack.wait(run, *FINISHED)

        too_big = api.put(f"{base}/file/", params={"path": "big"}, content=b"x" * 1_100_000)
        assert too_big.status_code == 413 and "quota of 1.0 MiB" in too_big.json()["detail"]
        assert not (stack.home(runner, agent) / "big").exists()
        fits = api.put(f"{base}/file/", params={"path": "fits"}, content=b"x" * 1000)
        assert fits.status_code == 201, fits.text
        assert viewer.get(f"{base}/entries/").status_code == 200
        assert viewer.post(f"{base}/mkdir/", json={"path": "no"}).status_code == 403

        Runner.objects.filter(pk=runner.pk).update(paused=True)  # a paused runner still serves
        assert api.get(f"{base}/stat/", params={"path": "fits"}).json()["size"] == 1000
    assert [c.status for c in HomeChange.objects.filter(agent=agent).order_by("at")] == [
        409,
        413,
        201,
        403,  # the viewer's mkdir: refused, and in the audit
    ]


def test_a_home_on_a_runner_that_is_offline_answers_503_saying_which(stack, acme, alice):
    runner, config = stack.register(acme, "edge-1")
    agent = stack.agent(acme, "Keeper", ["true"])
    with stack.runner(runner, config), stack.api(alice) as api:
        base = f"/api/v1/agents/{agent.pk}/home"
        assert api.post(f"{base}/mkdir/", json={"path": "kept"}).status_code == 201
    runner.refresh_from_db()
    seen = runner.last_seen_at
    Runner.objects.filter(pk=runner.pk).update(last_seen_at=seen.replace(year=seen.year - 1))
    with stack.api(alice) as api:
        answer = api.get(f"/api/v1/agents/{agent.pk}/home/entries/")
    assert answer.status_code == 503
    assert "on runner edge-1" in answer.json()["detail"]
    assert "silent since" in answer.json()["detail"]
