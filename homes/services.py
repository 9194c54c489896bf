"""Homes from outside, on the control plane: every operation is ordered to the runner holding
the home (over its Celery queue), which takes it, carries it out and answers through the runner
API (runners/host/serving.py). The control plane never mounts a home.

Bytes never travel in a broker message nor sit whole in memory: a download is streamed by the
runner into a spool file here (``COVEY_HOME_SPOOL``) which the asker's response reads as it
grows; an upload is spooled first, then fetched by the runner. The spool is on the control
plane's own disk, shared by its web processes.

A change is recorded (:class:`HomeChange`) whether it was made or refused; while a run of the
agent is active, changes are refused (409) unless ``COVEY_HOME_WRITES_DURING_RUNS``; an upload
that would pass the home's quota is refused (413) before its bytes are spooled when its size
says so, and by the runner as they are written otherwise.
"""

import logging
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from agents.models import Agent, size_text
from homes.models import HomeChange, HomeOperation, OperationState
from runners import dispatch
from runners.models import Runner
from runners.protocol import (
    CHANGING,
    HomeAnswer,
    HomeOp,
    HomeOrder,
    HomeSpace,
    ProtocolError,
)
from runs.models import ACTIVE, Run
from runs.placement import place

logger = logging.getLogger(__name__)

CHUNK = 1024 * 1024
TAKE_SECONDS = 10.0  # a runner that has not taken an operation by then is not going to
ANSWER_SECONDS = 300.0  # the most a look (a listing, a walk for usage) may take
IDLE_SECONDS = 60.0  # a transfer that stands still this long is broken off
END = ".end"  # beside a download's spool file once the runner has sent it all (or broke off)


class HomeProblem(Exception):
    """An operation that cannot be done or was refused: an HTTP status and what to say."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# --- where the home is, and whether it may change now ------------------------------------------


def holder(agent: Agent) -> Runner:
    """The runner holding the agent's home (an agent that never ran has its home made on the
    runner its first run would go to); HomeProblem 503 when it is offline or none can."""
    runner = agent.home_runner
    if runner is None:
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


def room(agent: Agent) -> int | None:
    """Bytes the home may still take by the figure kept (None: no quota, or no figure yet, so
    the runner measures)."""
    quota = agent.home_quota_bytes
    if not quota or agent.home_bytes is None:
        return None
    return quota - agent.home_bytes


def check_upload(agent: Agent, path: str, size: int, replace: bool) -> None:
    """HomeProblem 413 when an upload of ``size`` bytes is over the cap of one request or would
    pass the home's quota (a file it replaces counts as room)."""
    cap = settings.COVEY_HOME_UPLOAD_MAX_MB * 1024 * 1024
    if size > cap:
        raise HomeProblem(
            413, f"{size_text(size)} is more than one upload may carry ({size_text(cap)})"
        )
    left = room(agent)
    if left is None or size <= left:
        return
    if replace:
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
            f"the home holds {size_text(agent.home_bytes or 0)} of its quota of"
            f" {size_text(agent.home_quota_bytes)}: {size_text(size)} more would pass it;"
            " delete something first, or raise the agent's home quota",
        )


# --- operations ---------------------------------------------------------------------------


def order(
    agent: Agent, kind: HomeOp, operation: uuid.UUID | None = None, **fields: Any
) -> HomeOperation:
    """Order an operation to the runner holding the home; the HomeOperation to wait on."""
    runner = holder(agent)
    operation = operation or uuid.uuid4()
    during = settings.COVEY_HOME_WRITES_DURING_RUNS
    spec = HomeOrder(str(operation), agent.pk, kind, during_runs=during, **fields)
    op = HomeOperation.objects.create(
        id=operation, agent=agent, runner=runner, kind=kind, order=spec.to_json()
    )
    transaction.on_commit(lambda: dispatch.send_home(runner, str(operation)))
    return op


def wait(
    op: HomeOperation,
    until: frozenset[str] = frozenset({OperationState.ANSWERED}),
    within: float = ANSWER_SECONDS,
) -> HomeOperation:
    """The operation once it reached a state of ``until`` (or was answered); HomeProblem 503
    when its runner did not take it in time, 504 when it did not answer in ``within``."""
    started = time.monotonic()
    delay = 0.002
    while True:
        op.refresh_from_db(fields=["state", "answer"])
        if op.state in until or op.state == OperationState.ANSWERED:
            return op
        waited = time.monotonic() - started
        if op.state == OperationState.ORDERED and waited > TAKE_SECONDS and _abandon(op):
            raise HomeProblem(
                503,
                f"runner {op.runner.name} did not take the operation within {TAKE_SECONDS:.0f} s"
                " (it may be stopping, or not serving homes)",
            )
        if waited > within and _abandon(op):
            raise HomeProblem(
                504, f"runner {op.runner.name} did not finish the operation within {within:.0f} s"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.05)


def _abandon(op: HomeOperation) -> bool:
    """Give up on an operation not yet answered (False: it was answered meanwhile)."""
    return bool(
        HomeOperation.objects.filter(pk=op.pk)
        .exclude(state=OperationState.ANSWERED)
        .update(state=OperationState.ABANDONED)
    )


def answer_of(op: HomeOperation) -> HomeAnswer:
    """The runner's answer; HomeProblem when it is a refusal."""
    try:
        answer = HomeAnswer.from_json(op.answer)
    except ProtocolError as exc:
        raise HomeProblem(502, f"the runner's answer made no sense: {exc}") from None
    if answer.status >= 400:
        raise HomeProblem(answer.status, answer.detail or "refused")
    return answer


def ask(agent: Agent, kind: HomeOp, **fields: Any) -> HomeAnswer:
    """A look at the home (list, stat, usage): the runner's answer."""
    if kind in CHANGING:
        raise ValueError(f"{kind} is a change: see change()")
    answer = answer_of(wait(order(agent, kind, **fields)))
    if kind == HomeOp.USAGE and answer.usage is not None:
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
) -> HomeAnswer:
    """Make a change from outside and record it (made or refused); the kept usage follows."""
    if kind not in CHANGING:
        raise ValueError(f"{kind} is not a change: see ask()")
    record = _record(agent, user, kind, path, target=target, size=size)
    try:
        check_changeable(agent)
        op = order(
            agent,
            kind,
            operation,
            path=path,
            target=target,
            size=size,
            replace=replace,
            room=room(agent),
            measure=agent.home_bytes is None,
        )
        record.runner = op.runner
        answer = answer_of(wait(op, within=ANSWER_SECONDS + size / (1024 * 1024)))
    except HomeProblem as exc:
        record.status, record.detail = exc.status, exc.detail[:500]
        record.save()
        raise
    if answer.usage is not None:
        _measured(agent, answer.usage.bytes, answer.usage.files)
    elif answer.bytes_delta or answer.files_delta:
        Agent.objects.filter(pk=agent.pk, home_bytes__isnull=False).update(
            home_bytes=F("home_bytes") + answer.bytes_delta,
            home_files=F("home_files") + answer.files_delta,
        )
    if kind == HomeOp.DELETE:
        record.bytes = -answer.bytes_delta
    record.status = answer.status
    record.save()
    agent.refresh_from_db(fields=["home_bytes", "home_files", "home_measured_at"])
    return answer


def _record(
    agent: Agent, user: Any, kind: HomeOp, path: str, *, target: str = "", size: int = 0
) -> HomeChange:
    return HomeChange(
        agent=agent,
        by=user if getattr(user, "pk", None) else None,
        by_name=getattr(user, "username", "") or "?",
        operation=kind,
        path=path,
        target=target,
        bytes=size,
    )


def _admit_upload(agent: Agent, user: Any, path: str, size: int, replace: bool) -> None:
    """The checks before an upload's bytes are taken; a refusal is recorded too."""
    try:
        check_changeable(agent)
        check_upload(agent, path, size, replace)
    except HomeProblem as exc:
        record = _record(agent, user, HomeOp.WRITE, path, size=size)
        record.status, record.detail = exc.status, exc.detail[:500]
        record.save()
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


def upload_path(operation: uuid.UUID | str) -> Path:
    return spool() / f"{operation}.up"


def download_path(operation: uuid.UUID | str) -> Path:
    return spool() / f"{operation}.down"


def upload(
    agent: Agent, user: Any, path: str, chunks: Iterable[bytes], size: int, *, replace: bool
) -> HomeAnswer:
    """Spool an upload of ``size`` bytes, then have the runner fetch and write it."""
    _admit_upload(agent, user, path, size, replace)
    operation = uuid.uuid4()
    spooled = upload_path(operation)
    try:
        written = 0
        with open(spooled, "xb") as file:
            for data in chunks:
                written += len(data)
                if written > size:
                    raise HomeProblem(400, f"more bytes came than the {size} said")
                file.write(data)
        if written != size:
            raise HomeProblem(400, f"{written} bytes came of the {size} said")
        return change(
            agent, user, HomeOp.WRITE, path, size=size, replace=replace, operation=operation
        )
    finally:
        spooled.unlink(missing_ok=True)


def adopt_upload(
    agent: Agent, user: Any, path: str, file: Path, size: int, *, replace: bool
) -> HomeAnswer:
    """An upload already on this disk (a form's temporary file): linked into the spool."""
    _admit_upload(agent, user, path, size, replace)
    operation = uuid.uuid4()
    spooled = upload_path(operation)
    try:
        os.link(file, spooled)
    except OSError:
        with open(file, "rb") as source, open(spooled, "xb") as target:
            while data := source.read(CHUNK):
                target.write(data)
    try:
        return change(
            agent, user, HomeOp.WRITE, path, size=size, replace=replace, operation=operation
        )
    finally:
        spooled.unlink(missing_ok=True)


@dataclass
class Download:
    """A file or archive coming from the runner: what it is, and its bytes as they come."""

    answer: HomeAnswer
    size: int | None  # None: an archive, whose length is known only at its end
    chunks: Iterator[bytes]


def download(agent: Agent, path: str, *, archive: bool) -> Download:
    kind = HomeOp.ARCHIVE if archive else HomeOp.READ
    op = wait(order(agent, kind, path=path), frozenset({OperationState.STREAMING}))
    if op.state == OperationState.ANSWERED and not download_path(op.pk).exists():
        answer_of(op)  # a refusal raises
        raise HomeProblem(502, "the runner answered without the bytes")
    answer = answer_of(op)
    size = None if archive or answer.entry is None else answer.entry.size
    return Download(answer, size, _tail(op))


KEEP_OPERATIONS = timedelta(hours=1)  # operations are pruned this long after they were ordered


def prune() -> int:
    """Forget operations ordered over KEEP_OPERATIONS ago (the audit keeps the changes), and
    remove spool files of operations no longer known (a web process killed mid-transfer);
    how many operations went."""
    before = timezone.now() - KEEP_OPERATIONS
    stale = HomeOperation.objects.filter(created_at__lt=before)
    stale.exclude(state=OperationState.ANSWERED).update(state=OperationState.ABANDONED)
    count, _ = stale.delete()
    folder: Path = settings.COVEY_HOME_SPOOL
    if folder.is_dir():
        known = {str(pk) for pk in HomeOperation.objects.values_list("pk", flat=True)}
        for item in folder.iterdir():
            if item.name.split(".", 1)[0] not in known and _older(item, KEEP_OPERATIONS):
                item.unlink(missing_ok=True)
    return count


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


def _tail(op: HomeOperation) -> Iterator[bytes]:
    """A download's bytes from its spool file as the runner's stream fills it; broken off
    (an exception, so the client sees a cut response) when the runner's stream broke."""
    spooled = download_path(op.pk)
    end = spooled.with_name(spooled.name + END)
    try:
        with open(spooled, "rb", buffering=0) as file:
            idle_since = time.monotonic()
            delay = 0.001
            while True:
                data = file.read(CHUNK)
                if data:
                    yield data
                    idle_since, delay = time.monotonic(), 0.001
                    continue
                if end.exists():
                    while data := file.read(CHUNK):
                        yield data
                    if end.read_text() != "whole":
                        raise HomeProblem(502, f"the runner's stream broke off: {end.read_text()}")
                    return
                if time.monotonic() - idle_since > IDLE_SECONDS:
                    raise HomeProblem(504, "the runner's stream stood still; broken off")
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
    finally:
        _abandon(op)  # a stream still coming (its asker left) stops
        spooled.unlink(missing_ok=True)
        end.unlink(missing_ok=True)
