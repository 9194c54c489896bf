"""The covey egress addon for mitmproxy: its hooks, and the state they keep.

Every CONNECT tunnel and plain-HTTP request is decided by the steps of :mod:`egress.policy`,
from the in-memory policy; the name is resolved once and the vetted address pinned, so no
second look-up can change the target. Tunnels are carried by covey's front door
(:mod:`egress.proxy.front`), which asks this addon as its :class:`~egress.proxy.front.Gate`
and never involves mitmproxy; mitmproxy gets the other connections, whose plain requests are
decided in ``requestheaders`` (a CONNECT on such a connection in ``http_connect``, relayed
by :mod:`egress.proxy.tunnels`) and sent only to the vetted address (``server_connect``). What
the proxy answers is in :mod:`egress.proxy.answers`.

This addon replaces mitmproxy's own ``NextLayer`` addon: the proxy speaks regular HTTP proxy
and raw pass-through, nothing else.
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.addonmanager import Loader
from mitmproxy.net.http import http1
from mitmproxy.proxy import layer
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

import logs
from egress.policy import (
    Attempt,
    Code,
    Decision,
    IPNetwork,
    Policy,
    check_addresses,
    check_client_hello,
    check_request,
    hash_token,
    is_proxy_check,
    parse_networks,
)
from egress.protocol import CloseEvent, ConnectionKind, DecisionEvent
from egress.proxy import desk
from egress.proxy.answers import plain_http_problem, read_client_hello, refusal
from egress.proxy.config import ProxyConfig
from egress.proxy.desk import Desk
from egress.proxy.feed import DecisionLog, PolicyFeed
from egress.proxy.front import Front
from egress.proxy.layers import choose_layer, peer
from egress.proxy.lookups import LookUp, TokenLookups
from egress.proxy.resolver import ResolutionError, Resolver
from egress.proxy.tunnels import (
    ClientState,
    Tunnel,
    answer_now,
    close_client,
    hand_over,
    pause_reading,
)

logger = logging.getLogger(__name__)

TUNNEL_RECHECK_SECONDS = 1.0
LOOKUP_SECONDS = 2.0  # how long a request waits for the policy source before it is refused


class CoveyEgress:
    """Per-agent egress policy for every connection through the proxy; the
    :class:`~egress.proxy.layers.Gate` its layers decide through."""

    def __init__(
        self,
        feed: PolicyFeed,
        log: DecisionLog,
        *,
        clock: Callable[[], float] = time.time,
        desk: Desk | None = None,
    ) -> None:
        self.feed = feed
        self.desk = desk
        self.lookups = TokenLookups()
        self.log = log
        self.clock = clock
        self.clients: dict[str, ClientState] = {}
        self.tunnels_by_agent: Counter[int] = Counter()
        self.decisions: Counter[tuple[str, str]] = Counter()  # (kind, reason) → how many
        self.open_tunnels = 0
        # client id → since when (monotonic) the proxy waits for its next request head: from
        # the connection's start, and after each plain request's answer
        self.heads: dict[str, float] = {}
        self.slow_closed = 0  # connections closed because their head did not come in time
        self.resolver = Resolver()
        self.allowed_private: list[IPNetwork] = []
        self.max_tunnels = ProxyConfig.max_tunnels  # the options', once configured
        self.max_tunnels_per_agent = ProxyConfig.max_tunnels_per_agent
        self.front: Front | None = None  # the connections that opened with CONNECT
        self._watch: asyncio.Task[None] | None = None

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
        loader.add_option(
            "covey_head_seconds",
            float,
            ProxyConfig.head_timeout,
            "Seconds a client may take to send a request head before it is disconnected.",
        )

    def configure(self, updated: set[str]) -> None:
        if min(ctx.options.covey_max_tunnels, ctx.options.covey_max_tunnels_per_agent) < 1:
            raise exceptions.OptionsError("covey tunnel limits must be at least 1")
        if not ctx.options.covey_head_seconds > 0:
            raise exceptions.OptionsError("covey_head_seconds must be more than 0")
        # Read on every decision: kept here (an option's read is checked each time).
        self.max_tunnels = ctx.options.covey_max_tunnels
        self.max_tunnels_per_agent = ctx.options.covey_max_tunnels_per_agent
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

    # --- open tunnels follow the policy ------------------------------------------------------

    def running(self) -> None:
        self._watch = asyncio.create_task(self._watch_tunnels())

    def done(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def _watch_tunnels(self) -> None:
        """Once a second, close open tunnels the current policy would no longer allow, and
        connections whose request head is overdue."""
        while True:
            await asyncio.sleep(TUNNEL_RECHECK_SECONDS)
            self.enforce(self.feed.current())
            self.close_slow(time.monotonic() - ctx.options.covey_head_seconds)

    def close_slow(self, before: float) -> int:
        """Close every connection that has waited since ``before`` to send a request head (a
        slow client holds a connection and a file without being anyone's tunnel yet)."""
        closed = 0
        for client_id, since in list(self.heads.items()):
            if since < before:
                del self.heads[client_id]
                closed += self.close_client(client_id)
        self.slow_closed += closed
        return closed

    def enforce(self, policy: Policy | None) -> int:
        """Close every open tunnel, and every plain connection upgraded to a WebSocket, that
        ``policy`` refuses (all of them when it is None)."""
        closed = 0
        for client_id, state in list(self.clients.items()):
            if (tunnel := state.tunnel) is not None:
                attempt, agent_id, address = tunnel.attempt, tunnel.agent_id, tunnel.address
            elif state.upgraded is not None:
                (attempt, agent_id), address = state.upgraded, None
            else:
                continue
            again = check_request(policy, attempt, self.clock())
            if not again.allowed:
                self._record(again, attempt.plain_http, agent_id=agent_id, address=address)
                closed += self.close_client(client_id)
        return closed

    def close_client(self, client_id: str) -> int:
        """Close a client connection; 1 if there was one."""
        if self.front is not None and self.front.close(client_id):
            return 1
        state = self.clients.get(client_id)
        return close_client(client_id, state.tunnel if state else None)

    def tunnel_of(self, client_id: str) -> Tunnel | None:
        """The client connection's allowed tunnel, if it has one."""
        state = self.clients.get(client_id)
        return state.tunnel if state else None

    def hand_over(self, client_id: str, tunnel: Tunnel, early: Callable[[], bytes | None]) -> None:
        """Start handing a tunnel whose first bytes came over to a relay
        (:func:`~egress.proxy.tunnels.hand_over`), in a task of its own."""
        tunnel.handover = asyncio.create_task(
            hand_over(client_id, tunnel, early, self.close_client)
        )

    # --- hooks -------------------------------------------------------------------------------

    def client_connected(self, client: connection.Client) -> None:
        self.opened(client.id)

    def opened(self, client_id: str) -> None:
        """A client connected: its request head is awaited from now."""
        self.heads[client_id] = time.monotonic()

    def response(self, flow: http.HTTPFlow) -> None:
        self._await_next_head(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._await_next_head(flow)

    def head_came(self, client_id: str) -> None:
        """A request head is read whole: no more waiting for one on this connection."""
        self.heads.pop(client_id, None)

    def _await_next_head(self, flow: http.HTTPFlow) -> None:
        """A plain request is answered: the connection's next head is waited for anew. Not
        after an upgrade to a WebSocket, which no head follows: the connection is checked
        against the policy from then on, as a tunnel is (:meth:`enforce`)."""
        if flow.request.method == "CONNECT" or not flow.client_conn.connected:
            return
        client_id = flow.client_conn.id
        if flow.response is None or flow.response.status_code != 101:
            self.heads[client_id] = time.monotonic()
            return
        state = self.clients.get(client_id)
        allowed = flow.metadata.get("covey_allowed")
        if state is None or allowed is None:  # nothing covey allowed: fail closed
            self.close_client(client_id)
            return
        attempt, decision = allowed
        state.upgraded = (attempt.to(decision), decision.agent.id)

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        self.head_came(flow.client_conn.id)
        if flow.response is not None or flow.error is not None:
            return
        await self._decide_flow(flow, plain_http=False)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        self.head_came(flow.client_conn.id)
        if flow.response is not None or flow.error is not None:
            return
        if flow.request.method == "CONNECT":
            return  # decided in http_connect
        if flow.request.host.lower().rstrip(".") == desk.HOST:
            # Answered here, in request, once it is whole; never streamed (mitmproxy would
            # open an upstream connection for a streamed body).
            flow.metadata["covey_desk"] = True
            length = flow.request.headers.get("Content-Length", "")
            if (
                flow.request.stream
                or "Transfer-Encoding" in flow.request.headers
                or (length and (not length.isdigit() or int(length) > desk.MAX_BODY))
            ):
                flow.response = desk.too_large()
                self._answer_before_the_body(flow)
            return
        await self._decide_flow(flow, plain_http=True)

    async def request(self, flow: http.HTTPFlow) -> None:
        """The request desk (egress/proxy/desk.py): answered by the proxy, never forwarded."""
        if not flow.metadata.get("covey_desk") or flow.response is not None:
            return
        request = flow.request
        attempt = Attempt(
            request.headers.get("Proxy-Authorization"), desk.HOST, 80, plain_http=True
        )
        refused, token = await self._identify(attempt, peer(flow.client_conn))
        if refused is not None:
            flow.response = refusal(refused)
            return
        if self.desk is None:
            flow.response = http.Response.make(
                503, b'{"detail": "this proxy takes no requests"}\n',
                {"Content-Type": "application/json"},
            )  # fmt: skip
            return
        body = request.raw_content or b""
        try:
            flow.response = await asyncio.to_thread(
                self.desk.answer, request.method, request.path, body, token
            )
        except Exception:  # answered all the same: a desk request never goes upstream
            logger.exception("covey: the request desk failed")
            flow.response = desk.failed()

    async def _identify(self, attempt: Attempt, client: str) -> tuple[Decision | None, str]:
        """(None, the token's SHA-256) for a credential of an enabled agent; else the
        refusal (407 for no credential or an unknown one, as for any connection)."""
        policy = self.feed.current()
        start = Decision(Code.ALLOWED, attempt.host, attempt.port, attempt.username)
        if policy is None:
            return start.refuse(Code.POLICY_UNAVAILABLE), ""
        agent, unknown = policy.identify(attempt.credentials, self.clock())
        credentials = attempt.credentials
        if (
            agent is None
            and unknown
            and credentials is not None
            and self.lookups.begin(credentials[1], unknown, client)
        ):
            await self._look_up(LookUp(unknown, client))
            policy = self.feed.current()
            if policy is not None:
                agent, _ = policy.identify(credentials, self.clock())
        if agent is None or credentials is None:
            return start.refuse(Code.PROXY_AUTH), ""
        if not agent.enabled:
            return replace(start, agent=agent).refuse(Code.AGENT_DISABLED), ""
        return None, hash_token(credentials[1])

    async def settle(self, attempt: Attempt, pending: Decision | LookUp) -> Decision:
        """A CONNECT's decision that :meth:`decide_now` could not give at once: the token
        looked up, or the allowed name resolved."""
        if isinstance(pending, LookUp):
            await self._look_up(pending)
            return await self.decide(attempt, client=None)
        return await self._resolved(attempt, pending)

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
        self.closed(client.id)

    def closed(self, client_id: str) -> None:
        """A client connection ended: its tunnel's close is logged with its bytes."""
        self.heads.pop(client_id, None)
        state = self.clients.pop(client_id, None)
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
            CloseEvent(
                id=tunnel.decision_id, bytes_up=bytes_up, bytes_down=bytes_down, at=self.clock()
            )
        )

    # --- deciding ----------------------------------------------------------------------------

    async def _decide_flow(self, flow: http.HTTPFlow, *, plain_http: bool) -> None:
        request = flow.request
        attempt = Attempt(
            request.headers.get("Proxy-Authorization"),
            request.host,
            request.port,
            plain_http=plain_http,
            problem=plain_http_problem(request) if plain_http else "",
        )
        resume = pause_reading(flow.client_conn.id)
        try:
            decision = await self.decide(attempt, client=peer(flow.client_conn))
            if not decision.allowed:
                flow.response = refusal(decision)
                self._answer_before_the_body(flow)
                return
        finally:
            if flow.error is None:
                resume()  # else killed: mitmproxy closes the connection
        del request.headers["Proxy-Authorization"]
        self.admit(flow.client_conn.id, attempt, decision)
        if plain_http:
            flow.metadata["covey_allowed"] = (attempt, decision)  # should it be upgraded
            host, port = decision.host, decision.port
            request.host = host  # one canonical host for URL, Host header and dial
            shown = f"[{host}]" if ":" in host else host  # a built-in may be an IPv6 address
            request.headers["Host"] = shown if port == 80 else f"{shown}:{port}"
            # Bodies pass through as they come, never held: a streamed answer (the model
            # gateway's) reaches the sandbox chunk by chunk.
            request.stream = True
            flow.metadata["covey_forwarded"] = True

    def _answer_before_the_body(self, flow: http.HTTPFlow) -> None:
        """Send ``flow.response`` now and close, when a body follows the request: mitmproxy
        would read all of a body it will not forward before answering, and cannot answer at
        all one it streams (past ``stream_large_bodies``)."""
        assert flow.response is not None  # noqa: S101 - only called once there is one
        if http1.expected_http_body_size(flow.request) == 0:
            return
        flow.response.headers["Connection"] = "close"
        if answer_now(flow.client_conn.id, http1.assemble_response(flow.response)):
            flow.kill()  # mitmproxy closes the connection without a word of its own

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("covey_forwarded") and flow.response is not None:
            flow.response.stream = True

    async def decide(self, attempt: Attempt, *, client: str | None) -> Decision:
        """Decide one attempt up to its addresses (a refusal is logged here; an allow by
        :meth:`admit`, which the caller calls when it goes ahead). ``client``: the address it
        came from, which bounds its look-ups of unknown tokens (None: no look-up)."""
        first = self._by_name(attempt, client)
        if isinstance(first, LookUp):
            await self._look_up(first)
            first = self._by_name(attempt, None)  # the token is known now, or refused
            assert isinstance(first, Decision)  # noqa: S101 - no client, no look-up
        if not first.allowed:
            return first
        return await self._resolved(attempt, first)

    def decide_now(self, attempt: Attempt, client: str) -> Decision | LookUp:
        """:meth:`decide` for a CONNECT as far as it goes without waiting: the decision when it
        is refused by name or the name's addresses are cached; else what must be waited for
        (:meth:`settle`): the allow by name, whose name must be resolved, or the token."""
        first = self._by_name(attempt, client)
        if isinstance(first, LookUp) or not first.allowed:
            return first
        addresses = self.resolver.cached(first.host)
        if addresses is None:
            return first
        return self._by_address(attempt, first, addresses)

    def _by_name(self, attempt: Attempt, client: str | None) -> Decision | LookUp:
        """Steps 1 to 3 (:func:`check_request`); a token the policy does not have yet is to be
        looked up when ``client`` is given and :class:`TokenLookups` allows it."""
        decision = check_request(self.feed.current(), attempt, self.clock(), full=self._full)
        credentials = attempt.credentials
        if (
            decision.unknown_token
            and credentials is not None
            and client is not None
            and self.lookups.begin(credentials[1], decision.unknown_token, client)
        ):
            return LookUp(decision.unknown_token, client)
        if not decision.allowed:
            self._record(decision, attempt.plain_http)
        return decision

    async def _resolved(self, attempt: Attempt, allowed: Decision) -> Decision:
        try:
            addresses = await self.resolver.resolve(allowed.host)
        except ResolutionError as exc:
            addresses = []
            with logs.bound(agent_id=allowed.agent.id if allowed.agent is not None else None):
                logger.info("covey: %s", exc)
        return self._by_address(attempt, allowed, addresses)

    def _by_address(self, attempt: Attempt, allowed: Decision, addresses: list[str]) -> Decision:
        """Step 4 (:func:`check_addresses`); and, when the policy changed while the name was
        resolved, steps 1 to 3 again from memory."""
        decision = check_addresses(allowed, addresses, self.allowed_private)
        if decision.allowed:
            latest = self.feed.current()
            if latest is None or latest.generation != allowed.generation:
                again = check_request(latest, attempt.to(allowed), self.clock())
                if not again.allowed:
                    decision = again
        if not decision.allowed:
            # Logged as the agent it was allowed by name for, even when it is no one now.
            agent = decision.agent or allowed.agent
            self._record(decision, attempt.plain_http, agent_id=agent.id if agent else None)
        return decision

    def _full(self, agent_id: int) -> bool:
        return (
            self.open_tunnels >= self.max_tunnels
            or self.tunnels_by_agent[agent_id] >= self.max_tunnels_per_agent
        )

    def check_hello(self, tunnel: Tunnel, data: bytes) -> bool | None:
        """Step 5 on a tunnel's first bytes: True when they may flow (the tunnel has started),
        False when it is refused (logged), None to wait for more."""
        hello = read_client_hello(data)
        if hello is None:
            return None
        checked = check_client_hello(tunnel.decision, *hello)
        if not checked.allowed:
            self._record(checked, False)
            return False
        tunnel.started = True
        return True

    async def _look_up(self, lookup: LookUp) -> None:
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

    def admit(self, client_id: str, attempt: Attempt, decision: Decision) -> Tunnel | None:
        """Log an allowed decision and remember it for the client connection: the vetted
        address a plain request may be sent to, or the tunnel (returned)."""
        assert decision.agent is not None and decision.address is not None  # noqa: S101
        decision_id = self._record(decision, attempt.plain_http)
        state = self.clients.setdefault(client_id, ClientState())
        if attempt.plain_http:
            state.pinned[(decision.host, decision.port)] = decision.address
            return None
        state.tunnel = Tunnel(decision_id, attempt.to(decision), decision)
        self.open_tunnels += 1
        self.tunnels_by_agent[decision.agent.id] += 1
        return state.tunnel

    def _record(
        self,
        decision: Decision,
        plain_http: bool,
        *,
        agent_id: int | None = None,
        address: str | None = None,
    ) -> str:
        """Log a decision (who and where to from it unless given); its id. A runner's proxy
        check is answered and not logged: it is covey's, not anyone's attempt."""
        decision_id = self.log.new_id()
        if is_proxy_check(decision):
            return decision_id
        if agent_id is None and decision.agent is not None:
            agent_id = decision.agent.id
        kind = ConnectionKind.HTTP if plain_http else ConnectionKind.CONNECT
        self.decisions[kind.value, decision.code.value] += 1
        self.log.add(
            DecisionEvent(
                id=decision_id,
                agent_id=agent_id,
                username=decision.username,
                kind=kind,
                host=decision.host,
                port=decision.port,
                address=address or decision.address,
                allowed=decision.allowed,
                reason=decision.code,
                detail=", ".join(decision.sources) if decision.allowed else decision.detail,
                at=self.clock(),
                boot=self.log.boot,
                seq=self.log.number(),
            )
        )
        return decision_id


class NextLayer:
    """Stands in for mitmproxy's own NextLayer addon (and carries its name), so that only
    covey decides what a connection speaks: HTTP proxy requests, then checked pass-through."""

    def __init__(self, egress: CoveyEgress) -> None:
        self.egress = egress

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        choose_layer(self.egress, nextlayer)
