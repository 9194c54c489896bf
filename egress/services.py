"""Egress on the control-plane side: tokens, the policy snapshot the proxy reads, the log."""

import hashlib
import secrets
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, cast

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.models import Field, Q
from django.utils import timezone

from agents.models import Agent
from budgets.keys import gateway_destination
from budgets.services import exhausted
from egress.models import Decision, EgressToken, ProxySession
from egress.policy import base_list, hash_token
from egress.protocol import (
    AgentSnapshot,
    BuiltIn,
    CloseEvent,
    DecisionEvent,
    PolicySnapshot,
    ProxyEvent,
    StartEvent,
    StopEvent,
    TokenSnapshot,
)
from organisations.models import Organisation
from templates.models import AllowlistTemplate


def agent_username(agent: Agent) -> str:
    """The user name an agent shows the proxy: ``<organisation slug>.<agent slug>``."""
    return username(agent.organisation.slug, agent.slug)


def username(organisation_slug: str, agent_slug: str) -> str:
    return f"{organisation_slug}.{agent_slug}"


def issue_token(
    agent: Agent,
    *,
    ttl: timedelta | None = None,
    by: Any = None,
    purpose: str = "",
) -> tuple[EgressToken, str]:
    """Create a token for the agent; returns it and ``username:secret``, shown only now."""
    ttl = ttl if ttl is not None else timedelta(seconds=settings.COVEY_EGRESS_TOKEN_TTL)
    if ttl <= timedelta(0):
        raise ValueError("a token must live for a positive time")
    secret = secrets.token_urlsafe(32)
    token = EgressToken.objects.create(
        agent=agent,
        sha256=hash_token(secret),
        prefix=secret[:8],
        purpose=purpose,
        expires_at=timezone.now() + ttl,
        created_by=by if by is not None and by.is_authenticated else None,
    )
    return token, f"{agent_username(agent)}:{secret}"


def revoke_tokens(tokens: Iterable[EgressToken] | Any) -> int:
    """Revoke live tokens; returns how many were revoked."""
    ids = [t.pk for t in tokens]
    return EgressToken.objects.filter(pk__in=ids, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )


def _scoped(queryset: Any, organisation_id: int | None, lookup: str) -> Any:
    return queryset if organisation_id is None else queryset.filter(**{lookup: organisation_id})


def policy_fingerprint(organisation_id: int | None = None) -> str:
    """A cheap value that changes whenever anything the policy depends on changes: the count
    and latest change of the agents, organisations, templates and tokens (in one query: every
    proxy asks at every poll), the used-up budgets and the built-in destinations."""
    q = connection.ops.quote_name
    agent, org, template, token = (
        q(model._meta.db_table) for model in (Agent, Organisation, AllowlistTemplate, EgressToken)
    )
    scoped = organisation_id is not None
    agents = f"FROM {agent}" + (f" WHERE {q('organisation_id')} = %s" if scoped else "")
    orgs = f"FROM {org}" + (f" WHERE {q('id')} = %s" if scoped else "")
    tokens = f"FROM {token}" + (
        f" JOIN {agent} ON {agent}.{q('id')} = {token}.{q('agent_id')}"
        f" WHERE {agent}.{q('organisation_id')} = %s"
        if scoped
        else ""
    )
    parts = [
        (f"COUNT(*) {agents}", 1),
        (f"MAX({q('updated_at')}) {agents}", 1),
        (f"COUNT(*) {orgs}", 1),
        (f"MAX({q('updated_at')}) {orgs}", 1),
        (f"COUNT(*) FROM {template}", 0),
        (f"MAX({q('updated_at')}) FROM {template}", 0),
        (f"COUNT(*) {tokens}", 1),
        (f"MAX({token}.{q('created_at')}) {tokens}", 1),
        (f"MAX({token}.{q('revoked_at')}) {tokens}", 1),
    ]
    sql = "SELECT " + ", ".join(f"(SELECT {part})" for part, _ in parts)
    params = [organisation_id for _, takes_id in parts if scoped and takes_id]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        counted = cursor.fetchone()
    used_up = [sorted(ids) for ids in exhausted(organisation_id)]
    raw = "|".join(map(str, [*counted, used_up, built_in()]))
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def read_at_one_moment() -> None:
    """The transaction just begun reads at one moment: REPEATABLE READ on PostgreSQL, whose
    default gives each statement a moment of its own (an agent's templates and what they hold
    are read apart, and must be of one moment). SQLite's transactions are so already."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")


@contextmanager
def one_read() -> Iterator[None]:
    """A transaction that reads at one moment; inside one begun already, that one (the
    caller's ``brief_transaction(one_read=True)``)."""
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        read_at_one_moment()
        yield


def build_snapshot(organisation_id: int | None = None) -> PolicySnapshot:
    """Everything the proxy needs: the shared lists, the agents and their live tokens."""
    with one_read():
        generation = policy_fingerprint(organisation_id)
        agents = agent_snapshots(organisation_id)
        lists = shared_lists(organisation_id)
    return PolicySnapshot(generation, tuple(agents), built_in(), lists)


def shared_lists(organisation_id: int | None) -> dict[str, str]:
    """The lists agents share, by name (as they are stored: in the grammar's form): each
    organisation's base list (``base:<slug>``) and every template (``template:<slug>``)."""
    organisations = _scoped(Organisation.objects.all(), organisation_id, "pk")
    lists = {
        base_list(slug): "\n".join(entries)
        for slug, entries in organisations.values_list("slug", "base_allowlist")
    }
    templates = AllowlistTemplate.objects.order_by("slug").values_list("slug", "entries")
    lists.update((f"template:{slug}", "\n".join(entries)) for slug, entries in templates)
    return lists


def agent_snapshots(
    organisation_id: int | None, ids: Collection[int] | None = None
) -> list[AgentSnapshot]:
    """The organisation's agents as the proxy decides for them: all of them, or those of
    ``ids`` that exist (the policy stream reads only the agents a change named). Three
    queries, whatever the number of agents, and no entry parsed: they are stored in the
    grammar's form."""
    agents = _scoped(Agent.objects.all(), organisation_id, "organisation_id")
    if ids is not None:
        agents = agents.filter(pk__in=list(ids))
    rows = list(
        agents.values_list(
            "pk", "slug", "organisation__slug", "enabled", "allowlist", "organisation_id"
        )
    )
    chosen = [row[0] for row in rows] if ids is not None else None
    through = Agent.templates.through.objects.order_by("allowlisttemplate__slug")
    templates: dict[int, list[str]] = {}
    for agent_id, slug in _agents_of(through, organisation_id, chosen).values_list(
        "agent_id", "allowlisttemplate__slug"
    ):
        templates.setdefault(agent_id, []).append(f"template:{slug}")
    live = EgressToken.objects.filter(revoked_at__isnull=True, expires_at__gt=timezone.now())
    tokens: dict[int, list[TokenSnapshot]] = {}
    for agent_id, sha256, expires_at in _agents_of(live, organisation_id, chosen).values_list(
        "agent_id", "sha256", "expires_at"
    ):
        tokens.setdefault(agent_id, []).append(TokenSnapshot(sha256, expires_at.timestamp()))
    used_up = exhausted(organisation_id)
    return [
        AgentSnapshot(
            id=pk,
            username=username(organisation, slug),
            organisation=organisation,
            enabled=enabled,
            budget_exhausted=pk in used_up[0] or organisation_pk in used_up[1],
            lists=(base_list(organisation), *templates.get(pk, ())),
            own="\n".join(own),
            tokens=tuple(tokens.get(pk, ())),
        )
        for pk, slug, organisation, enabled, own, organisation_pk in rows
    ]


def _agents_of(queryset: Any, organisation_id: int | None, ids: list[int] | None) -> Any:
    """Rows that belong to agents: those of ``ids``, else the organisation's (else all)."""
    if ids is not None:
        return queryset.filter(agent_id__in=ids)
    return _scoped(queryset, organisation_id, "agent__organisation_id")


def built_in() -> tuple[BuiltIn, ...]:
    """Destinations every agent may reach, because the platform names them: the model gateway
    (COVEY_MODEL_GATEWAY_URL), at whatever address it has."""
    gateway = gateway_destination(settings.COVEY_MODEL_GATEWAY_URL)
    if gateway is None:
        return ()
    return (BuiltIn(host=gateway[0], port=gateway[1], name="model gateway"),)


# What record_decisions raises for events it cannot store (malformed: sending them again would
# not help); PostgreSQL's refusals (DataError) come besides, at the end of the transaction.
# Events parsed at the door (egress.protocol) have been checked already.
MALFORMED = (ValueError,)


def record_decisions(
    events: Iterable[ProxyEvent], *, proxy: str = "", organisation_id: int | None = None
) -> int:
    """Store decision events from a proxy: its start, new decisions, tunnel closes, its stop.
    Returns how many events.

    A decision carries its proxy's ``boot`` and its number there (``seq``), which keep the
    proxy's :class:`ProxySession` (a proxy of before them sends neither: no session). Agent ids
    that no longer exist (or, with ``organisation_id``, belong to another organisation) are
    kept as unidentified rows; a runner cannot write into another organisation's log.
    """
    decisions: list[DecisionEvent] = []
    closes: list[CloseEvent] = []
    starts: list[StartEvent] = []
    stops: list[StopEvent] = []
    for event in events:
        match event:
            case DecisionEvent():
                decisions.append(event)
            case CloseEvent():
                closes.append(event)
            case StartEvent():
                starts.append(event)
            case StopEvent():
                stops.append(event)
    agents = _scoped(
        Agent.objects.filter(pk__in={e.agent_id for e in decisions}),
        organisation_id,
        "organisation_id",
    )
    known = set(agents.values_list("pk", flat=True))
    name = proxy[:100]
    # A short tunnel's close usually comes in the same batch as its decision: one row.
    ended = {uuid.UUID(c.id): (c.bytes_up, c.bytes_down, _time(c.at)) for c in closes}
    made = [_row_of(e, e.agent_id if e.agent_id in known else None, name, ended) for e in decisions]
    rows = {row.id: row for row in made}
    numbered = {
        row.id: (e.boot, e.seq or 0)
        for e, row in zip(decisions, made, strict=True)
        if e.boot is not None
    }
    with transaction.atomic():
        # The sessions first, locked: a batch sent again meanwhile waits, then finds this
        # one's decisions stored and counts none twice.
        sessions = _Sessions(name, organisation_id)
        marks: list[StartEvent | StopEvent] = [*starts, *stops]
        for boot, at in sorted({(m.boot, _time(m.at)) for m in marks}):
            sessions.lock(boot, at)
        for pk, (boot, _) in sorted(numbered.items(), key=lambda item: item[1]):
            sessions.lock(boot, rows[pk].decided_at)
        for start in starts:
            sessions.started(start.boot, _time(start.at))
        # A batch sent again (its first answer was lost) finds its decisions already stored.
        new = _insert_decisions(list(rows.values()))
        for pk, (boot, seq) in numbered.items():
            sessions.decided(boot, seq, new=pk in new)
        _close_decisions([(*ended[pk], pk) for pk in ended if pk not in new], organisation_id)
        for stop in stops:
            sessions.stopped(stop.boot, stop.seq, _time(stop.at))
        sessions.save()
    return len(decisions) + len(closes) + len(starts) + len(stops)


class _DecisionRow(NamedTuple):
    """A decision's row as _insert_decisions writes it: its fields are the table's columns."""

    id: uuid.UUID
    agent_id: int | None
    username: str
    kind: str
    host: str
    port: int
    address: str | None
    allowed: bool
    reason: str
    detail: str
    decided_at: datetime
    bytes_up: int | None  # these three when the close came in the same batch
    bytes_down: int | None
    closed_at: datetime | None
    proxy: str


def _row_of(
    event: DecisionEvent,
    agent_id: int | None,
    proxy: str,
    ended: dict[uuid.UUID, tuple[int, int, datetime]],
) -> _DecisionRow:
    """A decision's row, with its close when ``ended`` holds it (the same batch brought it)."""
    pk = uuid.UUID(event.id)
    close = ended.get(pk)
    return _DecisionRow(
        id=pk,
        agent_id=agent_id,
        username=_text(event.username, 200),
        kind=event.kind.value,
        host=_text(event.host, 255),
        port=event.port,
        address=event.address or None,
        allowed=event.allowed,
        reason=_text(event.reason.value, 32),
        detail=_text(event.detail),
        decided_at=_time(event.at),
        bytes_up=close[0] if close else None,
        bytes_down=close[1] if close else None,
        closed_at=close[2] if close else None,
        proxy=proxy,
    )


_ROWS_PER_INSERT = 500  # 15 parameters a row: far below SQLite's limit of 32,766
_ADDRESS = cast("Field[Any, Any]", Decision._meta.get_field("address"))


def _adapters(db: Any) -> tuple[Callable[[Any], Any], ...]:
    """What the database takes for an id, an address and a time (aware datetimes, or None):
    its backend's own adapters, called straight (through the fields, each value cost several
    times more: a decision's row has four)."""
    ops, native_uuid = db.ops, db.features.has_native_uuid_field

    def time(value: datetime | None) -> Any:
        return None if value is None else ops.adapt_datetimefield_value(value)

    def pk(value: uuid.UUID) -> Any:
        return value if native_uuid else value.hex

    def address(value: str | None) -> Any:  # IPv6 in its one written form, as the field does
        return ops.adapt_ipaddressfield_value(_ADDRESS.get_prep_value(value))

    return pk, address, time


def _insert_decisions(rows: list[_DecisionRow]) -> set[uuid.UUID]:
    """Insert decision rows as they are, in a few multi-row statements (the ORM's bulk_create
    costs more per row than the whole statement); the ids of those that were new: a row whose
    id is stored already is left as it is (``ON CONFLICT DO NOTHING``)."""
    db = connections[DEFAULT_DB_ALIAS]
    q = db.ops.quote_name
    pk, address, time = _adapters(db)
    table, columns = q(Decision._meta.db_table), ", ".join(map(q, _DecisionRow._fields))
    row_marks = "(" + ", ".join(["%s"] * len(_DecisionRow._fields)) + ")"
    new: set[uuid.UUID] = set()
    with db.cursor() as cursor:
        for start in range(0, len(rows), _ROWS_PER_INSERT):
            chunk = rows[start : start + _ROWS_PER_INSERT]
            params: list[Any] = []
            for row in chunk:
                params.extend(
                    row._replace(
                        id=pk(row.id),
                        address=address(row.address),
                        decided_at=time(row.decided_at),
                        closed_at=time(row.closed_at),
                    )
                )
            cursor.execute(
                f"INSERT INTO {table} ({columns}) VALUES {', '.join([row_marks] * len(chunk))}"  # noqa: S608 - names quoted, values parameters
                f" ON CONFLICT ({q('id')}) DO NOTHING RETURNING {q('id')}",
                params,
            )
            new.update(
                stored if isinstance(stored, uuid.UUID) else uuid.UUID(stored)
                for (stored,) in cursor.fetchall()
            )
    return new


def _close_decisions(
    closed: list[tuple[int, int, datetime, uuid.UUID]], organisation_id: int | None
) -> None:
    """Write the bytes and the close of tunnels decided in an earlier batch: (bytes up, bytes
    down, closed at, id); with ``organisation_id``, only that organisation's agents' rows."""
    if not closed:
        return
    db = connections[DEFAULT_DB_ALIAS]
    q = db.ops.quote_name
    pk, _, time = _adapters(db)
    sql = (
        f"UPDATE {q(Decision._meta.db_table)} SET {q('bytes_up')} = %s, {q('bytes_down')} = %s,"  # noqa: S608
        f" {q('closed_at')} = %s WHERE {q('id')} = %s"
    )
    scope: list[Any] = []
    if organisation_id is not None:
        organisation = Agent._meta.get_field("organisation").column
        sql += (
            f" AND {q('agent_id')} IN (SELECT {q('id')} FROM {q(Agent._meta.db_table)}"  # noqa: S608
            f" WHERE {q(organisation)} = %s)"
        )
        scope = [organisation_id]
    params = [
        [
            up,
            down,
            time(at),
            pk(decision),
            *scope,
        ]
        for up, down, at, decision in closed
    ]
    with db.cursor() as cursor:
        cursor.executemany(sql, params)


class _Sessions:
    """The sessions one batch touches (of one proxy: an organisation's runner's, or the control
    plane's own), locked first, counted in memory and saved at the end of the transaction."""

    def __init__(self, proxy: str, organisation_id: int | None) -> None:
        self.proxy, self.organisation_id = proxy, organisation_id
        self.locked: dict[str, ProxySession | None] = {}

    def lock(self, boot: str, at: datetime) -> None:
        """Lock the boot's session, made if new (None: another proxy's, not the sender's)."""
        if boot in self.locked:
            return
        session, _ = ProxySession.objects.select_for_update().get_or_create(
            boot=boot,
            defaults={
                "proxy": self.proxy,
                "organisation_id": self.organisation_id,
                "started_at": at,
            },
        )
        mine = (session.proxy, session.organisation_id) == (self.proxy, self.organisation_id)
        self.locked[boot] = session if mine else None

    def started(self, boot: str, at: datetime) -> None:
        """The proxy started: its sessions still running ended without a word."""
        if self.locked.get(boot) is None:
            return
        owner = {"organisation_id": self.organisation_id}  # None: the control plane's (IS NULL)
        ProxySession.objects.filter(
            proxy=self.proxy, end=ProxySession.End.RUNNING, **owner
        ).exclude(boot=boot).update(end=ProxySession.End.LOST, ended_at=at)

    def decided(self, boot: str, seq: int, *, new: bool) -> None:
        if session := self.locked.get(boot):
            session.made = max(session.made, seq)
            session.recorded += new

    def stopped(self, boot: str, seq: int, at: datetime) -> None:
        if session := self.locked.get(boot):
            session.made = max(session.made, seq)
            session.end, session.ended_at = ProxySession.End.STOPPED, at

    def save(self) -> None:
        for session in self.locked.values():
            if session is not None:
                session.save()


def prune_decisions(now: datetime | None = None) -> int:
    """Delete decisions older than the retention setting; returns how many."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.COVEY_EGRESS_DECISION_RETENTION_DAYS)
    deleted, _ = Decision.objects.filter(Q(decided_at__lt=cutoff)).delete()
    # A session's counts go with its decisions (a running one, never heard to end, stays).
    ProxySession.objects.filter(ended_at__lt=cutoff).delete()
    return deleted


def _text(value: str, most: int | None = None) -> str:
    """Text from an event, as PostgreSQL keeps it: no NUL (a sandbox may put one in the user
    name of its credentials), at most ``most`` characters."""
    return value.replace("\x00", "")[:most]


def _time(at: float) -> datetime:
    """An event's time (checked by the event: a finite time a datetime can hold)."""
    return datetime.fromtimestamp(at, tz=UTC)
