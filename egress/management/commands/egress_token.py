"""Print a new egress token for an agent: exactly one line, ``username:token``."""

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from agents.models import Agent
from agents.services import find_agent
from egress.services import issue_token


class Command(BaseCommand):
    help = "Issue a short-lived egress token for AGENT (id, slug or org/slug) and print it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("agent")
        parser.add_argument(
            "--ttl", type=int, default=None, help="Lifetime in seconds (COVEY_EGRESS_TOKEN_TTL)."
        )
        parser.add_argument("--purpose", default="manual", help="Why, for the token list.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            agent = find_agent(options["agent"])
        except (Agent.DoesNotExist, Agent.MultipleObjectsReturned) as exc:
            raise CommandError(str(exc)) from None
        ttl = timedelta(seconds=options["ttl"]) if options["ttl"] is not None else None
        try:
            _, line = issue_token(agent, ttl=ttl, purpose=options["purpose"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(line)
