"""Print a new egress token for an agent: exactly one line, ``username:token``."""

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from agents.models import Agent
from egress.services import issue_token


def find_agent(reference: str) -> Agent:
    """An agent by id, ``slug`` (when unique) or ``organisation-slug/agent-slug``."""
    agents = Agent.objects.select_related("organisation")
    if reference.isdigit():
        found = list(agents.filter(pk=int(reference)))
    elif "/" in reference:
        org, _, slug = reference.partition("/")
        found = list(agents.filter(organisation__slug=org, slug=slug))
    else:
        found = list(agents.filter(slug=reference)[:2])
    if not found:
        raise CommandError(f"no agent {reference!r} (give an id, a slug or org-slug/agent-slug)")
    if len(found) > 1:
        raise CommandError(f"several agents are called {reference!r}; use org-slug/agent-slug")
    return found[0]


class Command(BaseCommand):
    help = "Issue a short-lived egress token for AGENT (id, slug or org/slug) and print it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("agent")
        parser.add_argument(
            "--ttl", type=int, default=None, help="Lifetime in seconds (COVEY_EGRESS_TOKEN_TTL)."
        )
        parser.add_argument("--purpose", default="manual", help="Why, for the token list.")

    def handle(self, *args: Any, **options: Any) -> None:
        agent = find_agent(options["agent"])
        ttl = timedelta(seconds=options["ttl"]) if options["ttl"] is not None else None
        try:
            _, line = issue_token(agent, ttl=ttl, purpose=options["purpose"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(line)
