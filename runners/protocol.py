"""The runner protocol: what crosses between the control plane and a runner host, as frozen
dataclasses with a JSON round-trip. Both sides use these (the control plane's serializers are
made from them, so the OpenAPI schema describes them; the runner host decodes its answers with
them), and nothing here imports Django: it is part of the data plane too.

``from_json`` refuses what does not fit (a missing field, a wrong type, an unknown state) with a
:class:`ProtocolError` that says where: a runner never acts on half an order.
"""

import dataclasses
import uuid
from datetime import datetime
from enum import StrEnum

from egress.environment import Isolation
from runners.probe.checks import Result

# The generic part (the JSON round-trip) is shared with the egress proxy's messages.
from wire import Message as Message
from wire import ProtocolError as ProtocolError

# Orders, as Celery task names: the control plane sends them (runners/dispatch.py) and the runner
# host's worker takes them (runners/host/worker.py). A runner one version back knows these
# names: they never change. Each takes the runner's id, then what the order is about.
LAUNCH = "covey.runner.launch"  # run id
CANCEL = "covey.runner.cancel"  # run id
RENEW = "covey.runner.renew_token"  # the new token, sealed (runners/host/sealing.py)
PROBE = "covey.runner.probe"  # probe id
HOME = "covey.runner.home"  # home operation id
# The queue every built-in runner takes its orders from (a remote runner's: runner.<id>).
BUILTIN_QUEUE = "runners.builtin"


@dataclasses.dataclass(frozen=True)
class Order(Message):
    """An order on a runner's queue, as the task's positional arguments carry it (a runner one
    version back sends and takes the same two): the runner it is for, and what it is about (a
    run's, probe's or home operation's id; a renewal's sealed token). The task's name says
    which order it is."""

    runner: int
    subject: str = dataclasses.field(repr=False)  # a renewal's is a secret, if sealed

    def args(self) -> list[int | str]:
        """The task's arguments."""
        return [self.runner, self.subject]

    @classmethod
    def from_args(cls, task: str, runner: object, subject: object) -> "Order":
        """The order a task was given; ProtocolError naming the task and the argument when
        it is not one (the runner acts on none of it)."""
        try:
            return cls.from_json({"runner": runner, "subject": subject})
        except ProtocolError as exc:
            raise ProtocolError(f"{task}: {exc}") from None


# Why a runner cannot take work, as its host says in a heartbeat: at most this long.
MAX_PROBLEM_CHARS = 1000

# Output of a running sandbox: at most this much UTF-8 in one chunk; a whole log says how much
# the sandbox wrote in all in this header.
MAX_OUTPUT_CHUNK_BYTES = 256 * 1024
OUTPUT_TOTAL_HEADER = "X-Covey-Output-Total"


def printable(text: str) -> str:
    """Output as both sides keep it: NUL (which PostgreSQL text cannot hold) becomes U+FFFD,
    so the runner and the control plane count the same bytes."""
    return text.replace("\x00", "\ufffd")


def cut_at_character(data: bytes, limit: int) -> int:
    """Where to cut UTF-8 ``data`` to at most ``limit`` bytes without splitting a character."""
    if len(data) <= limit:
        return len(data)
    cut = limit
    while cut > 0 and data[cut] & 0xC0 == 0x80:  # a continuation byte: inside a character
        cut -= 1
    return cut


class ReportState(StrEnum):
    """What a runner saw of a run's sandbox."""

    RUNNING = "running"  # it started
    EXITED = "exited"  # its process ended (with an exit code; detail "timeout" when stopped)
    BUILT = "built"  # it could not be built (detail says why): the run fails
    VANISHED = "vanished"  # the runner has no sandbox for a run that was running


@dataclasses.dataclass(frozen=True)
class EgressGrant(Message):
    """The run's egress: whether the sandbox is told of the proxy (COVEY_EGRESS_ENFORCE), and
    its per-run credential (``username:token``), revoked when the run ends."""

    enforce: bool
    credentials: str = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class ModelGrant(Message):
    """The run's way to its model: the model gateway's base URL and the run's token there
    (revoked when the run ends); the sandbox holds no vendor key. ``vendors``: whose APIs the
    sandbox is told of (Anthropic's always; OpenAI's when the organisation has a key there)."""

    base_url: str
    token: str = dataclasses.field(repr=False)
    vendors: tuple[str, ...] = ("anthropic",)


@dataclasses.dataclass(frozen=True)
class GitRemote(Message):
    """A git host the agent's grants name: the sandbox's git reaches ``url`` (a connection's
    git root) through the model gateway's ``/git/<host>/``, and its API (when it has one)
    through ``/api/<api_host>/``, with the run's token there."""

    url: str
    host: str  # as the gateway's git paths name it (with :port when not 443)
    name: str = ""  # the connection's
    api_host: str = ""  # its API's host ("" for none)


@dataclasses.dataclass(frozen=True)
class Registry(Message):
    """A package index or registry the agent's grants name: the sandbox reads it through the
    model gateway's ``/registry/<name>/``, with the run's token there; ``paths`` are those the
    connection's credential is for (an index of Python packages has ``/simple/``)."""

    name: str
    paths: tuple[str, ...]


# What a runner host can build, sent with every start request: a run that needs more is failed
# with a status saying so, never run without it (an older runner would ignore the fields).
FEATURE_WORKPLACES = "workplaces"  # packages (a built image) and companion services
FEATURES = (FEATURE_WORKPLACES,)


@dataclasses.dataclass(frozen=True)
class RunStart(Message):
    """A runner's start request: the features it has (names the control plane does not know
    are ignored: a newer runner may have more; none at all: a runner from before features)."""

    features: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Packages(Message):
    """Packages of one ecosystem (apt) to install in the sandbox's image, as its installer
    takes them (``name`` or ``name=version``; workplaces/config.py checks them)."""

    ecosystem: str
    specs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Readiness(Message):
    """How a service says it is ready: ``command`` run in it succeeds (exit 0). Tried after
    ``start_period`` seconds, every ``interval``, until ``timeout`` seconds after it started."""

    command: tuple[str, ...]
    start_period: float = 0.0
    interval: float = 1.0
    timeout: float = 60.0


@dataclasses.dataclass(frozen=True)
class ServiceSpec(Message):
    """A companion service of the run's workplace: a container beside the sandbox, reachable
    from it (and from nothing else) by ``name``."""

    name: str
    image: str
    # NAME=value; not for secrets (a workplace's versions show it), kept out of reprs all the same
    environment: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    command: tuple[str, ...] = ()  # empty: the image's own
    ready: Readiness | None = None  # None: ready once started
    cpus: float = 1.0
    memory_mb: int = 512


@dataclasses.dataclass(frozen=True)
class LaunchSpec(Message):
    """What a runner builds for a run: the answer to its start request. With ``packages``,
    the sandbox runs an image built from ``image`` with them installed (once, by the runner
    host, tagged by its content); ``services`` run beside it."""

    run: str
    agent: int
    image: str
    command: tuple[str, ...]
    task: str
    cpus: float
    memory_mb: int
    pids: int
    timeout: int
    egress: EgressGrant
    home_quota_bytes: int = 0  # the most its home may hold (0: no limit)
    packages: tuple[Packages, ...] = ()
    services: tuple[ServiceSpec, ...] = ()
    workplace: str = ""  # which workplace version, as people name it ("dev v3")
    model: ModelGrant | None = None  # None: the control plane runs no model gateway
    git: tuple[GitRemote, ...] = ()  # brokered through the gateway (needs ``model``)
    registries: tuple[Registry, ...] = ()  # the same


class ActiveStatus(StrEnum):
    """Where a run the runner should have a sandbox for stands (runs.models.RunStatus's
    values, the ones a run has between being placed and ending)."""

    PLACED = "placed"  # the runner was told to launch it
    STARTING = "starting"  # the runner asked for its spec: it is building the sandbox
    RUNNING = "running"  # the runner said the sandbox started


@dataclasses.dataclass(frozen=True)
class ActiveRun(Message):
    """A run the control plane expects a runner to have a sandbox for (what it reconciles
    against)."""

    run: str
    status: ActiveStatus
    cancel: bool  # cancelling was asked for
    waited: float  # seconds since it was placed
    output_size: int  # bytes of its output the control plane has


@dataclasses.dataclass(frozen=True)
class ActiveRuns(Message):
    runs: tuple[ActiveRun, ...]


OVER_QUOTA = "home-over-quota"  # an exit's detail: stopped for it (then why, after ": ")
DISK_FULL = "home-disk-full"  # an exit's detail: it failed with no room left under its home
ENGINE_RESTARTED = "docker-engine-restarted"  # an exit's detail: it ended with the engine
MAX_LISTED_CHANGES = 1000  # paths listed per kind in HomeChanges; the totals count them all


@dataclasses.dataclass(frozen=True)
class HomeChanges(Message):
    """What a run changed in its agent's home, from a manifest before it and one after (paths
    relative to the home; each list at most MAX_LISTED_CHANGES long, the totals whole)."""

    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    added_total: int = 0
    changed_total: int = 0
    removed_total: int = 0


@dataclasses.dataclass(frozen=True)
class HomeUsage(Message):
    """What an agent's home held when its runner measured it."""

    bytes: int
    files: int


MAX_SERVICE_LOG_CHARS = 64 * 1024  # the end of a service's log kept with the run


@dataclasses.dataclass(frozen=True)
class ServiceRecord(Message):
    """A service of the run as it ran: its image ID, how long it took to become ready, and
    (once the run has ended, or it failed to become ready) the end of its log."""

    name: str
    image_id: str = ""
    ready_seconds: float | None = None
    log: str = ""


@dataclasses.dataclass(frozen=True)
class RunReport(Message):
    """What a runner reports of a run's sandbox (``changes``: with an exit, when the runner
    saw the home before the run; ``usage``: what the home held, when it was measured;
    ``image_id``: the image the sandbox ran; ``services``: its services, as they ran)."""

    state: ReportState
    exit_code: int | None = None
    log_tail: str = ""
    detail: str = ""
    started_at: datetime | None = None
    finished_at: datetime | None = None
    changes: HomeChanges | None = None
    usage: HomeUsage | None = None
    image_id: str = ""
    services: tuple[ServiceRecord, ...] = ()


@dataclasses.dataclass(frozen=True)
class RunStatusAnswer(Message):
    """The control plane's answer to a report: the run's status now."""

    run: str
    status: str


@dataclasses.dataclass(frozen=True)
class ProbePlan(Message):
    """What an egress probe is to try, and as whom (the answer to a runner that begins one);
    ``error`` instead when it cannot run."""

    probe: str
    image: str = ""
    services: tuple[str, ...] = ()  # host:port of the control plane's web, database, broker
    allowed: str = ""  # host:port the agent may reach (the vendor)
    off_list: str = ""  # host:port it may not
    credentials: str = dataclasses.field(default="", repr=False)  # username:token, or ""
    agent: str = ""  # whom it probes as
    no_agent: str = ""  # why nobody: the proxy's checks are skipped
    error: str = ""


@dataclasses.dataclass(frozen=True)
class ProbeStatusAnswer(Message):
    """The control plane's answer to a probe's report: its verdict."""

    probe: str
    status: str


@dataclasses.dataclass(frozen=True)
class OutputChunk(Message):
    """Output of a running sandbox: ``text`` starts ``offset`` bytes (UTF-8) into it."""

    offset: int
    text: str


@dataclasses.dataclass(frozen=True)
class OutputAnswer(Message):
    """How much of the run's output the control plane has now (and, on a refusal, why)."""

    size: int
    detail: str = ""


class HomeOp(StrEnum):
    """What can be done to an agent's home from outside (homes/ on the control plane orders it,
    runners/host/serving.py does it)."""

    LIST = "list"
    STAT = "stat"
    READ = "read"  # a file's bytes, or a directory as a tar archive, streamed
    USAGE = "usage"  # where the space goes (a walk of the home or of one directory)
    WRITE = "write"  # an upload: the runner fetches its bytes
    MKDIR = "mkdir"
    MOVE = "move"
    DELETE = "delete"


CHANGING = frozenset({HomeOp.WRITE, HomeOp.MKDIR, HomeOp.MOVE, HomeOp.DELETE})
TRANSFERS = frozenset({HomeOp.READ, HomeOp.WRITE})  # their bytes pass through the spool
# A streamed answer's HomeAnswer travels in this header, its bytes in the body.
HOME_ANSWER_HEADER = "X-Covey-Home-Answer"
HOME_LISTING_MAX = 5000  # entries in one page of a listing


@dataclasses.dataclass(frozen=True)
class HomeOrder(Message):
    """One operation on an agent's home, as the runner that holds it is to carry it out (the
    answer to its taking the order). Paths are relative to the home."""

    operation: str
    agent: int
    kind: HomeOp
    path: str = ""
    target: str = ""  # where a move goes
    offset: int = 0  # a listing's page
    limit: int = 1000
    replace: bool = False  # a write may replace a file
    quota: int = 0  # bytes the home may hold (0: no quota); the runner holds a write to it
    size: int = 0  # an upload's bytes
    during_runs: bool = False  # a change may be made while a sandbox of the agent runs


@dataclasses.dataclass(frozen=True)
class HomeEntry(Message):
    """One thing in a home, as listed (a link is never followed: its target is text)."""

    name: str
    type: str  # file, directory, symlink, fifo, socket, device
    size: int
    modified: float  # seconds since the epoch
    usable: bool = True  # False: its name cannot be given back as a path
    target: str = ""
    links: int = 1  # a file's hard links: one with more is never read (another may be outside)


@dataclasses.dataclass(frozen=True)
class Sized(Message):
    path: str  # as shown (escaped where it is not printable)
    bytes: int
    usable: bool = True  # False: the path cannot be given back (see runners.host.homes.names)


@dataclasses.dataclass(frozen=True)
class Unmeasured(Message):
    path: str
    why: str


@dataclasses.dataclass(frozen=True)
class HomeSpace(Message):
    """Where the space goes in a home or one of its directories (``path``), by a walk."""

    path: str
    bytes: int
    files: int
    directories: int
    largest_files: tuple[Sized, ...]
    largest_directories: tuple[Sized, ...]  # with everything below them
    measured_at: datetime
    seconds: float
    unmeasured: int = 0  # places that could not be measured (0: the figures are whole)
    problems: tuple[Unmeasured, ...] = ()  # the first of them


@dataclasses.dataclass(frozen=True)
class HomeAnswer(Message):
    """What came of a home operation: ``status`` as HTTP says it (200, 201, or the refusal's,
    with ``detail``), what it found or made, and how the home's usage moved (a change's
    ``bytes_delta`` and ``files_delta``, also of a delete that stopped part-way; ``usage``: what
    the whole home holds now, when the runner knows)."""

    status: int = 200
    detail: str = ""
    entry: HomeEntry | None = None
    entries: tuple[HomeEntry, ...] = ()
    total: int = 0  # entries in the listed directory
    space: HomeSpace | None = None
    bytes_delta: int = 0
    files_delta: int = 0
    usage: HomeUsage | None = None


@dataclasses.dataclass(frozen=True)
class RunnerInfo(Message):
    """Who a runner is (the answer to its heartbeat)."""

    id: int
    name: str
    organisation: int
    labels: tuple[str, ...]
    builtin: bool
    paused: bool
    queue: str
    isolation: str  # an Isolation, or "" while its host has not said (an older runner reads str)
    installation: str


@dataclasses.dataclass(frozen=True)
class Heartbeat(Message):
    """A runner host's heartbeat: what it enforces, and whether it can take work (``problem``
    '' when it can, else why not; ``ready`` and ``problem`` both None: not said, as a host from
    before readiness)."""

    isolation: Isolation | None = None
    ready: bool | None = None
    problem: str | None = None

    def __post_init__(self) -> None:
        if (self.ready is None) != (self.problem is None):
            raise ValueError("ready: Send 'ready' and 'problem' together, or neither.")
        if self.ready is not None and self.ready != (self.problem == ""):
            raise ValueError(
                "ready: 'ready' is true exactly when 'problem' is empty (it says why not)."
            )


@dataclasses.dataclass(frozen=True)
class PauseOrder(Message):
    """Pause (finish what runs, take nothing new) or resume, from the runner host's command
    line."""

    paused: bool


@dataclasses.dataclass(frozen=True)
class ProbeBegin(Message):
    """A runner begins an egress probe: the one ordered (``probe``), or one of its own (None,
    saying why in ``reason``), under the isolation it enforces."""

    isolation: Isolation
    probe: uuid.UUID | None = None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class ProbeReport(Message):
    """What a runner's egress probe saw: one result per check (runners/probe/checks.py), or
    none and why it could not run (``detail``)."""

    checks: tuple[Result, ...]
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Registration(Message):
    """What a new runner host sends to register: the registration token an operator gave it,
    its name and labels."""

    registration_token: str = dataclasses.field(repr=False)
    name: str
    labels: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Registered(Message):
    """What a runner keeps of its registration's answer (runner_register saves it with the
    control plane's URL; runners/host/identity.py reads it): the runner token is shown once."""

    id: int
    name: str
    organisation: int
    token: str = dataclasses.field(repr=False)
    installation: str = ""
    labels: tuple[str, ...] = ()
