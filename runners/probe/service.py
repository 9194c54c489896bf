"""Egress probes on the control plane: ordering one, what the runner is told to try, and what
it reported (checks.py says what a check is; host.py runs them on a runner host).

A probe acts as one agent: its credentials and allowlist are what the proxy checks are made
with (a short-lived egress token, revoked when the probe reports). Without ``agent`` it is the
organisation's first enabled agent that may reach the allowed vendor; an organisation without
one gets its wall probed all the same, and the three checks through the proxy are skipped
(each line says why).
"""

import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from agents.models import Agent
from agents.services import effective_allowlist
from allowlists.entries import EntryError, parse_entry
from egress.environment import Isolation
from egress.services import issue_token, revoke_tokens
from runners import dispatch, services
from runners.models import Probe, ProbeStatus, Runner
from runners.probe import checks
from runners.protocol import ProbePlan

TOKEN_TTL = timedelta(minutes=10)
# A probe with no report after this long is ended as an error (the runner host stopped, or its
# order was lost); it changes nothing about the runner's trust.
REPORT_WITHIN = timedelta(minutes=5)


class ProbeConflict(Exception):
    """The probe is not this runner's to run (finished, or someone else's)."""


def allowed_target(agent: Agent | None, organisation: Any) -> str:
    """The vendor endpoint that must be reachable through the proxy, ``host:port``:
    COVEY_EGRESS_PROBE_ALLOWED, else the first entry of the organisation's base list."""
    if settings.COVEY_EGRESS_PROBE_ALLOWED:
        return str(parse_entry(settings.COVEY_EGRESS_PROBE_ALLOWED).host_port)
    base = list(organisation.base_allowlist)
    if not base:
        raise ValidationError(
            f"{organisation.name}'s base allowlist is empty: set COVEY_EGRESS_PROBE_ALLOWED"
        )
    return parse_entry(base[0]).host_port


def may_reach(agent: Agent, target: str) -> bool:
    """Whether the target (``host:port``) is on the agent's effective allowlist."""
    return parse_entry(target) in effective_allowlist(agent)


def choose_agent(runner: Runner, agent: Agent | None, allowed: str) -> Agent | None:
    """The agent a probe acts as; ValidationError when a chosen one cannot do it."""
    if agent is not None:
        if agent.organisation_id != runner.organisation_id:
            raise ValidationError(
                f"agent {agent} is not of {runner.organisation.name}, whose runner this is"
            )
        if not agent.enabled:
            raise ValidationError(f"agent {agent} is disabled; the proxy would refuse it")
        if not may_reach(agent, allowed):
            raise ValidationError(
                f"agent {agent} may not reach {allowed} (COVEY_EGRESS_PROBE_ALLOWED or the base"
                " list's first entry): choose another agent"
            )
        return agent
    candidates = Agent.objects.filter(organisation_id=runner.organisation_id, enabled=True)
    for candidate in candidates.select_related("organisation").order_by("pk"):
        if may_reach(candidate, allowed):
            return candidate
    return None


def order_probe(
    runner: Runner, *, agent: Agent | None = None, by: Any = None, reason: str = "ordered"
) -> Probe:
    """A pending probe, and the order to run it on the runner's queue (after commit)."""
    allowed = allowed_target(agent, runner.organisation)
    chosen = choose_agent(runner, agent, allowed)
    off_list_target(chosen)
    with transaction.atomic():
        probe_row = Probe.objects.create(
            runner=runner,
            agent=agent,  # None: the runner's order picks one when it starts
            reason=reason[:100],
            requested_by=by if by is not None and getattr(by, "is_authenticated", False) else None,
        )
        transaction.on_commit(lambda: dispatch.send_probe(runner, str(probe_row.pk)))
    return probe_row


def off_list_target(agent: Agent | None) -> str:
    """A name the agent may not reach (COVEY_EGRESS_PROBE_OFF_LIST), ``host:port``."""
    target = parse_entry(settings.COVEY_EGRESS_PROBE_OFF_LIST).host_port
    if agent is not None and may_reach(agent, target):
        raise ValidationError(
            f"COVEY_EGRESS_PROBE_OFF_LIST ({target}) is on agent {agent}'s allowlist:"
            " choose a name it may not reach"
        )
    return target


@transaction.atomic
def begin(
    runner: Runner, probe_id: str | None, isolation: Isolation, reason: str = ""
) -> ProbePlan:
    """The runner starts a probe (one ordered, or its own): what to try, as whom. When the
    control plane's probe settings make it impossible, the probe is finished as an error and
    the answer carries ``error`` instead."""
    note_isolation(runner, isolation)
    if probe_id is None:
        probe_row = Probe.objects.create(runner=runner, reason=(reason or "runner")[:100])
    else:
        found = (
            Probe.objects.select_for_update()
            .filter(pk=probe_id, runner=runner, status=ProbeStatus.PENDING, egress_token=None)
            .first()
        )
        if found is None:
            raise ProbeConflict("this probe is not this runner's to run (or already ran)")
        probe_row = found
    probe_row.isolation = isolation
    plan = ProbePlan(
        probe=str(probe_row.pk),
        image=settings.COVEY_PROBE_IMAGE,
        services=tuple(control_plane_services()),
    )
    try:
        allowed = allowed_target(probe_row.agent, runner.organisation)
        agent = choose_agent(runner, probe_row.agent, allowed)
        plan = replace(plan, allowed=allowed, off_list=off_list_target(agent))
    except (ValidationError, EntryError) as exc:
        probe_row.save(update_fields=["isolation"])
        _finish(probe_row, [], f"the probe cannot run: {words(exc)}")
        return ProbePlan(probe=str(probe_row.pk), error=probe_row.detail)
    if agent is None:
        plan = replace(
            plan,
            no_agent=f"no enabled agent of {runner.organisation.name} may reach {allowed} to"
            " probe as",
        )
    else:
        token, credentials = issue_token(
            agent, ttl=TOKEN_TTL, purpose=f"egress probe {probe_row.pk}"
        )
        probe_row.agent, probe_row.egress_token = agent, token
        plan = replace(plan, credentials=credentials, agent=str(agent))
    probe_row.save(update_fields=["isolation", "agent", "egress_token"])
    return plan


def note_isolation(runner: Runner, isolation: Isolation) -> None:
    """Record what the runner host says it enforces."""
    if runner.isolation != isolation:
        Runner.objects.filter(pk=runner.pk).update(isolation=isolation)
        runner.isolation = isolation


@transaction.atomic
def finish(
    runner: Runner, probe_id: str, results: Sequence[checks.Result], detail: str = ""
) -> Probe:
    """Store what the runner reported; the runner's trust follows its latest probe."""
    probe_row = (
        Probe.objects.select_for_update()
        .filter(pk=probe_id, runner=runner, status=ProbeStatus.PENDING)
        .first()
    )
    if probe_row is None:
        raise ProbeConflict("no pending probe of this runner has that id")
    _finish(probe_row, list(results), detail)
    if probe_row.status == ProbeStatus.PASSED:
        transaction.on_commit(lambda: services.available(runner))
    return probe_row


def expire(now: Any = None) -> int:
    """End the pending probes nobody reported on within REPORT_WITHIN; returns how many."""
    cutoff = (now or timezone.now()) - REPORT_WITHIN
    ended = 0
    for probe_id in Probe.objects.filter(
        status=ProbeStatus.PENDING, created_at__lt=cutoff
    ).values_list("pk", flat=True):
        with transaction.atomic():
            row = Probe.objects.select_for_update().filter(pk=probe_id).first()
            if row is None or row.status != ProbeStatus.PENDING:
                continue  # reported meanwhile
            minutes = int(REPORT_WITHIN.total_seconds() // 60)
            detail = f"no report from the runner within {minutes} minutes"
            _finish(row, [], detail, trusts=False)
            ended += 1
    return ended


def _finish(
    probe_row: Probe, results: Sequence[checks.Result], detail: str, *, trusts: bool = True
) -> None:
    if detail:
        probe_row.status = ProbeStatus.ERROR
    else:
        probe_row.status = ProbeStatus.PASSED if checks.passed(results) else ProbeStatus.FAILED
    probe_row.summary = (detail or checks.summary(results))[:400]
    probe_row.detail = detail
    probe_row.checks = [r.as_dict() for r in results]
    probe_row.finished_at = timezone.now()
    probe_row.save(update_fields=["status", "summary", "detail", "checks", "finished_at"])
    if probe_row.egress_token_id is not None:
        revoke_tokens([probe_row.egress_token])
    if trusts:  # the runner's trust follows what it reported
        Runner.objects.filter(pk=probe_row.runner_id).update(last_probe=probe_row)


def control_plane_services() -> list[str]:
    """``host:port`` of the control plane's web, database and broker, as it reaches them."""
    found = []
    for url in (settings.COVEY_CONTROL_PLANE_URL, settings.CELERY_BROKER_URL):
        parts = urlsplit(url or "")
        if parts.hostname and parts.scheme in ("http", "https", "redis", "rediss", "amqp"):
            default = {"https": 443, "http": 80, "amqp": 5672}.get(parts.scheme, 6379)
            found.append(f"{parts.hostname}:{parts.port or default}")
    database = settings.DATABASES["default"]
    if database.get("HOST") and not str(database["HOST"]).startswith("/"):
        found.append(f"{database['HOST']}:{database.get('PORT') or 5432}")
    return sorted(set(found))


def wait(probes: Iterable[Probe], timeout: float, poll: float = 0.2) -> list[Probe]:
    """The probes, once none is pending or ``timeout`` seconds have passed."""
    ids = [p.pk for p in probes]
    deadline = time.monotonic() + timeout
    while True:
        found = list(Probe.objects.filter(pk__in=ids).select_related("runner", "agent"))
        if all(p.status != ProbeStatus.PENDING for p in found) or time.monotonic() >= deadline:
            return sorted(found, key=lambda p: ids.index(p.pk))
        time.sleep(poll)


def lines(probe_row: Probe) -> list[str]:
    """The probe as people read it: one line per check."""
    if probe_row.detail and not probe_row.checks:
        return [checks.failure_line(probe_row.detail)]
    return [checks.Result.from_dict(c).line() for c in probe_row.checks]


def words(exc: Exception) -> str:
    """A validation error as one sentence."""
    if isinstance(exc, ValidationError):
        return "; ".join(exc.messages)
    return str(exc)
