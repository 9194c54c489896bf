"""A runner host serving homes to people outside (runners/host/serving.py), on the in-memory
seams (tests/fakes.py): what it answers for each operation, what it refuses and why, and that
changes wait for no sandbox of the agent. No Docker, Redis or PostgreSQL; the same paths run for
real in tests/homes/test_api.py."""

import io
import os
import tarfile

import pytest

from runners.protocol import HomeOp, HomeOrder
from tests.runners.test_runner_logic import RUN, Host, spec

AGENT = 7


@pytest.fixture
def host(tmp_path):
    return Host(tmp_path)


def serve(host: Host, kind: HomeOp, operation: str = "op-1", **fields):
    host.control.home_orders[operation] = HomeOrder(operation, AGENT, kind, **fields)
    host.host.serving.serve(1, host.control, operation)  # type: ignore[arg-type]
    return host.control.answers.get(operation)


def home(host: Host):
    return host.host.settings.homes / "1" / str(AGENT)


def test_an_upload_is_written_whole_with_what_it_did_to_the_usage(host):
    host.control.uploads["op-1"] = b"x" * 2500
    answer = serve(host, HomeOp.WRITE, path="a/b.bin", size=2500)
    assert (answer.status, answer.entry.size, answer.bytes_delta, answer.files_delta) == (
        201, 2500, 2500, 1,
    )  # fmt: skip
    host.control.uploads["op-2"] = b"y" * 100
    again = serve(host, HomeOp.WRITE, "op-2", path="a/b.bin", size=100, replace=True)
    assert (again.status, again.bytes_delta, again.files_delta) == (200, -2400, 0)
    assert (home(host) / "a" / "b.bin").read_bytes() == b"y" * 100


def test_uploads_are_held_to_the_quota_exactly_however_many_come(host):
    home(host).mkdir(parents=True)
    (home(host) / "old").write_bytes(b"o" * 500)  # walked once: the ledger knows 500 bytes
    host.control.uploads["op-1"] = b"x" * 400
    assert serve(host, HomeOp.WRITE, path="a", size=400, quota=1000).usage.bytes == 900
    host.control.uploads["op-2"] = b"x" * 101
    refused = serve(host, HomeOp.WRITE, "op-2", path="b", size=101, quota=1000)
    assert refused.status == 413 and "room for 100 bytes" in refused.detail
    host.control.uploads["op-3"] = b"x" * 500  # replacing a: its 400 bytes count as room
    replaced = serve(host, HomeOp.WRITE, "op-3", path="a", size=500, replace=True, quota=1000)
    assert (replaced.status, replaced.usage.bytes, replaced.usage.files) == (200, 1000, 2)
    assert not (home(host) / "b").exists()


def test_a_home_that_cannot_be_measured_whole_takes_no_write_under_a_quota(host, monkeypatch):
    from runners.host import homes

    home(host).mkdir(parents=True)
    monkeypatch.setattr(homes, "MAX_DEPTH", 1)
    (home(host) / "a" / "b").mkdir(parents=True)
    host.control.uploads["op-1"] = b"x"
    refused = serve(host, HomeOp.WRITE, path="x", size=1, quota=1000)
    assert refused.status == 507 and "cannot be vouched for" in refused.detail
    host.control.uploads["op-2"] = b"x"
    assert serve(host, HomeOp.WRITE, "op-2", path="x", size=1).status == 201  # no quota


def test_the_ledger_is_forgotten_while_a_run_uses_the_home_and_known_at_its_end(host):
    home(host).mkdir(parents=True)
    assert serve(host, HomeOp.MKDIR, path="d").usage.bytes == 0
    assert host.host.serving.ledger.get(home(host)) is not None
    host.order(spec())
    assert host.host.serving.ledger.get(home(host)) is None
    (home(host) / "made-by-the-run").write_bytes(b"r" * 70)
    host.engine.exit(RUN, 0)
    host.host.sweep(host.identity)
    assert host.host.serving.ledger.get(home(host)).bytes == 70


def test_an_upload_broken_off_leaves_nothing(host):
    host.control.uploads["op-broken"] = b"x" * 2500
    host.control.broken_uploads.add("op-broken")
    broken = serve(host, HomeOp.WRITE, "op-broken", path="cut", size=2500)
    assert broken.status == 502 and "did not come whole" in broken.detail
    assert os.listdir(home(host)) == []  # no draft left either


def test_the_first_change_to_a_home_measures_it_and_a_link_replaced_counts_as_a_file(host):
    (home(host)).mkdir(parents=True)
    (home(host) / "old").write_bytes(b"z" * 40)
    os.symlink("/nowhere", home(host) / "link")
    answer = serve(host, HomeOp.MKDIR, path="new")
    assert answer.status == 201 and (answer.usage.bytes, answer.usage.files) == (48, 1)
    host.control.uploads["op-2"] = b"f" * 10
    over = serve(host, HomeOp.WRITE, "op-2", path="link", size=10, replace=True)
    assert (over.files_delta, over.bytes_delta, over.usage.files) == (1, 2, 2)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files away needs root")
def test_files_put_in_from_outside_belong_to_the_sandbox_user(host):
    serve(host, HomeOp.MKDIR, path="made/here")
    for made in (home(host), home(host) / "made", home(host) / "made" / "here"):
        assert (made.stat().st_uid, made.stat().st_gid) == (1000, 1000)


def test_changes_are_refused_while_a_sandbox_of_the_agent_runs_and_reads_are_not(host):
    host.order(spec())  # agent 7's run is running
    home(host).mkdir(parents=True, exist_ok=True)
    (home(host) / "notes").write_text("hi")
    refused = serve(host, HomeOp.DELETE, path="notes")
    assert refused.status == 409 and f"run {RUN} of this agent is active" in refused.detail
    assert (home(host) / "notes").exists()
    assert serve(host, HomeOp.STAT, "op-2", path="notes").entry.size == 2
    allowed = serve(host, HomeOp.DELETE, "op-3", path="notes", during_runs=True)
    assert allowed.status == 200 and allowed.bytes_delta == -2


def test_a_sandbox_left_from_before_a_restart_counts_as_running(host):
    host.engine.add("left-over", agent_id=AGENT)  # not launched by this process
    refused = serve(host, HomeOp.MKDIR, path="x")
    assert refused.status == 409 and "run left-over" in refused.detail


def test_downloads_stream_a_file_or_a_tar_and_refusals_say_why(host):
    home(host).mkdir(parents=True)
    (home(host) / "data.bin").write_bytes(b"d" * 3000)
    os.symlink("/etc/passwd", home(host) / "link")
    serve(host, HomeOp.READ, path="data.bin")
    assert host.control.sent["op-1"] == b"d" * 3000
    assert host.control.answers["op-1"].entry.size == 3000
    assert serve(host, HomeOp.READ, "op-2").entry.type == "directory"  # the home, as a tar
    with tarfile.open(fileobj=io.BytesIO(host.control.sent["op-2"])) as tar:
        assert tar.extractfile("home/data.bin").read() == b"d" * 3000
        assert "link" in tar.extractfile("home/covey-skipped.txt").read().decode()
    refused = serve(host, HomeOp.READ, "op-3", path="link")
    assert refused.status == 400 and "op-3" not in host.control.sent
    assert serve(host, HomeOp.READ, "op-4", path="../etc").status == 400
    assert serve(host, HomeOp.STAT, "op-5", path="nowhere").status == 404


def test_listing_pages_and_usage_of_a_directory(host):
    home(host).mkdir(parents=True)
    for n in range(30):
        (home(host) / f"f{n:02}").write_bytes(b"x" * n)
    page = serve(host, HomeOp.LIST, offset=10, limit=5)
    assert page.total == 30
    assert [e.name for e in page.entries] == ["f10", "f11", "f12", "f13", "f14"]
    usage = serve(host, HomeOp.USAGE, "op-2")
    assert (usage.space.bytes, usage.space.files) == (sum(range(30)), 30)
    assert usage.usage.bytes == sum(range(30))  # the whole home: the figure to keep
    assert usage.space.largest_files[0].path == "f29"


def test_an_order_no_longer_wanted_is_left_alone(host):
    host.host.serving.serve(1, host.control, "never-ordered")
    assert host.control.answers == {}
