"""Run this host as a runner (runners/host/process.py, with no database): a thin wrapper
around ``python -m runners.host``, with the same options and the same environment."""

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runners.host.__main__ import add_arguments, options
from runners.host.config import HostSettings
from runners.host.process import HostError, serve


class Command(BaseCommand):
    help = (
        "Serve as a runner (no database needed): the remote runner registered in --config, or"
        " with --builtin the control-plane host's built-in runners."
    )
    requires_system_checks: list[str] = []  # a runner host has no database to check

    def add_arguments(self, parser: CommandParser) -> None:
        add_arguments(parser)

    def handle(self, *args: Any, **given: Any) -> None:
        def say(line: str) -> None:
            self.stdout.write(line)
            self.stdout.flush()

        try:
            serve(HostSettings.from_environment(), options(given), say)
        except (HostError, ValueError) as exc:
            raise CommandError(str(exc)) from None
