"""Run the model gateway in the foreground (budgets.gateway.server) over the database ledger."""

from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from allowlists.entries import split_host_port
from budgets.gateway.ledger import DjangoLedger
from budgets.gateway.server import Gateway, GatewayConfig


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
        for name in ("COVEY_MODEL_UPSTREAM", "COVEY_OPENAI_UPSTREAM"):
            parts = urlsplit(getattr(settings, name))
            if parts.scheme != "https" or not parts.hostname:
                raise CommandError(
                    f"{name} {getattr(settings, name)!r}: the vendor is called over https only"
                    " (its key travels with every request)"
                )
            if parts.path.strip("/") or parts.query:
                raise CommandError(
                    f"{name} {getattr(settings, name)!r}: give the vendor's root, without a path"
                    " (the gateway adds /v1/…)"
                )
        config = GatewayConfig(
            upstream=settings.COVEY_MODEL_UPSTREAM,
            openai_upstream=settings.COVEY_OPENAI_UPSTREAM,
            ca_bundle=settings.COVEY_MODEL_CA_BUNDLE,
            default_max_tokens=settings.COVEY_GATEWAY_DEFAULT_MAX_TOKENS,
            threads=settings.COVEY_GATEWAY_LEDGER_THREADS,
            total_timeout=settings.COVEY_GATEWAY_MAX_REQUEST_SECONDS,
            metrics_token=settings.COVEY_METRICS_TOKEN,
        )
        gateway = Gateway(DjangoLedger(), config)
        self.stdout.write(
            f"covey: model gateway on http://{host}:{port}/ to {config.upstream} (Anthropic)"
            f" and {config.openai_upstream} (OpenAI, at /openai/v1)"
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
