"""Where a run goes: an online, unpaused runner of the agent's organisation with every label the
agent requires (under hard isolation, one whose latest egress probe passed), and the runner
holding the agent's home when there is one."""

from collections.abc import Sequence
from dataclasses import dataclass

from django.db.models import Count, Q

from agents.models import Agent
from runners.models import Runner
from runs.models import ACTIVE


@dataclass(frozen=True)
class Placement:
    """The chosen runner, or None and why none fits (said in the run's status)."""

    runner: Runner | None
    reason: str = ""


def place(agent: Agent) -> Placement:
    """Choose a runner for the agent's next run: the least busy of those that fit."""
    runners = list(
        Runner.objects.filter(organisation_id=agent.organisation_id)
        .select_related("last_probe")
        .annotate(busy=Count("runs", filter=Q(runs__status__in=ACTIVE)))
        .order_by("busy", "builtin", "name")
    )
    if agent.home_runner_id is not None:
        home = next((r for r in runners if r.pk == agent.home_runner_id), None)
        if home is None:
            return Placement(None, "the runner holding this agent's home is gone; clear it to move")
        problem = _unfit(home, agent.required_labels)
        if problem:
            return Placement(None, f"waiting for {home.name}, which holds the home: {problem}")
        return Placement(home)
    fitting = [r for r in runners if not _unfit(r, agent.required_labels)]
    if fitting:
        return Placement(fitting[0])
    return Placement(None, _why_none(runners, agent))


def _unfit(runner: Runner, required: list[str]) -> str:
    """'' when the runner can take the agent's work now, else what stands in the way."""
    missing = sorted(set(required) - set(runner.labels))
    if missing:
        return f"lacks label{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    if runner.paused:
        return "paused"
    if not runner.online:
        return "offline"
    return runner.untrusted_reason()


def _why_none(runners: Sequence[Runner], agent: Agent) -> str:
    organisation = agent.organisation.name
    if not runners:
        return f"{organisation} has no runner; register one"
    required = set(agent.required_labels)
    if required and not any(required <= set(r.labels) for r in runners):
        carried = set().union(*(set(r.labels) for r in runners))
        missing = sorted(required - carried)
        if missing:
            return f"no runner of {organisation} carries {', '.join(missing)}"
        return f"no runner of {organisation} carries all of {', '.join(sorted(required))}"
    problems = "; ".join(
        f"{r.name} {problem}" for r in runners if (problem := _unfit(r, agent.required_labels))
    )
    return f"no runner can take it now: {problems}"
