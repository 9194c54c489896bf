"""The runner host's logic (runners/host/runner.py) on in-memory seams (tests/fakes.py): what it
does on a launch order, when a sandbox ends or overstays, and when it reconciles. No Docker,
Redis or PostgreSQL: milliseconds. The same paths run for real in test_runs.py."""

import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

import logs
from egress.environment import Isolation
from runners.host import engine_watch, quotas, trust
from runners.host import runner as host_module
from runners.host.engine_watch import HOST_ENGINE_NAME
from runners.host.runner import RELAUNCH_AFTER_SECONDS, HostSettings, RunnerHost
from runners.protocol import (
    ActiveRun,
    EgressGrant,
    HomeChanges,
    HomeUsage,
    LaunchSpec,
    Packages,
    Readiness,
    ReportState,
    ServiceSpec,
)
from tests.fakes import FakeBuilder, FakeControlPlane, FakeEngine, FakeIdentity

RUN = "0b6f6f2e-6c1c-4b7e-9d0c-1f0e5b7c9a11"


def spec(run: str = RUN, enforce: bool = False, timeout: int = 3600) -> LaunchSpec:
    return LaunchSpec(
        run=run, agent=7, image="covey-base:trixie", command=("sh", "-c", "make"), task="t",
        cpus=1.0, memory_mb=512, pids=64, timeout=timeout,
        egress=EgressGrant(enforce=enforce, credentials="acme-builder:tok"),
    )  # fmt: skip


def proxy_check(exit_code: int = 0, output: bytes = b"answered HTTP/1.1 407"):
    """How the proxy check's container ends (the runner's own sandboxes go on running)."""
    return lambda spec: (exit_code, output) if "proxy-check" in spec.command else None


def proxy_starting():
    """A proxy check refused once (the proxy not listening yet), answered from then on."""
    answers = iter([(1, b"ConnectionRefusedError")])

    def proxy(spec):
        if "proxy-check" not in spec.command:
            return None
        return next(answers, (0, b"answered HTTP/1.1 407"))

    return proxy


class Host:
    """A RunnerHost serving one runner, on a FakeEngine and a FakeControlPlane; ``proxy``:
    how its check of the proxy ends (the check itself is the runner's own code)."""

    def __init__(self, tmp_path, proxy_answers=None, clock=time.monotonic, **settings) -> None:
        self.control = FakeControlPlane()
        self.identity = FakeIdentity(self.control)
        self.engines: dict[str, FakeEngine] = {}

        def make_engine(name: str, installation: str, legacy: str) -> FakeEngine:
            engine = self.engines.setdefault(name, FakeEngine(name, installation, legacy))
            engine.runs = proxy_answers or proxy_check()
            return engine

        self.builder = FakeBuilder()
        self.host = RunnerHost(
            {1: self.identity},  # type: ignore[dict-item]
            HostSettings(homes=tmp_path / "homes", **({"proxy_wait": 0.0} | settings)),
            make_engine=make_engine,  # type: ignore[arg-type]
            make_builder=lambda settings: self.builder,  # type: ignore[arg-type,return-value]
            clock=clock,
        )
        self.engine: FakeEngine = self.host.engine(self.identity)  # type: ignore[assignment,arg-type]

    def order(self, launch: LaunchSpec) -> None:
        self.control.specs[launch.run] = launch
        self.host.launch(1, launch.run)


@pytest.fixture
def host(tmp_path):
    return Host(tmp_path)


def test_host_settings_take_an_isolation_level_and_refuse_a_bool(tmp_path):
    """A level is a str, truthy whatever it says: a bool where the level goes is a mistake."""
    assert HostSettings(homes=tmp_path).hard is False
    assert HostSettings(homes=tmp_path, isolation=Isolation.NETWORK).hard is True
    assert HostSettings(homes=tmp_path, isolation="network").isolation is Isolation.NETWORK
    with pytest.raises(ValueError, match="is not a valid Isolation"):
        HostSettings(homes=tmp_path, isolation=True)


def test_a_launch_builds_the_sandbox_from_the_spec_and_reports_it_running(host, tmp_path):
    host.order(spec())
    built = host.engine.specs[RUN]
    assert (built.image, built.command, built.cpus, built.memory_mb, built.pids) == (
        "covey-base:trixie", ["sh", "-c", "make"], 1.0, 512, 64,
    )  # fmt: skip
    assert built.home == tmp_path / "homes" / "1" / "7"
    assert built.environment == {"COVEY_RUN": RUN}  # not enforced: no proxy variables
    assert host.control.states(RUN) == ["running"]


def test_an_enforced_run_is_told_of_the_proxy_with_its_credential(tmp_path):
    enforced = Host(tmp_path, proxy="172.17.0.1:3128")
    enforced.order(spec(enforce=True))
    (check,) = [e for name, e in enforced.engines.items() if name.endswith(".probe")]
    (checked,) = check.specs.values()  # it answered, from the sandboxes' network; then gone
    assert checked.command[-3:] == ["proxy-check", "172.17.0.1", "3128"]
    assert check.sandboxes() == []
    environment = enforced.engine.specs[RUN].environment
    assert environment["HTTPS_PROXY"] == "http://acme-builder:tok@172.17.0.1:3128"
    assert environment["NO_PROXY"] == "localhost,127.0.0.1,::1"


def test_an_enforced_run_without_a_proxy_fails_built_and_nothing_is_made(host):
    host.order(spec(enforce=True))
    assert host.control.states(RUN) == ["built"]
    assert "this runner has no proxy" in host.control.reports[0][1].detail
    assert host.engine.sandboxes() == []


def test_a_proxy_that_does_not_answer_fails_the_launch_saying_so(tmp_path):
    refused = proxy_check(1, b"ConnectionRefusedError: Connection refused")
    checked = Host(tmp_path, refused, proxy="172.17.0.1:3128")
    checked.order(spec(enforce=True))
    assert checked.control.states(RUN) == ["built"]
    assert "does not answer" in checked.control.reports[0][1].detail
    assert checked.engine.sandboxes() == []


def test_a_launch_waits_a_little_for_a_proxy_that_is_still_starting(tmp_path):
    """As under make run, where the proxy starts beside the runner: a launch that finds it not
    answering checks again each second, for up to proxy_wait, rather than fail the run."""
    answers = iter([(1, b"ConnectionRefusedError"), (1, b"ConnectionRefusedError")])

    def proxy(spec):
        if "proxy-check" not in spec.command:
            return None
        return next(answers, (0, b"answered HTTP/1.1 407"))

    waiting = Host(tmp_path, proxy, proxy="172.17.0.1:3128", proxy_wait=5.0)
    started = time.monotonic()
    waiting.order(spec(enforce=True))
    assert waiting.control.states(RUN) == ["running"]
    assert 2 <= time.monotonic() - started < 5  # two more checks, a second apart


def test_a_launch_checks_afresh_rather_than_take_a_failed_check_of_a_proxy_still_starting(
    tmp_path,
):
    """A run queued in make run's first seconds: the runner's start check found the proxy not
    listening yet, and a launch a moment later takes no answer from it (it was kept 10 s and
    blamed COVEY_RUNNER_PROXY): it checks again, and the proxy answers by then."""
    proxy = proxy_starting()
    starting = Host(tmp_path, proxy, proxy="172.17.0.1:3128", proxy_wait=0.5)
    assert "does not answer" in starting.host.start_proxy_checks()[1]
    time.sleep(trust.PROXY_WAIT_STEP_SECONDS + 0.1)  # older than a shared check, not 10 s
    starting.order(spec(enforce=True))
    assert starting.control.states(RUN) == ["running"]


def test_a_launch_whose_proxy_never_answers_fails_saying_how_long_it_waited(tmp_path):
    silent = Host(
        tmp_path, proxy_check(1, b"ConnectionRefusedError"), proxy="172.17.0.1:3128",
        proxy_wait=1.5,
    )  # fmt: skip
    started = time.monotonic()
    silent.order(spec(enforce=True))
    assert 1 <= time.monotonic() - started < 3  # a check, a second, a check
    assert silent.control.states(RUN) == ["built"]
    detail = silent.control.reports[0][1].detail
    assert "no answer in 1.5 s (COVEY_RUNNER_PROXY_WAIT_SECONDS): " in detail
    assert "the egress proxy at 172.17.0.1:3128 does not answer" in detail


def test_a_failed_proxy_check_is_repeated_soon_and_a_passed_one_seldom(tmp_path):
    now, answer = [0.0], [proxy_check(1, b"ConnectionRefusedError")]
    checked = Host(tmp_path, lambda s: answer[0](s), lambda: now[0], proxy="172.17.0.1:3128")
    runs = [spec(run=f"0b6f6f2e-6c1c-4b7e-9d0c-1f0e5b7c9a{n:02}", enforce=True) for n in range(3)]

    def checks() -> int:
        return sum(e.launches for name, e in checked.engines.items() if name.endswith(".probe"))

    checked.order(runs[0])
    checked.order(runs[1])  # at once: the failed answer stands
    assert [checked.control.states(r.run) for r in runs[:2]] == [["built"], ["built"]]
    assert checks() == 1
    now[0] += trust.PROXY_RECHECK_SECONDS
    answer[0] = proxy_check()  # the proxy is up now
    checked.order(runs[2])
    assert checked.control.states(runs[2].run) == ["running"] and checks() == 2
    now[0] += trust.PROXY_CHECK_EVERY_SECONDS - 1
    checked.host.trust.recheck_proxy(checked.identity)  # what each heartbeat does
    assert checks() == 2
    now[0] += 1
    checked.host.trust.recheck_proxy(checked.identity)
    assert checks() == 3


def test_a_runner_the_host_took_on_after_it_started_is_checked_at_its_first_heartbeat(
    tmp_path,
):
    checked = Host(tmp_path, proxy_check(), proxy="172.17.0.1:3128")
    assert "has not been checked yet" in checked.host.trust.problem(checked.identity)
    checked.host.trust.recheck_proxy(checked.identity)  # what each heartbeat does
    assert checked.host.trust.problem(checked.identity) == ""


def test_a_docker_engine_that_restarts_stops_work_until_it_is_back_and_proved(tmp_path):
    """The runner holds the engine's event stream: when it ends, no launch is taken until the
    engine answers and the proxy is proved again; a sandbox stopped with the engine is
    reported as such (the hard-isolation case, with its probe, runs for real in
    test_isolated_runs.py)."""
    down = [""]

    def proxy(launch):
        if "proxy-check" not in launch.command:
            return None
        return (1, b"ConnectionRefusedError: the engine is gone") if down[0] else (0, b"407")

    checked = Host(tmp_path, proxy, proxy="172.17.0.1:3128")
    assert checked.host.start_proxy_checks() == {1: ""}
    checked.order(spec(enforce=True))
    watcher = threading.Thread(target=checked.host.docker.watch, daemon=True)
    watcher.start()
    try:
        wait(lambda: getattr(checked.engines.get(HOST_ENGINE_NAME), "held", None) is not None)
        docker = checked.engines[HOST_ENGINE_NAME]
        for engine in checked.engines.values():
            engine.down = down[0] = "the Docker engine does not answer: restarting"
        checked.engine.exit(RUN, 143)  # the engine stops its containers
        docker.held.end()
        wait(lambda: checked.host.trust.problem(checked.identity) != "")
        assert "the Docker engine went away at" in checked.host.problems(checked.identity)["egress"]
        later = spec(run="0b6f6f2e-6c1c-4b7e-9d0c-1f0e5b7c9a12", enforce=True)
        checked.order(later)  # the launch's own proxy check fails while the engine is gone
        assert checked.control.states(later.run) == ["built"]
        checked.host.sweep(checked.identity)
        ended = [seen for run, seen in checked.control.reports if run == RUN][-1]
        assert (ended.state, ended.exit_code, ended.detail) == (
            ReportState.EXITED, 143, "docker-engine-restarted",
        )  # fmt: skip
        for engine in checked.engines.values():
            engine.down = down[0] = ""
        wait(lambda: checked.host.docker.outages[-1][1] is not None)
        wait(lambda: checked.host.trust.problem(checked.identity) == "")
        again = spec(run="0b6f6f2e-6c1c-4b7e-9d0c-1f0e5b7c9a13", enforce=True)
        checked.order(again)
        assert checked.control.states(again.run) == ["running"]
    finally:
        checked.host.stop()
        watcher.join(5)
    assert not watcher.is_alive()


def test_an_engine_that_answers_the_stream_with_an_error_is_not_taken_for_back(
    tmp_path, monkeypatch
):
    """An engine that answers its event stream with an error (one going down) is no engine
    back (Engine.open_events raises: tests/runners/test_engine.py), and the watcher does not
    spin on it."""
    monkeypatch.setattr(engine_watch, "ENGINE_RETRY_SECONDS", 0.02)
    checked = Host(tmp_path, proxy="172.17.0.1:3128")
    docker = checked.host.make_engine(HOST_ENGINE_NAME, "", "")
    docker.down = "the Docker engine refuses its event stream: 500 the daemon is shutting down"
    watcher = threading.Thread(target=checked.host.docker.watch, daemon=True)
    watcher.start()
    try:
        time.sleep(0.5)  # some 25 rounds
        assert [back for _, back in checked.host.docker.outages] == [None]  # lost once, never back
        assert "the Docker engine went away" in checked.host.trust.problem(checked.identity)
    finally:
        checked.host.stop()
        watcher.join(5)
    assert not watcher.is_alive()


def test_a_runner_whose_engine_goes_tells_the_control_plane_at_once(tmp_path):
    checked = Host(tmp_path, proxy="172.17.0.1:3128")
    beating = threading.Thread(target=checked.host.heartbeats, args=(3600,), daemon=True)
    beating.start()
    try:
        wait(lambda: checked.control.heartbeats == 1)
        checked.host.docker.lost("its event stream ended")
        wait(lambda: checked.control.heartbeats == 2)  # not an hour later
        assert "the Docker engine went away" in checked.control.problems[-1]
    finally:
        checked.host.stop()
        beating.join(5)


def test_a_probe_begun_before_the_engine_went_proves_nothing_after(tmp_path, monkeypatch):
    """A probe that passes, but began before the engine went away, does not lift the distrust
    (it proved the shape of before)."""
    from runners.probe import checks
    from runners.protocol import ProbePlan

    began, finish = threading.Event(), threading.Event()

    def probe(*args, **kwargs):
        began.set()
        finish.wait(5)
        ok = checks.Result("direct", "203.0.113.9:443", checks.Verdict.OK, "refused")
        return trust.probing.Report([ok])

    monkeypatch.setattr(trust.probing, "run", probe)
    checked = Host(tmp_path, isolation=Isolation.NETWORK)
    client = checked.identity.client
    client.begin_probe = lambda *args, **kwargs: ProbePlan("p-1")
    client.report_probe = lambda *args, **kwargs: None
    monkeypatch.setattr(trust.Trust, "_where", lambda self, identity: None)
    probing = threading.Thread(target=checked.host.trust.probe, args=(checked.identity,))
    probing.start()
    assert began.wait(5)
    checked.host.docker.lost("its event stream ended")
    finish.set()
    probing.join(5)
    assert checked.host.trust.probe_state(checked.identity).passed
    assert "the Docker engine went away" in checked.host.trust.problem(checked.identity)


def test_only_a_sandbox_running_when_the_engine_went_is_said_to_have_stopped_with_it(host):
    gone = datetime.now(UTC) - timedelta(minutes=5)
    host.host.docker.outages = [(gone, gone + timedelta(seconds=20))]
    host.order(spec())
    sandbox = host.engine.sandboxes_by_run[RUN]
    stopped = replace(sandbox, started_at=gone - timedelta(minutes=1), finished_at=gone)
    later = gone + timedelta(seconds=25)
    after = replace(sandbox, started_at=later, finished_at=later + timedelta(seconds=5))
    assert host.host.docker.ended_with_it(stopped)
    assert not host.host.docker.ended_with_it(after)  # failed on its own, just after


def wait(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "it did not happen in time"
        time.sleep(0.01)


def test_an_engine_refusal_is_reported_as_built_with_its_reason(host):
    host.engine.refuse = "the image covey-base:trixie is not on this host"
    host.order(spec())
    assert host.control.states(RUN) == ["built"]
    assert host.control.reports[0][1].detail == "the image covey-base:trixie is not on this host"


def test_a_run_no_longer_ours_is_not_started(host):
    host.host.launch(1, RUN)  # the control plane has no spec for it (cancelled, moved)
    assert host.engine.sandboxes() == [] and host.control.reports == []


def test_an_order_that_comes_again_while_its_launch_runs_is_dropped(host):
    """A redelivered order (or the reconcile's relaunch) while the first launch is still
    building the sandbox: the host launches once."""
    host.engine.hold = threading.Event()
    host.control.specs[RUN] = spec()
    first = threading.Thread(target=host.host.launch, args=(1, RUN))
    first.start()
    while host.engine.launches == 0:
        time.sleep(0.001)
    host.host.launch(1, RUN)  # returns at once: that run is being launched
    host.engine.hold.set()
    first.join(5)
    assert host.engine.launches == 1
    assert host.control.states(RUN) == ["running"]


def test_an_ended_sandbox_is_reported_with_its_exit_code_and_log_then_removed(host):
    host.order(spec())
    host.engine.exit(RUN, 3, b"broken\n")
    host.host.sweep(host.identity)
    assert host.control.states(RUN) == ["running", "exited"]
    ended = host.control.reports[-1][1]
    assert (ended.exit_code, ended.detail) == (3, "")
    assert host.control.logs[RUN][0] == "broken\n"
    assert host.engine.removed == [RUN]


def test_an_overdue_sandbox_is_stopped_once_and_ends_timed_out(host):
    host.order(spec(timeout=60))
    started = datetime.now(UTC) - timedelta(seconds=120)
    sandbox = host.engine.sandboxes_by_run[RUN]
    host.engine.sandboxes_by_run[RUN] = replace(sandbox, started_at=started)
    host.host.sweep(host.identity)  # stopped for its time (FakeEngine: it exits at once)
    assert host.engine.stopped == [RUN]
    ended = host.engine.sandboxes_by_run[RUN]
    host.engine.sandboxes_by_run[RUN] = replace(ended, finished_at=started + timedelta(seconds=61))
    host.host.sweep(host.identity)
    assert host.control.reports[-1][1].state == ReportState.EXITED
    assert host.control.reports[-1][1].detail == "timeout"
    assert host.engine.stopped == [RUN]


def test_a_report_the_control_plane_cannot_take_keeps_the_sandbox_for_the_next_sweep(host):
    host.order(spec())
    host.engine.exit(RUN, 0)
    host.control.unreachable = True
    with pytest.raises(host_module.ControlPlaneError):
        host.host.sweep(host.identity)
    assert host.engine.get(RUN) is not None  # nothing lost: reported when it answers again
    host.control.unreachable = False
    host.host.sweep(host.identity)
    assert host.control.states(RUN)[-1] == "exited" and host.engine.get(RUN) is None


def reported_running(host) -> None:
    """Wait (5 s at most) for RUN's launch on the reconcile's thread to report it running."""
    deadline = time.monotonic() + 5
    while host.control.states(RUN) != ["running"] and time.monotonic() < deadline:
        time.sleep(0.01)


class TestReconcile:
    def test_a_sandbox_no_run_knows_is_removed(self, host):
        host.engine.add("r-leftover")
        host.host.reconcile(host.identity)
        assert host.engine.removed == ["r-leftover"]

    def test_a_legacy_sandbox_no_run_knows_is_left_alone(self, host):
        host.engine.add("r-another-installations", legacy=True)
        host.host.reconcile(host.identity)
        assert host.engine.removed == [] and host.engine.get("r-another-installations")

    def test_a_running_run_whose_sandbox_is_gone_is_reported_vanished(self, host):
        host.control.active[RUN] = ActiveRun(RUN, "running", False, 10.0, 0)
        host.host.reconcile(host.identity)
        assert host.control.states(RUN) == ["vanished"]
        assert "no sandbox on edge-1" in host.control.reports[0][1].detail

    def test_a_run_whose_order_was_lost_is_launched_without_holding_up_the_watcher(self, host):
        host.control.specs[RUN] = spec()
        host.control.active[RUN] = ActiveRun(RUN, "placed", False, RELAUNCH_AFTER_SECONDS, 0)
        host.engine.hold = threading.Event()  # a slow launch (an image to build, services)
        started = time.monotonic()
        host.host.reconcile(host.identity)
        assert time.monotonic() - started < 1  # the launch goes on a thread of its own
        host.engine.hold.set()
        reported_running(host)
        assert host.engine.get(RUN) is not None
        assert host.control.states(RUN) == ["running"]

    def test_a_run_placed_a_moment_ago_waits_for_its_order(self, host):
        host.control.specs[RUN] = spec()
        host.control.active[RUN] = ActiveRun(RUN, "placed", False, 1.0, 0)
        host.host.reconcile(host.identity)
        assert host.engine.get(RUN) is None

    def test_a_sandbox_made_and_never_started_is_started_once_its_order_is_lost(self, host):
        """Its runner was killed between making the sandbox and starting it."""
        host.control.specs[RUN] = spec()
        host.engine.add(RUN, "created")
        host.control.active[RUN] = ActiveRun(RUN, "starting", False, 1.0, 0)
        host.host.reconcile(host.identity)  # its order may still come
        time.sleep(0.1)
        assert host.engine.get(RUN).status == "created" and host.control.states(RUN) == []
        host.control.active[RUN] = ActiveRun(RUN, "starting", False, RELAUNCH_AFTER_SECONDS, 0)
        host.host.reconcile(host.identity)
        reported_running(host)
        assert host.control.states(RUN) == ["running"]
        assert host.engine.get(RUN).status == "running"

    def test_a_missed_cancellation_stops_the_sandbox(self, host):
        host.order(spec())
        host.control.active[RUN] = ActiveRun(RUN, "running", True, 5.0, 0)
        host.host.reconcile(host.identity)
        assert host.engine.stopped == [RUN]

    def test_a_lost_running_report_is_sent_again(self, host):
        host.engine.add(RUN)
        host.control.active[RUN] = ActiveRun(RUN, "starting", False, 5.0, 0)
        host.host.reconcile(host.identity)
        assert host.control.states(RUN) == ["running"]


def test_output_goes_live_and_the_whole_log_carries_the_count(host):
    host.engine.output[RUN] = "hello ✓\n".encode()
    host.order(spec())
    live = host.host.outputs.live(RUN)
    assert live is not None
    live.reader.join(2)  # the stream has ended: what is pending goes now
    host.host.outputs.ship(host.identity)
    assert host.control.output[RUN] == "hello ✓\n"
    host.engine.exit(RUN, 0)
    host.host.sweep(host.identity)
    assert host.control.logs[RUN] == ("hello ✓\n", len("hello ✓\n".encode()))


def test_output_of_a_sandbox_stopped_while_its_following_starts_is_not_kept(host):
    """The watcher finishes a sandbox that exited at once while its launch is still setting up
    the live output: the follower must not be listed afterwards (it would never go)."""
    outputs = host.host.outputs
    follow_logs = host.engine.follow_logs

    def finished_meanwhile(run_id):
        stream = follow_logs(run_id)
        assert outputs.stop(run_id) is None  # only the placeholder was there
        return stream

    host.engine.follow_logs = finished_meanwhile
    host.order(spec())
    assert outputs.live(RUN) is None


def test_the_exit_report_says_what_the_run_changed_in_its_home(host, tmp_path):
    home = tmp_path / "homes" / "1" / "7"
    home.mkdir(parents=True)
    (home / "kept.txt").write_text("same")
    (home / "edited.txt").write_text("before")
    (home / "gone.txt").write_text("bye")
    host.order(spec())
    # What the agent does while it runs:
    (home / "edited.txt").write_text("after, and longer")
    (home / "gone.txt").unlink()
    (home / "src").mkdir()
    (home / "src" / "new.py").write_text("x")
    host.engine.exit(RUN, 0)
    host.host.sweep(host.identity)
    (exited,) = [seen for run, seen in host.control.reports if seen.state == ReportState.EXITED]
    assert exited.changes == HomeChanges(
        added=("src", "src/new.py"), changed=("edited.txt",), removed=("gone.txt",),
        added_total=2, changed_total=1, removed_total=1,
    )  # fmt: skip


def test_a_run_whose_home_was_not_seen_before_reports_no_changes_rather_than_wrong_ones(host):
    host.engine.add(RUN)  # running before this runner (re)started: no manifest from before
    host.control.active[RUN] = ActiveRun(RUN, "running", False, 5.0, 0)
    host.engine.exit(RUN, 0)
    host.host.sweep(host.identity)
    (exited,) = [seen for run, seen in host.control.reports if seen.state == ReportState.EXITED]
    assert exited.changes is None


def test_a_home_over_its_quota_is_refused_before_a_sandbox_is_built(host, tmp_path):
    home = tmp_path / "homes" / "1" / "7"
    home.mkdir(parents=True)
    (home / "big").write_bytes(b"x" * 3000)
    host.order(replace(spec(), home_quota_bytes=2048))
    assert host.control.states(RUN) == ["built"]
    refused = host.control.reports[0][1]
    assert refused.detail.startswith("the home holds 2.9 KiB, more than its quota of 2.0 KiB")
    assert refused.usage == HomeUsage(bytes=3000, files=1)
    assert host.engine.sandboxes() == []


def test_what_the_home_holds_is_reported_when_a_run_starts_and_ends(host, tmp_path):
    home = tmp_path / "homes" / "1" / "7"
    home.mkdir(parents=True)
    (home / "a").write_bytes(b"x" * 10)
    host.order(replace(spec(), home_quota_bytes=1024))
    (home / "b").write_bytes(b"x" * 5)
    host.engine.exit(RUN, 0)
    host.host.sweep(host.identity)
    usage = {seen.state: seen.usage for _, seen in host.control.reports}
    assert usage == {
        ReportState.RUNNING: HomeUsage(bytes=10, files=1),
        ReportState.EXITED: HomeUsage(bytes=15, files=2),
    }


def test_a_run_whose_home_passes_its_quota_is_stopped_at_the_next_measurement(tmp_path):
    now = [0.0]
    watched = Host(tmp_path, clock=lambda: now[0])
    home = tmp_path / "homes" / "1" / "7"
    home.mkdir(parents=True)
    (home / "small").write_bytes(b"x" * 50)
    watched.order(replace(spec(), home_quota_bytes=100))
    (home / "grown").write_bytes(b"x" * 200)  # what the run writes
    watched.host.quotas.check()  # not due yet: nothing is measured
    assert watched.engine.stopped == []
    now[0] += quotas.HOME_CHECK_SECONDS
    watched.host.quotas.check()
    assert watched.engine.stopped == [RUN]
    watched.host.sweep(watched.identity)
    exited = watched.control.reports[-1][1]
    assert exited.state == ReportState.EXITED
    assert exited.detail == "home-over-quota: its home passed its quota (250 bytes of 100 bytes)"


def test_a_run_without_a_quota_is_never_measured_while_it_runs(tmp_path):
    now = [0.0]
    free = Host(tmp_path, clock=lambda: now[0])
    free.order(spec())  # home_quota_bytes 0: no limit
    now[0] += 3600
    free.host.quotas.check()
    assert free.engine.stopped == []


def test_a_home_that_cannot_be_measured_whole_is_refused_when_it_has_a_quota(host, tmp_path):
    home = tmp_path / "homes" / "1" / "7"
    home.joinpath(*["d"] * 140).mkdir(parents=True)  # deeper than a walk goes
    host.order(replace(spec(), home_quota_bytes=1024 * 1024))
    assert host.control.states(RUN) == ["built"]
    assert "could not be measured whole" in host.control.reports[0][1].detail
    assert host.engine.sandboxes() == []
    host.order(replace(spec(run=RUN.replace("a11", "a12")), home_quota_bytes=0))  # no quota
    assert host.control.states(RUN.replace("a11", "a12")) == ["running"]


def test_a_running_home_that_cannot_be_measured_whole_is_stopped(tmp_path):
    now = [0.0]
    watched = Host(tmp_path, clock=lambda: now[0])
    home = tmp_path / "homes" / "1" / "7"
    home.mkdir(parents=True)
    watched.order(replace(spec(), home_quota_bytes=1024 * 1024))
    home.joinpath(*["d"] * 140).mkdir(parents=True)  # what the run does
    now[0] += quotas.HOME_CHECK_SECONDS
    watched.host.quotas.check()
    assert watched.engine.stopped == [RUN]
    watched.host.sweep(watched.identity)
    assert "its home could not be measured whole" in watched.control.reports[-1][1].detail


def test_an_exit_report_sent_again_says_what_the_run_did_not_what_came_after(host, tmp_path):
    """The control plane is away when the sandbox ends: the next sweep sends the same changes,
    measured when it ended, not what the home holds by then."""
    home = tmp_path / "homes" / "1" / "7"
    home.mkdir(parents=True)
    host.order(spec())
    (home / "made.txt").write_text("by the run")
    host.engine.exit(RUN, 0)
    host.control.unreachable = True
    with pytest.raises(host_module.ControlPlaneError):
        host.host.sweep(host.identity)
    (home / "later.txt").write_text("not by the run")  # e.g. an upload after it ended
    host.control.unreachable = False
    host.host.sweep(host.identity)
    (exited,) = [seen for _, seen in host.control.reports if seen.state == ReportState.EXITED]
    assert exited.changes is not None and exited.changes.added == ("made.txt",)


# --- workplaces ----------------------------------------------------------------------------------

DB = ServiceSpec("db", "postgres:16", ("POSTGRES_PASSWORD=x",), ready=Readiness(("pg_isready",)))


def test_a_workplace_with_packages_runs_in_the_image_built_for_them(host):
    packages = (Packages("apt", ("jq",)),)
    host.order(replace(spec(), packages=packages, workplace="dev v2"))
    assert host.engine.specs[RUN].image == "covey-workplace:covey-base:trixie+jq"
    running = host.control.reports[-1][1]
    assert running.image_id == "sha256:covey-workplace:covey-base:trixie+jq"
    host.order(replace(spec(run=RUN.replace("a11", "a12")), packages=packages))
    assert host.builder.built == {"covey-workplace:covey-base:trixie+jq": 2}  # asked; it reuses


def test_a_workplace_without_packages_builds_nothing(host):
    host.order(replace(spec(), packages=(Packages("apt", ()),)))
    assert host.engine.specs[RUN].image == "covey-base:trixie"
    assert host.builder.built == {}


def test_a_build_that_fails_fails_the_run_with_its_last_lines_in_status_and_log(host):
    host.builder.fail = "E: Unable to locate package nope"
    host.order(replace(spec(), packages=(Packages("apt", ("nope",)),), workplace="dev v3"))
    assert host.control.states(RUN) == ["built"]
    detail = host.control.reports[-1][1].detail
    assert detail == "the image of dev v3 could not be built: E: Unable to locate package nope"
    assert "Unable to locate package nope" in host.control.logs[RUN][0]
    assert host.engine.sandboxes() == []


def test_services_go_with_the_spec_and_are_reported_with_the_run(host):
    host.order(replace(spec(), services=(DB,)))
    assert host.engine.specs[RUN].services == (DB,)
    running = host.control.reports[-1][1]
    assert [(s.name, s.image_id, s.ready_seconds) for s in running.services] == [
        ("db", "sha256:postgres:16", 0.5)
    ]
    host.engine.exit(RUN, 0)
    host.host.sweep(host.identity)
    ended = host.control.reports[-1][1]
    assert [(s.name, s.log) for s in ended.services] == [("db", "log of db\n")]
    assert host.engine.parts == {}  # removed with the sandbox


def test_a_service_that_is_not_ready_fails_the_run_naming_it(host):
    host.engine.not_ready = "db"
    host.order(replace(spec(), services=(DB,)))
    assert host.control.states(RUN) == ["built"]
    refused = host.control.reports[-1][1]
    assert refused.detail == "service db did not become ready"
    assert [(s.name, s.log) for s in refused.services] == [("db", "no!\n")]


def test_services_left_by_a_launch_that_died_are_removed_at_the_reconcile(host):
    host.engine.parts["gone-run"] = []
    host.host.reconcile(host.identity)
    assert host.engine.parts == {}


def test_the_services_of_a_run_launched_during_the_reconcile_are_left_alone(host):
    """A run placed after the control plane listed the active runs, launched before the
    leftovers are looked at: its sandbox is there, so its services are a live run's."""
    listed = host.control.active_runs

    def launch_meanwhile():
        found = listed()
        host.order(replace(spec(), services=(DB,)))
        return found

    host.control.active_runs = launch_meanwhile
    host.host.reconcile(host.identity)
    assert RUN in host.engine.parts and host.engine.get(RUN) is not None


def test_services_are_reached_directly_not_through_the_proxy(tmp_path):
    enforced = Host(tmp_path, proxy="172.17.0.1:3128")
    enforced.order(replace(spec(enforce=True), services=(DB,)))
    environment = enforced.engine.specs[RUN].environment
    assert environment["NO_PROXY"] == environment["no_proxy"] == "localhost,127.0.0.1,::1,db"


def test_a_sandbox_being_removed_does_not_hold_its_home(host):
    host.engine.add("r-old", status="removing", agent_id=7)
    assert host.host._home_busy(1, 7) == ""
    host.engine.add("r-new", status="running", agent_id=7)
    assert host.host._home_busy(1, 7) == "run r-new of this agent is active"


def test_at_exit_make_runs_runner_removes_every_sandbox_running_or_not(host):
    host.order(spec())
    host.order(spec(run="0b6f6f2e-6c1c-4b7e-9d0c-1f0e5b7c9a99"))
    assert len(host.engine.sandboxes()) == 2
    # A proxy check cut short (its thread stopped mid-way): its container goes too.
    checks = host.host.trust.probe_engine(host.identity)
    checks.add("proxy-check-0123456789ab", status="running")
    assert host.host.remove_sandboxes() == 3
    assert host.engine.sandboxes() == [] and checks.sandboxes() == []
    # The next start says what became of their runs (the proxy check was no run).
    assert host.host.removed_at_exit.keys() == {RUN, "0b6f6f2e-6c1c-4b7e-9d0c-1f0e5b7c9a99"}
    host.control.active[RUN] = ActiveRun(RUN, "running", False, 10.0, 0)
    host.host.reconcile(host.identity)
    assert host.control.reports[-1][1].detail.startswith("removed when edge-1 stopped, 20")


def test_at_start_a_missing_default_image_is_named_for_each_runner(host):
    assert host.host.missing_default_image("covey-workplace:latest") == {}
    host.engine.absent_images.add("covey-workplace:latest")
    assert host.host.missing_default_image("covey-workplace:latest") == {
        1: "image covey-workplace:latest is not on this host"
    }


def test_at_start_the_proxy_check_waits_for_a_proxy_still_starting(tmp_path, caplog):
    """Quietly: a proxy a moment from listening is no news; one that never answers is said."""
    proxy = proxy_starting()
    starting = Host(tmp_path, proxy, proxy="172.17.0.1:3128", proxy_wait=5.0)
    assert starting.host.start_proxy_checks() == {1: ""}
    assert "does not answer" not in caplog.text
    assert "sandboxes reach the egress proxy at 172.17.0.1:3128" in caplog.text
    hurried = Host(tmp_path, proxy_check(1, b"ConnectionRefusedError"), proxy="172.17.0.1:3128")
    assert "does not answer" in hurried.host.start_proxy_checks()[1]  # proxy_wait 0: at once
    assert "does not answer" in hurried.host.start_proxy_checks()[1]  # asked again: not said
    assert caplog.text.count("does not answer") == 1


def test_its_lines_about_a_run_carry_the_run_its_agent_and_runner(host, caplog):
    logs.install()
    with caplog.at_level("INFO", logger="runners.host.runner"):
        host.order(spec(enforce=True))  # no proxy: refused, and said
        host_module.logger.info("after the launch")
    (refused,) = [r for r in caplog.records if "could not be built" in r.getMessage()]
    assert logs.ids_of(refused) == {"run_id": RUN, "agent_id": 7, "runner_id": 1}
    assert logs.ids_of(caplog.records[-1]) == {}
