"""Filing and deciding requests; the API, the admin and tasks all call these.

- **Filing** (:func:`file_egress`, :func:`file_package`): what is asked for is checked as the
  allowlist or the workplace would check it; something already allowed is answered at once
  (approved, with a note saying where it is allowed, and no version made); a pending request for
  the same thing (the same agent and route; the same workplace and package) takes the new
  requester instead of a second request. Approvers are told of a new one.
- **Deciding** (:func:`approve`, :func:`reject`): approvers and admins of the organisation, with
  a note; a request somebody filed on an agent's behalf is decided by somebody else, unless
  they are the organisation's only decider and its ``own_requests`` setting allows it (then
  the request records ``decided_by_filer``); a decision is final. An
  egress approval adds the entry where the approver says (the agent, every agent of its
  workplace, or the base list), optionally until a time, after which :func:`expire_grants`
  removes it again; a package approval adds it to the workplace. Each change is a new version
  of what it changed, and the request records which.
- **Unattended requests** are rejected as expired after the organisation's
  ``request_expiry_minutes`` (:func:`expire_unattended`).
"""

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.mail import send_mail
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from agents.models import Agent
from agents.services import effective_allowlist, update_agent
from allowlists.entries import parse_entry
from approvals.models import Grant, Kind, Request, Requester, Scope, Status
from egress.environment import DESK_HOST
from egress.models import Decision, EgressToken
from organisations import webhooks
from organisations.models import Membership, Organisation, OwnRequests, Role
from organisations.roles import role_of
from organisations.services import update_organisation
from runs.models import Run
from workplaces import config
from workplaces.models import Workplace
from workplaces.services import update_workplace

logger = logging.getLogger(__name__)

MAX_REASON = 2000  # characters of a requester's reason
MAX_PENDING_PER_AGENT = 50  # a looping agent cannot flood its approvers
REFUSAL_WINDOW = timedelta(minutes=15)  # a refusal older than this did not prompt a request
DECIDERS = frozenset({Role.ADMIN, Role.APPROVER})


def file_egress(
    agent: Agent,
    target: str,
    *,
    reason: str,
    run: Run | None = None,
    refusal: Decision | None = None,
    by: Any = None,
) -> Request:
    """An agent asks to reach ``target`` (host or host:port)."""
    try:
        entry = parse_entry(target)
    except ValueError as exc:
        raise ValidationError({"target": [str(exc)]}) from None
    if entry.host == DESK_HOST:
        raise ValidationError({"target": [f"{DESK_HOST} is the proxy's own: it needs no route"]})
    with transaction.atomic():
        locked = Agent.objects.select_for_update().select_related("organisation").get(pk=agent.pk)
        sources = effective_allowlist(locked).get(entry)
        pending = Request.objects.filter(
            agent=locked, kind=Kind.EGRESS, target=entry.host_port, status=Status.PENDING
        ).first()
        if pending is None:
            _room(locked)
        request, merged = _request(
            pending,
            organisation=locked.organisation,
            agent=locked,
            workplace=locked.workplace,
            kind=Kind.EGRESS,
            target=entry.host_port,
        )
        _requester(request, locked, reason, run, refusal, by)
        if sources and not merged:
            _answer(request, f"already allowed ({', '.join(sources)})")
        elif not merged:
            _notify_later(request)
    return request


def file_package(
    agent: Agent,
    ecosystem: str,
    package: str,
    *,
    reason: str,
    run: Run | None = None,
    by: Any = None,
) -> Request:
    """An agent asks for a package (``name`` or ``name=version``) in its workplace."""
    if agent.workplace_id is None:
        raise ValidationError(
            {"agent": ["the agent has no workplace: a package can only be added to one"]}
        )
    try:
        (spec,) = config.check_packages({ecosystem: [package]}).get(ecosystem) or [""]
    except ValueError as exc:
        raise ValidationError({"package": [str(exc)]}) from None
    if not spec:
        raise ValidationError({"package": [f"give a package name ({config.PACKAGES_RULE})"]})
    name = config.package_name(ecosystem, spec)
    with transaction.atomic():
        workplace = Workplace.objects.select_for_update().get(pk=agent.workplace_id)
        # The same package in the same version (or the same unversioned name) merges.
        pending = Request.objects.filter(
            workplace=workplace,
            kind=Kind.PACKAGE,
            ecosystem=ecosystem,
            package=spec,
            status=Status.PENDING,
        ).first()
        if pending is None:
            _room(agent)
        request, merged = _request(
            pending,
            organisation=workplace.organisation,
            agent=agent,
            workplace=workplace,
            kind=Kind.PACKAGE,
            ecosystem=ecosystem,
            package=spec,
        )
        _requester(request, agent, reason, run, None, by)
        present = (workplace.packages or {}).get(ecosystem, [])
        names = {config.package_name(ecosystem, p): p for p in present}
        # Exactly that, or (no version asked for) the package in whatever version it has.
        if not merged and (spec in present or (config.is_bare(ecosystem, spec) and name in names)):
            shown = names.get(name, spec)
            _answer(request, f"already in {workplace.name} v{workplace.version} ({shown})")
        elif not merged:
            _notify_later(request)
    return request


def approve(
    request: Request,
    *,
    by: Any,
    note: str,
    scope: str = Scope.AGENT,
    expires_at: datetime | None = None,
) -> Request:
    """Grant what the request asks for; the versions it makes are recorded on it."""
    with transaction.atomic():
        _lock_what_it_changes(request, scope)  # in the order filing takes them: no deadlock
        locked = _decidable(request, by, note)
        if locked.kind == Kind.PACKAGE:
            if expires_at is not None or scope not in ("", Scope.AGENT, Scope.WORKPLACE):
                raise ValidationError(
                    {"scope": ["a package goes into the agent's workplace: no scope or expiry"]}
                )
            produced = _add_package(locked, by)
            scope = Scope.WORKPLACE
        else:
            if scope not in Scope.values:
                raise ValidationError({"scope": [f"one of {', '.join(Scope.values)}"]})
            if expires_at is not None and expires_at <= timezone.now():
                raise ValidationError({"expires_at": ["the expiry must be in the future"]})
            produced = _grant(locked, Scope(scope), expires_at, by)
        locked.status = Status.APPROVED
        locked.scope = scope
        locked.grant_expires_at = expires_at
        locked.produced = produced
        _decided(locked, by, note)
    request.refresh_from_db()
    return request


def reject(request: Request, *, by: Any, note: str) -> Request:
    with transaction.atomic():
        _lock_what_it_changes(request, "")
        locked = _decidable(request, by, note)
        locked.status = Status.REJECTED
        _decided(locked, by, note)
    request.refresh_from_db()
    return request


def expire_grants(now: datetime | None = None) -> int:
    """Remove entries whose grant has expired (a new version of each list); how many."""
    now = now or timezone.now()
    removed = 0
    for grant_id in Grant.objects.filter(expires_at__lte=now, removed_at__isnull=True).values_list(
        "pk", flat=True
    ):
        with transaction.atomic():
            grant = Grant.objects.select_for_update().get(pk=grant_id)
            if grant.removed_at is not None:
                continue
            others = Grant.objects.filter(
                entry=grant.entry, agent=grant.agent, organisation=grant.organisation,
                removed_at__isnull=True,
            ).exclude(pk=grant.pk).exclude(expires_at__lte=now)  # fmt: skip
            # Only what it put there, and not while another grant still holds it.
            if grant.added and not others.exists():
                grant.removed_version = _remove_entry(grant)
            grant.removed_at = now
            grant.save(update_fields=["removed_at", "removed_version"])
            removed += 1
    return removed


def expire_unattended(now: datetime | None = None) -> int:
    """Reject pending requests older than their organisation's request_expiry_minutes."""
    now = now or timezone.now()
    expired = 0
    for organisation in Organisation.objects.filter(request_expiry_minutes__isnull=False):
        minutes = organisation.request_expiry_minutes or 0
        cutoff = now - timedelta(minutes=minutes)
        for request in Request.objects.filter(
            organisation=organisation, status=Status.PENDING, created_at__lte=cutoff
        ):
            with transaction.atomic():
                locked = Request.objects.select_for_update().get(pk=request.pk)
                if locked.status != Status.PENDING:
                    continue
                locked.status = Status.REJECTED
                locked.expired = True
                locked.note = f"expired: nobody decided it within {minutes} minutes"
                locked.decided_at = now
                locked.save(update_fields=["status", "expired", "note", "decided_at"])
                webhooks.send(organisation.pk, "request.decided", event_data(locked))
                expired += 1
    return expired


def can_decide(user: Any, request: Request) -> str:
    """Why ``user`` may not decide ``request`` ('' when they may)."""
    return _not_allowed(user, request) or _not_pending(request)


def _not_allowed(user: Any, request: Request) -> str:
    if role_of(user, request.organisation) not in DECIDERS:
        return "only approvers and admins of the organisation decide requests"
    if not filed_by(user, request):
        return ""
    mine = "you filed this request on the agent's behalf"
    if request.organisation.own_requests == OwnRequests.NEVER:
        return f"{mine}: somebody else decides it (the organisation's four-eyes setting)"
    if others := other_deciders(user, request.organisation):
        return f"{mine}: somebody else decides it ({', '.join(others)} may)"
    return ""


def decidable(user: Any, requests: Iterable[Request]) -> set[int]:
    """The ids of the pending ``requests`` that ``user`` may decide: :func:`can_decide`'s rule
    for a page of them in a few queries (their role per organisation, what they filed, and
    who else decides once per organisation), not several a row."""
    pending = [r for r in requests if r.status == Status.PENDING]
    if not pending or not user.is_authenticated:
        return set()
    places = {r.organisation_id for r in pending}
    roles: dict[int, str] = (
        dict.fromkeys(places, Role.ADMIN)
        if user.is_superuser
        else dict(
            Membership.objects.filter(user=user, organisation_id__in=places).values_list(
                "organisation_id", "role"
            )
        )
    )
    filed = set(
        Requester.objects.filter(request__in=pending, filed_by=user).values_list(
            "request_id", flat=True
        )
    )
    alone: dict[int, bool] = {}
    allowed = set()
    for request in pending:
        if roles.get(request.organisation_id) not in DECIDERS:
            continue
        if request.pk in filed:
            organisation = request.organisation
            if organisation.own_requests == OwnRequests.NEVER:
                continue
            if organisation.pk not in alone:
                alone[organisation.pk] = not other_deciders(user, organisation)
            if not alone[organisation.pk]:
                continue
        allowed.add(request.pk)
    return allowed


def filed_by(user: Any, request: Request) -> bool:
    """Whether ``user`` filed the request on an agent's behalf."""
    return bool(user.is_authenticated and request.requesters.filter(filed_by=user).exists())


def other_deciders(user: Any, organisation: Organisation, shown: int = 3) -> list[str]:
    """Up to ``shown`` names of the active people, other than ``user``, who may decide the
    organisation's requests: its approvers and admins, and the platform team."""
    members = Membership.objects.filter(
        organisation=organisation, role__in=DECIDERS, user__is_active=True
    ).exclude(user_id=user.pk)
    names = list(members.values_list("user__username", flat=True)[:shown])
    if len(names) < shown:
        platform = get_user_model().objects.filter(is_superuser=True, is_active=True)
        more = platform.exclude(pk=user.pk).exclude(username__in=names)
        names += list(more.values_list("username", flat=True)[: shown - len(names)])
    return names


def _not_pending(request: Request) -> str:
    return "" if request.status == Status.PENDING else f"it was {request.status} already"


# --- the parts ---------------------------------------------------------------------------------


def _lock_what_it_changes(request: Request, scope: str) -> None:
    """The rows a decision changes, locked before the request (filing locks the agent or the
    workplace, then writes a requester, which takes a lock on the request)."""
    if request.kind == Kind.PACKAGE:
        if request.workplace_id is not None:
            Workplace.objects.select_for_update().filter(pk=request.workplace_id).first()
        return
    agents = Agent.objects.select_for_update().order_by("pk")
    if scope == Scope.WORKPLACE and request.workplace_id is not None:
        list(agents.filter(workplace_id=request.workplace_id))
    else:
        list(agents.filter(pk=request.agent_id))


def _room(agent: Agent) -> None:
    """A new pending request of the agent fits (at most MAX_PENDING_PER_AGENT wait at once)."""
    waiting = (
        Request.objects.filter(requesters__agent=agent, status=Status.PENDING).distinct().count()
    )
    if waiting >= MAX_PENDING_PER_AGENT:
        raise ValidationError(
            f"agent {agent} has {waiting} requests waiting for a decision already: wait for"
            " them to be decided"
        )


def _request(pending: Request | None, **fields: Any) -> tuple[Request, bool]:
    if pending is not None:
        return pending, True
    workplace = fields.get("workplace")
    fields["workplace_version"] = workplace.version if workplace is not None else None
    return Request.objects.create(**fields), False


def _requester(
    request: Request,
    agent: Agent,
    reason: str,
    run: Run | None,
    refusal: Decision | None,
    by: Any,
) -> None:
    reason = (reason or "").strip()
    if not reason:
        raise ValidationError({"reason": ["say why the agent needs it"]})
    if len(reason) > MAX_REASON or "\0" in reason:
        raise ValidationError({"reason": [f"a reason is text of at most {MAX_REASON} characters"]})
    if run is not None and run.agent_id != agent.pk:
        raise ValidationError({"run": ["the run is another agent's"]})
    Requester.objects.create(
        request=request,
        agent=agent,
        run=run,
        reason=reason,
        refusal=refusal,
        filed_by=by if by is not None and by.is_authenticated else None,
    )


def _answer(request: Request, note: str) -> None:
    """Something already allowed: approved at once, by nobody, changing nothing."""
    request.status = Status.APPROVED
    request.note = note
    request.decided_at = timezone.now()
    request.save(update_fields=["status", "note", "decided_at"])


def _decidable(request: Request, by: Any, note: str) -> Request:
    locked = Request.objects.select_for_update().select_related("organisation").get(pk=request.pk)
    if why := _not_allowed(by, locked):
        raise PermissionDenied(why)
    if why := _not_pending(locked):
        raise ValidationError(why)
    if not (note or "").strip():
        raise ValidationError({"note": ["a decision needs a note saying why"]})
    return locked


def _decided(request: Request, by: Any, note: str) -> None:
    request.decided_by = by
    request.decided_at = timezone.now()
    request.note = note.strip()
    # Allowed only as its organisation's only decider (_not_allowed): said and kept.
    request.decided_by_filer = filed_by(by, request)
    request.save()
    webhooks.send(request.organisation_id, "request.decided", event_data(request))


def _has(entries: list[str], entry: str) -> bool:
    """Whether a list holds the entry, however it is written there (host, host:443…)."""
    wanted = parse_entry(entry)
    return any(parse_entry(text) == wanted for text in entries)


def _without(entries: list[str], entry: str) -> list[str]:
    wanted = parse_entry(entry)
    return [text for text in entries if parse_entry(text) != wanted]


def _grant(request: Request, scope: Scope, expires_at: datetime | None, by: Any) -> dict[str, Any]:
    entry = str(parse_entry(request.target))  # as lists write it
    organisation = request.organisation
    if scope == Scope.ORGANISATION:
        locked = Organisation.objects.select_for_update().get(pk=organisation.pk)
        added = not _has(locked.base_allowlist, entry)
        if added:
            update_organisation(
                locked,
                by=by,
                reason=_because(request),
                base_allowlist=[*locked.base_allowlist, entry],
            )
        Grant.objects.create(
            request=request,
            entry=entry,
            organisation=organisation,
            expires_at=expires_at,
            added=added,
        )
        return {"base_allowlist": True}
    if scope == Scope.WORKPLACE:
        # The workplace the agent had when it asked, as the decision page shows it.
        if request.workplace_id is None:
            raise ValidationError({"scope": ["the agent had no workplace when it asked"]})
        agents = list(Agent.objects.filter(workplace_id=request.workplace_id).order_by("pk"))
    else:
        agents = [request.agent]
    versions = {}
    for agent in agents:
        locked_agent = Agent.objects.select_for_update().get(pk=agent.pk)
        added = not _has(locked_agent.allowlist, entry)
        if added:
            locked_agent = update_agent(
                locked_agent,
                by=by,
                reason=_because(request),
                allowlist=[*locked_agent.allowlist, entry],
            )
            versions[str(agent.pk)] = locked_agent.version
        Grant.objects.create(
            request=request,
            entry=entry,
            agent=agent,
            organisation=organisation,
            expires_at=expires_at,
            added=added,
            added_version=locked_agent.version if added else None,
        )
    return {"agent_versions": versions}


def _add_package(request: Request, by: Any) -> dict[str, Any]:
    if request.workplace_id is None:
        raise ValidationError("the request names no workplace to add the package to")
    workplace = Workplace.objects.select_for_update().get(pk=request.workplace_id)
    packages = {k: list(v) for k, v in (workplace.packages or {}).items()}
    ecosystem = request.ecosystem
    name = config.package_name(ecosystem, request.package)
    present = packages.get(ecosystem, [])
    replaced = [
        p for p in present if config.package_name(ecosystem, p) == name and p != request.package
    ]
    kept = [p for p in present if config.package_name(ecosystem, p) != name]
    packages[ecosystem] = [*kept, request.package]
    workplace = update_workplace(workplace, by=by, reason=_because(request), packages=packages)
    produced: dict[str, Any] = {"workplace_version": workplace.version}
    if replaced:
        produced["replaced"] = replaced
    return produced


def _remove_entry(grant: Grant) -> int | None:
    if grant.agent_id is None:
        organisation = Organisation.objects.select_for_update().get(pk=grant.organisation_id)
        if _has(organisation.base_allowlist, grant.entry):
            kept = _without(organisation.base_allowlist, grant.entry)
            update_organisation(organisation, reason=_expired(grant), base_allowlist=kept)
        return None
    agent = Agent.objects.select_for_update().get(pk=grant.agent_id)
    if not _has(agent.allowlist, grant.entry):
        return None
    agent = update_agent(
        agent, reason=_expired(grant), allowlist=_without(agent.allowlist, grant.entry)
    )
    return agent.version


def _because(request: Request) -> str:
    """A version's reason, when an approval makes it."""
    return f"request #{request.pk} approved: {request.kind} {request.thing}"


def _expired(grant: Grant) -> str:
    return f"grant of {grant.entry} (request #{grant.request_id}) expired"


def _notify_later(request: Request) -> None:
    """Once filing commits: email the approvers, and post ``request.pending`` to the
    organisation's webhook."""
    pk = request.pk
    transaction.on_commit(lambda: _notify_quietly(pk))
    webhooks.send(request.organisation_id, "request.pending", event_data(request))


def event_data(request: Request) -> dict[str, Any]:
    """A request as its webhook events carry it."""
    first = request.requesters.order_by("at", "id").first()
    base = settings.COVEY_CONTROL_PLANE_URL.rstrip("/")
    return {
        "id": request.pk,
        "kind": request.kind,
        "thing": request.thing,
        "ecosystem": request.ecosystem,
        "package": request.package,
        "target": request.target,
        "status": request.status,
        "expired": request.expired,
        "agent": {"id": request.agent_id, "slug": request.agent.slug, "name": request.agent.name},
        "run": str(first.run_id) if first and first.run_id else None,
        "reason": first.reason if first else "",
        "decided_by": request.decided_by.get_username() if request.decided_by else None,
        "decided_at": request.decided_at.isoformat() if request.decided_at else None,
        "note": request.note,
        "scope": request.scope,
        "produced": request.produced,
        "decide": base + reverse("admin:approvals_request_decide", args=[request.pk]),
        "api": base + reverse("request-detail", args=[request.pk]),
    }


def pending_no_longer(data: dict[str, Any]) -> str:
    """Why a ``request.pending`` event (``data``: :func:`event_data`) no longer holds when a
    try of its delivery comes: its request was decided since, and ``request.decided`` went or
    goes instead ('' while it waits, or when it is not known). A retry never brings a
    receiver the request as pending after its decision."""
    pk = data.get("id")
    found = Request.objects.filter(pk=pk) if isinstance(pk, int) else Request.objects.none()
    status = found.values_list("status", flat=True).first()
    if status is None or status == Status.PENDING:
        return ""
    return f"request #{pk} is {status} now"


def _notify_quietly(request_id: int) -> None:
    """:func:`notify`, whose failure (a mail server down) is logged: the request is filed."""
    try:
        notify(request_id)
    except Exception:
        logger.exception("covey: approvers could not be told of request %s", request_id)


def notify(request_id: int) -> int:
    """Tell the organisation's approvers and admins (those with an email address) of a new
    request, through Django's mail backend; how many were told."""
    request = Request.objects.select_related("organisation", "agent").get(pk=request_id)
    emails = sorted(
        set(
            Membership.objects.filter(
                organisation=request.organisation, role__in=[Role.ADMIN, Role.APPROVER]
            )
            .exclude(user__email="")
            .values_list("user__email", flat=True)
        )
    )
    if not emails:
        return 0
    reason = request.requesters.order_by("at").values_list("reason", flat=True).first() or ""
    link = settings.COVEY_CONTROL_PLANE_URL.rstrip("/") + reverse(
        "admin:approvals_request_decide", args=[request.pk]
    )
    send_mail(
        f"covey: {request.agent} asks for {request.thing}",
        f"{request.agent} ({request.organisation}) asks for {request.kind} {request.thing}.\n\n"
        f"Its reason: {reason}\n\nDecide: {link}\n",
        None,
        emails,
    )
    return len(emails)


# --- from inside a sandbox: the proxy files for the agent its credential proves ------------------


def agent_of_token(
    token_sha256: str, organisation: Organisation | None, runner: Any = None
) -> tuple[Agent, Run | None]:
    """The agent (and its run) whose live egress credential has this SHA-256, in the
    organisation (None: any, for the control-plane host's own proxy); PermissionDenied when
    there is none (revoked, expired, another organisation's)."""
    tokens = EgressToken.objects.select_related("agent__organisation", "agent__workplace")
    if organisation is not None:
        tokens = tokens.filter(agent__organisation=organisation)
    token = tokens.filter(sha256=token_sha256).first()
    if token is None or not token.is_live:
        raise PermissionDenied("no live egress credential of this organisation's agents")
    if not token.agent.enabled:
        raise PermissionDenied(f"agent {token.agent} is disabled")
    run = Run.objects.filter(egress_token=token).first()
    if runner is not None and run is not None and run.runner_id != runner.pk:
        raise PermissionDenied("that credential is of a run on another runner")
    return token.agent, run


def file_from_sandbox(
    organisation: Organisation | None,
    token_sha256: str,
    data: Mapping[str, Any],
    runner: Any = None,
) -> Request:
    """A request the proxy forwards from a sandbox: the agent is the one its credential
    proves, the run the one that credential was issued for; the refusal that prompted an
    egress request is the agent's latest refusal of that route within REFUSAL_WINDOW, when
    there is one (an older one prompted nothing the agent asks now)."""
    agent, run = agent_of_token(token_sha256, organisation, runner)
    reason = str(data.get("reason") or "")
    if data.get("kind") == Kind.EGRESS:
        target = str(data.get("target") or "")
        try:
            entry = parse_entry(target)
        except ValueError as exc:
            raise ValidationError({"target": [str(exc)]}) from None
        refusal = (
            Decision.objects.filter(agent=agent, host=entry.host, port=entry.port, allowed=False)
            .filter(decided_at__gte=timezone.now() - REFUSAL_WINDOW)
            .order_by("-decided_at")
            .first()
        )
        return file_egress(agent, target, reason=reason, run=run, refusal=refusal)
    if data.get("kind") == Kind.PACKAGE:
        return file_package(
            agent,
            str(data.get("ecosystem") or ""),
            str(data.get("package") or ""),
            reason=reason,
            run=run,
        )
    raise ValidationError({"kind": ["egress or package"]})


def answer(request: Request) -> dict[str, Any]:
    """What the agent is told of its request: machine-readable, and what to do next."""
    shown: dict[str, Any] = {
        "id": request.pk,
        "kind": request.kind,
        "what": request.thing,
        "status": request.status,
    }
    if request.status != Status.PENDING:
        shown.update(
            decision=request.status,
            note=request.note,
            changed=request.produced,
            expired=request.expired,
        )
        if request.grant_expires_at:
            shown["until"] = request.grant_expires_at.isoformat()
    return shown


def desk_file(
    token_sha256: str,
    filing: Mapping[str, Any],
    organisation: Organisation | None = None,
    runner: Any = None,
) -> tuple[int, dict[str, Any]]:
    """The desk's filing (egress/proxy/desk.py) as an HTTP status and JSON answer."""
    try:
        filed = file_from_sandbox(organisation, token_sha256, filing, runner)
    except PermissionDenied as exc:
        return 403, {"detail": str(exc)}
    except ValidationError as exc:
        return 400, {"detail": "; ".join(exc.messages)}
    return 201, answer(filed)


def desk_status(
    token_sha256: str,
    request_id: int,
    organisation: Organisation | None = None,
    runner: Any = None,
) -> tuple[int, dict[str, Any]]:
    """How a request the agent made (or was merged into) stands."""
    try:
        agent, _ = agent_of_token(token_sha256, organisation, runner)
    except PermissionDenied as exc:
        return 403, {"detail": str(exc)}
    found = Request.objects.filter(pk=request_id, requesters__agent=agent).distinct().first()
    if found is None:
        return 404, {"detail": f"agent {agent} made no request {request_id}"}
    return 200, answer(found)
