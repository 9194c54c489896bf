"""Homes from outside, on the control plane: every operation is ordered to the runner holding
the home (over its Celery queue), which takes it, carries it out and answers through the runner
API (runners/host/serving.py). The control plane never mounts a home.

Bytes never travel in a broker message nor sit whole in memory: a download is streamed by the
runner into a spool file here (``COVEY_HOME_SPOOL``) which the asker's response reads as it
grows, the runner held back while it is more than WINDOW ahead of the reader; an upload is
spooled first, then fetched by the runner. The spool is on the control plane's own disk, shared
by its web processes (one control-plane host). At most ``COVEY_HOME_TRANSFERS`` transfers go at
once (503 beyond), which bounds the web threads and spool files they take.

Every change from outside is recorded (:class:`HomeChange`) before it is ordered, and settled by
the runner's answer whenever it comes (a late answer after its asker gave up still settles it,
and moves the kept usage); a refusal before any order is recorded too. While a run of the agent
is active, changes are refused (409) unless ``COVEY_HOME_WRITES_DURING_RUNS``; an upload that
would pass the home's quota is refused (413) here when the kept figure says so, and by the
runner, which holds each write to the quota exactly, otherwise.
"""

import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.http.response import HttpResponseBase
from django.utils import timezone

from agents.models import Agent, size_text
from homes.models import HomeChange, HomeOperation, OperationState
from organisations.models import Role
from organisations.roles import role_of
from runners import dispatch
from runners.host.homes import unreadable
from runners.models import Runner
from runners.protocol import (
    CHANGING,
    TRANSFERS,
    HomeAnswer,
    HomeEntry,
    HomeOp,
    HomeOrder,
    HomeSpace,
    ProtocolError,
)
from runs.models import ACTIVE, Run
from runs.placement import place

CHUNK = 1024 * 1024
WINDOW = 64 * CHUNK  # how far a runner's download may run ahead of its reader
TAKE_SECONDS = 10.0  # a runner that has not taken an operation by then is not going to
LOOK_SECONDS = 120.0  # the most a look (a listing, a walk for usage) may take once taken
CHANGE_SECONDS = 300.0  # the most a change may take once taken, plus a second per MiB it carries
IDLE_SECONDS = 60.0  # a transfer that stands still this long is broken off
END = ".end"  # beside a download's spool file once the runner has sent it all (or broke off)
READ = ".read"  # beside it: how far its reader has got (the runner is held back by it)
OPEN = (OperationState.ORDERED, OperationState.TAKEN, OperationState.STREAMING)


class HomeProblem(Exception):
    """An operation that cannot be done or was refused: an HTTP status and what to say."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# --- where the home is, and whether it may change now ------------------------------------------


def holder(agent: Agent, *, make: bool) -> Runner:
    """The runner holding the agent's home. An agent that never ran has its home made (when
    ``make``: a change) on the runner its first run would go to; HomeProblem 404 for a look at
    a home not made yet, 503 when its runner is offline or none can take it."""
    runner = agent.home_runner
    if runner is None:
        if not make:
            raise HomeProblem(404, "this agent has no home yet: its first run or upload makes it")
        placement = place(agent)
        if placement.runner is None:
            raise HomeProblem(
                503, f"{agent} has no home yet, and no runner can hold one now: {placement.reason}"
            )
        Agent.objects.filter(pk=agent.pk, home_runner__isnull=True).update(
            home_runner=placement.runner
        )
        agent.refresh_from_db(fields=["home_runner"])
        runner = agent.home_runner or placement.runner
    if not runner.online:
        raise HomeProblem(503, f"the home of {agent} is on runner {runner.name}: {silence(runner)}")
    return runner


def silence(runner: Runner) -> str:
    if runner.last_seen_at is None:
        return "it has never been heard from"
    seconds = int((timezone.now() - runner.last_seen_at).total_seconds())
    when = runner.last_seen_at.isoformat(timespec="seconds")
    return f"it has been silent since {when} ({seconds} s); its homes are served when it is back"


def active_run(agent: Agent) -> Run | None:
    return Run.objects.filter(agent=agent, status__in=ACTIVE).order_by("created_at").first()


def check_changeable(agent: Agent) -> None:
    """HomeProblem 409 while a run of the agent is active (unless the setting allows it)."""
    if settings.COVEY_HOME_WRITES_DURING_RUNS:
        return
    run = active_run(agent)
    if run is not None:
        raise HomeProblem(
            409,
            f"run {run.pk} of this agent is {run.status}: its home is not changed from outside"
            " until it ends (COVEY_HOME_WRITES_DURING_RUNS=true allows it)",
        )


ROLE_REFUSAL = "Your role in this organisation does not allow changing homes."


def may_change(agent: Agent, user: Any) -> bool:
    """Whether ``user`` may change the agent's home: an admin of its organisation."""
    return role_of(user, agent.organisation) == Role.ADMIN


def refuse_change(
    agent: Agent, user: Any, kind: HomeOp, path: str, *, target: str = "", size: int = 0
) -> HomeProblem:
    """A change refused because ``user`` may not change the home (:func:`may_change`),
    recorded in the home's audit, which lists every change made from outside, or refused; the
    403 to raise."""
    _refused(_record(agent, user, kind, path, target=target, size=size), 403, ROLE_REFUSAL)
    return HomeProblem(403, ROLE_REFUSAL)


def upload_cap() -> int:
    return int(settings.COVEY_HOME_UPLOAD_MAX_MB) * 1024 * 1024


def check_upload(agent: Agent, path: str, size: int, replace: bool) -> None:
    """HomeProblem 413 when an upload of ``size`` bytes is over the cap of one request or
    would pass the home's quota by the figure kept (a file it replaces counts as room); the
    runner holds the write to the quota exactly whatever this says."""
    if size > upload_cap():
        raise HomeProblem(
            413, f"{size_text(size)} is more than one upload may carry ({size_text(upload_cap())})"
        )
    quota = agent.home_quota_bytes
    if not quota or agent.home_bytes is None or size <= quota - agent.home_bytes:
        return
    left = quota - agent.home_bytes
    if replace and agent.home_runner is not None:
        try:
            entry = ask(agent, HomeOp.STAT, path=path).entry
        except HomeProblem as exc:
            if exc.status != 404:
                raise
            entry = None
        if entry is not None and entry.type == "file":
            left += entry.size
    if size > left:
        raise HomeProblem(
            413,
            f"the home holds {size_text(agent.home_bytes)} of its quota of {size_text(quota)}:"
            f" {size_text(size)} more would pass it; delete something first, or raise the"
            " agent's home quota",
        )


# --- operations ---------------------------------------------------------------------------


def order(
    agent: Agent,
    kind: HomeOp,
    operation: uuid.UUID | None = None,
    *,
    change: HomeChange | None = None,
    **fields: Any,
) -> HomeOperation:
    """Order an operation to the runner holding the home; the HomeOperation to wait on."""
    runner = holder(agent, make=kind in CHANGING)
    if kind in TRANSFERS:
        going = HomeOperation.objects.filter(kind__in=TRANSFERS, state__in=OPEN).count()
        if going >= settings.COVEY_HOME_TRANSFERS:
            raise HomeProblem(
                503,
                f"{going} home transfers are going already (COVEY_HOME_TRANSFERS): try again"
                " when one has ended",
            )
    operation = operation or uuid.uuid4()
    spec = HomeOrder(
        str(operation),
        agent.pk,
        kind,
        quota=agent.home_quota_bytes,
        during_runs=settings.COVEY_HOME_WRITES_DURING_RUNS,
        **fields,
    )
    op = HomeOperation.objects.create(
        id=operation, agent=agent, runner=runner, kind=kind, order=spec.to_json(), change=change
    )
    transaction.on_commit(lambda: dispatch.send_home(runner, str(operation)))
    return op


def wait(
    op: HomeOperation,
    until: frozenset[str] = frozenset({OperationState.ANSWERED}),
    within: float = LOOK_SECONDS,
) -> HomeOperation:
    """The operation once it reached a state of ``until`` (or was answered); HomeProblem 503
    when its runner did not take it in time, 504 when it did not answer ``within`` seconds of
    taking it (a change may still be made then: its record says so when the answer comes)."""
    started = time.monotonic()
    taken: float | None = None
    delay = 0.002
    while True:
        found = HomeOperation.objects.filter(pk=op.pk).values_list("state", "answer").first()
        if found is None:
            raise HomeProblem(504, "the operation was given up (pruned) before it was answered")
        op.state, op.answer = found
        if op.state in until or op.state == OperationState.ANSWERED:
            return op
        now = time.monotonic()
        if op.state == OperationState.ORDERED:
            if now - started > TAKE_SECONDS and _abandon(op, OperationState.ORDERED):
                raise HomeProblem(
                    503,
                    f"runner {op.runner.name} did not take the operation within"
                    f" {TAKE_SECONDS:.0f} s (it may be stopping, or not serving homes)",
                )
        elif op.state == OperationState.ABANDONED:
            raise HomeProblem(504, "the operation was given up")
        else:
            taken = taken or now
            if now - taken > within and _abandon(op, *OPEN):
                raise HomeProblem(
                    504,
                    f"runner {op.runner.name} took the operation and did not finish it within"
                    f" {within:.0f} s",
                )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.02)


def _abandon(op: HomeOperation, *states: str) -> bool:
    """Give up on an operation in one of ``states`` (False: it moved on meanwhile)."""
    given_up = HomeOperation.objects.filter(pk=op.pk, state__in=states)
    return bool(given_up.update(state=OperationState.ABANDONED))


def answer_of(op: HomeOperation) -> HomeAnswer:
    """The runner's answer; HomeProblem when it is a refusal (or makes no sense)."""
    try:
        answer = HomeAnswer.from_json(op.answer)
    except ProtocolError as exc:
        raise HomeProblem(502, f"the runner's answer made no sense: {exc}") from None
    if not 200 <= answer.status <= 599:
        raise HomeProblem(502, f"the runner answered with status {answer.status}")
    if answer.status >= 400:
        raise HomeProblem(answer.status, answer.detail or "refused")
    return answer


def ask(agent: Agent, kind: HomeOp, **fields: Any) -> HomeAnswer:
    """A look at the home (list, stat, usage): the runner's answer."""
    if kind in CHANGING:
        raise ValueError(f"{kind} is a change: see change()")
    if agent.home_runner_id is None and kind == HomeOp.LIST and not fields.get("path"):
        return HomeAnswer()  # no home yet: an empty one, placed nowhere until a change
    answer = answer_of(wait(order(agent, kind, **fields)))
    if answer.usage is not None:
        _measured(agent, answer.usage.bytes, answer.usage.files)
    return answer


def space(agent: Agent, path: str = "") -> HomeSpace:
    """Where the space goes (a walk, on request); the whole home's walk renews the kept figure."""
    found = ask(agent, HomeOp.USAGE, path=path).space
    if found is None:
        raise HomeProblem(502, "the runner said nothing of the space")
    return found


def change(
    agent: Agent,
    user: Any,
    kind: HomeOp,
    path: str,
    *,
    target: str = "",
    size: int = 0,
    replace: bool = False,
    operation: uuid.UUID | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> HomeAnswer:
    """Make a change from outside, recorded before it is ordered and settled by its answer;
    ``meanwhile`` runs once it is ordered (an upload's bytes are spooled while the runner
    already writes them)."""
    if kind not in CHANGING:
        raise ValueError(f"{kind} is not a change: see ask()")
    record = _record(agent, user, kind, path, target=target, size=size)
    try:
        check_changeable(agent)
        record.save()
        op = order(
            agent,
            kind,
            operation,
            change=record,
            path=path,
            target=target,
            size=size,
            replace=replace,
        )
        HomeChange.objects.filter(pk=record.pk).update(runner=op.runner)
        if meanwhile is not None:
            meanwhile()
        within = CHANGE_SECONDS + size / CHUNK
        answer = HomeAnswer.from_json(wait(op, within=within).answer)
    except ProtocolError as exc:
        _refused(record, 502, f"the runner's answer made no sense: {exc}")
        raise HomeProblem(502, f"the runner's answer made no sense: {exc}") from None
    except HomeProblem as exc:
        _refused(record, exc.status, exc.detail)
        raise
    except Exception as exc:
        _refused(record, 500, f"it failed on the control plane: {type(exc).__name__}")
        raise
    settle(op.pk, answer)
    agent.refresh_from_db(fields=["home_bytes", "home_files", "home_measured_at"])
    return answer_of(op)


def settle(operation: uuid.UUID | str, answer: HomeAnswer) -> None:
    """A change's answer, whenever it comes: its record says how it went (once), and the kept
    usage follows what the runner says it did (a part-way delete included)."""
    op = HomeOperation.objects.filter(pk=operation).select_related("change").first()
    if op is None or op.change is None:
        return
    record = op.change
    detail = answer.detail[:500]
    moved = -answer.bytes_delta if op.kind == HomeOp.DELETE else record.bytes
    settled = HomeChange.objects.filter(pk=record.pk, settled=False).update(
        status=answer.status, detail=detail, bytes=moved, settled=True
    )
    if not settled:
        return
    if answer.usage is not None:
        _measured(op.agent, answer.usage.bytes, answer.usage.files)
    elif answer.bytes_delta or answer.files_delta:
        Agent.objects.filter(pk=op.agent_id, home_bytes__isnull=False).update(
            home_bytes=F("home_bytes") + answer.bytes_delta,
            home_files=F("home_files") + answer.files_delta,
        )


def _refused(record: HomeChange, status: int, detail: str) -> None:
    """A change that was refused, or whose outcome is not known (504: a late answer may still
    settle it)."""
    record.status, record.detail = status, detail[:500]
    record.settled = status != 504
    if record.pk is None:
        record.save()
    else:
        HomeChange.objects.filter(pk=record.pk, settled=False).update(
            status=record.status, detail=record.detail, settled=record.settled
        )


def _record(
    agent: Agent, user: Any, kind: HomeOp, path: str, *, target: str = "", size: int = 0
) -> HomeChange:
    return HomeChange(
        agent=agent,
        by=user if getattr(user, "pk", None) else None,
        by_name=getattr(user, "username", "") or "?",
        operation=kind,
        path=_as_kept(path),
        target=_as_kept(target),
        bytes=size,
    )


KEPT_PATH_CHARS = 5000  # of a path in the audit (a home's paths are at most 4096 bytes)


def _as_kept(path: str) -> str:
    """A path as the audit can keep it, however it came (PostgreSQL text holds no NUL, and a
    refused request's path was never checked)."""
    return path.replace("\x00", "\ufffd")[:KEPT_PATH_CHARS]


def _admit_upload(agent: Agent, user: Any, path: str, size: int, replace: bool) -> None:
    """The checks before an upload's bytes are taken; a refusal is recorded too."""
    try:
        check_changeable(agent)
        check_upload(agent, path, size, replace)
    except HomeProblem as exc:
        _refused(_record(agent, user, HomeOp.WRITE, path, size=size), exc.status, exc.detail)
        raise


def _measured(agent: Agent, size: int, files: int) -> None:
    Agent.objects.filter(pk=agent.pk).update(
        home_bytes=size, home_files=files, home_measured_at=timezone.now()
    )


# --- bytes: the spool ---------------------------------------------------------------------


def spool() -> Path:
    folder: Path = settings.COVEY_HOME_SPOOL
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def upload_file(agent: Agent, user: Any, path: str, file: Any, *, replace: bool) -> HomeAnswer:
    """One file of a form (the API's or the admin's: Django's UploadedFile)."""
    return upload(agent, user, path, file.chunks(CHUNK), file.size, replace=replace)


def check_download(entry: HomeEntry, path: str) -> None:
    """HomeProblem 400 when a download of ``path``, as the runner says it is (``entry``), is
    refused: the rule the runner holds every read to, in its words (a HEAD says what the GET
    would)."""
    if why := unreadable(path, entry.type, entry.links):
        raise HomeProblem(400, why)


def download_headers(
    response: HttpResponseBase, path: str, *, archive: bool, size: int | None
) -> HttpResponseBase:
    """What a download of ``path`` says of itself: a tar (a directory) or bytes, its name,
    and a file's length."""
    response["Content-Type"] = "application/x-tar" if archive else "application/octet-stream"
    if size is not None:
        response["Content-Length"] = str(size)
    name = (path.rsplit("/", 1)[-1] or "home") + (".tar" if archive else "")
    response["Content-Disposition"] = attachment(name)
    return response


def upload_path(operation: uuid.UUID | str) -> Path:
    return spool() / f"{operation}.up"


def download_path(operation: uuid.UUID | str) -> Path:
    return spool() / f"{operation}.down"


def upload(
    agent: Agent, user: Any, path: str, chunks: Iterable[bytes], size: int, *, replace: bool
) -> HomeAnswer:
    """An upload of ``size`` bytes: ordered at once, its bytes spooled as they come while the
    runner fetches and writes them (it follows the spool file, see :func:`follow`)."""
    _admit_upload(agent, user, path, size, replace)
    operation = uuid.uuid4()
    spooled = upload_path(operation)
    end = end_of(spooled)

    def spool_it() -> None:
        outcome = "broken off"
        try:
            written = 0
            with open(spooled, "ab", buffering=0) as file:
                for data in chunks:
                    written += len(data)
                    if written > size:
                        outcome = f"more bytes came than the {size} said"
                        raise HomeProblem(400, outcome)
                    file.write(data)
            if written != size:
                outcome = f"{written} bytes came of the {size} said"
                raise HomeProblem(400, outcome)
            outcome = "whole"
        finally:
            mark_end(end, outcome)

    spooled.touch(mode=0o600, exist_ok=False)
    try:
        return change(
            agent,
            user,
            HomeOp.WRITE,
            path,
            size=size,
            replace=replace,
            operation=operation,
            meanwhile=spool_it,
        )
    finally:
        spooled.unlink(missing_ok=True)
        end.unlink(missing_ok=True)


def end_of(spooled: Path) -> Path:
    """The marker beside a spool file that says it is whole (or why not)."""
    return spooled.with_name(spooled.name + END)


def mark_end(end: Path, outcome: str) -> None:
    """Say a spool file is whole (or why not), at once: a reader never sees the marker
    without what it says."""
    draft = end.with_name(end.name + ".new")
    draft.write_text(outcome)
    draft.replace(end)


Wire = Callable[[Any, int, int], int]
"""Puts ``count`` bytes of a file from ``offset`` on the wire without reading them into
Python (``socket.sendfile``); the bytes sent."""


def follow(
    spooled: Path,
    *,
    position: "Position | None" = None,
    wire: Wire | None = None,
    size: int | None = None,
) -> Iterator[bytes]:
    """A spool file's bytes as its writer fills it, until its end marker says it is whole;
    broken off (HomeProblem, so the reader sees a cut response) when the writer broke off or
    stood still. ``position``: where to tell how far it has been read. ``wire``: how to send
    bytes past the first chunk straight from the file (the first is yielded all the same: it
    sends the response's headers before anything goes on the wire), never past ``size`` (the
    length the response said: the server holds the chunks to it, not the wire)."""
    end = end_of(spooled)
    with open(spooled, "rb", buffering=0) as file:
        read = told = 0
        idle_since = time.monotonic()
        delay = 0.001
        while True:
            whole = end.exists()  # first: what was written before the marker is in the size
            grown = os.fstat(file.fileno()).st_size - read
            if grown > 0:
                if wire is None or read == 0:
                    data = os.pread(file.fileno(), min(CHUNK, grown), read)
                    read += len(data)
                    yield data
                else:
                    count = min(grown, TELL_EVERY, (size - read) if size is not None else grown)
                    if count <= 0:
                        raise HomeProblem(502, f"the stream holds more than its {size} bytes")
                    read += wire(file, read, count)
                if position is not None and read - told >= TELL_EVERY:
                    position.tell(read)
                    told = read
                idle_since, delay = time.monotonic(), 0.001
                continue
            if whole:
                if end.read_text() != "whole":
                    raise HomeProblem(502, f"the stream broke off: {end.read_text()}")
                return
            if time.monotonic() - idle_since > IDLE_SECONDS:
                raise HomeProblem(504, "the stream stood still; broken off")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


@dataclass
class Download:
    """A file, or a directory as a tar archive, coming from the runner: what it is, its length
    when known (a file's), and its bytes as they come."""

    answer: HomeAnswer
    archive: bool
    size: int | None
    chunks: Iterator[bytes]


def download(agent: Agent, path: str, *, wire: Wire | None = None) -> Download:
    """A file or directory of the home as the runner sends it; ``wire``: see :func:`follow`
    (a file's bytes only: an archive's length is not known, so the server frames it)."""
    op = wait(order(agent, HomeOp.READ, path=path), frozenset({OperationState.STREAMING}))
    if op.state == OperationState.ANSWERED and not download_path(op.pk).exists():
        answer_of(op)  # a refusal raises
        raise HomeProblem(502, "the runner answered without the bytes")
    answer = answer_of(op)
    archive = answer.entry is None or answer.entry.type == "directory"
    size = None if archive or answer.entry is None else answer.entry.size
    return Download(answer, archive, size, _tail(op, None if size is None else wire, size))


def _tail(op: HomeOperation, wire: Wire | None, size: int | None) -> Iterator[bytes]:
    """A download's bytes as the runner's stream fills its spool file, telling the runner how
    far they have been read; a stream still coming when its asker leaves is stopped."""
    spooled = download_path(op.pk)
    end = end_of(spooled)
    position = Position(spooled, writer=True)
    whole = False
    try:
        yield from follow(spooled, position=position, wire=wire, size=size)
        whole = True
    finally:
        if not whole:
            _abandon(op, *OPEN)
        position.close()
        for item in (spooled, end, position.path):
            item.unlink(missing_ok=True)


class Position:
    """How far a download's reader has got, in a small file beside its spool file: the reader
    says it every TELL_EVERY bytes, the runner's stream reads it to keep within WINDOW."""

    WIDTH = 20  # digits, written whole in one pwrite

    def __init__(self, spooled: Path, *, writer: bool = False) -> None:
        self.path = spooled.with_name(spooled.name + READ)
        self._writer = writer
        self._fd: int | None = None
        self._open()

    def _open(self) -> None:
        flags = (os.O_RDWR | os.O_CREAT if self._writer else os.O_RDONLY) | os.O_CLOEXEC
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            self._fd = None  # the reader has not begun

    def tell(self, read: int) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, str(read).zfill(self.WIDTH).encode(), 0)

    def get(self) -> int:
        if self._fd is None:
            self._open()
        if self._fd is None:
            return 0
        said = os.pread(self._fd, self.WIDTH, 0)
        return int(said) if said.isdigit() else 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


TELL_EVERY = 8 * CHUNK


# --- housekeeping -------------------------------------------------------------------------

KEEP_OPERATIONS = timedelta(hours=1)  # ended operations are pruned this long after they began
KEEP_OPEN_OPERATIONS = timedelta(days=1)  # and any other, this long (nothing takes so long)


def prune() -> int:
    """Forget operations that ended over KEEP_OPERATIONS ago and any over KEEP_OPEN_OPERATIONS
    old (the audit keeps the changes), and remove spool files of operations no longer known
    (a web process killed mid-transfer); how many operations went."""
    now = timezone.now()
    ended = HomeOperation.objects.filter(created_at__lt=now - KEEP_OPERATIONS).exclude(
        state__in=OPEN
    )
    count, _ = ended.delete()
    stuck, _ = HomeOperation.objects.filter(created_at__lt=now - KEEP_OPEN_OPERATIONS).delete()
    folder: Path = settings.COVEY_HOME_SPOOL
    if folder.is_dir():
        known = {str(pk) for pk in HomeOperation.objects.values_list("pk", flat=True)}
        for item in folder.iterdir():
            if item.name.split(".", 1)[0] not in known and _older(item, KEEP_OPERATIONS):
                item.unlink(missing_ok=True)
    return count + stuck


def _older(item: Path, age: timedelta) -> bool:
    try:
        return time.time() - item.stat().st_mtime > age.total_seconds()
    except FileNotFoundError:
        return False


def attachment(name: str) -> str:
    """A Content-Disposition for a download named ``name`` (any characters, said safely)."""
    plain = name.encode("ascii", "replace").decode().replace('"', "_").replace("\\", "_")
    plain = "".join(c if c.isprintable() else "_" for c in plain)
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{quote(name, safe='')}"
