"""Print this host's address as sandboxes on a Docker network reach it (no database needed)."""

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runners.host.containers.engine import Engine, EngineError


class Command(BaseCommand):
    help = (
        "Print the host's IPv4 address on the Docker network sandboxes join (default: Docker's"
        " default bridge): where they reach a proxy that listens on this host."
    )
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--network", default="", help="The network (default: the bridge).")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            address = Engine("address").bridge_address(options["network"] or None)
        except EngineError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(address)
