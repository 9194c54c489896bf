"""The Docker seam (runners/host/containers/engine.py) against the real engine and the local
base image.

Containers are inspected with the docker CLI: only runners/host/containers/ may import docker.
"""

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from uuid import uuid4

import pytest

from runners.host.containers.engine import (
    LABEL_AGENT,
    LABEL_RUN,
    LABEL_RUNNER,
    Engine,
    EngineError,
    Sandbox,
    SandboxNotFound,
    SandboxSpec,
)

pytestmark = pytest.mark.docker

TASK = "Fix the büg in parser.py ✓"
WAIT = 20  # seconds; every sandbox here lives well under one


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=30, check=check
    )


def containers_of(runner: str) -> list[str]:
    return docker(
        "ps", "--all", "--quiet", "--filter", f"label={LABEL_RUNNER}={runner}"
    ).stdout.split()


def inspect(container_id: str) -> dict:
    return json.loads(docker("inspect", container_id).stdout)[0]


@pytest.fixture(scope="session")
def runner_name() -> Iterator[str]:
    """A runner name unique to this session; its containers, and its neighbour's, go at the end."""
    name = f"test-{uuid4().hex[:8]}"
    yield name
    for runner in (name, f"{name}-other", f"{name}-old"):
        if left := containers_of(runner):
            docker("rm", "--force", *left, check=False)


@pytest.fixture
def engine(runner_name: str) -> Iterator[Engine]:
    """This session's runner; after each test no container may carry its label."""
    yield Engine(runner_name)
    left = containers_of(runner_name)
    if left:
        docker("rm", "--force", *left, check=False)
    assert not left, f"containers were left behind: {left}"


@pytest.fixture
def launch(engine: Engine) -> Iterator[Callable[[SandboxSpec], Sandbox]]:
    """Launch through the engine; what was launched is removed through it when the test ends."""
    run_ids: list[str] = []

    def launch(spec: SandboxSpec) -> Sandbox:
        run_ids.append(spec.run_id)
        return engine.launch(spec)

    yield launch
    for run_id in run_ids:
        engine.remove(run_id)


@pytest.fixture
def make_spec(tmp_path: Path, base_image: str) -> Callable[..., SandboxSpec]:
    """A spec for agent 7, whose home is under tmp_path; keyword arguments change fields."""

    def make(command: Sequence[str] = ("true",), **changes) -> SandboxSpec:
        spec = SandboxSpec(
            run_id=f"r-{uuid4().hex[:12]}",
            agent_id=7,
            image=base_image,
            command=command,
            task=TASK,
            environment={},
            home=tmp_path / "homes" / "agent-7",
        )
        return replace(spec, **changes)

    return make


def run_dir(spec: SandboxSpec) -> Path:
    return spec.home.parent / ".covey-runs" / spec.run_id


def test_a_run_reports_its_exit_code_and_logs_and_sees_the_task_both_ways(
    engine, launch, make_spec
):
    spec = make_spec(["sh", "-c", "echo hello; cat $COVEY_TASK_FILE; echo $COVEY_TASK; exit 3"])

    launched = launch(spec)
    done = engine.wait(spec.run_id, timeout=WAIT)

    assert (launched.run_id, launched.agent_id) == (spec.run_id, 7)
    assert launched.status in ("running", "exited")
    assert (done.container_id, done.status, done.exit_code) == (launched.container_id, "exited", 3)
    assert done.started_at is not None and done.finished_at is not None
    assert done.started_at <= done.finished_at
    logs = engine.logs(spec.run_id)
    assert logs.startswith("hello\n")
    assert logs.count(TASK) == 2
    assert "hello" not in engine.logs(spec.run_id, tail=1)


def test_launch_is_idempotent_per_run_id(engine, launch, make_spec):
    spec = make_spec(["sh", "-c", "echo once"])

    first = launch(spec)
    engine.wait(spec.run_id, timeout=WAIT)
    second = launch(spec)

    assert second.container_id == first.container_id
    assert second.status == "exited"  # not run again
    assert engine.logs(spec.run_id) == "once\n"
    assert [s.container_id for s in engine.sandboxes()] == [first.container_id]


def _create_by_hand(engine: Engine, spec: SandboxSpec, home: Path) -> None:
    """A container left created but not started, as by a launch that crashed in between."""
    docker(
        "create",
        "--name",
        f"covey-run-{spec.run_id}",
        *("--label", f"{LABEL_RUN}={spec.run_id}"),
        *("--label", f"{LABEL_AGENT}={spec.agent_id}"),
        *("--label", f"{LABEL_RUNNER}={engine.runner}"),
        *("--mount", f"type=bind,source={home},target=/home/agent"),
        spec.image,
        *spec.command,
    )


def test_launch_starts_a_sandbox_that_was_only_created(engine, launch, make_spec, tmp_path):
    spec = make_spec(["sh", "-c", "echo started"])
    _create_by_hand(engine, spec, tmp_path)

    launch(spec)

    assert engine.wait(spec.run_id, timeout=WAIT).exit_code == 0
    assert engine.logs(spec.run_id) == "started\n"


def test_a_sandbox_that_fails_to_start_is_removed(engine, make_spec, tmp_path):
    spec = make_spec(["true"])
    gone = tmp_path / "gone"
    gone.mkdir()
    _create_by_hand(engine, spec, gone)
    gone.rmdir()  # the bind mount's source: start must fail

    with pytest.raises(EngineError, match=f"cannot start the sandbox of run {spec.run_id}"):
        engine.launch(spec)

    assert engine.get(spec.run_id) is None


def test_the_home_survives_across_runs_and_nothing_else_does(engine, launch, make_spec):
    first = make_spec(["sh", "-c", "echo kept > /home/agent/x && echo lost > /tmp/y"])
    launch(first)
    assert engine.wait(first.run_id, timeout=WAIT).exit_code == 0

    second = make_spec(["sh", "-c", "cat /home/agent/x; test -e /tmp/y || echo no-y"])
    launch(second)
    engine.wait(second.run_id, timeout=WAIT)

    assert engine.logs(second.run_id) == "kept\nno-y\n"
    # The engine gives the home to the sandbox's user, so uid 1000 can write in it.
    home = first.home.stat()
    assert (home.st_uid, home.st_gid) == (1000, 1000)
    assert (first.home / "x").stat().st_uid == 1000


def test_the_root_filesystem_is_read_only_and_the_process_is_not_root(engine, launch, make_spec):
    spec = make_spec(
        ["sh", "-c", "id -u; id -g; pwd; echo $HOME; touch /x /etc/x /run/covey/x 2>&1"]
    )

    launch(spec)
    done = engine.wait(spec.run_id, timeout=WAIT)

    logs = engine.logs(spec.run_id)
    assert logs.splitlines()[:4] == ["1000", "1000", "/home/agent", "/home/agent"]
    assert logs.count("Read-only file system") == 3
    assert done.exit_code != 0


def test_the_container_is_created_with_the_sandbox_limits(engine, launch, make_spec):
    spec = make_spec(
        ["true"],
        cpus=0.5,
        memory_mb=64,
        pids=50,
        tmp_mb=16,
        environment={"HTTPS_PROXY": "http://proxy:3128"},
    )

    sandbox = launch(spec)
    engine.wait(spec.run_id, timeout=WAIT)

    info = inspect(sandbox.container_id)
    host = info["HostConfig"]
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == host["MemorySwap"] == 64 * 1024 * 1024
    assert host["PidsLimit"] == 50
    assert host["CapDrop"] == ["ALL"]
    assert not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["ReadonlyRootfs"] is True
    assert host["Privileged"] is False
    assert host["Init"] is True
    assert host["AutoRemove"] is False
    assert host["Tmpfs"] == {"/tmp": "rw,exec,nosuid,nodev,size=16m"}  # noqa: S108
    assert host["LogConfig"] == {
        "Type": "json-file",
        "Config": {"max-file": "2", "max-size": "10m"},
    }
    assert not host["Binds"]
    assert {m["Target"]: (m["Source"], m.get("ReadOnly", False)) for m in host["Mounts"]} == {
        "/home/agent": (str(spec.home), False),
        "/run/covey": (str(run_dir(spec)), True),
    }
    assert sorted(m["Destination"] for m in info["Mounts"]) == ["/home/agent", "/run/covey"]
    assert "docker.sock" not in json.dumps(info)
    config = info["Config"]
    assert info["Name"] == f"/covey-run-{spec.run_id}"
    assert (config["User"], config["WorkingDir"]) == ("1000:1000", "/home/agent")
    assert (config["OpenStdin"], config["Tty"]) == (False, False)
    assert (
        config["Labels"].items()
        >= {
            LABEL_RUN: spec.run_id,
            LABEL_AGENT: "7",
            LABEL_RUNNER: engine.runner,
        }.items()
    )
    assert {
        "HOME=/home/agent",
        "COVEY_TASK_FILE=/run/covey/task",
        f"COVEY_TASK={TASK}",
        "HTTPS_PROXY=http://proxy:3128",
    } <= set(config["Env"])


def test_a_sandbox_joins_the_network_it_is_given(engine, launch, make_spec):
    spec = make_spec(["ls", "/sys/class/net"], network="none")

    sandbox = launch(spec)
    engine.wait(spec.run_id, timeout=WAIT)

    assert inspect(sandbox.container_id)["HostConfig"]["NetworkMode"] == "none"
    assert engine.logs(spec.run_id) == "lo\n"


def test_the_pids_limit_stops_a_fork_bomb(engine, launch, make_spec):
    spec = make_spec(["sh", "-c", "for i in $(seq 1 100); do sleep 5 & done; wait"], pids=20)

    launch(spec)
    done = engine.wait(spec.run_id, timeout=WAIT)

    assert done.exit_code != 0
    logs = engine.logs(spec.run_id)
    assert re.search(r"can(no|')t fork|resource temporarily unavailable", logs, re.I), logs


def test_the_process_has_no_capabilities_and_cannot_gain_any(engine, launch, make_spec):
    spec = make_spec(["grep", "-E", "^(CapEff|CapBnd|NoNewPrivs):", "/proc/self/status"])

    launch(spec)
    engine.wait(spec.run_id, timeout=WAIT)

    status = dict(line.split(":\t") for line in engine.logs(spec.run_id).splitlines())
    # A non-root process has no effective capabilities anyway; the empty bounding set is what
    # cap_drop=ALL adds: nothing (setuid files included) can raise them again.
    assert status == {"CapEff": "0000000000000000", "CapBnd": "0000000000000000", "NoNewPrivs": "1"}


def test_stop_ends_a_sleeping_sandbox_within_the_timeout(engine, launch, make_spec):
    spec = make_spec(["sleep", "600"])
    launch(spec)
    with pytest.raises(TimeoutError):
        engine.wait(spec.run_id, timeout=0.5)

    started = time.monotonic()
    engine.stop(spec.run_id, timeout=10)

    # Docker's init passed SIGTERM on to sleep: no SIGKILL after the timeout was needed.
    assert time.monotonic() - started < 5
    stopped = engine.get(spec.run_id)
    assert stopped is not None
    assert (stopped.status, stopped.exit_code) == ("exited", 128 + 15)


def test_remove_leaves_no_container_and_no_run_directory(engine, make_spec):
    spec = make_spec(["sleep", "600"])
    engine.launch(spec)
    task = run_dir(spec) / "task"
    assert task.read_text(encoding="utf-8") == TASK
    assert task.stat().st_mode & 0o777 == 0o644

    engine.remove(spec.run_id)

    assert engine.get(spec.run_id) is None
    assert (
        docker("ps", "--all", "--quiet", "--filter", f"name=covey-run-{spec.run_id}").stdout == ""
    )
    assert not run_dir(spec).exists()
    assert spec.home.is_dir()  # the home outlives every run


def test_unknown_runs_are_none_and_harmless_to_stop_and_remove(engine):
    assert engine.get("r-unknown") is None
    engine.stop("r-unknown")
    engine.remove("r-unknown")
    with pytest.raises(SandboxNotFound):
        engine.logs("r-unknown")
    with pytest.raises(SandboxNotFound):
        engine.wait("r-unknown", timeout=1)


def test_sandboxes_lists_only_this_runners_containers(
    engine, launch, make_spec, runner_name, tmp_path
):
    other = Engine(f"{runner_name}-other")
    mine = launch(make_spec(["true"]))
    theirs_spec = make_spec(["sleep", "600"], home=tmp_path / "homes" / "agent-8")
    try:
        theirs = other.launch(theirs_spec)

        assert [s.container_id for s in engine.sandboxes()] == [mine.container_id]
        assert [s.container_id for s in other.sandboxes()] == [theirs.container_id]
        assert engine.get(theirs_spec.run_id) is None
        engine.stop(theirs_spec.run_id, timeout=0)
        engine.remove(theirs_spec.run_id)
        assert other.get(theirs_spec.run_id) == theirs  # untouched, still running
    finally:
        other.remove(theirs_spec.run_id)
    assert other.sandboxes() == []


def test_another_installation_with_the_same_runner_name_is_never_touched(
    launch, make_spec, runner_name, tmp_path, base_image
):
    """Two installations on one engine have runners with the same database ids: each sees and
    removes only what carries its own installation key (issue 9, item 6)."""
    ours = Engine(runner_name, installation="ours1234")
    theirs = Engine(runner_name, installation="theirs12")
    spec = make_spec(["sleep", "600"], home=tmp_path / "homes" / "agent-9")
    other_spec = make_spec(["sleep", "600"], home=tmp_path / "homes" / "agent-10")
    try:
        mine = ours.launch(spec)
        other = theirs.launch(other_spec)
        assert inspect(mine.container_id)["Config"]["Labels"]["covey.installation"] == "ours1234"
        assert [s.run_id for s in ours.sandboxes()] == [spec.run_id]
        assert [s.run_id for s in theirs.sandboxes()] == [other_spec.run_id]
        assert ours.get(other_spec.run_id) is None
        ours.stop(other_spec.run_id, timeout=0)
        ours.remove(other_spec.run_id)
        assert theirs.get(other_spec.run_id) == other  # untouched, still running
    finally:
        ours.remove(spec.run_id)
        theirs.remove(other_spec.run_id)


def test_sandboxes_from_before_installation_keys_are_seen_as_legacy(
    make_spec, runner_name, tmp_path
):
    """After an upgrade, a sandbox labelled only with the runner's old name is still found
    (so its run can finish), marked legacy; one with another installation's key is not."""
    old = Engine(f"{runner_name}-old")  # what covey made before installation keys
    spec = make_spec(["sleep", "600"], home=tmp_path / "homes" / "agent-11")
    keyed = make_spec(["sleep", "600"], home=tmp_path / "homes" / "agent-12")
    upgraded = Engine(runner_name, installation="new12345", legacy_runner=f"{runner_name}-old")
    theirs = Engine(f"{runner_name}-old", installation="other123")
    try:
        old.launch(spec)
        theirs.launch(keyed)
        assert [(s.run_id, s.legacy) for s in upgraded.sandboxes()] == [(spec.run_id, True)]
        assert upgraded.get(spec.run_id).legacy
        assert upgraded.get(keyed.run_id) is None
        upgraded.remove(spec.run_id)
        assert old.get(spec.run_id) is None
        assert theirs.get(keyed.run_id).status == "running"
    finally:
        old.remove(spec.run_id)
        theirs.remove(keyed.run_id)


def test_events_report_the_start_and_death_of_this_runners_sandboxes(engine, launch, make_spec):
    since = time.time()
    spec = make_spec(["true"])
    launch(spec)

    seen = []
    with closing(engine.events(since=since, until=time.time() + 10)) as events:
        for run_id, action in events:
            if run_id == spec.run_id:
                seen.append(action)
                if action == "die":
                    break

    assert seen == ["start", "die"]


def test_a_missing_image_is_refused_and_not_pulled(engine, make_spec):
    spec = make_spec(["true"], image="covey-test-missing:nope")

    with pytest.raises(
        EngineError,
        match=re.escape(
            "image covey-test-missing:nope is not on this host: build it (docker build, or"
            " docker pull there) or load it (docker load)"
        ),
    ):
        engine.launch(spec)

    assert engine.get(spec.run_id) is None
    assert not run_dir(spec).exists()
    assert docker("image", "inspect", spec.image, check=False).returncode != 0


def test_a_spec_the_engine_refuses_leaves_no_task_directory(engine, make_spec):
    spec = make_spec(["true"], cpus=1000)  # more than the host has: the engine refuses

    with pytest.raises(EngineError, match=f"cannot create the sandbox of run {spec.run_id}"):
        engine.launch(spec)

    assert engine.get(spec.run_id) is None
    assert not run_dir(spec).exists()


BAD_SPECS: list[tuple[dict[str, object], str]] = [
    ({"home": Path("/")}, "root directory"),
    ({"home": Path("relative/home")}, "absolute path"),
    ({"home": Path("/var")}, "Docker socket"),
    ({"home": Path("/var/run")}, "Docker socket"),
    ({"home": Path("/run")}, "Docker socket"),
    ({"home": Path("/var/run/docker.sock")}, "Docker socket"),
    ({"command": []}, "command"),
    ({"command": "sh -c true"}, "list of arguments"),
    ({"cpus": 0}, "cpus"),
    ({"memory_mb": 0}, "memory_mb"),
    ({"pids": 0}, "pids"),
    ({"tmp_mb": -1}, "tmp_mb"),
    ({"user": "agent"}, "numeric"),
    ({"user": "0:0"}, "root"),
    ({"run_id": "../escape"}, "run id"),
    ({"environment": {"COVEY_TASK": "other"}}, "COVEY_TASK"),
    ({"task": "x" * 200_000}, "task"),
]


@pytest.mark.parametrize(
    ("changes", "message"),
    BAD_SPECS,
    ids=[",".join(f"{k}={v!s:.20}" for k, v in changes.items()) for changes, _ in BAD_SPECS],
)
def test_a_bad_spec_is_refused_before_anything_is_made(
    engine, make_spec, tmp_path, changes, message
):
    spec = make_spec(**changes)

    with pytest.raises(ValueError, match=message):
        engine.launch(spec)

    assert engine.sandboxes() == []
    assert not (tmp_path / "homes").exists()


def test_an_event_stream_the_engine_refuses_is_no_stream(monkeypatch):
    """What a socket proxy in front of Docker may do: answer pings and refuse the event
    stream. The SDK hands the refusal back as a stream that raises only when read; the engine
    says so at once instead (the runner's watcher would take it for an engine come back)."""
    import http.server
    import json
    import threading

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = 200, b"OK"
            if "/events" in self.path:
                status, body = 403, json.dumps({"message": "events are forbidden here"}).encode()
            elif self.path.endswith("/version"):
                body = json.dumps({"ApiVersion": "1.41", "Version": "26.1.5"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            monkeypatch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{server.server_address[1]}")
            engine = Engine("refused")
            assert engine.problem() == ""  # it answers pings
            with pytest.raises(EngineError, match="refuses its event stream: 403"):
                engine.open_events()
        finally:
            server.shutdown()
