"""Renew every runner's token: the control plane does this each time it starts."""

from typing import Any

from django.core.management.base import BaseCommand

from runners.services import renew_runner_tokens


class Command(BaseCommand):
    help = (
        "Give every runner a new token (the old ones stop working at once); runners pick"
        " theirs up without a restart. Also makes missing built-in runners."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        renewed = renew_runner_tokens()
        self.stdout.write(f"renewed the tokens of {renewed} runner(s)")
