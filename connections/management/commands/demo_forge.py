"""Run the demo forge (connections/forge.py) in the foreground: a stand-in git host that
``make run`` starts, so that brokered git can be tried with nothing else (README.md)."""

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from connections import forge
from covey.serving import listen_address, serve


class Command(BaseCommand):
    help = (
        "Run covey's demo forge: a stand-in git host over TLS (a CA of its own) with the"
        " repository demo/app, answering to one token. Not a git host for real work."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--listen", default="127.0.0.1:8003", help="HOST:PORT to serve on (loopback)."
        )
        parser.add_argument(
            "--dir",
            type=Path,
            default=None,
            help="Where its repositories, token and CA are kept (default: demo-forge/ under"
            " COVEY_VAR_DIR).",
        )
        parser.add_argument(
            "--prepare", action="store_true", help="Make what it keeps, print where, and exit."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        host, port = listen_address(options["listen"])
        directory = options["dir"] or Path(settings.VAR_DIR) / "demo-forge"
        served = forge.prepare(directory, host)
        url = f"https://{host}:{port}"
        if options["prepare"]:
            self.stdout.write(
                f"covey: demo forge at {url}: repository {forge.DEMO_REPOSITORY}, its token in"
                f" {directory / forge.TOKEN_FILE}, its CA {directory / forge.CA_FILE}"
            )
            return
        self.stdout.write(f"covey: demo forge on {url}/ (stand-in git host, {served.root})")
        self.stdout.flush()
        serve(
            served.app(),
            host,
            port,
            port_setting="COVEY_DEMO_FORGE_PORT",
            ssl_context=forge.server_context(directory),
        )
