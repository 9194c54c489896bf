"""Say what the egress proxy would decide for an agent and a target, and why (no connection)."""

import asyncio
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from agents.models import Agent
from agents.services import find_agent
from allowlists.entries import split_host_port
from egress.policy import (
    EXPLANATIONS,
    Attempt,
    Decision,
    Policy,
    check_addresses,
    check_agent,
    parse_networks,
)
from egress.proxy.resolver import ResolutionError, Resolver
from egress.services import build_snapshot


def split_target(text: str, default_port: int) -> tuple[str, int]:
    """HOST[:PORT] → (host, port); an IP literal is kept for the decision to refuse."""
    try:
        return split_host_port(text, default_port)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


class Command(BaseCommand):
    help = "Explain the proxy's decision for AGENT and HOST[:PORT], without connecting."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("agent", help="id, slug or org-slug/agent-slug")
        parser.add_argument("target", help="HOST[:PORT] (port 443, or 80 with --plain-http)")
        parser.add_argument(
            "--plain-http", action="store_true", help="as a plain-HTTP request, not CONNECT"
        )
        parser.add_argument(
            "--no-resolve", action="store_true", help="skip resolving and vetting the addresses"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            agent = find_agent(options["agent"])
        except (Agent.DoesNotExist, Agent.MultipleObjectsReturned) as exc:
            raise CommandError(str(exc)) from None
        plain = options["plain_http"]
        host, port = split_target(options["target"], 80 if plain else 443)
        policy = Policy.from_snapshot(build_snapshot(agent.organisation_id))
        subject = policy.agents[agent.pk]
        kind = "plain HTTP request" if plain else "CONNECT tunnel"
        self.stdout.write(f"agent {agent} (version {agent.version}), {kind} to {host}:{port}")
        # The proxy's own steps (egress.policy), from step 2: the agent is given, not proven.
        decision = check_agent(
            subject, Attempt(None, host, port, plain_http=plain), built_in=policy.built_in
        )
        if not decision.allowed:
            self._deny(decision)
            return
        self.stdout.write(
            f"on the allowlist: {decision.host}:{decision.port} from {', '.join(decision.sources)}"
        )
        if options["no_resolve"]:
            self.stdout.write("decision: allow (addresses not checked: --no-resolve)")
            return
        resolver = Resolver(settings.COVEY_EGRESS_NAMESERVERS)
        try:
            addresses = asyncio.run(resolver.resolve(decision.host))
        except ResolutionError as exc:
            addresses = []
            self.stdout.write(f"cannot resolve: {exc}")
        allowed_private = parse_networks(settings.COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS)
        decision = check_addresses(decision, addresses, allowed_private)
        self.stdout.write(f"resolves to: {', '.join(addresses) or 'nothing'}")
        if not decision.allowed:
            self._deny(decision)
            return
        self.stdout.write(f"decision: allow, connecting to {decision.address} port {decision.port}")

    def _deny(self, decision: Decision) -> None:
        code, detail = decision.code, decision.detail
        reason = EXPLANATIONS.get(code, str(code))
        self.stdout.write(f"decision: deny {code}: {reason}" + (f" ({detail})" if detail else ""))
