"""The covey egress addon for mitmproxy: decide every CONNECT tunnel and plain-HTTP request.

The decision order is DESIGN.md §3, from the in-memory policy; the name is resolved once and
the vetted address pinned, so no second lookup can change the target.

A connection that opens with CONNECT (nearly all of them) is answered by covey's own
:class:`Connect` layer: it reads the head, decides (at once when the name's addresses are
cached, else through one hook while the resolver waits), answers 200 or the refusal, and lets
the tunnel go on only once its first bytes are a TLS ClientHello whose SNI is the CONNECT host;
only then does covey dial the vetted address (itself, not through mitmproxy). From then on the
bytes are opaque, and a :class:`~egress.proxy.relay.Relay` moves them outside mitmproxy's per-chunk
machinery. A connection that opens with a plain-HTTP request gets mitmproxy's HTTP layer, and
its requests (a later CONNECT too) are decided in ``requestheaders`` and ``http_connect``; plain
requests are sent only to the vetted address (``server_connect``).

This addon replaces mitmproxy's own ``NextLayer`` addon: the proxy speaks regular HTTP proxy
and raw pass-through, nothing else.
"""

import asyncio
import logging
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.addonmanager import Loader
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http import http1
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import parse_client_hello
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from egress.policy import (
    EXPLANATIONS,
    AgentPolicy,
    Code,
    Decision,
    IPNetwork,
    Policy,
    parse_basic,
    parse_networks,
    status_of,
    vet_addresses,
)
from egress.proxy.feed import DecisionLog, PolicyFeed
from egress.proxy.lookups import TokenLookups
from egress.proxy.relay import Relay
from egress.proxy.resolver import ResolutionError, Resolver

logger = logging.getLogger(__name__)

MAX_CLIENT_HELLO = 64 * 1024
MAX_HEAD = 64 * 1024  # a CONNECT request's head
CONNECTED = b"HTTP/1.1 200 Connection established\r\n\r\n"
TUNNEL_RECHECK_SECONDS = 1.0
HANDOVER_SECONDS = 2.0  # how long a client may take to read its 200 before the relay takes over
CONNECT_SECONDS = 10.0  # how long dialling the upstream may take
_NOT_TLS = "the tunnel did not start with a TLS ClientHello"


@dataclass
class Tunnel:
    """An allowed CONNECT tunnel, from the decision until the client disconnects."""

    decision_id: str
    agent_id: int
    credential: str  # re-checked against every new policy while the tunnel is open
    host: str
    port: int
    address: str
    started: bool = False  # the ClientHello was checked and the bytes flow
    bytes_up: int = 0  # before the relay took over; then the relay counts
    bytes_down: int = 0
    handover: "asyncio.Task[None] | None" = None  # dials, sends the first bytes, starts the relay
    upstream: socket.socket | None = None  # ours, once dialled (mitmproxy never sees it)
    relay: Relay | None = None

    def discard(self) -> None:
        """Stop the hand-over and the relay and close the upstream, whatever state they are in."""
        if self.handover is not None:
            self.handover.cancel()  # a no-op once it is done
        if self.relay is not None:
            self.relay.close()
        if self.upstream is not None:
            self.upstream.close()

    def totals(self) -> tuple[int, int]:
        """Bytes up and down so far."""
        if self.relay is None:
            return self.bytes_up, self.bytes_down
        return self.bytes_up + self.relay.up.bytes, self.bytes_down + self.relay.down.bytes


@dataclass
class ClientState:
    """What the proxy knows about one client connection."""

    tunnel: Tunnel | None = None
    # plain HTTP: (host, port) as mitmproxy will dial it → the vetted address
    pinned: dict[tuple[str, int], str] = field(default_factory=dict)


@dataclass
class Verdict:
    """The outcome of deciding one CONNECT tunnel or plain-HTTP request."""

    decision: Decision
    username: str
    agent: AgentPolicy | None = None
    address: str | None = None  # the vetted address, when allowed
    credential: str = ""

    @property
    def allowed(self) -> bool:
        return self.decision.allowed


@dataclass
class _Allowed:
    """A request allowed by name, before its name is resolved."""

    policy: Policy
    agent: AgentPolicy
    decision: Decision
    username: str
    credential: str | None


@dataclass(frozen=True)
class _LookUp:
    """The credential's token is not in the policy: ask the policy source once, then decide
    again (a run's token is issued moments before its sandbox's first request). Its slot in
    :class:`TokenLookups` is held until :meth:`CoveyEgress._look_up` ends it."""

    token_hash: str
    client: str


LOOKUP_SECONDS = 2.0  # how long a request waits for the policy source before it is refused


@dataclass
class ConnectRequest:
    """A CONNECT that must wait: its name must be resolved (``allowed``), or its token looked
    up first (``lookup``); and, once decided, its verdict."""

    allowed: "_Allowed | None"
    lookup: "_LookUp | None"
    credential: str | None
    host: str
    port: int
    verdict: Verdict | None = None


@dataclass
class CoveyDecideHook(commands.StartHook):
    """The Connect layer asks the addon (``covey_decide``) to decide a CONNECT."""

    request: ConnectRequest


class Connect(layer.Layer):
    """A client connection that opens with CONNECT, answered by covey itself.

    mitmproxy's HTTP layer would parse the request, run several hooks, build a flow and a
    response, then ask for the next layer again when the tunnel's first bytes come; this
    layer reads the CONNECT head, asks for the decision (one hook, since resolving may wait),
    answers 200 or the refusal, checks the ClientHello and hands the tunnel to a
    :class:`Passthrough`. A refused CONNECT closes the connection. A connection that opens with
    anything else gets mitmproxy's HTTP layer (:meth:`CoveyEgress.choose_layer`).
    """

    def __init__(self, context: Context, egress: "CoveyEgress") -> None:
        super().__init__(context)
        self.egress = egress
        self.buffer = b""
        self.tunnel: Tunnel | None = None
        self.child: Passthrough | None = None

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.child is not None:
            yield from self.child.handle_event(event)
        elif isinstance(event, events.DataReceived) and event.connection == self.context.client:
            self.buffer += event.data
            if self.tunnel is None:
                yield from self._read_connect()
            else:
                yield from self._read_hello()
        elif isinstance(event, events.ConnectionClosed):
            yield from self._close()

    def _read_connect(self) -> layer.CommandGenerator[None]:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                yield from self._answer(400, "the request head is too large")
            return
        head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
        try:
            request = http1.read_request_head(head.split(b"\r\n"))
        except ValueError as exc:
            yield from self._answer(400, f"bad request: {exc}")
            return
        if request.method != "CONNECT" or not request.host:
            yield from self._answer(400, "only CONNECT host:port may open this connection")
            return
        credential = request.headers.get("Proxy-Authorization")
        client = _peer(self.context.client)
        verdict: Verdict | _Allowed | _LookUp | None = self.egress.decide_now(
            credential, request.host, request.port, client
        )
        if not isinstance(verdict, Verdict):  # it must wait: a hook, the loop goes on
            asked = ConnectRequest(
                verdict if isinstance(verdict, _Allowed) else None,
                verdict if isinstance(verdict, _LookUp) else None,
                credential,
                request.host,
                request.port,
            )
            yield CoveyDecideHook(asked)
            verdict = asked.verdict
        if verdict is None or not verdict.allowed:
            decision = verdict.decision if verdict else Decision(Code.BAD_REQUEST, request.host)
            response = refusal(decision, verdict.username if verdict else "")
            response.headers["Connection"] = "close"
            yield commands.SendData(self.context.client, http1.assemble_response(response))
            yield from self._close()
            return
        self.tunnel = self.egress.admit(self.context.client.id, verdict, plain_http=False)
        yield commands.SendData(self.context.client, CONNECTED)
        if self.buffer:
            yield from self._read_hello()

    def _read_hello(self) -> layer.CommandGenerator[None]:
        tunnel = self.tunnel
        assert tunnel is not None  # noqa: S101 - only called once there is one
        problem = _client_hello_problem(self.buffer, tunnel.host)
        if problem is None:
            return  # wait for the rest of the ClientHello
        if problem:
            refused = Decision(Code.BAD_REQUEST, tunnel.host, tunnel.port, detail=problem)
            self.egress._record(refused, "", tunnel.agent_id, tunnel.address, False)
            yield from self._close()
            return
        tunnel.started = True
        self.child = Passthrough(self.context, self.egress, tunnel)
        data, self.buffer = self.buffer, b""
        yield from self.child.handle_event(events.Start())
        yield from self.child.handle_event(events.DataReceived(self.context.client, data))

    def _answer(self, status: int, reason: str) -> layer.CommandGenerator[None]:
        response = http.Response.make(
            status, reason + "\n", {"Content-Type": "text/plain", "Connection": "close"}
        )
        yield commands.SendData(self.context.client, http1.assemble_response(response))
        yield from self._close()

    def _close(self) -> layer.CommandGenerator[None]:
        self._handle_event = self._done  # type: ignore[method-assign]
        if self.tunnel is not None:
            self.tunnel.discard()
        if self.context.client.state is not ConnectionState.CLOSED:
            yield commands.CloseConnection(self.context.client)

    def _done(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()


class Refuse(layer.Layer):
    """A layer that closes the client connection at once (a tunnel we will not carry)."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start | events.DataReceived):
            yield commands.CloseConnection(self.context.client)
        self._handle_event = self._ignore  # type: ignore[method-assign]

    def _ignore(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()


class Passthrough(layer.Layer):
    """A decided tunnel whose ClientHello was checked. The client's bytes are collected here
    until :meth:`CoveyEgress.hand_over` has sent them upstream and handed both sockets to a
    :class:`Relay`; after that mitmproxy no longer reads the client."""

    def __init__(self, context: Context, egress: "CoveyEgress", tunnel: Tunnel) -> None:
        super().__init__(context)
        self.egress = egress
        self.tunnel = tunnel
        self.early: list[bytes] = []  # from the client, not yet sent upstream

    @property
    def forwarding(self) -> bool:
        """The tunnel is open and its bytes flow."""
        return self._handle_event == self._forward

    def take_early(self) -> bytes:
        data, self.early = b"".join(self.early), []
        return data

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            self._handle_event = self._forward  # type: ignore[method-assign]
        yield from ()

    def _forward(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived) and event.connection == self.context.client:
            if self.tunnel.relay is not None:
                # The relay owns the socket: bytes here would overtake or trail its own.
                logger.error("covey: bytes reached mitmproxy after the relay took over; closing")
                yield from self._close()
                return
            self.early.append(event.data)
            self.tunnel.bytes_up += len(event.data)
            if self.tunnel.handover is None:
                self.tunnel.handover = asyncio.create_task(self.egress.hand_over(self))
        elif isinstance(event, events.ConnectionClosed):
            # The client went (or mitmproxy is tearing the tunnel down): TLS has no use for a
            # half-open tunnel before the relay, and the relay passes half-closes on itself.
            yield from self._close()

    def _close(self) -> layer.CommandGenerator[None]:
        self.tunnel.discard()
        self._handle_event = self._done  # type: ignore[method-assign]
        if self.context.client.state is not ConnectionState.CLOSED:
            yield commands.CloseConnection(self.context.client)

    def _done(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from ()


class CoveyEgress:
    """Per-agent egress policy for every connection through the proxy."""

    def __init__(
        self,
        feed: PolicyFeed,
        log: DecisionLog,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.feed = feed
        self.lookups = TokenLookups()
        self.log = log
        self.clock = clock
        self.clients: dict[str, ClientState] = {}
        self.tunnels_by_agent: Counter[int] = Counter()
        self.open_tunnels = 0
        self.resolver = Resolver()
        self.allowed_private: list[IPNetwork] = []
        self._watch: asyncio.Task[None] | None = None

    # --- open tunnels follow the policy ------------------------------------------------------

    def running(self) -> None:
        self._watch = asyncio.create_task(self._watch_tunnels())

    def done(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def _watch_tunnels(self) -> None:
        """Once a second, close open tunnels the current policy would no longer allow."""
        while True:
            await asyncio.sleep(TUNNEL_RECHECK_SECONDS)
            self.enforce(self.feed.current())

    def enforce(self, policy: Policy | None) -> int:
        """Close every open tunnel that ``policy`` refuses (all of them when it is None)."""
        closed = 0
        for client_id, state in list(self.clients.items()):
            tunnel = state.tunnel
            if tunnel is None:
                continue
            verdict = self._redecide(policy, tunnel.credential, tunnel.host, tunnel.port, False)
            if verdict.allowed:
                continue
            username = (parse_basic(tunnel.credential) or ("", ""))[0]
            self._record(verdict, username, tunnel.agent_id, tunnel.address, False)
            closed += self._close_client(client_id)
        return closed

    def _close_client(self, client_id: str) -> int:
        state = self.clients.get(client_id)
        if state is not None and state.tunnel is not None and state.tunnel.relay is not None:
            state.tunnel.relay.close()  # at once: the handler's teardown takes a few steps
        handler = _handler(client_id)
        io = handler.transports.get(handler.client) if handler else None
        if io is None or io.handler is None:
            return 0
        io.handler.cancel()  # mitmproxy then closes both sides and reports the disconnect
        return 1

    # --- the relay ---------------------------------------------------------------------------

    async def hand_over(self, passthrough: Passthrough) -> None:
        """Dial the vetted address, send the client's first bytes, then give both sockets to a
        :class:`Relay`. Cancelled (by :meth:`Tunnel.discard`) when the client goes first.

        The client stops being read; once every byte mitmproxy read from it has been sent
        upstream and everything written to it (the 200) has left, the relay takes over. A
        client that does not read its 200 within HANDOVER_SECONDS is closed.
        """
        await asyncio.sleep(0)  # out of mitmproxy's event handling first
        client_id, tunnel = passthrough.context.client.id, passthrough.tunnel
        try:
            tunnel.upstream = await _dial(tunnel.address, tunnel.port)
        except (OSError, TimeoutError) as exc:
            logger.info("covey: could not reach %s:%s: %s", tunnel.address, tunnel.port, exc)
            self._close_client(client_id)
            return
        upstream = tunnel.upstream
        handler = _handler(client_id)
        io = handler.transports.get(handler.client) if handler else None
        if io is None or not (
            isinstance(io.writer, asyncio.StreamWriter)
            and isinstance(io.reader, asyncio.StreamReader)
        ):
            self._close_client(client_id)
            return
        transport = cast(asyncio.Transport, io.writer.transport)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANDOVER_SECONDS
        try:
            while True:
                if not passthrough.forwarding:
                    return  # closed meanwhile
                transport.pause_reading()
                if data := passthrough.take_early():
                    await loop.sock_sendall(upstream, data)
                    continue
                if _quiet(io.reader, io.writer):
                    break
                if loop.time() >= deadline:
                    logger.info("covey: tunnel %s did not go quiet; closing", client_id)
                    self._close_client(client_id)
                    return
                await asyncio.sleep(0.001)
        except OSError as exc:
            logger.info("covey: tunnel to %s:%s failed: %s", tunnel.address, tunnel.port, exc)
            self._close_client(client_id)
            return
        tunnel.relay = Relay(
            transport.get_extra_info("socket"),
            upstream,
            on_activity=handler.timeout_watchdog.register_activity,
            on_end=lambda error: self._relay_ended(client_id, error),
        )
        tunnel.relay.start()

    def _relay_ended(self, client_id: str, error: OSError | None) -> None:
        if error is not None:
            logger.debug("covey: tunnel %s ended: %s", client_id, error)
        self._close_client(client_id)

    # --- options -----------------------------------------------------------------------------

    def load(self, loader: Loader) -> None:
        loader.add_option("covey_max_tunnels", int, 4000, "Tunnels open at once, over all agents.")
        loader.add_option(
            "covey_max_tunnels_per_agent", int, 500, "Tunnels open at once for one agent."
        )
        loader.add_option(
            "covey_nameservers",
            Sequence[str],
            [],
            "Resolvers for target names, 'addr' or 'addr@port' (default: the system's).",
        )
        loader.add_option(
            "covey_allowed_private_cidrs",
            Sequence[str],
            [],
            "Non-public networks the proxy may still connect to.",
        )
        loader.add_option("covey_proxy_name", str, "", "Name of this proxy in the decision log.")

    def configure(self, updated: set[str]) -> None:
        if min(ctx.options.covey_max_tunnels, ctx.options.covey_max_tunnels_per_agent) < 1:
            raise exceptions.OptionsError("covey tunnel limits must be at least 1")
        if "covey_allowed_private_cidrs" in updated:
            try:
                self.allowed_private = parse_networks(ctx.options.covey_allowed_private_cidrs)
            except ValueError as exc:
                raise exceptions.OptionsError(f"covey_allowed_private_cidrs: {exc}") from None
        if "covey_nameservers" in updated:
            try:
                self.resolver = Resolver(ctx.options.covey_nameservers)
            except ValueError as exc:
                raise exceptions.OptionsError(f"covey_nameservers: {exc}") from None

    # --- decisions ---------------------------------------------------------------------------

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None:
            return
        await self._decide(flow, plain_http=False)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.error is not None:
            return
        if flow.request.method == "CONNECT":
            return  # decided in http_connect
        await self._decide(flow, plain_http=True)

    async def _decide(self, flow: http.HTTPFlow, *, plain_http: bool) -> None:
        request = flow.request
        credential = request.headers.get("Proxy-Authorization")
        problem = _plain_http_problem(request) if plain_http else ""
        verdict = await self.decide(
            credential,
            request.host,
            request.port,
            plain_http=plain_http,
            problem=problem,
            client=_peer(flow.client_conn),
        )
        if not verdict.allowed:
            flow.response = refusal(verdict.decision, verdict.username)
            return
        del request.headers["Proxy-Authorization"]
        self.admit(flow.client_conn.id, verdict, plain_http=plain_http)
        if plain_http:
            host, port = verdict.decision.host, verdict.decision.port
            request.host = host  # one canonical host for URL, Host header and dial
            request.headers["Host"] = host if port == 80 else f"{host}:{port}"

    async def decide(
        self,
        credential: str | None,
        host: str,
        port: int,
        *,
        plain_http: bool,
        problem: str = "",
        client: str | None,
    ) -> "Verdict":
        """Decide one CONNECT tunnel or plain-HTTP request (a refusal is logged here; an
        allowed one is logged by :meth:`admit`, which the caller calls when it goes ahead).
        ``client``: the address it came from, which bounds its look-ups of unknown tokens
        (None: no look-up)."""
        first = self._before_resolving(credential, host, port, plain_http, problem, client)
        if isinstance(first, _LookUp):
            await self._look_up(first)
            # Without a client it never looks up: the token is known now, or refused.
            first = cast(
                "Verdict | _Allowed",
                self._before_resolving(credential, host, port, plain_http, problem, None),
            )
        if isinstance(first, Verdict):
            return first
        return await self._resolved(first, plain_http)

    def decide_now(
        self, credential: str | None, host: str, port: int, client: str
    ) -> "Verdict | _Allowed | _LookUp":
        """:meth:`decide` for a CONNECT as far as it goes without waiting: the verdict when it
        is refused before resolving or the name's addresses are cached; else what must be
        waited for first (:meth:`covey_decide`): the name's addresses, or the token."""
        first = self._before_resolving(credential, host, port, False, "", client)
        if isinstance(first, Verdict | _LookUp):
            return first
        addresses = self.resolver.cached(first.decision.host)
        if addresses is None:
            return first
        return self._after_resolving(first, addresses, False)

    async def _resolved(self, allowed: "_Allowed", plain_http: bool) -> "Verdict":
        try:
            addresses = await self.resolver.resolve(allowed.decision.host)
        except ResolutionError as exc:
            addresses = []
            logger.info("covey: %s", exc)
        return self._after_resolving(allowed, addresses, plain_http)

    async def _look_up(self, lookup: "_LookUp") -> None:
        """Ask the policy source now (one ask shared with every look-up in flight), and end
        the look-up with what it found."""
        found: bool | None = None
        try:
            # Shielded: a look-up that gives up must not cancel the round others share (nor
            # leave the polling thread a future it cannot complete).
            answered = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(self.feed.refresh_soon())), LOOKUP_SECONDS
            )
            policy = self.feed.current()
            if answered and policy is not None:
                found = lookup.token_hash in policy.tokens
        except TimeoutError:
            pass
        finally:
            self.lookups.end(lookup.token_hash, lookup.client, found=found)
        if found is None:  # refused now, but not held against the token: nobody said no
            logger.warning("covey: the policy source did not answer a token look-up in time")

    def _before_resolving(
        self,
        credential: str | None,
        host: str,
        port: int,
        plain_http: bool,
        problem: str,
        client: str | None = None,
    ) -> "Verdict | _Allowed | _LookUp":
        """Who asks, and may they reach the target by its name (DESIGN.md §3, steps 1 to 3).
        A token the policy does not have yet is looked up (LOOK_UP) when ``client`` is given
        and :class:`TokenLookups` allows it; else it is refused."""
        parsed = parse_basic(credential)
        username = parsed[0] if parsed else ""
        policy = self.feed.current()
        if policy is None:
            return self._refused(
                Decision(Code.POLICY_UNAVAILABLE, host, port), username, plain_http
            )
        if problem:
            refused = Decision(Code.BAD_REQUEST, host, port, detail=problem)
            return self._refused(refused, username, plain_http)
        agent, unknown = policy.identify(parsed, self.clock())
        if agent is None:
            secret = parsed[1] if parsed else ""  # ``unknown`` is set only when parsed
            if unknown and client is not None and self.lookups.begin(secret, unknown, client):
                return _LookUp(unknown, client)
            return self._refused(Decision(Code.PROXY_AUTH, host, port), username, plain_http)
        at_capacity = not plain_http and (
            self.open_tunnels >= ctx.options.covey_max_tunnels
            or self.tunnels_by_agent[agent.id] >= ctx.options.covey_max_tunnels_per_agent
        )
        decision = policy.decide(agent, host, port, plain_http=plain_http, at_capacity=at_capacity)
        if not decision.allowed:
            return self._refused(decision, username, plain_http, agent)
        return _Allowed(policy, agent, decision, username, credential)

    def _after_resolving(
        self, allowed: "_Allowed", addresses: list[str], plain_http: bool
    ) -> "Verdict":
        """May they reach what the name resolved to (step 4); the vetted address."""
        decision, username, agent = allowed.decision, allowed.username, allowed.agent
        vetted, address = vet_addresses(
            decision.host, decision.port, addresses, self.allowed_private
        )
        if not vetted.allowed or address is None:
            return self._refused(vetted, username, plain_http, agent)
        # The policy may have changed while we waited for DNS: decide again, from memory.
        latest = self.feed.current()
        if latest is None or latest.generation != allowed.policy.generation:
            again = self._redecide(
                latest, allowed.credential, decision.host, decision.port, plain_http
            )
            if not again.allowed:
                return self._refused(again, username, plain_http, agent)
        return Verdict(decision, username, agent, str(address), allowed.credential or "")

    def admit(self, client_id: str, verdict: "Verdict", *, plain_http: bool) -> Tunnel | None:
        """Log an allowed decision and remember it for the client connection: the vetted
        address a plain request may be sent to, or the tunnel (returned)."""
        decision, agent = verdict.decision, verdict.agent
        assert agent is not None and verdict.address is not None  # noqa: S101 - allowed ones
        decision_id = self._record(
            decision, verdict.username, agent.id, verdict.address, plain_http
        )
        state = self.clients.setdefault(client_id, ClientState())
        if plain_http:
            state.pinned[(decision.host, decision.port)] = verdict.address
            return None
        state.tunnel = Tunnel(
            decision_id=decision_id,
            agent_id=agent.id,
            credential=verdict.credential,
            host=decision.host,
            port=decision.port,
            address=verdict.address,
        )
        self.open_tunnels += 1
        self.tunnels_by_agent[agent.id] += 1
        return state.tunnel

    async def covey_decide(self, request: "ConnectRequest") -> None:
        """The :class:`Connect` layer's question (a hook, so that resolving or a token's
        look-up may wait)."""
        if request.allowed is not None:
            request.verdict = await self._resolved(request.allowed, plain_http=False)
            return
        if request.lookup is not None:
            await self._look_up(request.lookup)
        request.verdict = await self.decide(
            request.credential, request.host, request.port, plain_http=False, client=None
        )

    def _redecide(
        self,
        policy: Policy | None,
        credential: str | None,
        host: str,
        port: int,
        plain_http: bool,
    ) -> Decision:
        if policy is None:
            return Decision(Code.POLICY_UNAVAILABLE, host, port)
        agent = policy.authenticate(credential, self.clock())
        if agent is None:
            return Decision(Code.PROXY_AUTH, host, port)
        return policy.decide(agent, host, port, plain_http=plain_http, at_capacity=False)

    def _refused(
        self,
        decision: Decision,
        username: str,
        plain_http: bool,
        agent: AgentPolicy | None = None,
    ) -> "Verdict":
        self._record(decision, username, agent.id if agent else None, None, plain_http)
        return Verdict(decision, username, agent)

    def _record(
        self,
        decision: Decision,
        username: str,
        agent_id: int | None,
        address: Any,
        plain_http: bool,
    ) -> str:
        decision_id = str(uuid.uuid4())
        self.log.add(
            {
                "event": "decision",
                "id": decision_id,
                "agent_id": agent_id,
                "username": username,
                "kind": "http" if plain_http else "connect",
                "host": decision.host,
                "port": decision.port,
                "address": str(address) if address is not None else None,
                "allowed": decision.allowed,
                "reason": str(decision.code),
                "detail": ", ".join(decision.sources) if decision.allowed else decision.detail,
                "at": self.clock(),
            }
        )
        return decision_id

    # --- the tunnel's first bytes --------------------------------------------------------------

    def choose_layer(self, nextlayer: layer.NextLayer) -> None:
        """Which layer handles new bytes: see :class:`NextLayer`."""
        if nextlayer.layer is not None:
            return
        context = nextlayer.context
        if len(context.layers) == 1:  # a new client connection
            opening = nextlayer.data_client()
            if opening.startswith(b"CONNECT "):
                nextlayer.layer = Connect(context, self)
            elif len(opening) < len(b"CONNECT ") and b"CONNECT ".startswith(opening):
                return  # wait for the request line
            else:  # a plain-HTTP proxy request (and whatever follows on the connection)
                nextlayer.layer = layers.HttpLayer(context, HTTPMode.regular)
            return
        state = self.clients.get(context.client.id)
        tunnel = state.tunnel if state else None
        if tunnel is None or tunnel.started:
            nextlayer.layer = Refuse(context)  # fail closed: no decision, no bytes
            return
        data = nextlayer.data_client()
        problem = _client_hello_problem(data, tunnel.host)
        if problem is None:
            return  # wait for the rest of the ClientHello
        if problem:
            refused = Decision(Code.BAD_REQUEST, tunnel.host, tunnel.port, detail=problem)
            self._record(refused, "", tunnel.agent_id, tunnel.address, False)
            nextlayer.layer = Refuse(context)
            return
        tunnel.started = True
        nextlayer.layer = Passthrough(context, self, tunnel)

    def server_connect(self, data: ServerConnectionHookData) -> None:
        """Plain HTTP dials only the vetted address; tunnels never dial through mitmproxy
        (covey dials them itself), and anything we did not decide is refused."""
        state = self.clients.get(data.client.id)
        address = data.server.address
        vetted: str | None = None
        if state is not None and address is not None and state.tunnel is None:
            vetted = state.pinned.get((address[0], address[1]))
        if vetted is None or address is None:
            data.server.error = "covey: no vetted address for this connection"
            return
        data.server.address = (vetted, address[1])

    def client_disconnected(self, client: connection.Client) -> None:
        state = self.clients.pop(client.id, None)
        if state is None or state.tunnel is None:
            return
        tunnel = state.tunnel
        tunnel.discard()
        bytes_up, bytes_down = tunnel.totals()
        self.open_tunnels -= 1
        self.tunnels_by_agent[tunnel.agent_id] -= 1
        if self.tunnels_by_agent[tunnel.agent_id] <= 0:
            del self.tunnels_by_agent[tunnel.agent_id]
        self.log.add(
            {
                "event": "close",
                "id": tunnel.decision_id,
                "bytes_up": bytes_up,
                "bytes_down": bytes_down,
                "at": self.clock(),
            }
        )


class NextLayer:
    """Stands in for mitmproxy's own NextLayer addon (and carries its name), so that only
    covey decides what a connection speaks: HTTP proxy requests, then checked pass-through."""

    def __init__(self, egress: CoveyEgress) -> None:
        self.egress = egress

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        self.egress.choose_layer(nextlayer)


async def _dial(address: str, port: int) -> socket.socket:
    """A TCP connection to the vetted address, ours alone (mitmproxy never sees it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        async with asyncio.timeout(CONNECT_SECONDS):
            await asyncio.get_running_loop().sock_connect(sock, (address, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _peer(client: connection.Client) -> str:
    """The address a client connection came from (what look-ups are counted by)."""
    peer = client.peername
    return str(peer[0]) if peer else ""


def _handler(client_id: str) -> Any:
    """mitmproxy's handler of one client connection (None once it has gone)."""
    proxyserver = ctx.master.addons.get("proxyserver")
    return proxyserver.connections.get(client_id) if proxyserver else None


def _quiet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Nothing read and not yet forwarded, nothing forwarded and not yet written, no EOF."""
    transport = writer.transport
    return (
        not transport.is_reading()  # type: ignore[attr-defined]
        and not transport.is_closing()
        and transport.get_write_buffer_size() == 0
        and not reader._buffer  # type: ignore[attr-defined]  # no public way to ask
        and not reader.at_eof()
        and reader.exception() is None
    )


def refusal(decision: Decision, username: str) -> http.Response:
    """The answer to a refused connection: status, deny reason and how to ask for access."""
    code = decision.code
    target = f"{decision.host}:{decision.port}"
    lines = [f"covey refused {target}: {EXPLANATIONS.get(code, str(code))} ({code})."]
    if decision.detail:
        lines.append(decision.detail)
    if code in (Code.NOT_ON_ALLOWLIST, Code.PORT_NOT_ALLOWED, Code.NON_PUBLIC_ADDRESS):
        who = f"agent {username}" if username else "your agent"
        lines.append(
            f"If {who} needs {target}, ask for it: a person on your platform team can add it"
            " to the agent's allowlist in covey. Do not try another route."
        )
    headers = {"X-Covey-Deny-Reason": str(code), "Content-Type": "text/plain; charset=utf-8"}
    if code is Code.PROXY_AUTH:
        headers["Proxy-Authenticate"] = 'Basic realm="covey egress"'
    if code is Code.CAPACITY:
        headers["Retry-After"] = "1"
    return http.Response.make(status_of(code), "\n".join(lines) + "\n", headers)


def _plain_http_problem(request: http.Request) -> str:
    """Why a plain-HTTP proxy request is ambiguous, or '' when it names one host clearly.

    mitmproxy has already taken the host from the absolute URL (or, for an origin-form
    request, from the Host header); a Host header that names anything else is refused, and
    the request goes out with the decided host only.
    """
    if request.scheme != "http":
        return "only http:// URLs can be sent as plain requests; use CONNECT for TLS"
    host_headers = request.headers.get_all("Host")
    if len(host_headers) > 1:
        return "more than one Host header"
    if host_headers:
        given = host_headers[0].strip().lower().rstrip(".")
        expected = {
            request.host.lower().rstrip("."),
            f"{request.host.lower().rstrip('.')}:{request.port}",
        }
        if given not in expected:
            return f"the Host header ({host_headers[0]!r}) does not match the URL's host"
    return ""


def _client_hello_problem(data: bytes, host: str) -> str | None:
    """'' when data opens TLS with SNI == host; None to wait for more; else what is wrong."""
    if len(data) < 3:
        return None if data in (b"", b"\x16", b"\x16\x03") else _NOT_TLS
    if not starts_like_tls_record(data):
        return _NOT_TLS
    try:
        hello = parse_client_hello(data)
    except ValueError:
        return "the tunnel did not start with a valid TLS ClientHello"
    if hello is None:
        return "the ClientHello is too large" if len(data) > MAX_CLIENT_HELLO else None
    sni = (hello.sni or "").lower().rstrip(".")
    if not sni:
        return "the TLS ClientHello names no server (SNI)"
    if sni != host:
        return f"the TLS ClientHello names {sni!r}, not the CONNECT host {host!r}"
    return ""
