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
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar

from egress.policy import Code
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
    """One agent as the proxy decides for it: its switches, its effective allowlist (entry →
    where it comes from: ``base``, ``template:<slug>``, ``agent``) and its live tokens."""

    id: int
    username: str  # <organisation slug>.<agent slug>
    organisation: str
    enabled: bool
    budget_exhausted: bool  # the model gateway found a budget of the agent's used up
    entries: dict[str, tuple[str, ...]]
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
    (the ETag a proxy polls with)."""

    generation: str
    agents: tuple[AgentSnapshot, ...]
    built_in: tuple[BuiltIn, ...] = ()


# The policy stream (egress/stream/): a proxy on a runner host holds one request open and reads
# a line of JSON for each change of its organisation's policy, and at least one every
# STREAM_KEEPALIVE seconds while nothing changes (each line says the stream is still current).
STREAM_KEEPALIVE = 5.0
# The header of the policy's answer (GET /api/v1/egress/policy/) that names the stream's URL.
STREAM_HEADER = "Covey-Policy-Stream"


@dataclasses.dataclass(frozen=True)
class PolicyDelta(Message):
    """What changed from generation ``since`` to ``generation``: the agents added or changed
    (each whole) and the ids of agents gone. Built-in destinations never change in a stream."""

    since: str
    generation: str
    agents: tuple[AgentSnapshot, ...] = ()
    removed: tuple[int, ...] = ()


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
