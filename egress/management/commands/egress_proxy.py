"""Run the egress proxy in the foreground: mitmproxy with the covey addon."""

import asyncio
import logging
import signal
import socket
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from mitmproxy import master, options
from mitmproxy.addons import core, errorcheck, proxyserver

from egress.addon import CoveyEgress, NextLayer
from egress.control_plane import ControlPlaneSource, RunnerFile
from egress.feed import DecisionLog, DecisionSink, PolicyFeed, PolicySource
from egress.sources import DatabaseSink, DatabaseSource


def parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 in brackets) → (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise CommandError(f"--listen must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


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

    def handle(self, *args: Any, **options_: Any) -> None:
        if options_["verbosity"] < 2:
            # One line per connection is mitmproxy's INFO; covey keeps its own decision log.
            logging.getLogger("mitmproxy").setLevel(logging.WARNING)
        host, port = parse_listen(options_["listen"])
        name = options_["name"] or f"{socket.gethostname()}:{port}"
        token = options_["runner_token"] or settings.COVEY_RUNNER_TOKEN
        url = options_["control_plane"] or (settings.COVEY_CONTROL_PLANE_URL if token else None)
        source: PolicySource
        sink: DecisionSink
        if options_["runner_config"]:
            try:
                runner_file = RunnerFile(Path(options_["runner_config"]))
                where = options_["control_plane"] or runner_file.url
            except (OSError, ValueError) as exc:
                raise CommandError(f"cannot read {options_['runner_config']}: {exc}") from None
            remote = ControlPlaneSource(where, runner_file.token)
            source, sink = remote, remote.post_decisions
        elif url and not token:
            raise CommandError("--control-plane needs a runner token (--runner-token)")
        elif url:
            remote = ControlPlaneSource(url, lambda: token)
            source, sink, where = remote, remote.post_decisions, url
        else:
            # Its two threads each keep one connection (checked before use) instead of opening
            # one for every poll and every batch of decisions.
            settings.DATABASES["default"].update(CONN_MAX_AGE=None, CONN_HEALTH_CHECKS=True)
            source, sink, where = DatabaseSource(), DatabaseSink(name), "the database"

        feed = PolicyFeed(
            source, poll=settings.COVEY_EGRESS_POLICY_POLL, grace=settings.COVEY_EGRESS_POLICY_GRACE
        )
        log = DecisionLog(sink)
        addon = CoveyEgress(feed, log)
        feed.start()
        log.start()
        try:
            asyncio.run(self._serve(addon, host, port, name, where))
        finally:
            feed.stop()
            log.stop()

    async def _serve(self, addon: CoveyEgress, host: str, port: int, name: str, where: str) -> None:
        opts = options.Options()
        proxy = master.Master(opts)
        announce = Announce(self, f"{host}:{port}", where)
        proxy.addons.add(
            core.Core(),
            errorcheck.ErrorCheck(),
            proxyserver.Proxyserver(),
            NextLayer(addon),
            addon,
            announce,
        )
        opts.update(
            mode=[f"regular@{host}:{port}"],
            connection_strategy="lazy",
            stream_large_bodies="1m",
            covey_max_tunnels=settings.COVEY_EGRESS_MAX_TUNNELS,
            covey_max_tunnels_per_agent=settings.COVEY_EGRESS_MAX_TUNNELS_PER_AGENT,
            covey_nameservers=settings.COVEY_EGRESS_NAMESERVERS,
            covey_allowed_private_cidrs=settings.COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS,
            covey_proxy_name=name,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, proxy.shutdown)
        ready = addon.feed.wait_ready
        if not await asyncio.to_thread(ready, settings.COVEY_EGRESS_POLICY_GRACE):
            self.stderr.write("covey egress proxy: no policy yet; refusing until one arrives")
        await proxy.run()
        if not announce.announced:
            raise CommandError(f"the proxy could not listen on {host}:{port}")


class Announce:
    """Says so once the proxy listens (tests and supervisors wait for this line)."""

    def __init__(self, command: BaseCommand, listen: str, where: str) -> None:
        self.command, self.listen, self.where = command, listen, where
        self.announced = False

    def running(self) -> None:
        self.announced = True
        self.command.stdout.write(
            f"covey egress proxy listening on {self.listen}, policy from {self.where}"
        )
        self.command.stdout.flush()
