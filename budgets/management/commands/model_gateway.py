"""Run the model gateway in the foreground (budgets.gateway.server) over the database ledger."""

from dataclasses import replace
from typing import Any

from aiohttp import web
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from allowlists.entries import split_host_port
from budgets.gateway.broker import DjangoBroker
from budgets.gateway.config import GatewayConfig
from budgets.gateway.ledger import DjangoLedger
from budgets.gateway.server import Gateway


class Command(BaseCommand):
    help = "Run covey's model gateway: agents call their model through it, metered."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--listen",
            default=settings.COVEY_MODEL_GATEWAY_LISTEN,
            help="HOST:PORT to accept sandboxes on (default COVEY_MODEL_GATEWAY_LISTEN).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            host, port = split_host_port(options["listen"])
        except ValueError as exc:
            raise CommandError(f"--listen {options['listen']!r}: {exc}") from None
        if not host:  # never every interface by omission
            raise CommandError(f"--listen {options['listen']!r}: name the host (HOST:PORT)")
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
        try:
            web.run_app(
                gateway.app(), host=host, port=port, print=None, access_log=None, shutdown_timeout=5
            )
        except OSError as exc:
            raise CommandError(
                f"cannot listen on {host}:{port}: {exc} (another port: --listen, or"
                " COVEY_MODEL_GATEWAY_PORT under make run)"
            ) from None
