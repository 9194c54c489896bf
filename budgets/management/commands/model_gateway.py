"""Run the model gateway in the foreground (budgets.gateway.server) over the database ledger."""

from dataclasses import replace
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from budgets.gateway.broker import DjangoBroker
from budgets.gateway.config import GatewayConfig
from budgets.gateway.ledger import DjangoLedger
from budgets.gateway.server import Gateway
from covey.serving import listen_address, serve


class Command(BaseCommand):
    help = "Run covey's model gateway: agents call their model through it, metered."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--listen",
            default=settings.COVEY_MODEL_GATEWAY_LISTEN,
            help="HOST:PORT to accept sandboxes on (default COVEY_MODEL_GATEWAY_LISTEN).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        host, port = listen_address(options["listen"])
        # The settings read the gateway's variables with its own parser: the same values.
        config = replace(
            GatewayConfig.from_environment(), metrics_token=settings.COVEY_METRICS_TOKEN
        )
        try:
            config.check()
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        ledger = DjangoLedger()
        gateway = Gateway(ledger, config, DjangoBroker(ledger))
        self.stdout.write(
            f"covey: model gateway on http://{host}:{port}/ to {config.upstream} (Anthropic)"
            f" and {config.openai_upstream} (OpenAI, at /openai/v1); connections' git hosts"
            " at /git/"
        )
        self.stdout.flush()
        serve(gateway.app(), host, port, port_setting="COVEY_MODEL_GATEWAY_PORT")
