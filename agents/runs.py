"""Runs: queueing work for an agent, placing it on a runner, and following it to the end.

Every status change goes through :func:`_move`, which records it in the run's history. Orders
to runners leave only after the transaction that decided them commits.
"""

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files.base import ContentFile
from django.db import transaction
from django.http import FileResponse, HttpResponse, HttpResponseBase
from django.utils import timezone

from agents.models import ACTIVE, FINISHED, Agent, Run, RunEvent, RunOutput, RunStatus
from egress.models import EgressToken
from egress.services import issue_token, revoke_tokens
from runners import dispatch
from runners.models import Runner
from runners.placement import place

MAX_TASK_BYTES = 100 * 1024  # it travels in an environment variable too
LOG_TAIL_CHARS = 16_000
# Live output: a runner sends at most this much at once, and a run takes at most this much
# before its sandbox ends. The whole log then replaces it; Docker keeps the last 10 to 20 MB of
# a sandbox's output (runners/engine.py), so live output stops below that, and a whole log
# that lost its start says how much (Run.log_start).
MAX_OUTPUT_CHUNK_BYTES = 256 * 1024
MAX_LIVE_OUTPUT_BYTES = 16 * 1024 * 1024
MAX_LIVE_ANSWER_BYTES = 1024 * 1024  # of live output per answer: ask again from where it ends
# Without a command of its own, an agent runs the Claude runtime on its task; an image without
# it ends with NO_RUNTIME_EXIT, which the run's status explains (see report).
NO_RUNTIME_EXIT = 127
DEFAULT_RUNTIME = [
    "sh",
    "-c",
    "command -v claude >/dev/null 2>&1 || { echo 'covey: this image has no Claude runtime"
    " (claude is not on its PATH): give the agent a workplace whose image has it, or a runtime"
    f' command\' >&2; exit {NO_RUNTIME_EXIT}; }}; exec claude --print "$COVEY_TASK"',
]


class RunError(Exception):
    """A run cannot do what was asked in its current state; the message says why."""


@transaction.atomic
def queue_run(agent: Agent, task: str, *, by: Any = None) -> Run:
    """Queue work for an agent at its current configuration version, and place it."""
    if not agent.enabled:
        raise ValidationError({"agent": ["the agent is disabled"]})
    if not task.strip():
        raise ValidationError({"task": ["the task is empty"]})
    if len(task.encode()) > MAX_TASK_BYTES or "\0" in task:
        raise ValidationError({"task": [f"a task is text of at most {MAX_TASK_BYTES} bytes"]})
    run = Run.objects.create(
        agent=agent,
        agent_version=agent.versions.get(number=agent.version),
        task=task,
        timeout=agent.run_timeout,
        created_by=by if by is not None and by.is_authenticated else None,
    )
    RunEvent.objects.create(run=run, status=RunStatus.QUEUED)
    _place(run)
    return run


def place_waiting(organisation_id: int | None = None) -> int:
    """Place queued runs, oldest first; returns how many found a runner."""
    placed = 0
    queued = Run.objects.filter(status=RunStatus.QUEUED).order_by("created_at")
    if organisation_id is not None:
        queued = queued.filter(agent__organisation_id=organisation_id)
    for run_id in list(queued.values_list("pk", flat=True)[:500]):
        with transaction.atomic():
            run = (
                Run.objects.select_for_update(skip_locked=True)
                .filter(pk=run_id, status=RunStatus.QUEUED)
                .first()
            )
            if run is not None and _place(run):
                placed += 1
    return placed


def _place(run: Run) -> bool:
    agent = Agent.objects.select_for_update().get(pk=run.agent_id)
    placement = place(agent)
    if placement.runner is None:
        reason = _fit(placement.reason, Run._meta.get_field("status_detail").max_length)
        if reason != run.status_detail:
            run.status_detail = reason
            run.save(update_fields=["status_detail"])
        return False
    runner = placement.runner
    if agent.home_runner_id is None:
        # The first run makes the home: from now on the agent's work goes where its home is.
        Agent.objects.filter(pk=agent.pk).update(home_runner=runner)
    run.runner = runner
    run.placed_at = timezone.now()
    _move(run, RunStatus.PLACED, f"on {runner.name}", fields=["runner", "placed_at"])
    transaction.on_commit(lambda: dispatch.send_launch(runner, str(run.pk)))
    return True


@transaction.atomic
def cancel(run: Run, *, by: Any = None) -> Run:
    """Cancel a run: at once when it waits, through its runner when it has one."""
    run = Run.objects.select_for_update().get(pk=run.pk)
    if run.status in FINISHED:
        raise RunError(f"the run has ended already ({run.status})")
    who = f" by {by.get_username()}" if by is not None and by.is_authenticated else ""
    if run.status == RunStatus.QUEUED or run.runner is None:
        run.finished_at = timezone.now()
        _move(run, RunStatus.CANCELLED, f"cancelled{who} before it started", ["finished_at"])
        return run
    if run.cancel_requested_at is None:
        run.cancel_requested_at = timezone.now()
        run.status_detail = f"cancelling{who}"
        run.save(update_fields=["cancel_requested_at", "status_detail"])
        runner = run.runner
        transaction.on_commit(lambda: dispatch.send_cancel(runner, str(run.pk)))
    return run


# --- what runners report ---------------------------------------------------------------------


@transaction.atomic
def start(run_id: str, runner: Runner) -> dict[str, Any] | None:
    """A runner is about to build the sandbox: mark it starting and return what it needs
    (None when the run is no longer this runner's to start)."""
    run = _runners_run(run_id, runner)
    if run is None or run.status not in (RunStatus.PLACED, RunStatus.STARTING):
        return None
    if run.cancel_requested_at is not None:
        run.finished_at = timezone.now()
        _move(run, RunStatus.CANCELLED, "cancelled before it started", ["finished_at"])
        return None
    if run.egress_token is not None:  # the first try died mid-launch: a fresh credential
        revoke_tokens([run.egress_token])
    token, credentials = issue_token(
        run.agent,
        ttl=timedelta(seconds=run.timeout + 600),
        purpose=f"run {run.pk}",
    )
    run.egress_token = token
    if run.status == RunStatus.PLACED:
        _move(run, RunStatus.STARTING, "", ["egress_token"])
    else:
        run.save(update_fields=["egress_token"])
    return sandbox_spec(run, credentials)


def sandbox_image(run: Run) -> str:
    """The image a run's sandbox is built from: its workplace's, else COVEY_DEFAULT_IMAGE."""
    workplace = run.agent_version.config.get("workplace") or {}
    return str(workplace.get("image") or settings.COVEY_DEFAULT_IMAGE)


def _default_runtime(run: Run) -> bool:
    """The run has no command of its own: it runs the Claude runtime."""
    return not (run.agent_version.config.get("sandbox") or {}).get("command")


def sandbox_spec(run: Run, credentials: str) -> dict[str, Any]:
    """What the runner builds, from the agent's configuration version the run was queued at."""
    config = run.agent_version.config
    sandbox = config.get("sandbox") or {}
    return {
        "run": str(run.pk),
        "agent": run.agent_id,
        "image": sandbox_image(run),
        "command": sandbox.get("command") or DEFAULT_RUNTIME,
        "task": run.task,
        "cpus": float(sandbox.get("cpus", 1)),
        "memory_mb": int(sandbox.get("memory_mb", 2048)),
        "pids": int(sandbox.get("pids", 512)),
        "timeout": run.timeout,
        "egress": {"enforce": settings.COVEY_EGRESS_ENFORCE, "credentials": credentials},
    }


@transaction.atomic
def report(
    run_id: str,
    runner: Runner,
    *,
    state: str,
    exit_code: int | None = None,
    log_tail: str = "",
    detail: str = "",
    started_at: datetime | None = None,
    finished_at: datetime | None = None,
) -> Run | None:
    """What a runner saw: the sandbox is ``running``, has ``exited`` (with its code, or
    ``timeout`` in detail), could not be ``built``, or ``vanished``; with the sandbox's own
    start and end times when it has them. None: not this runner's."""
    run = _runners_run(run_id, runner)
    if run is None:
        return None
    if run.status in FINISHED:
        return run  # a late or repeated report changes nothing
    now = timezone.now()
    if state == "running" or (state == "exited" and run.status != RunStatus.RUNNING):
        # A quick sandbox may have ended before its runner said it started: it still ran.
        if run.status != RunStatus.RUNNING:
            run.started_at = started_at or now
            _move(run, RunStatus.RUNNING, detail if state == "running" else "", ["started_at"])
        if state == "running":
            return run
    if state == "vanished" and settings.COVEY_RUN_LOST == "retry":
        _end_credential(run)
        run.runner = None
        run.egress_token = None
        _move(
            run,
            RunStatus.QUEUED,
            f"its sandbox vanished ({detail}); queued again",
            ["runner", "egress_token"],
        )
        _place(run)
        return run
    run.exit_code = exit_code
    if log_tail:  # else the tail of the whole log the runner sent first
        run.log_tail = log_tail[-LOG_TAIL_CHARS:]
    run.finished_at = finished_at or now
    if run.cancel_requested_at is not None:
        status, why = RunStatus.CANCELLED, "cancelled"
    elif state == "exited" and detail == "timeout":
        status, why = RunStatus.TIMED_OUT, f"stopped after {run.timeout} s"
    elif state == "exited" and exit_code == 0:
        status, why = RunStatus.SUCCEEDED, ""
    elif state == "exited" and exit_code == NO_RUNTIME_EXIT and _default_runtime(run):
        image = sandbox_image(run)
        status, why = (
            RunStatus.FAILED,
            f"exit code {exit_code}: the image {image} has no Claude runtime (claude is not on"
            " its PATH). Give the agent a workplace whose image has it, or a runtime command"
            ' (a list of arguments, e.g. ["sh", "-c", "make test"]).',
        )
    elif state == "exited":
        status, why = RunStatus.FAILED, f"exit code {exit_code}"
    elif state == "built":
        status, why = RunStatus.FAILED, f"the sandbox could not be built: {detail}"
    elif state == "vanished":
        status, why = RunStatus.FAILED, f"its sandbox vanished ({detail})"
    else:
        raise ValidationError({"state": [f"unknown state {state!r}"]})
    _end_credential(run)
    _move(run, status, why, ["exit_code", "log_tail", "finished_at"])
    return run


def printable(text: str) -> str:
    """Output as the database and the files keep it: NUL (which PostgreSQL text cannot hold)
    becomes U+FFFD, as the runner's live output does, so both count the same bytes."""
    return text.replace("\x00", "\ufffd")


@transaction.atomic
def save_log(run_id: str, runner: Runner, text: str, total: int | None = None) -> Run | None:
    """Keep a run's whole output and its tail (a runner sends it once the sandbox ended); it
    replaces the output sent while the run went. ``total``: how many bytes the sandbox wrote
    in all, when the runner counted them; the log lacks the difference at its start (Docker
    keeps only the last of a large output), which ``Run.log_start`` records so that offsets
    into the output stay the same."""
    run = _runners_run(run_id, runner)
    if run is None:
        return None
    if run.log:
        run.log.delete(save=False)
    text = printable(text)
    data = text.encode()
    run.log.save(f"{run.pk}.log", ContentFile(data), save=False)
    run.log_tail = text[-LOG_TAIL_CHARS:]
    run.log_start = max(0, (total or 0) - len(data))
    run.output_size = run.log_start + len(data)
    Run.objects.filter(pk=run.pk).update(
        log=run.log.name,
        log_tail=run.log_tail,
        output_size=run.output_size,
        log_start=run.log_start,
    )
    RunOutput.objects.filter(run=run).delete()
    return run


class OutputConflict(Exception):
    """Output sent at another offset than the run's size; ``size`` is where to go on from."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the run has {size} bytes of output; send from there")
        self.size = size


class OutputClosed(Exception):
    """The run takes no more live output (it has ended, or has as much as it keeps): the whole
    log comes at the end."""

    def __init__(self, size: int, why: str) -> None:
        super().__init__(why)
        self.size = size


@transaction.atomic
def append_output(run_id: str, runner: Runner, offset: int, text: str) -> Run | None:
    """Keep output a runner sent while the sandbox runs, at ``offset`` bytes into it.

    OutputConflict when the offset is not the run's current size (a resend, or a runner that
    restarted: it goes on from the size it is told); OutputClosed when the run has ended or
    would pass MAX_LIVE_OUTPUT_BYTES. None: not this runner's run."""
    run = _runners_run(run_id, runner)
    if run is None:
        return None
    if run.log or run.status in FINISHED:
        raise OutputClosed(run.output_size, "the run has ended: send its whole log")
    if offset != run.output_size:
        raise OutputConflict(run.output_size)
    text = printable(text)
    size = len(text.encode())
    if run.output_size + size > MAX_LIVE_OUTPUT_BYTES:
        raise OutputClosed(
            run.output_size,
            f"a run takes {MAX_LIVE_OUTPUT_BYTES} bytes of output while it goes: the rest"
            " comes with its whole log",
        )
    if not text:
        return run
    RunOutput.objects.create(run=run, start=offset, end=offset + size, text=text)
    run.output_size += size
    run.log_tail = (run.log_tail + text)[-LOG_TAIL_CHARS:]
    Run.objects.filter(pk=run.pk).update(output_size=run.output_size, log_tail=run.log_tail)
    return run


def log_response(run: Run, offset: int = 0) -> HttpResponseBase:
    """The run's output as text from ``offset`` bytes on. The headers say where to ask from
    next (``X-Covey-Log-Size``, a byte count), whether more can come (``X-Covey-Log-Complete``:
    the run has ended and everything up to that size was given) and, when the whole log lacks
    the start of a large output, how much (``X-Covey-Log-Start``). A whole log is streamed;
    live output comes at most MAX_LIVE_ANSWER_BYTES at a time."""
    finished = run.status in FINISHED
    headers = {"X-Covey-Log-Start": str(run.log_start)}
    if run.log:
        file = run.log.open("rb")
        length = file.size
        skip = min(max(0, offset - run.log_start), length)
        file.seek(skip)
        response: HttpResponseBase = FileResponse(file, content_type=TEXT)
        response["Content-Length"] = str(length - skip)
        size = run.log_start + length
    else:
        data, size = _live_output(run, offset)
        response = HttpResponse(data, content_type=TEXT)
        # A finished run without a whole log (its runner lost it): what arrived is all.
        finished = finished and size >= run.output_size
    for name, value in headers.items():
        response[name] = value
    response["X-Covey-Log-Size"] = str(size)
    response["X-Covey-Log-Complete"] = "true" if finished else "false"
    return response


TEXT = "text/plain; charset=utf-8"


def _live_output(run: Run, offset: int) -> tuple[bytes, int]:
    """Live output from ``offset`` on (at most MAX_LIVE_ANSWER_BYTES, whole pieces cut at a
    character) and the offset it ends at."""
    offset = min(max(0, offset), run.output_size)
    pieces = RunOutput.objects.filter(run=run, end__gt=offset, start__lt=run.output_size)
    if not pieces.exists():
        if run.output_size == 0 and offset == 0 and run.log_tail:
            # A run from before live output: its tail is all there is.
            tail = run.log_tail.encode()
            return tail, len(tail)
        return b"", offset
    taken: list[bytes] = []
    end = offset
    for start, text in pieces.order_by("start").values_list("start", "text").iterator():
        data = text.encode()[max(0, offset - start) :]
        room = MAX_LIVE_ANSWER_BYTES - (end - offset)
        if len(data) > room:
            cut = room
            while cut > 0 and data[cut] & 0xC0 == 0x80:  # not inside a character
                cut -= 1
            taken.append(data[:cut])
            end += cut
            break
        taken.append(data)
        end += len(data)
    return b"".join(taken), end


def runners_active_runs(runner: Runner) -> list[dict[str, Any]]:
    """The runs a runner should have a sandbox for (what it reconciles against), with how much
    of their output the control plane has."""
    now = timezone.now()
    return [
        {
            "run": str(pk),
            "status": status,
            "cancel": cancel is not None,
            "waited": (now - placed_at).total_seconds() if placed_at else 0.0,
            "output_size": output_size,
        }
        for pk, status, cancel, placed_at, output_size in Run.objects.filter(
            runner=runner, status__in=ACTIVE
        )
        .order_by("created_at")
        .values_list("pk", "status", "cancel_requested_at", "placed_at", "output_size")
    ]


def _runners_run(run_id: str, runner: Runner) -> Run | None:
    return (
        Run.objects.select_for_update(of=("self",))
        .select_related("agent", "agent_version", "egress_token")
        .filter(pk=run_id, runner=runner)
        .first()
    )


def _end_credential(run: Run) -> None:
    if run.egress_token_id is not None:
        revoke_tokens(EgressToken.objects.filter(pk=run.egress_token_id))


def _fit(text: str, limit: int | None) -> str:
    """Text cut to a column's length, saying it was cut."""
    if limit is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"


def _move(run: Run, status: RunStatus, detail: str = "", fields: list[str] | None = None) -> None:
    detail = _fit(detail, Run._meta.get_field("status_detail").max_length)
    run.status = status
    run.status_detail = detail
    run.save(update_fields=["status", "status_detail", *(fields or [])])
    RunEvent.objects.create(run=run, status=status, detail=detail)


def prune_logs(now: datetime | None = None) -> int:
    """Delete the whole output of runs that ended more than COVEY_RUN_LOG_RETENTION_DAYS ago
    (the run, its history and the tail of its output stay); returns how many."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.COVEY_RUN_LOG_RETENTION_DAYS)
    pruned = 0
    for run in Run.objects.filter(finished_at__lt=cutoff).exclude(log=""):
        run.log.delete(save=False)
        Run.objects.filter(pk=run.pk).update(log="")
        pruned += 1
    return pruned
