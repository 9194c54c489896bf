"""Run the egress proxy in the foreground (egress.proxy.server): policy from the database on
the control-plane host, or from a control plane over HTTP with a runner token."""

import socket
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from egress.proxy.config import ProxyConfig
from egress.proxy.control_plane import remote_source
from egress.proxy.desk import Desk
from egress.proxy.feed import DecisionSink, PolicySource, PolicyStream
from egress.proxy.server import ProxyError, parse_listen, serve
from egress.sources import DatabaseDesk, DatabaseSink, DatabaseSource


class Command(BaseCommand):
    help = "Run the covey egress proxy (reads policy from the database or the control plane)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--listen", required=True, help="HOST:PORT to accept agents on.")
        parser.add_argument(
            "--control-plane",
            default=None,
            help="Read policy from this control plane instead of the database "
            "(default COVEY_CONTROL_PLANE_URL when --runner-token is given).",
        )
        parser.add_argument(
            "--runner-token", default=None, help="Runner token (default COVEY_RUNNER_TOKEN)."
        )
        parser.add_argument(
            "--runner-config",
            default=None,
            help="The runner's file from runner_register (URL and token): the token is re-read"
            " whenever the runner host takes a renewed one, so the proxy needs no restart.",
        )
        parser.add_argument("--name", default="", help="This proxy's name in the decision log.")

    def handle(self, *args: Any, **options: Any) -> None:
        config = ProxyConfig(
            poll=settings.COVEY_EGRESS_POLICY_POLL,
            grace=settings.COVEY_EGRESS_POLICY_GRACE,
            max_tunnels=settings.COVEY_EGRESS_MAX_TUNNELS,
            max_tunnels_per_agent=settings.COVEY_EGRESS_MAX_TUNNELS_PER_AGENT,
            head_timeout=settings.COVEY_EGRESS_HEAD_TIMEOUT,
            nameservers=tuple(settings.COVEY_EGRESS_NAMESERVERS),
            allowed_private_cidrs=tuple(settings.COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS),
            control_plane_url=settings.COVEY_CONTROL_PLANE_URL,
            runner_token=settings.COVEY_RUNNER_TOKEN,
            status_listen=settings.COVEY_EGRESS_STATUS_LISTEN,
            metrics_token=settings.COVEY_METRICS_TOKEN,
        )
        try:
            _, port = parse_listen(options["listen"])
            name = options["name"] or f"{socket.gethostname()}:{port}"
            source: PolicySource
            sink: DecisionSink
            stream: PolicyStream | None = None
            if options["runner_config"] or options["runner_token"] or config.runner_token:
                remote = remote_source(
                    config,
                    options["control_plane"],
                    options["runner_token"],
                    options["runner_config"],
                )
                source, sink, where = remote, remote.post_decisions, remote.url
                stream = remote
                desk = Desk(remote.file_request, remote.request_status)
            elif options["control_plane"]:
                raise ProxyError("--control-plane needs a runner token (--runner-token)")
            else:
                # Its two threads each keep one connection (checked before use) instead of
                # opening one for every poll and every batch of decisions.
                settings.DATABASES["default"].update(CONN_MAX_AGE=None, CONN_HEALTH_CHECKS=True)
                source, sink, where = DatabaseSource(), DatabaseSink(name), "the database"
                database = DatabaseDesk()
                desk = Desk(database.file, database.status)
            serve(
                config,
                options["listen"],
                name,
                source,
                sink,
                where=where,
                say=self._say,
                verbose=options["verbosity"] >= 2,
                desk=desk,
                stream=stream,
            )
        except (ProxyError, ValueError) as exc:
            raise CommandError(str(exc)) from None

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()
