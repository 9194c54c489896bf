"""In-memory stand-ins for covey's own seams, for fast tests of the logic behind them: the
Docker seam (runners/host/containers/engine.py) and the runner's control-plane client
(runners/host/client.py). Each keeps what was done to it so a test can say what must have
happened; the real seams have their own tests against the real Docker and control plane."""

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from egress.environment import Isolation
from runners.host.client import ControlPlaneError, OutputBehind
from runners.host.containers.builds import BuildFailed
from runners.host.containers.engine import (
    EngineError,
    LogStream,
    Sandbox,
    SandboxSpec,
    ServiceNotReady,
)
from runners.protocol import (
    ActiveRun,
    ActiveStatus,
    HomeAnswer,
    HomeOrder,
    LaunchSpec,
    Packages,
    ReportState,
    RunnerInfo,
    RunReport,
    RunStatusAnswer,
    ServiceRecord,
)


class FakeEngine:
    """Sandboxes in a dict; ``exit`` ends one as if its process had, ``refuse`` makes the next
    launch fail the way Docker would, ``runs`` says how a sandbox ends by itself at once (its
    exit code and output; None: it goes on running)."""

    def __init__(self, name: str, installation: str = "", legacy: str = "") -> None:
        self.name, self.installation, self.legacy = name, installation, legacy
        self.sandboxes_by_run: dict[str, Sandbox] = {}
        self.specs: dict[str, SandboxSpec] = {}
        self.output: dict[str, bytes] = {}
        self.stopped: list[str] = []
        self.removed: list[str] = []
        self.refuse = ""
        self.launches = 0  # calls, idempotent or not
        self.hold: threading.Event | None = None  # set: launches wait for it (a slow engine)
        self.runs: Callable[[SandboxSpec], tuple[int, bytes] | None] = lambda spec: None
        self.parts: dict[str, list[ServiceRecord]] = {}  # runs' services, as started
        self.not_ready = ""  # a service of this name never becomes ready
        self.absent_images: set[str] = set()  # every other image is on this host
        self.down = ""  # why the engine does not answer ("": it does)

    def problem(self) -> str:
        return self.down

    def open_events(self) -> "Held":
        if self.down:
            raise EngineError(self.down)
        self.held = Held()
        return self.held

    def missing_image(self, image: str) -> str:
        return f"image {image} is not on this host" if image in self.absent_images else ""

    # --- what a test does --------------------------------------------------------------------

    def add(
        self, run_id: str, status: str = "running", *, legacy: bool = False, agent_id: int = 1
    ) -> Sandbox:
        """A sandbox that is already there (a leftover, another installation's, …)."""
        sandbox = Sandbox(
            run_id, agent_id, f"c-{run_id}", status, None, _now(), None, legacy=legacy
        )
        self.sandboxes_by_run[run_id] = sandbox
        return sandbox

    def exit(self, run_id: str, code: int, output: bytes = b"") -> None:
        sandbox = self.sandboxes_by_run[run_id]
        self.output[run_id] = self.output.get(run_id, b"") + output
        self.sandboxes_by_run[run_id] = replace(
            sandbox, status="exited", exit_code=code, finished_at=_now()
        )

    # --- the seam ----------------------------------------------------------------------------

    def launch(self, spec: SandboxSpec) -> Sandbox:
        self.launches += 1
        if self.hold is not None:
            self.hold.wait(5)
        if self.refuse:
            raise EngineError(self.refuse)
        if (made := self.sandboxes_by_run.get(spec.run_id)) is not None:
            if made.status == "created":  # made, never started: started now, as Docker's is
                made = self.sandboxes_by_run[spec.run_id] = replace(made, status="running")
            return made
        self.specs[spec.run_id] = spec
        if spec.services:
            names = [service.name for service in spec.services]
            if self.not_ready in names:
                record = ServiceRecord(self.not_ready, f"sha256:{self.not_ready}", log="no!\n")
                raise ServiceNotReady(f"service {self.not_ready} did not become ready", record)
            self.parts[spec.run_id] = [
                ServiceRecord(s.name, f"sha256:{s.image}", ready_seconds=0.5) for s in spec.services
            ]
        sandbox = Sandbox(
            spec.run_id, spec.agent_id, f"c-{spec.run_id}", "running", None, _now(), None,
            timeout=spec.timeout, image_id=f"sha256:{spec.image}",
        )  # fmt: skip
        self.sandboxes_by_run[spec.run_id] = sandbox
        if (ended := self.runs(spec)) is not None:
            self.exit(spec.run_id, *ended)
            return self.sandboxes_by_run[spec.run_id]
        return sandbox

    def wait(self, run_id: str, timeout: float) -> Sandbox:
        sandbox = self.sandboxes_by_run[run_id]
        if sandbox.status == "running":
            raise TimeoutError(f"run {run_id} still running after {timeout} s")
        return sandbox

    def get(self, run_id: str) -> Sandbox | None:
        return self.sandboxes_by_run.get(run_id)

    def sandboxes(self) -> list[Sandbox]:
        return sorted(self.sandboxes_by_run.values(), key=lambda s: s.run_id)

    def gateway(self, network: str | None = None) -> str:
        return "172.17.0.1"

    def logs(self, run_id: str, tail: int | None = None) -> str:
        return self.output.get(run_id, b"").decode(errors="replace")

    def follow_logs(self, run_id: str) -> LogStream:
        return LogStream(_Chunks(self.output.get(run_id, b"")))

    def stop(self, run_id: str, timeout: float = 10) -> None:
        self.stopped.append(run_id)
        if run_id in self.sandboxes_by_run and self.sandboxes_by_run[run_id].status == "running":
            self.exit(run_id, 137)

    def remove(self, run_id: str) -> None:
        self.parts.pop(run_id, None)
        if self.sandboxes_by_run.pop(run_id, None) is not None:
            self.removed.append(run_id)

    def services(self, run_id: str, logs: bool = False) -> list[ServiceRecord]:
        return [
            replace(record, log=f"log of {record.name}\n" if logs else "")
            for record in self.parts.get(run_id, [])
        ]

    def runs_with_parts(self) -> set[str]:
        return set(self.parts)

    def remove_services(self, run_id: str) -> None:
        self.parts.pop(run_id, None)


class Held:
    """An engine's event stream, held open until the engine goes (``end``) or it is closed."""

    def __init__(self) -> None:
        self._ended = threading.Event()

    def __iter__(self) -> Iterator[dict]:
        self._ended.wait()
        return iter(())

    def end(self) -> None:
        self._ended.set()

    close = end


class FakeBuilder:
    """Workplace images in a dict: the tag a base with packages gets, and how often each was
    built; ``fail`` makes builds fail with that last line."""

    def __init__(self, settings: object = None) -> None:
        self.built: dict[str, int] = {}
        self.fail = ""

    def image(self, base: str, packages: Sequence[Packages], what: str = "") -> str:
        if self.fail:
            raise BuildFailed(f"the image of {what} could not be built: {self.fail}", self.fail)
        tag = f"covey-workplace:{base}+" + ",".join(s for p in packages for s in p.specs)
        self.built[tag] = self.built.get(tag, 0) + 1
        return tag


class _Chunks:
    """What follow_logs streams: the output so far, then the end."""

    def __init__(self, data: bytes) -> None:
        self._data = [data] if data else []

    def __iter__(self):
        return iter(self._data)

    def close(self) -> None:
        pass


@dataclass
class FakeControlPlane:
    """The runner's client: runs it may start, what it reported, the output it sent."""

    specs: dict[str, LaunchSpec] = field(default_factory=dict)
    active: dict[str, ActiveRun] = field(default_factory=dict)
    reports: list[tuple[str, RunReport]] = field(default_factory=list)
    logs: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    output: dict[str, str] = field(default_factory=dict)
    heartbeats: int = 0
    problems: list[str | None] = field(default_factory=list)  # what each heartbeat said
    unreachable: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Homes: orders to take, uploads' bytes, and what was answered or sent back.
    home_orders: dict[str, HomeOrder] = field(default_factory=dict)
    uploads: dict[str, bytes] = field(default_factory=dict)
    answers: dict[str, HomeAnswer] = field(default_factory=dict)
    sent: dict[str, bytes] = field(default_factory=dict)
    broken_uploads: set[str] = field(default_factory=set)  # their bytes stop short, an error

    def _check(self) -> None:
        if self.unreachable:
            raise ControlPlaneError("the control plane does not answer")

    def start_run(self, run_id: str) -> LaunchSpec | None:
        """The spec, and the run is now active (starting), as the control plane has it."""
        self._check()
        launch = self.specs.get(run_id)
        if launch is not None:
            self.active[run_id] = ActiveRun(run_id, ActiveStatus.STARTING, False, 0.0, 0)
        return launch

    def active_runs(self) -> tuple[ActiveRun, ...]:
        self._check()
        return tuple(self.active.values())

    def report(self, run_id: str, seen: RunReport) -> RunStatusAnswer:
        self._check()
        with self.lock:
            self.reports.append((run_id, seen))
        if run_id not in self.specs and run_id not in self.active:
            raise ControlPlaneError("no such run on this runner", 404)
        if seen.state == ReportState.RUNNING and run_id in self.active:
            self.active[run_id] = replace(self.active[run_id], status=ActiveStatus.RUNNING)
        elif seen.state != ReportState.RUNNING:
            self.active.pop(run_id, None)  # it has ended
        return RunStatusAnswer(run_id, seen.state.value)

    def put_log(self, run_id: str, text: str, total: int | None = None) -> None:
        self._check()
        if run_id not in self.specs and run_id not in self.active:
            raise ControlPlaneError("no such run on this runner", 404)
        self.logs[run_id] = (text, total)

    def put_output(self, run_id: str, offset: int, text: str) -> int:
        self._check()
        have = self.output.get(run_id, "")
        if offset != len(have.encode()):
            raise OutputBehind(len(have.encode()))
        self.output[run_id] = have + text
        return len(self.output[run_id].encode())

    def take_home(self, operation: str) -> HomeOrder | None:
        self._check()
        return self.home_orders.pop(operation, None)

    def answer_home(self, operation: str, answer: HomeAnswer) -> None:
        self._check()
        self.answers[operation] = answer

    def send_home(
        self, operation: str, answer: HomeAnswer, chunks: Iterable[bytes], size: int | None
    ) -> None:
        self._check()
        self.answers[operation] = answer
        self.sent[operation] = b"".join(chunks)
        if size is not None and len(self.sent[operation]) != size:
            raise ControlPlaneError(f"{len(self.sent[operation])} bytes sent of {size}")

    @contextmanager
    def home_upload(self, operation: str) -> Iterator[Iterator[bytes]]:
        self._check()
        data = self.uploads[operation]

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(data), 1000):
                yield data[start : start + 1000]
            if operation in self.broken_uploads:
                raise ControlPlaneError("the upload broke off")

        yield chunks()

    def heartbeat(
        self, isolation: Isolation | None = None, problem: str | None = None
    ) -> RunnerInfo:
        self._check()
        self.heartbeats += 1
        self.problems.append(problem)
        return self.me()

    def me(self) -> RunnerInfo:
        return RunnerInfo(1, "edge-1", 1, (), False, False, "runner.1", "cooperative", "inst0001")

    def states(self, run_id: str) -> list[str]:
        """What was reported of a run, in order."""
        return [seen.state.value for reported, seen in self.reports if reported == run_id]


@dataclass
class FakeIdentity:
    """A runner's identity without a file: its client is a FakeControlPlane."""

    client: FakeControlPlane
    id: int = 1
    name: str = "edge-1"
    installation: str = "inst0001"
    token: str = "covey-run-fake"
    path: Path = Path("/nonexistent/runner.json")


class Clock:
    """A clock a test moves (``clock.now += 1``), for code that takes ``clock=``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _now() -> datetime:
    return datetime.now(UTC)
