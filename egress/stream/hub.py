"""The stream's state: each followed organisation's policy, kept current by change notices, and
the proxies that follow it. No Django, no aiohttp: the database is a :class:`Store`, the notices
an async iterator (egress/stream/notices.py), the proxies :class:`Follower` queues.

How it stays exact:
- notices are heard before anything is read (a change committed after a read is noticed
  after it, and read again);
- a notice names what changed (an agent, an organisation, its budgets, the shared lists, or
  everything), and only that is read; an agent read that equals what is held is no change;
- one reader applies the notices, in the order they came, and a change becomes a new generation
  that every follower gets as one delta line, in order;
- a generation names the load it belongs to (a nonce per load), so one of a load that is gone
  is never taken for current;
- the hub vouches for what it holds (a ``current`` line, a new stream) only while it is sure:
  its notices' connection answered within TRUST_SECONDS and no notice has waited longer than
  that to be read. Otherwise, and while notices cannot be heard at all, nothing is held:
  followers' streams end and new ones are refused, so that no proxy is told it is current when
  it may not be (it polls instead, and its grace rule applies as before);
- a barrier (:meth:`Hub.sync`) names the generation that holds every change committed before
  it: a notice of its own, which the database delivers after those.
"""

import asyncio
import dataclasses
import enum
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from egress.protocol import (
    AgentSnapshot,
    Current,
    PolicyDelta,
    PolicySnapshot,
    StreamLine,
    stream_line_to_json,
)

logger = logging.getLogger(__name__)

HISTORY = 64  # deltas kept per organisation, for a proxy that comes back a few changes behind
FOLLOWER_BACKLOG = 256  # lines a follower may be behind before its stream is ended
SWEEP_SECONDS = 10.0  # followers' tokens checked (and their proxies marked seen), budgets re-read
IDLE_SECONDS = 60.0  # an organisation nobody follows is dropped after this long
RETRY_SECONDS = (0.5, 1.0, 2.0, 5.0)  # hearing notices again after the connection was lost
# The hub vouches for what it holds only while the notices' connection was heard from this
# recently, and no notice has waited this long to be read: else every stream ends (a proxy's
# grace must not be kept alive by a hub that is stuck).
TRUST_SECONDS = 6.0
READ_THREADS = 2  # reads of the policy; a runner's token is looked up apart (AUTH_THREADS)
AUTH_THREADS = 2


class Heard(enum.Enum):
    """What the notices say besides changes."""

    LISTENING = "listening"  # listening (again): what is held may be behind, read it all
    STILL = "still"  # the connection answered: nothing was missed so far


class Unavailable(Exception):
    """The stream cannot be current now (it does not hear the database's notices)."""


class Unauthorized(Exception):
    """The runner token is no runner's."""


@dataclasses.dataclass(frozen=True)
class Change:
    """What a notice names. ``organisation_id`` None: every organisation's (everything, when
    the notices were lost or a template was renamed); ``agent_id`` None: every agent of the
    organisation; ``budgets``: only whose budget is used up; ``lists``: only the shared lists
    (a template's entries changed, or a template came or went)."""

    organisation_id: int | None
    agent_id: int | None = None
    budgets: bool = False
    lists: bool = False


EVERYTHING = Change(None)
LISTS = Change(None, lists=True)


@dataclasses.dataclass(frozen=True)
class Sync:
    """A barrier (``s:NONCE``): every change committed before it was announced has been noticed
    before it (notices come in the order of their commits)."""

    nonce: str


def parse_notice(payload: str) -> Change | Sync | None:
    """The change a notice's payload names (egress/migrations/0003_policy_notices.py writes
    them, and 0004_template_notices.py): ``a:ORG:AGENT``, ``o:ORG``, ``b:ORG``, ``l:*`` or ``*``;
    None for one that names no organisation (an agent's rows removed with it: the agent's own
    notice says so)."""
    kind, _, rest = payload.partition(":")
    organisation, _, agent = rest.partition(":")
    try:
        if kind == "*":
            return EVERYTHING
        if payload == "l:*":  # of no known shape to a stream of before: it reads everything
            return LISTS
        if kind == "s" and rest:
            return Sync(rest)
        if not organisation:
            return None
        if kind == "a":
            return Change(int(organisation), int(agent))
        if kind == "o":
            return Change(int(organisation))
        if kind == "b":
            return Change(int(organisation), budgets=True)
    except ValueError:
        pass
    logger.warning(
        "covey: a policy notice of no known shape: %r (everything is read again)", payload
    )
    return EVERYTHING


@dataclasses.dataclass(frozen=True)
class Runner:
    """Whose proxy follows: the runner its token proves."""

    organisation_id: int
    token_sha256: str
    name: str


class Store(Protocol):
    """What the stream reads from the database (runners/streaming.py, ``RunnersStore``)."""

    def load(self, organisation_id: int) -> PolicySnapshot:
        """The organisation's whole policy (its generation is not used)."""
        ...

    def agents(self, organisation_id: int, ids: Collection[int] | None) -> list[AgentSnapshot]:
        """Those of ``ids`` that are the organisation's agents now (None: all of them)."""
        ...

    def lists(self, organisation_id: int) -> dict[str, str]:
        """The organisation's shared lists now (its base list and every template)."""
        ...

    def used_up(self, organisation_id: int) -> set[int]:
        """The organisation's agents whose budget, or the organisation's, is used up now."""
        ...

    def runner(self, token: str) -> Runner | None:
        """The runner a runner token proves, or None."""
        ...

    def touch(self, token_hashes: Collection[str]) -> set[str]:
        """Those tokens (SHA-256) that are still runners', their proxies marked seen now."""
        ...


def encode(line: StreamLine) -> bytes:
    """One line of the stream, as sent."""
    return json.dumps(stream_line_to_json(line), separators=(",", ":")).encode() + b"\n"


class Follower:
    """One proxy's stream: the lines it has yet to be sent (None: its stream ends)."""

    def __init__(self, runner: Runner, organisation: "Organisation") -> None:
        self.runner = runner
        self.organisation = organisation
        self.lines: asyncio.Queue[bytes | None] = asyncio.Queue(FOLLOWER_BACKLOG)
        self.ended = False

    def send(self, line: bytes) -> None:
        """Queue a line; a follower too far behind is ended (it comes back with its generation,
        and is sent what it missed)."""
        if self.ended:
            return
        try:
            self.lines.put_nowait(line)
        except asyncio.QueueFull:
            logger.warning("covey: the proxy of runner %s fell behind its stream", self.runner.name)
            self.end(at_once=True)

    def end(self, *, at_once: bool = False) -> None:
        """End the stream after what is queued, or ``at_once`` (what is queued is dropped: it
        may be too far behind, or no longer true)."""
        if self.ended:
            return
        self.ended = True
        if at_once or self.lines.full():
            while not self.lines.empty():
                self.lines.get_nowait()
        self.lines.put_nowait(None)

    def current(self) -> bytes:
        """The line that says nothing changed."""
        return encode(Current(self.organisation.generation))


class Organisation:
    """One organisation's policy as its followers hold it, numbered by generation."""

    def __init__(self, organisation_id: int, snapshot: PolicySnapshot) -> None:
        self.id = organisation_id
        # Generations of this load are never another's: not another process's, nor this one's
        # after the organisation was dropped and loaded again (a proxy that held one of those
        # is sent the whole snapshot).
        self.nonce = secrets.token_hex(6)
        self.number = 0
        self.dropped = False
        self.agents: dict[int, AgentSnapshot] = {a.id: a for a in snapshot.agents}
        self.built_in = snapshot.built_in
        self.lists: dict[str, str] = dict(snapshot.lists)
        # Each generation's predecessor, and the agents and the shared lists it changed.
        self.history: deque[tuple[str, frozenset[int], frozenset[str]]] = deque(maxlen=HISTORY)
        self.followers: set[Follower] = set()
        self.idle_since: float | None = time.monotonic()
        self._snapshot: bytes | None = None

    @property
    def generation(self) -> str:
        return f"{self.nonce}.{self.number}"

    def update(
        self,
        agents: Iterable[AgentSnapshot],
        gone: Iterable[int],
        lists: dict[str, str] | None = None,
    ) -> PolicyDelta | None:
        """Take what was read (``lists``: all the shared lists, when they were read): a new
        generation when anything differs, sent to every follower as one delta; None when
        nothing does."""
        changed = tuple(a for a in agents if self.agents.get(a.id) != a)
        removed = tuple(sorted({i for i in gone if i in self.agents}))
        if lists is None:
            lists = self.lists
        new_lists = {n: entries for n, entries in lists.items() if self.lists.get(n) != entries}
        lists_removed = tuple(sorted(set(self.lists) - set(lists)))
        if not (changed or removed or new_lists or lists_removed):
            return None
        since = self.generation
        self.number += 1
        for agent in changed:
            self.agents[agent.id] = agent
        for agent_id in removed:
            del self.agents[agent_id]
        self.lists = dict(lists)
        touched = frozenset([*(a.id for a in changed), *removed])
        self.history.append((since, touched, frozenset([*new_lists, *lists_removed])))
        self._snapshot = None
        delta = PolicyDelta(since, self.generation, changed, removed, new_lists, lists_removed)
        line = encode(delta)
        for follower in tuple(self.followers):
            follower.send(line)
        return delta

    def catch_up(self, known: str | None) -> bytes:
        """What a proxy that holds generation ``known`` is sent first: that it is current, the
        agents changed since (when ``known`` is recent), or the whole snapshot."""
        if known == self.generation:
            return encode(Current(known))
        for n, (since, _, _) in enumerate(self.history):
            if since == known:
                later = list(self.history)[n:]
                touched = frozenset[int]().union(*(ids for _, ids, _ in later))
                names = frozenset[str]().union(*(names for _, _, names in later))
                return encode(
                    PolicyDelta(
                        known,
                        self.generation,
                        tuple(self.agents[i] for i in sorted(touched) if i in self.agents),
                        tuple(sorted(i for i in touched if i not in self.agents)),
                        {n: self.lists[n] for n in sorted(names) if n in self.lists},
                        tuple(sorted(n for n in names if n not in self.lists)),
                    )
                )
        if self._snapshot is None:
            agents = tuple(self.agents.values())
            snapshot = PolicySnapshot(self.generation, agents, self.built_in, self.lists)
            self._snapshot = encode(snapshot)
        return self._snapshot

    def drop(self) -> None:
        """Nobody may follow this load any more: every stream ends."""
        self.dropped = True
        for follower in tuple(self.followers):
            follower.end()
        self.followers.clear()


class Notices(Protocol):
    """Where the hub hears of changes (egress/stream/notices.py)."""

    def __call__(self) -> AsyncIterator[Change | Heard | Sync]:
        """Notices from now on: ``Heard.LISTENING`` first, then changes, barriers and
        ``Heard.STILL``; it raises when it stops hearing."""
        ...

    async def announce(self, nonce: str) -> None:
        """Have ``Sync(nonce)`` come after the notices of every change committed before."""
        ...


class Hub:
    """Every followed organisation and its followers; :meth:`run` keeps them current."""

    def __init__(
        self,
        store: Store,
        *,
        sweep: float = SWEEP_SECONDS,
        idle: float = IDLE_SECONDS,
    ) -> None:
        self.store = store
        self.sweep_seconds = sweep
        self.idle_seconds = idle
        self.listening = False
        self.organisations: dict[int, Organisation] = {}
        self._loading: dict[int, asyncio.Future[Organisation]] = {}
        self._held_back: dict[int, list[Change]] = {}  # noticed while the organisation loads
        self._pending: dict[Change, None] = {}  # in the order noticed, each once
        self._pending_since: float | None = None
        self._reading_since: float | None = None
        self._heard_at = float("-inf")
        self._barriers: list[str] = []  # heard, to be answered once what came before is read
        self._syncs: dict[str, tuple[int, asyncio.Future[str]]] = {}
        self._notices: Notices | None = None
        self._wake = asyncio.Event()
        self._reads = ThreadPoolExecutor(READ_THREADS, "covey-stream-read")
        self._auth = ThreadPoolExecutor(AUTH_THREADS, "covey-stream-auth")
        self.changes = 0  # generations made (for metrics)
        self.failed: BaseException | None = None  # what stopped run(), if anything did

    def trusted(self) -> bool:
        """Whether what is held may be vouched for now: the notices are heard, the connection
        answered within TRUST_SECONDS, and no notice has waited longer than that to be read."""
        now = time.monotonic()
        return (
            self.listening
            and now - self._heard_at <= TRUST_SECONDS
            and (self._pending_since is None or now - self._pending_since <= TRUST_SECONDS)
            and (self._reading_since is None or now - self._reading_since <= TRUST_SECONDS)
        )

    def keepalive(self, follower: "Follower") -> bytes | None:
        """The line that tells a follower nothing changed, or None when the hub cannot vouch
        for that (its stream ends)."""
        if follower.organisation.dropped or not self.trusted():
            return None
        return follower.current()

    async def _in(self, pool: ThreadPoolExecutor, call: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, call, *args)

    @property
    def followers(self) -> int:
        return sum(len(o.followers) for o in self.organisations.values())

    async def follow(self, token: str, known: str | None) -> tuple[Follower, bytes]:
        """A new follower for the runner ``token`` proves, and its first line.
        Raises Unauthorized or Unavailable."""
        if not self.trusted():
            raise Unavailable("the policy stream does not hear of the policy's changes now")
        runner = await self._in(self._auth, self.store.runner, token)
        if runner is None:
            raise Unauthorized("unknown runner token")
        organisation = await self._organisation(runner.organisation_id)
        # No await from here on: the first line and the queue are taken at one generation, of
        # an organisation still held (it may have been dropped while this one waited for it).
        if not self.trusted() or self.organisations.get(organisation.id) is not organisation:
            raise Unavailable("the policy stream lost the database meanwhile")
        follower = Follower(runner, organisation)
        organisation.followers.add(follower)
        organisation.idle_since = None
        return follower, organisation.catch_up(known)

    def unfollow(self, follower: Follower) -> None:
        """The follower's stream has ended."""
        organisation = follower.organisation
        organisation.followers.discard(follower)
        if not organisation.followers and organisation.idle_since is None:
            organisation.idle_since = time.monotonic()

    async def _organisation(self, organisation_id: int) -> Organisation:
        held = self.organisations.get(organisation_id)
        if held is not None:
            return held
        loading = self._loading.get(organisation_id)
        if loading is not None:
            return await asyncio.shield(loading)
        future: asyncio.Future[Organisation] = asyncio.get_running_loop().create_future()
        self._loading[organisation_id] = future
        self._held_back[organisation_id] = []
        try:
            snapshot = await self._in(self._reads, self.store.load, organisation_id)
            if not self.listening:  # notices were lost while it loaded
                raise Unavailable("the policy stream does not hear of the policy's changes now")
            organisation = Organisation(organisation_id, snapshot)
            self.organisations[organisation_id] = organisation
            held_back = self._held_back.pop(organisation_id, [])
            if held_back:  # noticed after the load began: read again, in order
                self._notice(held_back)
            future.set_result(organisation)
            return organisation
        except BaseException as exc:
            future.set_exception(exc if isinstance(exc, Exception) else Unavailable(str(exc)))
            future.exception()  # retrieved: nobody else may be waiting
            self._held_back.pop(organisation_id, None)
            raise
        finally:
            del self._loading[organisation_id]

    def _notice(self, changes: Iterable[Change]) -> None:
        for change in changes:
            if change.organisation_id in self._held_back:
                self._held_back[change.organisation_id].append(change)
                continue
            if change.organisation_id is None:
                for held_back in self._held_back.values():
                    held_back.append(change)
            self._pending[change] = None
        if self._pending:
            if self._pending_since is None:
                self._pending_since = time.monotonic()
            self._wake.set()

    async def run(self, notices: Notices) -> None:
        """Hear notices and apply them, sweep, and watch that all of it keeps up, until
        cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._hear(notices))
            tasks.create_task(self._apply())
            tasks.create_task(self._sweep())
            tasks.create_task(self._watch())

    async def sync(self, token: str) -> str:
        """The generation a proxy of the runner ``token`` proves must reach to hold every change
        committed before this call: what a proxy asks before it says that a token is unknown.
        Raises Unauthorized or Unavailable."""
        if not self.trusted() or self._notices is None:
            raise Unavailable("the policy stream does not hear of the policy's changes now")
        runner = await self._in(self._auth, self.store.runner, token)
        if runner is None:
            raise Unauthorized("unknown runner token")
        if runner.organisation_id not in self.organisations:
            raise Unavailable("nobody follows this organisation's policy here")
        nonce = secrets.token_hex(8)
        answered: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._syncs[nonce] = (runner.organisation_id, answered)
        try:
            await asyncio.wait_for(self._notices.announce(nonce), TRUST_SECONDS)
            return await asyncio.wait_for(answered, TRUST_SECONDS)
        except (TimeoutError, OSError) as exc:
            raise Unavailable(f"the barrier was not heard in time ({exc!r})") from None
        finally:
            self._syncs.pop(nonce, None)

    def _answer_barriers(self, barriers: Iterable[str]) -> None:
        for nonce in barriers:
            organisation_id, answered = self._syncs.get(nonce, (0, None))
            organisation = self.organisations.get(organisation_id)
            if answered is None or answered.done():
                continue
            if organisation is None:
                answered.set_exception(Unavailable("the organisation is no longer held"))
            else:
                answered.set_result(organisation.generation)

    async def _hear(self, notices: Notices) -> None:
        self._notices = notices
        failures = 0
        while True:
            try:
                async for heard in notices():
                    self._heard_at = time.monotonic()
                    if heard is Heard.LISTENING:
                        self.listening = True
                        failures = 0
                        logger.info("covey: the policy stream hears of the policy's changes")
                        self._notice([EVERYTHING])
                    elif not self.listening:  # given up on (_watch): listen anew
                        raise ConnectionError("the notices were late")
                    elif isinstance(heard, Change):
                        self._notice([heard])
                    elif isinstance(heard, Sync):  # answered once what came before is read
                        self._barriers.append(heard.nonce)
                        self._wake.set()
                raise ConnectionError("the notices ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lost(f"the database's notices are lost: {exc}", deaf=True)
                await asyncio.sleep(RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)])
                failures += 1

    def _lost(self, why: str, *, deaf: bool = False) -> None:
        """Nothing held can be trusted: end every stream and hold nothing (``deaf``: and take
        no new one until notices are heard again)."""
        if self.listening or self.organisations:
            logger.warning("covey: %s; every proxy's stream ends (they poll meanwhile)", why)
        if deaf:
            self.listening = False
        for organisation in self.organisations.values():
            organisation.drop()
        self.organisations.clear()
        self._pending.clear()
        self._pending_since = None
        barriers, self._barriers = self._barriers, []
        self._answer_barriers(barriers)  # unavailable: nothing is held

    async def _watch(self) -> None:
        """Once a second: a hub that stopped keeping up holds nothing (its proxies poll)."""
        while True:
            await asyncio.sleep(1)
            if self.listening and not self.trusted():
                self._lost(
                    "the database's notices went unanswered or unread for over"
                    f" {TRUST_SECONDS:g} s",
                    deaf=time.monotonic() - self._heard_at > TRUST_SECONDS,
                )

    async def _apply(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            changes, self._pending = list(self._pending), {}
            barriers, self._barriers = self._barriers, []
            wanted = _by_organisation(changes, set(self.organisations))
            if not wanted:
                self._pending_since = None
                self._answer_barriers(barriers)
                continue
            # Read for these very objects: one dropped and loaded again meanwhile is newer.
            targets = {i: self.organisations[i] for i in wanted}
            self._reading_since, self._pending_since = self._pending_since, None
            try:
                read = await self._in(self._reads, self._read, wanted, targets)
            except Exception as exc:
                self._lost(f"the policy could not be read: {exc}")
                self._answer_barriers(barriers)  # unavailable: nothing is held
                continue
            finally:
                self._reading_since = None
            for organisation_id, (agents, gone, lists) in read.items():
                organisation = targets[organisation_id]
                if self.organisations.get(organisation_id) is not organisation:
                    continue
                if organisation.update(agents, gone, lists) is not None:
                    self.changes += 1
            self._answer_barriers(barriers)

    def _read(
        self,
        wanted: dict[int, tuple[set[int] | None, bool, bool]],
        targets: dict[int, Organisation],
    ) -> dict[int, tuple[list[AgentSnapshot], set[int], dict[str, str] | None]]:
        """In a thread: what each organisation's changes name, as read now (its shared lists
        too, when the change is the organisation's, everything's or the lists')."""
        read = {}
        for organisation_id, (ids, budgets, lists_changed) in wanted.items():
            organisation = targets[organisation_id]
            held = set(organisation.agents)
            lists = None
            if ids is None:  # the agents and the lists they share, in one read
                whole = self.store.load(organisation_id)
                agents, lists = list(whole.agents), whole.lists
                gone = held - {a.id for a in agents}
            elif ids:
                agents = self.store.agents(organisation_id, ids)
                gone = ids - {a.id for a in agents}
            else:
                agents, gone = [], set()
            if lists is None and lists_changed:
                lists = self.store.lists(organisation_id)
            if budgets:
                fresh = {a.id for a in agents}
                used_up = self.store.used_up(organisation_id)
                agents += [
                    dataclasses.replace(agent, budget_exhausted=agent.id in used_up)
                    for agent in list(organisation.agents.values())
                    if agent.id not in fresh and agent.budget_exhausted != (agent.id in used_up)
                ]
            read[organisation_id] = (agents, gone, lists)
        return read

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_seconds)
            try:
                await self.sweep()
            except Exception as exc:
                self._lost(f"the sweep could not read the database: {exc}")

    async def sweep(self) -> None:
        """End the streams of tokens no runner holds now (and mark the others' proxies seen),
        read every organisation's budgets again (a period may have ended), and drop the
        organisations nobody has followed for a while."""
        now = time.monotonic()
        for organisation_id, organisation in list(self.organisations.items()):
            if (
                organisation.idle_since is not None
                and now - organisation.idle_since > self.idle_seconds
            ):
                del self.organisations[organisation_id]
        followers = [f for o in self.organisations.values() for f in o.followers]
        if followers:
            valid = await self._in(
                self._reads, self.store.touch, {f.runner.token_sha256 for f in followers}
            )
            for follower in followers:
                if follower.runner.token_sha256 not in valid:
                    follower.end()
                    self.unfollow(follower)
        self._notice(Change(o, budgets=True) for o in self.organisations)


def _by_organisation(
    changes: Iterable[Change], loaded: set[int]
) -> dict[int, tuple[set[int] | None, bool, bool]]:
    """Changes gathered per loaded organisation: the agent ids to read (None: all), whether
    its budgets are to be read, and whether its shared lists are."""
    wanted: dict[int, tuple[set[int] | None, bool, bool]] = {}
    for change in changes:
        targets = loaded if change.organisation_id is None else {change.organisation_id} & loaded
        for organisation_id in targets:
            ids, budgets, lists = wanted.get(organisation_id, (set(), False, False))
            if change.budgets:
                budgets = True
            elif change.lists:
                lists = True
            elif change.agent_id is None or change.organisation_id is None:
                ids = None
            elif ids is not None:
                ids.add(change.agent_id)
            wanted[organisation_id] = (ids, budgets, lists)
    return wanted
