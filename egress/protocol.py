"""What crosses between an egress proxy and the control plane, as frozen dataclasses with a JSON
round-trip (:mod:`wire`): the policy snapshot the proxy reads (``GET /api/v1/egress/policy/``,
or the database on the control-plane host) and the events it writes to the decision log
(``POST /api/v1/egress/decisions/``). Both sides use these: the control plane builds the
snapshot and parses the events with them, its serializers (egress/messages.py) are made from
them so the OpenAPI schema describes them, and the proxy parses the snapshot and builds the
events. No Django: the proxy's image holds it.

The JSON is what it was when these were dicts (tests/egress/test_wires.py posts a proxy of one
version back's bodies): a receiver refuses what does not fit, naming the field, and ignores keys
it does not know.
"""

import dataclasses
import math
import typing
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar

from allowlists.entries import EntryError, parse_entry
from egress.policy import Code, base_list, source_of
from wire import Message, ProtocolError, decode

# At most this many events in one batch (the proxy's DecisionLog sends at most 5000 at once).
MAX_EVENTS = 5000
MAX_COUNT = 2**63 - 1  # a bigint column's bound: bytes, and decisions numbered by one proxy


@dataclasses.dataclass(frozen=True)
class TokenSnapshot(Message):
    """A live egress token, by its SHA-256 (the proxy never sees a secret)."""

    sha256: str
    expires_at: float  # seconds since the epoch


@dataclasses.dataclass(frozen=True)
class AgentSnapshot(Message):
    """One agent as the proxy decides for it: its switches, its allowlist and its live tokens.
    Its allowlist is the shared lists it has (``lists``: its organisation's base list, then
    its templates, named as in the snapshot's ``lists``) and its own entries (``own``: their
    source is ``agent``). A list of entries is one text, an entry per line (a policy may hold a
    million: a string each would cost twice the memory, docs/performance.md). Entries are sent
    as the grammar writes them (allowlists/entries.py), and the proxy looks them up as they
    are: one in no other form matches nothing."""

    id: int
    username: str  # <organisation slug>.<agent slug>
    organisation: str
    enabled: bool
    budget_exhausted: bool  # the model gateway found a budget of the agent's used up
    lists: tuple[str, ...]
    own: str  # one entry per line
    tokens: tuple[TokenSnapshot, ...]


@dataclasses.dataclass(frozen=True)
class BuiltIn(Message):
    """A destination every agent may reach because the platform names it (the model gateway)."""

    host: str
    port: int
    name: str


@dataclasses.dataclass(frozen=True)
class PolicySnapshot(Message):
    """Everything a proxy needs to decide, at one moment; ``generation`` is its fingerprint
    (the ETag a proxy polls with). ``lists``: the lists agents share, by name (each
    organisation's base list, ``base:<organisation slug>``, and every template,
    ``template:<slug>``), each held once however many agents have it."""

    generation: str
    agents: tuple[AgentSnapshot, ...]
    built_in: tuple[BuiltIn, ...] = ()
    lists: dict[str, str] = dataclasses.field(default_factory=dict)  # one entry per line

    @classmethod
    def from_json(cls, data: Any) -> "PolicySnapshot":
        """The snapshot in ``data``, of either form: with shared lists, or as a control plane
        of before them serves it (each agent's ``entries``: entry → sources), whose lists are
        gathered here. ProtocolError naming what does not fit."""
        return typing.cast(PolicySnapshot, decode(cls, _from_v1(data), cls.__name__))


def _from_v1(data: Any) -> Any:
    """A snapshot of before shared lists (its agents have ``entries``) in today's form;
    anything else as it is. ProtocolError naming what does not fit."""
    agents = data.get("agents") if isinstance(data, dict) and "lists" not in data else None
    if not isinstance(agents, list) or not any(
        isinstance(a, dict) and "entries" in a for a in agents
    ):
        return data  # today's form, or no snapshot: decoded as it is
    lists: dict[str, dict[str, None]] = {}
    converted = []
    for i, agent in enumerate(agents):
        where = f"PolicySnapshot.agents[{i}]"
        if not isinstance(agent, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(agent).__name__}")
        entries = agent.get("entries")
        if not isinstance(entries, dict):
            raise ProtocolError(f"{where}.entries: expected an object")
        names: dict[str, None] = {}
        own = []
        for written, sources in entries.items():
            if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
                raise ProtocolError(f"{where}.entries[{written!r}]: expected a list of text")
            try:  # such a control plane left the grammar's form to its proxies
                text = str(parse_entry(written))
            except EntryError as exc:
                raise ProtocolError(f"{where}.entries: {exc}") from None
            for source in sources:
                if source == "agent":
                    own.append(text)
                    continue
                name = base_list(str(agent.get("organisation"))) if source == "base" else source
                names[name] = None
                lists.setdefault(name, {})[text] = None
        order = sorted(names, key=lambda name: (not name.startswith("base:"), name))
        body = {k: v for k, v in agent.items() if k != "entries"}
        converted.append({**body, "lists": order, "own": "\n".join(own)})
    return {**data, "agents": converted, "lists": {n: "\n".join(e) for n, e in lists.items()}}


# The form of the policy with shared lists, as a proxy asks for it (``?v=2``, on the poll and
# the stream). One of before asks without it, and is answered by snapshot_v1_json.
POLICY_FORM = "2"


def snapshot_v1_json(snapshot: PolicySnapshot) -> dict[str, Any]:
    """The snapshot as a proxy of before shared lists reads it: no ``lists``, and each agent
    with ``entries`` (entry → its sources, ``base``, ``template:<slug>``, ``agent``)."""
    agents = []
    for agent in snapshot.agents:
        entries: dict[str, list[str]] = {}
        named = [(source_of(name), snapshot.lists.get(name, "")) for name in agent.lists]
        for source, lines in [*named, ("agent", agent.own)]:
            for text in lines.split("\n") if lines else ():
                entries.setdefault(text, []).append(source)
        body = agent.to_json()
        del body["lists"], body["own"]
        agents.append({**body, "entries": entries})
    return {
        "generation": snapshot.generation,
        "agents": agents,
        "built_in": [b.to_json() for b in snapshot.built_in],
    }


# The policy stream (egress/stream/): a proxy on a runner host holds one request open and reads
# a line of JSON for each change of its organisation's policy, and at least one every
# STREAM_KEEPALIVE seconds while nothing changes (each line says the stream is still current).
STREAM_KEEPALIVE = 5.0
# The header of the policy's answer (GET /api/v1/egress/policy/) that names the stream's URL.
STREAM_HEADER = "Covey-Policy-Stream"


@dataclasses.dataclass(frozen=True)
class PolicyDelta(Message):
    """What changed from generation ``since`` to ``generation``: the agents added or changed
    (each whole) and the ids of agents gone; the shared lists added or changed (each whole)
    and the names of those gone. Built-in destinations never change in a stream."""

    since: str
    generation: str
    agents: tuple[AgentSnapshot, ...] = ()
    removed: tuple[int, ...] = ()
    lists: dict[str, str] = dataclasses.field(default_factory=dict)
    lists_removed: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Current(Message):
    """Nothing changed: the proxy's ``generation`` is still the current one."""

    generation: str


StreamLine = PolicySnapshot | PolicyDelta | Current
STREAM_LINES: dict[str, type[StreamLine]] = {
    "snapshot": PolicySnapshot,
    "delta": PolicyDelta,
    "current": Current,
}


def stream_line_to_json(line: StreamLine) -> dict[str, Any]:
    """One line of the stream: ``{"snapshot": …}``, ``{"delta": …}`` or ``{"current": …}``."""
    tag = next(tag for tag, kind in STREAM_LINES.items() if isinstance(line, kind))
    return {tag: line.to_json()}


def stream_line_from_json(data: Any) -> StreamLine:
    """The line in ``data``; ProtocolError naming what does not fit. A line of a kind this
    proxy does not know is refused (the stream is dropped, and the proxy polls)."""
    if not isinstance(data, dict) or len(data) != 1:
        raise ProtocolError("a stream line is an object with one key")
    ((tag, body),) = data.items()
    kind = STREAM_LINES.get(tag)
    if kind is None:
        raise ProtocolError(f"{tag!r} is not one of {', '.join(STREAM_LINES)}")
    line: StreamLine = decode(kind, body, tag)
    return line


class EventKind(StrEnum):
    """What an event in the decision log says (its ``event`` field)."""

    DECISION = "decision"  # an allow or a deny
    CLOSE = "close"  # an allowed tunnel closed, with its byte counts
    START = "start"  # a proxy process started (a new proxy session, its ``boot``)
    STOP = "stop"  # it stopped cleanly, after every decision it made was written


class ConnectionKind(StrEnum):
    """What was decided: a CONNECT tunnel or a plain-HTTP request."""

    CONNECT = "connect"
    HTTP = "http"


def _check_time(at: float) -> None:
    if not math.isfinite(at):
        raise ValueError(f"at: {at!r} is no time")
    try:
        datetime.fromtimestamp(at, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise ValueError(f"at: {at!r} is no time") from None


def _check_count(name: str, value: int | None, most: int = MAX_COUNT) -> None:
    if value is not None and not 0 <= value <= most:
        raise ValueError(f"{name}: {value} is not between 0 and {most}")


def _check_boot(boot: str | None) -> None:
    if boot is not None and not (0 < len(boot) <= 32 and boot.isalnum()):
        raise ValueError(f"boot: a proxy's boot is up to 32 letters and digits, not {boot!r}")


def _check_id(value: str) -> None:
    try:
        uuid.UUID(value)
    except ValueError:
        raise ValueError(f"id: {value!r} is not a UUID") from None


class _Event(Message):
    """What every event checks: that it is of its own kind."""

    KIND: ClassVar[EventKind]
    event: EventKind

    def _check_kind(self) -> None:
        if self.event is not self.KIND:
            raise ValueError(f"event: a {type(self).__name__} is a {self.KIND!s}, not {self.event}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionEvent(_Event):
    """One allow or deny. ``boot`` and ``seq``: the proxy's session and the decision's number
    there (a proxy of before sessions sent neither)."""

    KIND: ClassVar[EventKind] = EventKind.DECISION
    event: EventKind = EventKind.DECISION
    id: str  # a UUID, the log row's; the tunnel's close names it
    agent_id: int | None = None  # None: nobody was identified
    username: str = ""  # as the credential claimed it
    kind: ConnectionKind
    host: str
    port: int
    address: str | None = None  # the vetted address it was (or would have been) sent to
    allowed: bool
    reason: Code
    detail: str = ""  # an allow's entry sources, a refusal's detail
    at: float  # seconds since the epoch
    boot: str | None = None
    seq: int | None = None

    def __post_init__(self) -> None:
        self._check_kind()
        _check_id(self.id)
        _check_count("port", self.port, 65535)
        _check_time(self.at)
        _check_boot(self.boot)
        _check_count("seq", self.seq)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CloseEvent(_Event):
    """An allowed tunnel closed: the bytes it carried each way."""

    KIND: ClassVar[EventKind] = EventKind.CLOSE
    event: EventKind = EventKind.CLOSE
    id: str  # the decision's
    bytes_up: int
    bytes_down: int
    at: float

    def __post_init__(self) -> None:
        self._check_kind()
        _check_id(self.id)
        _check_count("bytes_up", self.bytes_up)
        _check_count("bytes_down", self.bytes_down)
        _check_time(self.at)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartEvent(_Event):
    """A proxy process started: its session (``boot``, random for each process)."""

    KIND: ClassVar[EventKind] = EventKind.START
    event: EventKind = EventKind.START
    boot: str
    at: float

    def __post_init__(self) -> None:
        self._check_kind()
        _check_boot(self.boot)
        _check_time(self.at)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopEvent(_Event):
    """A proxy process stopped cleanly; ``seq``: how many decisions it made."""

    KIND: ClassVar[EventKind] = EventKind.STOP
    event: EventKind = EventKind.STOP
    boot: str
    seq: int = 0
    at: float

    def __post_init__(self) -> None:
        self._check_kind()
        _check_boot(self.boot)
        _check_count("seq", self.seq)
        _check_time(self.at)


ProxyEvent = DecisionEvent | CloseEvent | StartEvent | StopEvent
EVENTS: dict[EventKind, type[ProxyEvent]] = {
    EventKind.DECISION: DecisionEvent,
    EventKind.CLOSE: CloseEvent,
    EventKind.START: StartEvent,
    EventKind.STOP: StopEvent,
}


def event_from_json(data: Any, where: str = "event") -> ProxyEvent:
    """The event in ``data``, of the kind its ``event`` field names; ProtocolError naming the
    field when it does not fit."""
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(data).__name__}")
    tag = data.get("event", EventKind.DECISION)
    try:
        kind = EVENTS[EventKind(tag)]
    except (ValueError, TypeError):
        allowed = ", ".join(EVENTS)
        raise ProtocolError(f"{where}.event: {tag!r} is not one of {allowed}") from None
    event: ProxyEvent = decode(kind, data, where)
    return event


@dataclasses.dataclass(frozen=True)
class DecisionBatch:
    """What a proxy posts to the log: up to :data:`MAX_EVENTS` events, in the order it had
    them."""

    events: tuple[ProxyEvent, ...]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types, ready for the wire."""
        return {"events": [event.to_json() for event in self.events]}

    @classmethod
    def from_json(cls, data: Any) -> "DecisionBatch":
        """The batch in ``data``; ProtocolError naming the event and field that does not fit."""
        if not isinstance(data, dict):
            raise ProtocolError(f"expected an object, got {type(data).__name__}")
        events = data.get("events")
        if not isinstance(events, list):
            raise ProtocolError("events: expected a list")
        if len(events) > MAX_EVENTS:
            raise ProtocolError(f"events: at most {MAX_EVENTS} events in a batch")
        return cls(tuple(event_from_json(e, f"events[{i}]") for i, e in enumerate(events)))
