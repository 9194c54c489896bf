"""Serving the proxy: the policy feed, the decision log and mitmproxy, until a signal stops it."""

import asyncio
import gc
import logging
import resource
import signal
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mitmproxy import master, options
from mitmproxy.addons import core, errorcheck, proxyserver
from mitmproxy.proxy.mode_servers import ServerInstance

from allowlists.entries import split_host_port
from egress.proxy.addon import CoveyEgress, NextLayer
from egress.proxy.config import ProxyConfig
from egress.proxy.desk import Desk
from egress.proxy.feed import DecisionLog, DecisionSink, PolicyFeed, PolicySource, PolicyStream
from egress.proxy.front import Front
from egress.proxy.status import ProxyStatus


class ProxyError(Exception):
    """The proxy cannot start as asked (a bad --listen, a port it cannot bind)."""


def parse_listen(value: str, what: str = "--listen") -> tuple[str, int]:
    """HOST:PORT (IPv6 in brackets) → (host, port); ``what`` names it in the error."""
    try:
        host, port = split_host_port(value)
    except ValueError as exc:
        raise ProxyError(f"{what} must be HOST:PORT: {exc}") from None
    if not host:
        raise ProxyError(f"{what} must be HOST:PORT, got {value!r}")
    return host, port


# The agent's side and the upstream's; twice for a tunnel of mitmproxy's, whose relay works on
# duplicates of the sockets its transports hold (egress.proxy.relay): the most a tunnel takes.
FILES_PER_TUNNEL = 4
SPARE_FILES = 256  # listeners, the resolver, the policy source, logs, connections being decided


def within_open_files(config: ProxyConfig, say: Callable[[str], None]) -> ProxyConfig:
    """Room for ``max_tunnels``: the soft limit of open files raised as far as the hard one
    allows; where even that is too few, fewer tunnels, so that one too many is refused with 429
    (capacity) rather than failing to be accepted at all (EMFILE), and a warning says so."""
    needed = config.max_tunnels * FILES_PER_TUNNEL + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return config
    most = max(1, (soft - SPARE_FILES) // FILES_PER_TUNNEL)
    say(
        f"covey egress proxy: {config.max_tunnels} tunnels (COVEY_EGRESS_MAX_TUNNELS) need"
        f" {needed} open files and this process may open {soft} (ulimit -n): holding at most"
        f" {most}, more are refused with 429. Raise the limit (LimitNOFILE= under systemd,"
        " ulimits: nofile in compose) or lower COVEY_EGRESS_MAX_TUNNELS."
    )
    return replace(
        config, max_tunnels=most, max_tunnels_per_agent=min(config.max_tunnels_per_agent, most)
    )


def serve(
    config: ProxyConfig,
    listen: str,
    name: str,
    source: PolicySource,
    sink: DecisionSink,
    *,
    where: str,
    say: Callable[[str], None],
    verbose: bool = False,
    desk: Desk | None = None,
    stream: PolicyStream | None = None,
) -> None:
    """Run the proxy on ``listen`` (HOST:PORT) with policy from ``source`` (and ``stream``,
    where the source names one) and decisions to ``sink`` until SIGTERM or SIGINT. ``say``
    gets the line that announces it listens (what supervisors and tests wait for) and
    warnings; ``where`` names the policy source in it."""
    host, port = parse_listen(listen)
    if problem := config.timing_problem():
        raise ProxyError(problem)
    config = within_open_files(config, say)
    if not verbose:
        # One line per connection is mitmproxy's INFO, one per policy poll httpx's (four a
        # second); covey keeps its own decision log and says when the source fails.
        for noisy in ("mitmproxy", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    feed = PolicyFeed(source, poll=config.poll, grace=config.grace, stream=stream)
    log = DecisionLog(sink)
    addon = CoveyEgress(feed, log, desk=desk)
    status = None
    if config.status_listen:
        status_address = parse_listen(config.status_listen, "COVEY_EGRESS_STATUS_LISTEN")
        try:
            status = ProxyStatus(
                status_address, addon, log, token=config.metrics_token, grace=config.grace
            )
        except OSError as exc:
            raise ProxyError(
                f"cannot listen on COVEY_EGRESS_STATUS_LISTEN {config.status_listen}: {exc}"
            ) from None
        status.start()
    feed.start()
    log.start()
    # What the proxy made to start lives as long as it does: the collector's full passes need
    # not walk it, nor its pass at exit (nine tenths of a second of each stop).
    gc.freeze()
    try:
        asyncio.run(_serve(config, addon, host, port, name, where, say, status))
    finally:
        if status is not None:
            status.stop()
        feed.stop()
        log.stop()


async def _serve(
    config: ProxyConfig,
    addon: CoveyEgress,
    host: str,
    port: int,
    name: str,
    where: str,
    say: Callable[[str], None],
    status: ProxyStatus | None,
) -> None:
    opts = options.Options()
    proxy = master.Master(opts)
    server = proxyserver.Proxyserver()
    # Every client is accepted by covey's front door; mitmproxy listens nowhere and gets only
    # the connections that do not open with CONNECT, as its regular mode would have them.
    plain: ServerInstance[Any] = ServerInstance.make("regular", server)
    front = Front(addon, plain.handle_stream, idle_seconds=opts.tcp_timeout)
    addon.front = front
    try:
        front.bind(host, port)
    except OSError as exc:
        raise ProxyError(f"the proxy could not listen on {host}:{port}: {exc}") from None
    status_line = f"; status at http://{config.status_listen}/" if status else ""
    announce = Announce(say, f"{host}:{port}", where + status_line, status, front, proxy.shutdown)
    proxy.addons.add(
        core.Core(),
        errorcheck.ErrorCheck(),
        server,
        NextLayer(addon),
        addon,
        announce,
    )
    opts.update(
        mode=[],
        connection_strategy="lazy",
        stream_large_bodies="1m",
        covey_max_tunnels=config.max_tunnels,
        covey_max_tunnels_per_agent=config.max_tunnels_per_agent,
        covey_head_seconds=config.head_timeout,
        covey_nameservers=list(config.nameservers),
        covey_allowed_private_cidrs=list(config.allowed_private_cidrs),
        covey_proxy_name=name,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, proxy.shutdown)
    try:
        if not await asyncio.to_thread(addon.feed.wait_ready, config.grace):
            say("covey egress proxy: no policy yet; refusing until one arrives")
        await proxy.run()
    finally:
        front.stop()
    if announce.failure:
        raise ProxyError(announce.failure)


class Announce:
    """Opens the front door once mitmproxy runs, and says so (an addon: mitmproxy calls
    ``running``)."""

    def __init__(
        self,
        say: Callable[[str], None],
        listen: str,
        where: str,
        status: ProxyStatus | None,
        front: Front,
        stop: Callable[[], None],
    ) -> None:
        self.say, self.listen, self.where, self.status = say, listen, where, status
        self.front, self.stop = front, stop
        self.failure = ""

    def running(self) -> None:
        try:
            self.front.start()
        except OSError as exc:  # mitmproxy would log this and run on, listening nowhere
            self.failure = f"the proxy could not listen on {self.listen}: {exc}"
            self.stop()
            return
        if self.status is not None:
            self.status.listening = True
        self.say(f"covey egress proxy listening on {self.listen}, policy from {self.where}")
