"""Runs: queueing work for an agent, placing it on a runner, and following it to the end.

Every status change goes through :func:`_move`, which records it in the run's history. Orders
to runners leave only after the transaction that decided them commits.
"""

import shlex
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from agents.models import Agent, home_quota_bytes
from budgets.keys import has_model_key, issue_gateway_token, model_vendors, revoke_gateway_tokens
from budgets.models import Vendor
from budgets.services import exhausted, used_up
from connections.grants import GIT_KINDS
from connections.models import Kind
from connections.services import granted
from egress.models import EgressToken
from egress.services import issue_token, revoke_tokens
from runners import dispatch
from runners.models import Runner
from runners.protocol import (
    DISK_FULL,
    ENGINE_RESTARTED,
    FEATURE_WORKPLACES,
    FEATURES,
    OVER_QUOTA,
    ActiveRun,
    ActiveRuns,
    ActiveStatus,
    EgressGrant,
    GitRemote,
    LaunchSpec,
    ModelGrant,
    Packages,
    Readiness,
    Registry,
    ReportState,
    RunReport,
    ServiceSpec,
)
from runs.models import ACTIVE, FINISHED, Run, RunEvent, RunStatus
from runs.placement import Placement, place
from workplaces.services import current_version

MAX_TASK_BYTES = 100 * 1024  # it travels in an environment variable too
LOG_TAIL_CHARS = 16_000
# Without a command of its own, an agent runs the Claude runtime on its task; an image without
# it ends with NO_RUNTIME_EXIT, which the run's status explains (see report).
NO_RUNTIME_EXIT = 127
DEFAULT_RUNTIME = [
    "sh",
    "-c",
    "command -v claude >/dev/null 2>&1 || { echo 'covey: this image has no Claude runtime"
    " (claude is not on its PATH): give the agent a workplace whose image has it, or a runtime"
    f" command' >&2; exit {NO_RUNTIME_EXIT}; }}; exec claude --print"
    # The sandbox is the boundary: nobody is there to grant the runtime each permission.
    ' --dangerously-skip-permissions -- "$COVEY_TASK"',
]


class RunError(Exception):
    """A run cannot do what was asked in its current state; the message says why."""


@transaction.atomic
def queue_run(agent: Agent, task: str, *, by: Any = None) -> Run:
    """Queue work for an agent at its current configuration version, and place it."""
    if not agent.enabled:
        raise ValidationError({"agent": ["the agent is disabled"]})
    if why := used_up(agent):
        raise ValidationError({"agent": [why]})
    if not task.strip():
        raise ValidationError({"task": ["the task is empty"]})
    if len(task.encode()) > MAX_TASK_BYTES or "\0" in task:
        raise ValidationError({"task": [f"a task is text of at most {MAX_TASK_BYTES} bytes"]})
    # The newest versions, whatever ``agent`` says: an approval may have made one since it was
    # read. The workplace is the one that agent version names.
    version = agent.versions.latest("number")
    workplace_id = (version.config.get("workplace") or {}).get("id")
    run = Run.objects.create(
        agent=agent,
        agent_version=version,
        workplace_version=None if workplace_id is None else current_version(workplace_id),
        task=task,
        timeout=agent.run_timeout,
        created_by=by if by is not None and by.is_authenticated else None,
    )
    RunEvent.objects.create(run=run, status=RunStatus.QUEUED)
    _place(run)
    return run


def _no_model(run: Run) -> str:
    """Why a run of the Claude runtime cannot reach its model ('' when it can): through the
    model gateway (when there is one: without it, only the runtime's own errors say), which
    needs the organisation's Anthropic key."""
    if not settings.COVEY_MODEL_GATEWAY_URL or not _default_runtime(run):
        return ""
    organisation = run.agent.organisation
    if has_model_key(organisation.pk, Vendor.ANTHROPIC):
        return ""
    return (
        f"{organisation.name} has no Anthropic API key, which the Claude runtime needs: enter"
        f" one in the admin (Budgets, Model keys, Add: {reverse('admin:budgets_modelkey_add')}),"
        " then start the run again"
    )


def place_waiting(organisation_id: int | None = None, *, agent_id: int | None = None) -> int:
    """Place queued runs (of an organisation, or of one agent), oldest first; returns how many
    found a runner."""
    placed = 0
    queued = Run.objects.filter(status=RunStatus.QUEUED).order_by("created_at")
    if organisation_id is not None:
        queued = queued.filter(agent__organisation_id=organisation_id)
    if agent_id is not None:
        queued = queued.filter(agent_id=agent_id)
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
    agent = Agent.objects.select_for_update().get(pk=run.agent_id)  # one placement at a time
    ahead = _ahead(run)
    placement = Placement(None, ahead) if ahead else place(agent)
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


def _ahead(run: Run) -> str:
    """Why the run must wait for another run of its agent ('' when it need not): one run at a
    time uses an agent's home, and they take it in the order they were queued."""
    others = Run.objects.filter(agent_id=run.agent_id).exclude(pk=run.pk)
    active = others.filter(status__in=ACTIVE).order_by("placed_at").first()
    if active is not None:
        return f"waiting for run {active.pk} of this agent to end: one run at a time uses its home"
    older = (
        others.filter(status=RunStatus.QUEUED, created_at__lt=run.created_at)
        .order_by("created_at")
        .first()
    )
    if older is not None:
        return f"waiting behind run {older.pk} of this agent, queued before it"
    return ""


def _ended(run: Run) -> None:
    """A run of the agent has ended: the next one waiting for its home goes, once this commits
    (the periodic placement would place it too, later)."""
    agent_id = run.agent_id
    transaction.on_commit(lambda: place_waiting(agent_id=agent_id))


def stop_over_budget(agent_id: int) -> int:
    """Stop the active runs a used-up budget holds: the agent's, or every agent's of its
    organisation when the organisation's budget is the one; returns how many."""
    agent = Agent.objects.get(pk=agent_id)
    own, whole = exhausted(agent.organisation_id)
    runs = Run.objects.filter(status__in=ACTIVE, agent__organisation_id=agent.organisation_id)
    if agent.organisation_id not in whole:
        if agent.pk not in own:
            return 0  # raised meanwhile
        runs = runs.filter(agent=agent)
    stopped = 0
    for run in runs.select_related("agent__organisation"):
        try:
            cancel(run, reason=used_up(run.agent))
            stopped += 1
        except RunError:
            pass  # it ended meanwhile
    return stopped


@transaction.atomic
def cancel(run: Run, *, by: Any = None, reason: str = "") -> Run:
    """Cancel a run: at once when it waits, through its runner when it has one. ``reason``:
    why covey stops it (its status says so), rather than a person."""
    run = Run.objects.select_for_update().get(pk=run.pk)
    if run.status in FINISHED:
        raise RunError(f"the run has ended already ({run.status})")
    who = f" by {by.get_username()}" if by is not None and by.is_authenticated else ""
    if reason:
        who = f" ({reason})"
    if run.status in (RunStatus.QUEUED, RunStatus.PLACED) or run.runner is None:
        # Placed but not started: its runner will not start it now (start() refuses a run that
        # is not placed or starting), and a lost order cannot strand it, nor its agent's next.
        run.finished_at = timezone.now()
        _move(run, RunStatus.CANCELLED, f"cancelled{who} before it started", ["finished_at"])
        _ended(run)
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
def start(
    run_id: str, runner: Runner, features: frozenset[str] = frozenset(FEATURES)
) -> LaunchSpec | None:
    """A runner is about to build the sandbox: mark it starting and return what it needs
    (None when the run is no longer this runner's to start). ``features``: what the runner
    says it can build; a run that needs more fails, saying so."""
    run = runners_run(run_id, runner)
    if run is None or run.status not in (RunStatus.PLACED, RunStatus.STARTING):
        return None
    workplace = _workplace(run)
    needs = workplace.get("services") or any((workplace.get("packages") or {}).values())
    if needs and FEATURE_WORKPLACES not in features:
        run.finished_at = timezone.now()
        _move(
            run,
            RunStatus.FAILED,
            f"runner {runner.name} cannot start a workplace's services or install its packages"
            " (it is older than them): upgrade it, or place the agent on another runner",
            ["finished_at"],
        )
        _ended(run)
        return None
    if run.cancel_requested_at is not None:
        run.finished_at = timezone.now()
        _move(run, RunStatus.CANCELLED, "cancelled before it started", ["finished_at"])
        _ended(run)
        return None
    if why := _no_model(run):  # before a sandbox is built, not after it asked in vain
        run.finished_at = timezone.now()
        _end_credential(run)  # a first try that died mid-launch had some
        _move(run, RunStatus.FAILED, why, ["finished_at"])
        _ended(run)
        return None
    if run.egress_token is not None:  # the first try died mid-launch: fresh credentials
        revoke_tokens([run.egress_token])
        revoke_gateway_tokens(run_id=run.pk)
    ttl = timedelta(seconds=run.timeout + 600)
    token, credentials = issue_token(run.agent, ttl=ttl, purpose=f"run {run.pk}")
    model = None
    if settings.COVEY_MODEL_GATEWAY_URL:
        secret = issue_gateway_token(run.agent, run_id=run.pk, ttl=ttl)
        model = ModelGrant(
            base_url=settings.COVEY_MODEL_GATEWAY_URL,
            token=secret,
            vendors=model_vendors(run.agent.organisation_id),
        )
    run.egress_token = token
    if run.status == RunStatus.PLACED:
        _move(run, RunStatus.STARTING, "", ["egress_token"])
    else:
        run.save(update_fields=["egress_token"])
    return sandbox_spec(run, credentials, model)


def _workplace(run: Run) -> dict[str, Any]:
    """The configuration of the workplace version the run was queued at ({}: none). Runs
    from before workplaces were versioned have the image in the agent's version."""
    if run.workplace_version is not None:
        return dict(run.workplace_version.config)
    return dict(run.agent_version.config.get("workplace") or {})


def sandbox_image(run: Run) -> str:
    """The image a run's sandbox is built from: its workplace's base (with the workplace's
    packages installed, when it has any), else COVEY_DEFAULT_IMAGE."""
    return str(_workplace(run).get("image") or settings.COVEY_DEFAULT_IMAGE)


def _command(run: Run) -> list[str]:
    """The agent's own command, else its workplace's (empty: the Claude runtime)."""
    own = (run.agent_version.config.get("sandbox") or {}).get("command")
    return list(own or _workplace(run).get("runtime_command") or [])


def command_shown(run: Run) -> str:
    """What the run's sandbox runs, as a shell line: its command, or the Claude runtime's."""
    return shlex.join(_command(run) or DEFAULT_RUNTIME)


def runs_at(moments: Iterable[tuple[int, datetime]]) -> dict[tuple[int, datetime], Run]:
    """For each (agent id, moment), the run of that agent going then, where one was (runs of
    one agent never overlap: one at a time uses its home); one query for them all."""
    wanted = set(moments)
    if not wanted:
        return {}
    first, last = min(m for _, m in wanted), max(m for _, m in wanted)
    runs = (
        Run.objects.filter(agent_id__in={a for a, _ in wanted}, started_at__lte=last)
        .filter(Q(finished_at__isnull=True) | Q(finished_at__gte=first))
        .order_by("started_at")
    )
    by_agent: dict[int, list[Run]] = {}
    for run in runs:
        by_agent.setdefault(run.agent_id, []).append(run)
    found = {}
    for agent_id, moment in wanted:
        for run in by_agent.get(agent_id, []):
            assert run.started_at is not None  # noqa: S101 - the query says so
            if run.started_at <= moment and (run.finished_at is None or moment <= run.finished_at):
                found[(agent_id, moment)] = run
                break
    return found


def _default_runtime(run: Run) -> bool:
    """The run has no command of its own or of its workplace: it runs the Claude runtime."""
    return not _command(run)


def sandbox_spec(run: Run, credentials: str, model: ModelGrant | None = None) -> LaunchSpec:
    """What the runner builds, from the agent's configuration version the run was queued at."""
    config = run.agent_version.config
    sandbox = config.get("sandbox") or {}
    workplace = _workplace(run)
    # The gateway brokers the connections the agent's grants name (none without it).
    grants = config.get("credential_grants") or []
    connections = granted(run.agent.organisation_id, grants) if model is not None else []
    return LaunchSpec(
        run=str(run.pk),
        agent=run.agent_id,
        image=sandbox_image(run),
        command=tuple(_command(run) or DEFAULT_RUNTIME),
        task=run.task,
        cpus=float(sandbox.get("cpus", 1)),
        memory_mb=int(sandbox.get("memory_mb", 2048)),
        pids=int(sandbox.get("pids", 512)),
        timeout=run.timeout,
        egress=EgressGrant(enforce=settings.COVEY_EGRESS_ENFORCE, credentials=credentials),
        # The quota of the version the run was queued at (its default: the setting now).
        home_quota_bytes=home_quota_bytes(sandbox.get("home_quota_mb")),
        packages=tuple(
            Packages(ecosystem, tuple(specs))
            for ecosystem, specs in (workplace.get("packages") or {}).items()
        ),
        services=tuple(_service(service) for service in workplace.get("services") or []),
        workplace=""
        if run.workplace_version is None
        else f"{workplace.get('name')} v{run.workplace_version.number}",
        model=model,
        git=tuple(
            GitRemote(url=c.git_url, host=c.host, name=c.name, api_host=c.api_host)
            for c in connections
            if c.kind in GIT_KINDS and c.git_url
        ),
        registries=tuple(
            Registry(name=c.name, paths=tuple(c.paths)) for c in connections if c.kind == Kind.BASIC
        ),
    )


def _service(service: dict[str, Any]) -> ServiceSpec:
    ready = service.get("ready")
    return ServiceSpec(
        name=service["name"],
        image=service["image"],
        environment=tuple(f"{k}={v}" for k, v in (service.get("environment") or {}).items()),
        command=tuple(service.get("command") or ()),
        ready=None
        if not ready
        else Readiness(
            command=tuple(ready["command"]),
            start_period=float(ready["start_period"]),
            interval=float(ready["interval"]),
            timeout=float(ready["timeout"]),
        ),
        cpus=float(service.get("cpus", 1)),
        memory_mb=int(service.get("memory_mb", 512)),
    )


@transaction.atomic
def report(run_id: str, runner: Runner, seen: RunReport) -> Run | None:
    """What a runner saw: the sandbox is ``running``, has ``exited`` (with its code, or
    ``timeout`` in detail), could not be ``built``, or ``vanished``; with the sandbox's own
    start and end times when it has them. None: not this runner's."""
    state, exit_code, detail = seen.state, seen.exit_code, seen.detail
    log_tail, started_at, finished_at = seen.log_tail, seen.started_at, seen.finished_at
    run = runners_run(run_id, runner)
    if run is None:
        return None
    if run.status in FINISHED:
        return run  # a late or repeated report changes nothing
    now = timezone.now()
    _record_images(run, seen)
    if seen.usage is not None:
        Agent.objects.filter(pk=run.agent_id).update(
            home_bytes=seen.usage.bytes, home_files=seen.usage.files, home_measured_at=now
        )
    if state == ReportState.RUNNING or (
        state == ReportState.EXITED and run.status != RunStatus.RUNNING
    ):
        # A quick sandbox may have ended before its runner said it started: it still ran.
        if run.status != RunStatus.RUNNING:
            run.started_at = started_at or now
            why = detail if state == ReportState.RUNNING else ""
            _move(run, RunStatus.RUNNING, why, ["started_at"])
        if state == ReportState.RUNNING:
            return run
    if state == ReportState.VANISHED and settings.COVEY_RUN_LOST == "retry":
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
    if seen.changes is not None:
        run.home_changes = seen.changes.to_json()
    if log_tail:  # else the tail of the whole log the runner sent first
        run.log_tail = log_tail[-LOG_TAIL_CHARS:]
    run.finished_at = finished_at or now
    if run.cancel_requested_at is not None:
        asked = run.status_detail  # "cancelling by …", or why covey stopped it
        why = (
            "cancelled" + asked.removeprefix("cancelling")
            if asked.startswith("cancelling")
            else "cancelled"
        )
        status = RunStatus.CANCELLED
    elif state == ReportState.EXITED and detail == "timeout":
        status, why = RunStatus.TIMED_OUT, f"stopped after {run.timeout} s"
    elif state == ReportState.EXITED and detail.startswith(f"{OVER_QUOTA}: "):
        status, why = RunStatus.FAILED, f"stopped: {detail.removeprefix(f'{OVER_QUOTA}: ')}"
    elif state == ReportState.EXITED and exit_code == 0:
        status, why = RunStatus.SUCCEEDED, ""
    elif state == ReportState.EXITED and detail.startswith(f"{DISK_FULL}: "):
        where = f" on {run.runner.name}" if run.runner else ""
        full = detail.removeprefix(f"{DISK_FULL}: ")
        status, why = RunStatus.FAILED, f"exit code {exit_code}: {full}{where}: make room there"
    elif state == ReportState.EXITED and detail == ENGINE_RESTARTED:
        where = f" on {run.runner.name}" if run.runner else ""
        status, why = (
            RunStatus.FAILED,
            f"exit code {exit_code}: the Docker engine{where} stopped during the run, and its"
            " sandbox with it",
        )
    elif state == ReportState.EXITED and exit_code == NO_RUNTIME_EXIT and _default_runtime(run):
        image = sandbox_image(run)
        status, why = (
            RunStatus.FAILED,
            f"exit code {exit_code}: the image {image} has no Claude runtime (claude is not on"
            " its PATH). Give the agent a workplace whose image has it, or a runtime command"
            ' (a list of arguments, e.g. ["sh", "-c", "make test"]).',
        )
    elif state == ReportState.EXITED:
        status, why = RunStatus.FAILED, f"exit code {exit_code}"
    elif state == ReportState.BUILT:
        status, why = RunStatus.FAILED, f"the sandbox could not be built: {detail}"
    else:  # VANISHED
        status, why = RunStatus.FAILED, f"its sandbox vanished ({detail})"
    _end_credential(run)
    _move(run, status, why, ["exit_code", "log_tail", "finished_at", "home_changes"])
    _ended(run)
    return run


def _record_images(run: Run, seen: RunReport) -> None:
    """What the sandbox and its services ran (image IDs), and the services' logs, as reported;
    a later report adds to what an earlier one said."""
    fields = []
    if seen.image_id and seen.image_id != run.image_id:
        run.image_id = seen.image_id
        fields.append("image_id")
    if seen.services:
        known = {service["name"]: dict(service) for service in run.services or []}
        for record in seen.services:
            kept = known.setdefault(record.name, {"name": record.name})
            for key, value in record.to_json().items():
                if value not in ("", None):
                    kept[key] = value
        run.services = list(known.values())
        fields.append("services")
    if fields:
        run.save(update_fields=fields)


def runners_active_runs(runner: Runner) -> ActiveRuns:
    """The runs a runner should have a sandbox for (what it reconciles against), with how much
    of their output the control plane has."""
    now = timezone.now()
    return ActiveRuns(
        runs=tuple(
            ActiveRun(
                run=str(pk),
                status=ActiveStatus(status),
                cancel=cancel is not None,
                waited=(now - placed_at).total_seconds() if placed_at else 0.0,
                output_size=output_size,
            )
            for pk, status, cancel, placed_at, output_size in Run.objects.filter(
                runner=runner, status__in=ACTIVE
            )
            .order_by("created_at")
            .values_list("pk", "status", "cancel_requested_at", "placed_at", "output_size")
        )
    )


def runners_run(run_id: str, runner: Runner) -> Run | None:
    """The run, locked, when it is this runner's; else None."""
    return (
        Run.objects.select_for_update(of=("self",))
        .select_related("agent", "agent_version", "workplace_version", "egress_token")
        .filter(pk=run_id, runner=runner)
        .first()
    )


def _end_credential(run: Run) -> None:
    if run.egress_token_id is not None:
        revoke_tokens(EgressToken.objects.filter(pk=run.egress_token_id))
    revoke_gateway_tokens(run_id=run.pk)


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
