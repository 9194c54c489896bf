"""Register this host as a runner with a control plane (no database needed)."""

import json
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from runners.host.client import ControlPlaneClient, ControlPlaneError


class Command(BaseCommand):
    help = "Exchange a registration token for a runner token; saves both URL and token."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", required=True, help="The control plane, e.g. https://covey")
        parser.add_argument("--registration-token", required=True)
        parser.add_argument("--name", default=os.uname().nodename, help="Default: host name.")
        parser.add_argument("--label", action="append", default=[], dest="labels")
        parser.add_argument(
            "--config",
            default=str(settings.VAR_DIR / "runner.json"),
            help="Where to save the runner's URL and token (mode 0600).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            runner = ControlPlaneClient.register(
                options["url"], options["registration_token"], options["name"], options["labels"]
            )
        except ControlPlaneError as exc:
            raise CommandError(str(exc)) from None
        path = Path(options["config"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(json.dumps({"url": options["url"], **runner.to_json()}, indent=2))
        self.stdout.write(
            f"Registered runner {runner.name!r} (id {runner.id}); token saved in {path}."
        )
