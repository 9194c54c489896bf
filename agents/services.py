"""Creating and changing agents; the API, the admin and tasks all call these.

Every change to an agent's configuration goes through :func:`update_agent`, which writes a new
numbered :class:`AgentVersion` when (and only when) the configuration actually changed.
"""

from collections.abc import Iterable
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from agents import models
from agents.labels import normalise_labels
from agents.models import COMMAND_RULE, Agent, is_command
from allowlists.entries import Entry, parse_entry
from connections.grants import check_grants
from connections.services import kinds_of
from covey.versions import record_version
from organisations.models import Organisation
from organisations.services import find_one, slug_for
from templates.models import AllowlistTemplate
from workplaces.models import Workplace

AGENT_FIELDS = frozenset(models.AGENT_FIELDS)  # what update_agent accepts


SANDBOX_FIELDS = frozenset(
    {"runtime_command", "cpus", "memory_mb", "pids_limit", "run_timeout", "home_quota_mb"}
)


def find_agent(reference: str) -> Agent:
    """An agent by id, ``slug`` (when unique) or ``organisation-slug/agent-slug``."""
    agent: Agent = find_one(
        Agent.objects.select_related("organisation"), reference, "slug", "agent"
    )
    return agent


def agent_config(agent: Agent) -> dict[str, Any]:
    """The agent's configuration as a plain dict: what a version records and a run uses."""
    workplace = agent.workplace
    return {
        "name": agent.name,
        "slug": agent.slug,
        "enabled": agent.enabled,
        "templates": sorted(t.slug for t in agent.templates.all()),
        "allowlist": list(agent.allowlist),
        "credential_grants": list(agent.credential_grants),
        "required_labels": list(agent.required_labels),
        # Which workplace, not what it holds: that is versioned with the workplace, and a run
        # records the workplace version it was queued at.
        "workplace": None if workplace is None else {"id": workplace.pk, "name": workplace.name},
        "sandbox": {
            "command": list(agent.runtime_command),
            "cpus": float(agent.cpus),
            "memory_mb": agent.memory_mb,
            "pids": agent.pids_limit,
            "timeout": agent.run_timeout,
            "home_quota_mb": agent.home_quota_mb,
        },
    }


@transaction.atomic
def create_agent(
    organisation: Organisation,
    name: str,
    *,
    by: Any = None,
    slug: str | None = None,
    enabled: bool = True,
    templates: Iterable[AllowlistTemplate] = (),
    allowlist: Iterable[str] = (),
    credential_grants: Iterable[dict[str, Any]] = (),
    required_labels: Iterable[str] = (),
    workplace: Workplace | None = None,
    **sandbox: Any,
) -> Agent:
    """Create an agent at version 1 (``sandbox``: runtime_command, cpus, memory_mb,
    pids_limit, run_timeout, home_runner; defaults otherwise)."""
    unknown = set(sandbox) - SANDBOX_FIELDS - {"home_runner"}
    if unknown:
        raise TypeError(f"unknown agent fields: {', '.join(sorted(unknown))}")
    agent = Agent(
        organisation=organisation,
        name=name,
        slug=slug or slug_for(name),
        enabled=enabled,
        allowlist=list(allowlist),
        credential_grants=list(credential_grants),
        workplace=workplace,
        **sandbox,
    )
    agent.required_labels = _labels(required_labels)
    _validate(agent)
    agent.save()
    agent.templates.set(list(templates))
    record_version(agent, agent_config(agent), by=by)
    return agent


@transaction.atomic
def update_agent(agent: Agent, *, by: Any = None, reason: str = "", **changes: Any) -> Agent:
    """Apply changes to an agent; a new version is written if the configuration changed
    (``reason``: why, when covey changes it, e.g. an approved request).

    The row is locked for the duration, so concurrent changes get consecutive numbers.
    Returns the agent as saved (``agent`` itself is refreshed too).
    """
    unknown = set(changes) - AGENT_FIELDS
    if unknown:
        raise TypeError(f"cannot change {', '.join(sorted(unknown))} of an agent")
    locked = (
        Agent.objects.select_for_update(of=("self",)).select_related("workplace").get(pk=agent.pk)
    )
    before = agent_config(locked)
    templates = changes.pop("templates", None)
    if "required_labels" in changes:
        changes["required_labels"] = _labels(changes["required_labels"])
    if "allowlist" in changes:
        changes["allowlist"] = list(changes["allowlist"])
    for field, value in changes.items():
        setattr(locked, field, value)
    _validate(locked)
    locked.save()
    if templates is not None:
        locked.templates.set(list(templates))
    after = agent_config(locked)
    if after != before:
        locked.version += 1
        locked.save(update_fields=["version", "updated_at"])
        record_version(locked, after, before=before, by=by, reason=reason)
    agent.refresh_from_db()
    return locked


def effective_allowlist(agent: Agent) -> dict[Entry, list[str]]:
    """Base + templates + own entries → where each entry comes from, in entry order.

    Sources read ``base``, ``template:<slug>`` or ``agent``.
    """
    sources: dict[Entry, list[str]] = {}
    lists: list[tuple[str, list[str]]] = [("base", agent.organisation.base_allowlist)]
    lists += [(f"template:{t.slug}", t.entries) for t in agent.templates.all()]
    lists.append(("agent", agent.allowlist))
    for source, texts in lists:
        for text in texts:
            sources.setdefault(parse_entry(text), []).append(source)
    return dict(sorted(sources.items()))


def _validate(agent: Agent) -> None:
    others = Agent.objects.filter(organisation_id=agent.organisation_id).exclude(pk=agent.pk)
    if others.filter(name=agent.name).exists():
        raise ValidationError({"name": [f"an agent named {agent.name!r} exists already"]})
    if others.filter(slug=agent.slug).exists():
        raise ValidationError(
            {"name": [f"an agent with the slug {agent.slug!r} exists already; choose another name"]}
        )
    if not is_command(agent.runtime_command):
        raise ValidationError({"runtime_command": [COMMAND_RULE]})
    try:
        agent.credential_grants = check_grants(
            agent.credential_grants, agent=agent.slug, connections=kinds_of(agent.organisation_id)
        )
    except ValueError as exc:
        raise ValidationError({"credential_grants": [str(exc)]}) from None
    agent.full_clean(exclude=["templates"])
    if agent.home_runner is not None and agent.home_runner.organisation_id != agent.organisation_id:
        raise ValidationError({"home_runner": ["the runner belongs to another organisation"]})
    if agent.workplace is not None and agent.workplace.organisation_id != agent.organisation_id:
        raise ValidationError({"workplace": ["the workplace belongs to another organisation"]})


def _labels(values: Iterable[str]) -> list[str]:
    try:
        return normalise_labels(list(values) if not isinstance(values, str) else values)
    except ValueError as exc:
        raise ValidationError({"required_labels": [str(exc)]}) from None
