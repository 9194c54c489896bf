"""Run the policy stream (egress/stream/) in the foreground, over the database: runner hosts'
proxies follow it (runners/streaming.py says who may)."""

import resource
from typing import Any

from aiohttp import web
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from allowlists.entries import split_host_port
from egress.stream.hub import Hub
from egress.stream.notices import FingerprintNotices, PostgresNotices
from egress.stream.server import PATH, make_app
from runners.streaming import RunnersStore


class Command(BaseCommand):
    help = "Run covey's policy stream: runner hosts' proxies hear of policy changes at once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--listen",
            default=settings.COVEY_EGRESS_STREAM_LISTEN,
            help="HOST:PORT to accept proxies on (default COVEY_EGRESS_STREAM_LISTEN).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            host, port = split_host_port(options["listen"])
        except ValueError as exc:
            raise CommandError(f"--listen {options['listen']!r}: {exc}") from None
        if not host:  # never every interface by omission
            raise CommandError(f"--listen {options['listen']!r}: name the host (HOST:PORT)")
        # A follower is an open connection: as many as the hard limit allows (ulimit -n).
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        store = RunnersStore()
        if connection.vendor == "postgresql":
            params = connection.get_connection_params()
            for django_only in ("cursor_factory", "context", "prepare_threshold"):
                params.pop(django_only, None)  # Django's sync cursor; its adapters
            notices: PostgresNotices | FingerprintNotices = PostgresNotices(params)
            how = "PostgreSQL's notices"
        else:  # no notices: this one process reads a fingerprint, not every proxy
            notices = FingerprintNotices(store.fingerprint)
            how = f"a fingerprint of the policy ({connection.vendor} sends no notices)"
        told = settings.COVEY_EGRESS_STREAM_URL or "nobody: COVEY_EGRESS_STREAM_URL is not set"
        self.stdout.write(
            f"covey: policy stream on http://{host}:{port}{PATH}, hearing of changes by {how};"
            f" proxies are told of it at {told}"
        )
        self.stdout.flush()
        hub = Hub(store)
        try:
            web.run_app(
                make_app(hub, notices, metrics_token=settings.COVEY_METRICS_TOKEN),
                host=host,
                port=port,
                print=None,
                access_log=None,
                shutdown_timeout=5,
            )
        except OSError as exc:
            raise CommandError(
                f"cannot listen on {host}:{port}: {exc} (another port: --listen, or"
                " COVEY_EGRESS_STREAM_PORT under make run)"
            ) from None
        if hub.failed is not None:
            raise CommandError(f"the policy stream's hub failed: {hub.failed!r}")
