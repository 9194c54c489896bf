"""Run the policy stream (egress/stream/) in the foreground, over the database: runner hosts'
proxies follow it (runners/streaming.py says who may)."""

import resource
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from covey.serving import listen_address, serve
from egress.stream.hub import Hub
from egress.stream.notices import FingerprintNotices, PostgresNotices
from egress.stream.server import PATH, make_app
from runners.streaming import RunnersStore, psycopg_params


class Command(BaseCommand):
    help = "Run covey's policy stream: runner hosts' proxies hear of policy changes at once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--listen",
            default=settings.COVEY_EGRESS_STREAM_LISTEN,
            help="HOST:PORT to accept proxies on (default COVEY_EGRESS_STREAM_LISTEN).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        host, port = listen_address(options["listen"])
        # A follower is an open connection: as many as the hard limit allows (ulimit -n).
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        store = RunnersStore()
        if connection.vendor == "postgresql":
            notices: PostgresNotices | FingerprintNotices = PostgresNotices(psycopg_params())
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
        app = make_app(hub, notices, metrics_token=settings.COVEY_METRICS_TOKEN)
        serve(app, host, port, port_setting="COVEY_EGRESS_STREAM_PORT")
        if hub.failed is not None:
            raise CommandError(f"the policy stream's hub failed: {hub.failed!r}")
