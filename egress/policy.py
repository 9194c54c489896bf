"""The egress decision, as pure Python: no Django, no mitmproxy, no I/O.

Every CONNECT tunnel and plain-HTTP request (an :class:`Attempt`) is decided in these steps, in
this order (docs/architecture.md, "Egress decisions"); each function returns a
:class:`Decision`, and the first refusal is the answer:

1. Who is it: :func:`check_request` refuses when the proxy has no policy it can trust, when the
   proxy found the request malformed, and when the credential proves no agent (407); then
2. may this agent connect at all (disabled, budget used up, its tunnels or the proxy's full), and
3. may it reach this host and port by name (no IP literal; on the effective allowlist; plain
   HTTP only to port 80): :func:`check_agent`, which ``egress_explain`` calls for a given agent.
   A destination the platform itself names for every agent (a *built-in*: the model gateway,
   from COVEY_MODEL_GATEWAY_URL) is allowed as named, IP literal and port included.
4. Is every address the name resolved to one it may reach: :func:`check_addresses`, which
   also picks the one address to connect to (no second look-up); a built-in's may be private.
5. Does the tunnel open with a TLS ClientHello naming the CONNECT host: :func:`check_client_hello`.

The proxy addon, ``egress_explain`` and the tests call these same functions.
"""

import base64
import functools
import hashlib
import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from allowlists.entries import Entry, EntryError, IPLiteralError, parse_entry

if TYPE_CHECKING:  # egress/protocol.py builds on this module (its Code)
    from egress.protocol import AgentSnapshot, PolicyDelta, PolicySnapshot

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

PLAIN_HTTP_PORT = 80


class Code(StrEnum):
    """Why a connection was allowed or refused; sent as ``X-Covey-Deny-Reason``."""

    ALLOWED = "allowed"
    PROXY_AUTH = "proxy-auth-required"  # 407
    AGENT_DISABLED = "agent-disabled"
    BUDGET_EXHAUSTED = "budget-exhausted"
    CAPACITY = "capacity"  # 429
    IP_LITERAL = "ip-literal"
    NOT_ON_ALLOWLIST = "not-on-allowlist"
    PORT_NOT_ALLOWED = "port-not-allowed"
    NON_PUBLIC_ADDRESS = "non-public-address"
    UNRESOLVABLE = "unresolvable"  # 502: the name has no address
    BAD_REQUEST = "bad-request"
    POLICY_UNAVAILABLE = "policy-unavailable"  # 503: the proxy's policy is too old to trust


# What each code means, in words an agent (or a person) can act on.
EXPLANATIONS = {
    Code.PROXY_AUTH: "this proxy needs the agent's egress credentials (Proxy-Authorization)",
    Code.AGENT_DISABLED: "this agent is disabled",
    Code.BUDGET_EXHAUSTED: "this agent's budget is used up",
    Code.CAPACITY: "the proxy is at its limit of open tunnels; retry shortly",
    Code.IP_LITERAL: "connections go to host names, never to IP addresses",
    Code.NOT_ON_ALLOWLIST: "the host is not on this agent's allowlist",
    Code.PORT_NOT_ALLOWED: "the host is on the allowlist, but not with this port",
    Code.NON_PUBLIC_ADDRESS: "the name resolves to an address that is not public",
    Code.UNRESOLVABLE: "the name could not be resolved",
    Code.BAD_REQUEST: "the request is malformed or ambiguous",
    Code.POLICY_UNAVAILABLE: "the proxy cannot confirm the current policy, so it refuses all",
}

STATUS = {
    Code.ALLOWED: 200,
    Code.PROXY_AUTH: 407,
    Code.CAPACITY: 429,
    Code.BUDGET_EXHAUSTED: 402,  # as the model gateway answers
    Code.UNRESOLVABLE: 502,
    Code.POLICY_UNAVAILABLE: 503,
}


def status_of(code: Code) -> int:
    """The HTTP status the proxy answers with for a decision code."""
    return STATUS.get(code, 403)


@dataclass(frozen=True)
class Attempt:
    """One CONNECT or plain-HTTP request, as the proxy received it."""

    credential: str | None = field(repr=False)  # the Proxy-Authorization header: a secret
    host: str
    port: int
    plain_http: bool = False
    problem: str = ""  # what the proxy found malformed or ambiguous in it ('' when nothing)

    @functools.cached_property
    def credentials(self) -> tuple[str, str] | None:
        """(username, token) from the credential, or None when it is not one (decoded once
        per attempt, however many steps ask)."""
        return parse_basic(self.credential)

    @property
    def username(self) -> str:
        """The name the credential claims ('' when there is none)."""
        credentials = self.credentials
        return credentials[0] if credentials else ""

    def to(self, decision: "Decision") -> "Attempt":
        """This attempt aimed where ``decision`` says (its host and port normalised): what a
        later check decides again, so that its refusal names what the allow named."""
        return replace(self, host=decision.host, port=decision.port)


# What a runner asks the proxy, without a credential, to see that it answers (the probe
# program's proxy-check, runners/probe/program.py, which cannot import this): a name that can
# never be a destination (.invalid, RFC 6761). Its 407 is covey's own check, not an attempt of
# anyone's, so the proxy does not log it.
PROXY_CHECK = ("covey-proxy-check.invalid", 443)


def is_proxy_check(decision: "Decision") -> bool:
    """The refusal of a runner's proxy check (PROXY_CHECK, no credential at all)."""
    return (
        decision.code is Code.PROXY_AUTH
        and not decision.username
        and (decision.host, decision.port) == PROXY_CHECK
    )


@dataclass(frozen=True)
class Decision:
    """The answer to one attempt, as far as its steps have gone. A refusal is final; an allow
    lets the attempt on to the next step, and after the last one, through."""

    code: Code
    host: str
    port: int
    username: str = ""  # as claimed by the credential
    agent: "AgentPolicy | None" = None  # once identified
    sources: tuple[str, ...] = ()  # for an allow: where the matching entry comes from
    address: str | None = None  # for an allow whose addresses were checked: the one to dial
    detail: str = ""
    generation: str = ""  # of the policy it was decided by
    unknown_token: str = ""  # a 407 for a token this policy has never seen: its SHA-256
    built_in: str = ""  # for an allow of a built-in destination: its name

    @property
    def allowed(self) -> bool:
        """True only for an allow."""
        return self.code is Code.ALLOWED

    def refuse(self, code: Code, detail: str = "") -> "Decision":
        """This attempt refused at a later step: who, what and where to are kept."""
        return replace(self, code=code, detail=detail, sources=(), built_in="")


def base_list(organisation: str) -> str:
    """The name of an organisation's base list among the shared lists (by its slug)."""
    return f"base:{organisation}"


def source_of(name: str) -> str:
    """What the decision log says an entry of a shared list comes from: ``base`` for an
    organisation's base list, ``template:<slug>`` for a template."""
    return "base" if name.startswith("base:") else name


@dataclass(frozen=True)
class EntryList:
    """Allowlist entries as the proxy looks them up: as the grammar writes them
    (``str(Entry)``), never parsed here. What a sandbox asks for is put in that form before it
    is looked up, so an entry in any other form matches nothing.

    A proxy holds every agent of its organisation and decides for the few that run on its
    host: the entries are held as the snapshot has them, one text with an entry per line (half
    the memory of a string each), and the set to look them up in is made when first asked."""

    lines: str

    @property
    def texts(self) -> tuple[str, ...]:
        return tuple(self.lines.split("\n")) if self.lines else ()

    @functools.cached_property
    def entries(self) -> frozenset[str]:
        return frozenset(self.texts)

    @functools.cached_property
    def hosts(self) -> frozenset[str]:
        """The host names of the entries (read only to say why a connection was refused)."""
        return frozenset(
            host if port.isdigit() else text
            for text in self.entries
            for host, _, port in [text.rpartition(":")]
        )


EMPTY = EntryList("")


@dataclass(frozen=True)
class AgentPolicy:
    """What one agent may do: its allowlist (the lists it has, each with its source's name:
    ``base``, ``template:<slug>``, then its own ``agent``) and the switches that stop it."""

    id: int
    username: str
    organisation: str
    enabled: bool
    budget_exhausted: bool
    lists: tuple[tuple[str, EntryList], ...]

    def sources(self, entry: Entry) -> tuple[str, ...]:
        """Where ``entry`` comes from in this agent's allowlist (none: it is not on it)."""
        text = str(entry)
        return tuple(source_of(name) for name, held in self.lists if text in held.entries)

    @functools.cached_property
    def hosts(self) -> frozenset[str]:
        """Every host name on the agent's allowlist, at whatever port."""
        return frozenset().union(*(held.hosts for _, held in self.lists))


@dataclass(frozen=True)
class Token:
    """An egress token, known to the proxy only by its SHA-256."""

    agent_id: int
    expires_at: float  # seconds since the epoch


@dataclass(frozen=True)
class Policy:
    """Everything the proxy needs to decide, at one moment (one snapshot)."""

    generation: str
    agents: Mapping[int, AgentPolicy]
    tokens: Mapping[str, Token]
    built_in: Mapping[tuple[str, int], str] = field(default_factory=dict)  # (host, port) → name
    lists: Mapping[str, EntryList] = field(default_factory=dict)  # shared, by name

    @classmethod
    def from_snapshot(cls, snapshot: "PolicySnapshot") -> "Policy":
        """Build from the snapshot the control plane serves (egress/protocol.py); ValueError
        when a built-in destination is not one. An agent that names a list the snapshot does
        not hold has it empty (a template made while the snapshot was read: the next one
        holds it)."""
        lists = {name: EntryList(texts) for name, texts in snapshot.lists.items()}
        try:
            built_in = {destination(b.host, b.port): b.name for b in snapshot.built_in}
        except ValueError as exc:
            raise ValueError(f"malformed policy snapshot: {exc}") from None
        return cls(snapshot.generation, {}, {}, built_in, lists)._with(snapshot.agents, ())

    def _with(self, changed: Iterable["AgentSnapshot"], removed: Iterable[int]) -> "Policy":
        """This policy with ``changed`` agents (and their tokens) in place of theirs and the
        ``removed`` gone."""
        agents = dict(self.agents)
        tokens = dict(self.tokens)
        touched = set(removed)
        fresh = []
        for item in changed:
            touched.add(item.id)
            shared = tuple((name, self.lists.get(name, EMPTY)) for name in item.lists)
            own = (("agent", EntryList(item.own)),) if item.own else ()
            agent = AgentPolicy(
                item.id,
                item.username,
                item.organisation,
                item.enabled,
                item.budget_exhausted,
                shared + own,
            )
            fresh.append((agent, item.tokens))
        if touched and tokens:
            tokens = {h: t for h, t in tokens.items() if t.agent_id not in touched}
        for agent_id in touched:
            agents.pop(agent_id, None)
        for agent, held in fresh:
            agents[agent.id] = agent
            for token in held:
                tokens[token.sha256] = Token(agent.id, token.expires_at)
        return replace(self, agents=agents, tokens=tokens)

    def apply(self, delta: "PolicyDelta") -> "Policy":
        """This policy with ``delta``'s shared lists and agents in place of theirs (their
        tokens too) and its removed ones gone. ValueError when the delta is not from this
        generation."""
        if delta.since != self.generation:
            raise ValueError(f"a delta from {delta.since}, and this policy is {self.generation}")
        policy = replace(self, generation=delta.generation)
        if delta.lists or delta.lists_removed:
            lists = {n: held for n, held in self.lists.items() if n not in delta.lists_removed}
            lists.update((n, EntryList(texts)) for n, texts in delta.lists.items())
            policy = replace(policy, lists=lists)
            # Every agent that has a changed list holds the new one.
            names = {*delta.lists, *delta.lists_removed}
            rebound = {
                agent.id: replace(
                    agent,
                    lists=tuple(
                        (n, lists.get(n, EMPTY) if n in names else held) for n, held in agent.lists
                    ),
                )
                for agent in self.agents.values()
                if any(n in names for n, _ in agent.lists)
            }
            policy = replace(policy, agents={**self.agents, **rebound})
        return policy._with(delta.agents, delta.removed)

    def identify(
        self, credentials: tuple[str, str] | None, now: float
    ) -> tuple[AgentPolicy | None, str]:
        """The agent ``(username, token)`` proves, or None; and the token's SHA-256 when this
        policy has no such token at all (issued after this snapshot, or never), else ''. The
        token is hashed once, whatever the answer."""
        if credentials is None:
            return None, ""
        username, secret = credentials
        digest = hash_token(secret)
        token = self.tokens.get(digest)
        if token is None:
            return None, digest
        if token.expires_at <= now:
            return None, ""
        agent = self.agents.get(token.agent_id)
        if agent is None or agent.username != username:
            return None, ""
        return agent, ""


def _never(agent_id: int) -> bool:
    return False


def check_request(
    policy: Policy | None,
    attempt: Attempt,
    now: float,
    *,
    full: Callable[[int], bool] = _never,
) -> Decision:
    """Step 1, then :func:`check_agent`: is there a policy to decide by, is the request well
    formed, and which agent does its credential prove. ``full(agent_id)``: whether a new tunnel
    of that agent would be over a limit."""
    if policy is None:
        start = Decision(Code.ALLOWED, attempt.host, attempt.port, attempt.username)
        return start.refuse(Code.POLICY_UNAVAILABLE)
    start = Decision(
        Code.ALLOWED, attempt.host, attempt.port, attempt.username, generation=policy.generation
    )
    if attempt.problem:
        return start.refuse(Code.BAD_REQUEST, attempt.problem)
    agent, unknown = policy.identify(attempt.credentials, now)
    if agent is None:
        return replace(start.refuse(Code.PROXY_AUTH), unknown_token=unknown)
    return check_agent(
        agent, attempt, full=full, generation=policy.generation, built_in=policy.built_in
    )


def destination(host: str, port: int) -> tuple[str, int]:
    """(host, port) as destinations are compared: a name as the entry grammar normalises it,
    an IP address in its standard form; ValueError for anything else."""
    try:
        entry = parse_entry(f"{host}:{port}")
        return entry.host, entry.port
    except IPLiteralError:
        address = standard_address(host)
        if not address:
            raise ValueError(f"{host!r} is neither a host name nor an IP address") from None
        return address, port


def standard_address(host: str) -> str:
    """An IP address (IPv6 bracketed or not) in its standard form; '' when it is not one."""
    try:
        return str(ipaddress.ip_address(host.removeprefix("[").removesuffix("]")))
    except ValueError:
        return ""


def check_agent(
    agent: AgentPolicy,
    attempt: Attempt,
    *,
    full: Callable[[int], bool] = _never,
    generation: str = "",
    built_in: Mapping[tuple[str, int], str] | None = None,
) -> Decision:
    """Steps 2 and 3 for an identified agent: its switches and the proxy's capacity (tunnels
    only; plain requests hold nothing open), then the target by name: a built-in destination
    (``built_in``: (host, port) → name), else the agent's allowlist."""
    start = Decision(
        Code.ALLOWED, attempt.host, attempt.port, attempt.username, agent, generation=generation
    )
    if not agent.enabled:
        return start.refuse(Code.AGENT_DISABLED)
    if agent.budget_exhausted:
        return start.refuse(Code.BUDGET_EXHAUSTED)
    if not attempt.plain_http and full(agent.id):
        return start.refuse(Code.CAPACITY)
    try:
        entry = parse_entry(f"{attempt.host}:{attempt.port}")
    except IPLiteralError:  # only a built-in destination may be an IP address
        address = standard_address(attempt.host) if built_in else ""
        name = built_in.get((address, attempt.port)) if built_in and address else None
        if name is None:
            return start.refuse(Code.IP_LITERAL)
        return replace(start, host=address, sources=(f"built-in: {name}",), built_in=name)
    except EntryError as exc:
        return start.refuse(Code.BAD_REQUEST, str(exc))
    name = built_in.get((entry.host, entry.port)) if built_in else None
    if name is not None:
        return replace(start, host=entry.host, sources=(f"built-in: {name}",), built_in=name)
    sources = agent.sources(entry)
    if sources and (not attempt.plain_http or entry.port == PLAIN_HTTP_PORT):
        return replace(start, host=entry.host, port=entry.port, sources=sources)
    named = replace(start, host=entry.host, port=entry.port)
    if entry.host in agent.hosts:
        plain_only = attempt.plain_http and sources
        return named.refuse(
            Code.PORT_NOT_ALLOWED, "plain HTTP is allowed only to port 80" if plain_only else ""
        )
    return named.refuse(Code.NOT_ON_ALLOWLIST)


def parse_basic(header: str | None) -> tuple[str, str] | None:
    """(username, token) from a ``Basic`` credential, or None when it is not one."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except ValueError:  # not base64 (binascii.Error), not ASCII, or not UTF-8 once decoded
        return None
    username, colon, secret = decoded.partition(":")
    if not colon or not username or not secret:
        return None
    return username, secret


def hash_token(secret: str) -> str:
    """How tokens are stored and compared: SHA-256 (they are long random strings)."""
    return hashlib.sha256(secret.encode()).hexdigest()


# Ranges that are never the public internet, listed here so the answer does not depend on the
# Python version's idea of ``is_global`` (which has changed between patch releases).
_NOT_PUBLIC = [
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",
        "169.254.0.0/16",  # link-local, cloud metadata
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, broadcast
        "::/128",
        "::1/128",
        "100::/64",
        "2001::/23",  # IETF protocol assignments, Teredo among them
        "2001:db8::/32",
        "3fff::/20",
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local
        "ff00::/8",  # multicast
    )
]
_NAT64 = [ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48")]


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, NAT64, 6to4, compatible), if any."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if any(address in net for net in _NAT64):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if int(address) >> 32 == 0 and int(address) > 1:  # deprecated IPv4-compatible ::a.b.c.d
        return ipaddress.IPv4Address(int(address))
    return None


def is_public(address: IPAddress) -> bool:
    """True only for a globally routable unicast address (also for what it embeds). An address
    of NAT64's well-known prefix is as public as the IPv4 address it carries: that is where
    its gateway connects (an IPv6-only host's DNS64 answers so for every IPv4-only name). The
    local-use prefix is not: where it carries its IPv4 address is the operator's to say."""
    inner = embedded_ipv4(address)
    if inner is not None and not is_public(inner):
        return False
    if inner is not None and address in _NAT64[0]:
        return True
    if any(address in net for net in _NOT_PUBLIC if net.version == address.version):
        return False
    return address.is_global and not (
        address.is_multicast or address.is_reserved or address.is_loopback
    )


def check_addresses(
    decision: Decision, addresses: Iterable[str], allowed_private: Sequence[IPNetwork] = ()
) -> Decision:
    """Step 4: refuse if the name has no address, or any is not public (unless inside
    ``allowed_private``, or the destination is a built-in, which the platform named); else the
    allow with the one vetted address to dial (IPv4 first)."""
    if not decision.allowed:
        return decision
    parsed = [ipaddress.ip_address(a) for a in addresses]
    if not parsed:
        return decision.refuse(Code.UNRESOLVABLE, "the name has no address")
    for address in [] if decision.built_in else parsed:
        inner = embedded_ipv4(address) or address
        if any(inner in net for net in allowed_private if net.version == inner.version):
            continue
        if not is_public(address):
            return decision.refuse(Code.NON_PUBLIC_ADDRESS, str(address))
    chosen = next((a for a in parsed if a.version == 4), parsed[0])
    return replace(decision, address=str(chosen))


def check_client_hello(decision: Decision, sni: str, problem: str = "") -> Decision:
    """Step 5, for a tunnel: its first bytes are a TLS ClientHello (``problem`` says how they
    are not, as the proxy read them) whose SNI is the CONNECT host."""
    if not decision.allowed:
        return decision
    if problem:
        return decision.refuse(Code.BAD_REQUEST, problem)
    name = sni.lower().rstrip(".")
    if not name:
        return decision.refuse(Code.BAD_REQUEST, "the TLS ClientHello names no server (SNI)")
    if name != decision.host:
        return decision.refuse(
            Code.BAD_REQUEST,
            f"the TLS ClientHello names {name!r}, not the CONNECT host {decision.host!r}",
        )
    return decision


def parse_networks(texts: Iterable[str]) -> list[IPNetwork]:
    """COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS as networks (ValueError on a bad one)."""
    return [ipaddress.ip_network(text.strip()) for text in texts if text.strip()]
