"""Pause or resume this runner host's runner from its command line (no database needed)."""

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from runners.host.client import ControlPlaneError
from runners.host.identity import Identity


class Command(BaseCommand):
    help = "Pause the runner (running work finishes, nothing new starts), or --resume it."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--resume", action="store_true", help="Accept work again.")
        parser.add_argument(
            "--config",
            default=str(settings.VAR_DIR / "runner.json"),
            help="The runner's file from runner_register (URL, id, token).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path = Path(options["config"])
        if not path.exists():
            raise CommandError(f"{path} does not exist: register first (runner_register)")
        client = Identity(path).client
        try:
            me = client.pause(not options["resume"])
        except ControlPlaneError as exc:
            raise CommandError(str(exc)) from None
        finally:
            client.close()
        state = "paused" if me.paused else "accepting work"
        self.stdout.write(f"runner {me.name} is {state}")
