"""The policy stream's state (egress/stream/hub.py) over an in-memory store and notices: what a
follower is sent, and when. No database, no server: tests/egress/test_stream.py runs the real
processes."""

import asyncio
import dataclasses
import json

import pytest

from allowlists.entries import Entry
from egress.policy import Policy
from egress.protocol import (
    AgentSnapshot,
    PolicyDelta,
    PolicySnapshot,
    TokenSnapshot,
    stream_line_from_json,
)
from egress.stream.hub import (
    EVERYTHING,
    FOLLOWER_BACKLOG,
    LISTS,
    Change,
    Heard,
    Hub,
    Runner,
    Sync,
    Unauthorized,
    Unavailable,
    parse_notice,
)

ACME, GLOBEX = 1, 2


def agent(agent_id, organisation=ACME, entries=("good.test",), **fields):
    return AgentSnapshot(
        id=agent_id,
        username=f"org{organisation}.agent-{agent_id}",
        organisation=f"org{organisation}",
        enabled=True,
        budget_exhausted=False,
        lists=("base:org1",),
        own="\n".join(entries),
        tokens=(TokenSnapshot(sha256=f"{agent_id:064x}", expires_at=4e9),),
        **fields,
    )


class Store:
    """The database as the hub reads it, and what it was asked."""

    def __init__(self):
        self.agents_of = {ACME: {1: agent(1), 2: agent(2)}, GLOBEX: {3: agent(3, GLOBEX)}}
        self.lists_of = {
            ACME: {"base:org1": "base.test", "template:t": "t.test"},
            GLOBEX: {"base:org2": "", "template:t": "t.test"},
        }
        self.exhausted: set[int] = set()
        self.runners = {"acme-token": Runner(ACME, "a" * 64, "edge-1")}
        self.reads: list[tuple[int, object]] = []
        self.fail = False

    def load(self, organisation_id):
        self._check()
        self.reads.append((organisation_id, "load"))
        agents = tuple(self.agents_of[organisation_id].values())
        return PolicySnapshot("ignored", agents, (), dict(self.lists_of[organisation_id]))

    def lists(self, organisation_id):
        self._check()
        self.reads.append((organisation_id, "lists"))
        return dict(self.lists_of[organisation_id])

    def agents(self, organisation_id, ids):
        self._check()
        self.reads.append((organisation_id, None if ids is None else sorted(ids)))
        held = self.agents_of[organisation_id]
        return [
            dataclasses.replace(a, budget_exhausted=a.id in self.exhausted)
            for i, a in held.items()
            if ids is None or i in ids
        ]

    def used_up(self, organisation_id):
        self._check()
        return {i for i in self.agents_of[organisation_id] if i in self.exhausted}

    def runner(self, token):
        self._check()
        return self.runners.get(token)

    def touch(self, hashes):
        self._check()
        return {r.token_sha256 for r in self.runners.values()} & set(hashes)

    def _check(self):
        if self.fail:
            raise ConnectionError("the database is away")


class Notices:
    """Notices the test sends; ``drop()`` makes the hub lose them (the connection fails)."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self):
        return self._iterate()

    async def _iterate(self):
        yield Heard.LISTENING
        while True:
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item

    def send(self, change):
        self.queue.put_nowait(change)

    async def announce(self, nonce):
        self.queue.put_nowait(Sync(nonce))

    def drop(self):
        self.queue.put_nowait(ConnectionError("lost"))


def lines(follower):
    """The lines queued for a follower, parsed (None: its stream ends)."""
    out = []
    while not follower.lines.empty():
        raw = follower.lines.get_nowait()
        out.append(None if raw is None else stream_line_from_json(json.loads(raw)))
    return out


def parsed(raw: bytes):
    return stream_line_from_json(json.loads(raw))


async def settle():
    """Let the hub's tasks and threads run (reads go to a thread)."""
    for _ in range(10):
        await asyncio.sleep(0.01)


def running(test):
    """Run ``test(hub, store, notices)`` with the hub running; stop it afterwards."""

    async def main():
        store, notices = Store(), Notices()
        hub = Hub(store, sweep=3600)
        task = asyncio.create_task(hub.run(notices))
        await settle()
        try:
            await test(hub, store, notices)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


def test_a_new_follower_gets_the_whole_snapshot_and_then_one_delta_per_change():
    async def test(hub, store, notices):
        follower, first = await hub.follow("acme-token", None)
        snapshot = parsed(first)
        assert isinstance(snapshot, PolicySnapshot)
        assert sorted(a.id for a in snapshot.agents) == [1, 2]  # Acme's only

        store.agents_of[ACME][2] = agent(2, entries=("good.test", "new.test"))
        notices.send(Change(ACME, 2))
        await settle()
        (delta,) = lines(follower)
        assert isinstance(delta, PolicyDelta)
        assert delta.since == snapshot.generation
        assert [a.id for a in delta.agents] == [2] and delta.removed == ()
        assert delta.agents[0].own == "good.test\nnew.test"
        # Only the agent the notice named was read.
        assert store.reads[-1] == (ACME, [2])
        # What the proxy holds is what the hub holds.
        policy = Policy.from_snapshot(snapshot).apply(delta)
        assert policy.generation == follower.organisation.generation
        assert set(policy.agents) == {1, 2}

    running(test)


def test_a_notice_that_changes_nothing_makes_no_generation():
    async def test(hub, store, notices):
        follower, first = await hub.follow("acme-token", None)
        notices.send(Change(ACME, 1))
        notices.send(Change(GLOBEX, 3))  # nobody follows Globex: not even read
        await settle()
        assert lines(follower) == []
        assert follower.organisation.generation == parsed(first).generation
        assert all(organisation == ACME for organisation, _ in store.reads)

    running(test)


def test_agents_gone_are_named_in_the_delta():
    async def test(hub, store, notices):
        follower, _ = await hub.follow("acme-token", None)
        del store.agents_of[ACME][1]
        notices.send(Change(ACME, 1))
        await settle()
        (delta,) = lines(follower)
        assert delta.agents == () and delta.removed == (1,)
        # A whole organisation read again finds it gone too, once.
        notices.send(Change(ACME))
        await settle()
        assert lines(follower) == []

    running(test)


def test_a_budget_used_up_flips_the_flag_without_reading_the_agents():
    async def test(hub, store, notices):
        follower, _ = await hub.follow("acme-token", None)
        reads = len(store.reads)
        store.exhausted = {2}
        notices.send(Change(ACME, budgets=True))
        await settle()
        (delta,) = lines(follower)
        assert [(a.id, a.budget_exhausted) for a in delta.agents] == [(2, True)]
        assert store.reads[reads:] == []  # used_up only

    running(test)


def test_a_shared_list_changed_is_sent_alone_and_reaches_every_agent_that_has_it():
    async def test(hub, store, notices):
        follower, first = await hub.follow("acme-token", None)
        snapshot = parsed(first)
        assert snapshot.lists == store.lists_of[ACME]
        store.lists_of[ACME] = {"base:org1": "base.test\nmirror.test"}  # a template gone
        notices.send(EVERYTHING)
        await settle()
        (delta,) = lines(follower)
        assert (delta.agents, delta.removed) == ((), ())  # no agent changed: none is sent
        assert delta.lists == {"base:org1": "base.test\nmirror.test"}
        assert delta.lists_removed == ("template:t",)
        policy = Policy.from_snapshot(snapshot).apply(delta)
        assert policy.agents[1].sources(Entry("mirror.test")) == ("base",)
        # One that comes back from before the change is sent the lists too.
        hub.unfollow(follower)
        _, again = await hub.follow("acme-token", snapshot.generation)
        caught_up = parsed(again)
        assert (caught_up.lists, caught_up.lists_removed) == (delta.lists, delta.lists_removed)

    running(test)


def test_a_templates_notice_reads_the_shared_lists_alone_not_every_agent():
    async def test(hub, store, notices):
        follower, _ = await hub.follow("acme-token", None)
        reads = len(store.reads)
        store.lists_of[ACME] = {"base:org1": "base.test", "template:t": "t.test\nu.test"}
        store.agents_of[ACME][2] = agent(2, entries=("other.test",))
        notices.send(LISTS)
        await settle()
        (delta,) = lines(follower)
        assert store.reads[reads:] == [(ACME, "lists")]  # no agent read: none is sent
        assert (delta.agents, delta.lists) == ((), {"template:t": "t.test\nu.test"})
        # With an agent's own notice in the same round: that agent, and the lists.
        store.lists_of[ACME] = {"base:org1": "base.test"}
        notices.send(LISTS)
        notices.send(Change(ACME, 2))
        await settle()
        (delta,) = lines(follower)
        assert store.reads[-2:] == [(ACME, [2]), (ACME, "lists")]
        assert [a.id for a in delta.agents] == [2]
        assert delta.lists_removed == ("template:t",)

    running(test)


def test_a_follower_that_comes_back_gets_what_it_missed_or_that_it_is_current():
    async def test(hub, store, notices):
        follower, first = await hub.follow("acme-token", None)
        start = parsed(first).generation
        for entries in (("a.test",), ("b.test",)):
            store.agents_of[ACME][1] = agent(1, entries=entries)
            notices.send(Change(ACME, 1))
            await settle()
        hub.unfollow(follower)
        _, again = await hub.follow("acme-token", start)
        caught_up = parsed(again)
        assert isinstance(caught_up, PolicyDelta)
        assert caught_up.since == start and [a.id for a in caught_up.agents] == [1]
        assert caught_up.agents[0].own == "b.test"
        _, current = await hub.follow("acme-token", caught_up.generation)
        assert parsed(current).to_json() == {"generation": caught_up.generation}
        # A generation the hub never made (a polled one, another process's): the snapshot.
        _, unknown = await hub.follow("acme-token", "0123abcd")
        assert isinstance(parsed(unknown), PolicySnapshot)

    running(test)


def test_an_unknown_token_is_refused_and_so_is_everyone_while_notices_are_lost():
    async def test(hub, store, notices):
        with pytest.raises(Unauthorized):
            await hub.follow("no-such-token", None)
        follower, _ = await hub.follow("acme-token", None)
        notices.drop()
        await settle()
        assert lines(follower) == [None]  # its stream ends: the proxy polls
        assert not hub.organisations
        with pytest.raises(Unavailable):
            await hub.follow("acme-token", None)

    async def main():
        store, notices = Store(), Notices()
        hub = Hub(store, sweep=3600)
        task = asyncio.create_task(hub.run(notices))
        await settle()
        await test(hub, store, notices)
        # Heard again (after the retry's pause): changes made meanwhile are in what it loads.
        store.agents_of[ACME][1] = agent(1, entries=("while-away.test",))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if hub.listening:
                break
        _, first = await hub.follow("acme-token", None)
        (one,) = [a for a in parsed(first).agents if a.id == 1]
        assert one.own == "while-away.test"
        task.cancel()

    asyncio.run(main())


def test_a_database_that_fails_a_read_ends_every_stream():
    async def test(hub, store, notices):
        follower, _ = await hub.follow("acme-token", None)
        store.fail = True
        notices.send(Change(ACME, 1))
        await settle()
        assert lines(follower) == [None]
        store.fail = False
        _, first = await hub.follow("acme-token", None)  # still hearing: loaded anew
        assert isinstance(parsed(first), PolicySnapshot)

    running(test)


def test_changes_noticed_while_an_organisation_loads_are_read_after_it():
    class SlowStore(Store):
        def load(self, organisation_id):
            snapshot = super().load(organisation_id)
            self.loaded.set()
            self.go.wait(5)
            return snapshot

    async def main():
        import threading

        store, notices = SlowStore(), Notices()
        store.loaded, store.go = threading.Event(), threading.Event()
        hub = Hub(store, sweep=3600)
        task = asyncio.create_task(hub.run(notices))
        await settle()
        following = asyncio.create_task(hub.follow("acme-token", None))
        await asyncio.to_thread(store.loaded.wait, 5)
        # Changed after the load read: noticed while it is still loading.
        store.agents_of[ACME][2] = agent(2, entries=("later.test",))
        notices.send(Change(ACME, 2))
        await settle()
        store.go.set()
        follower, first = await following
        await settle()
        (delta,) = lines(follower)
        assert delta.since == parsed(first).generation
        assert delta.agents[0].own == "later.test"
        task.cancel()

    asyncio.run(main())


def test_the_sweep_ends_streams_of_tokens_no_runner_holds_and_drops_idle_organisations():
    async def test(hub, store, notices):
        follower, _ = await hub.follow("acme-token", None)
        del store.runners["acme-token"]  # its token renewed, or the runner removed
        await hub.sweep()
        assert lines(follower) == [None]
        hub.idle_seconds = 0
        await asyncio.sleep(0.01)
        await hub.sweep()
        assert not hub.organisations

    running(test)


def test_a_follower_too_far_behind_is_ended():
    async def test(hub, store, notices):
        follower, _ = await hub.follow("acme-token", None)
        for n in range(FOLLOWER_BACKLOG + 1):
            store.agents_of[ACME][1] = agent(1, entries=(f"n{n}.test",))
            follower.organisation.update([store.agents_of[ACME][1]], [])
        assert follower.ended
        assert lines(follower)[-1] is None

    running(test)


@pytest.mark.parametrize(
    ("payload", "change"),
    [
        ("a:1:7", Change(1, 7)),
        ("o:1", Change(1)),
        ("b:1", Change(1, budgets=True)),
        ("*", EVERYTHING),
        ("l:*", LISTS),
        ("l:1", EVERYTHING),  # of no known shape
        ("a::7", None),  # the agent's rows went with it: its own notice says so
        ("b:", None),
        ("x:1", EVERYTHING),  # of no known shape: read everything again
        ("a:one:7", EVERYTHING),
    ],
)
def test_notices_are_read_as_the_triggers_write_them(payload, change):
    assert parse_notice(payload) == change


def test_an_organisation_loaded_again_never_reuses_a_generation():
    async def test(hub, store, notices):
        _, first = await hub.follow("acme-token", None)
        before = parsed(first).generation
        store.fail = True
        notices.send(Change(ACME, 1))  # its read fails: nothing is held any more
        await settle()
        store.fail = False
        store.agents_of[ACME][1] = dataclasses.replace(agent(1), enabled=False)
        # A proxy that held the old load's generation is sent the whole new snapshot, never
        # told it is current.
        _, again = await hub.follow("acme-token", before)
        snapshot = parsed(again)
        assert isinstance(snapshot, PolicySnapshot) and snapshot.generation != before
        assert not next(a for a in snapshot.agents if a.id == 1).enabled

    running(test)


def test_a_hub_that_stops_hearing_or_reading_vouches_for_nothing(monkeypatch):
    import egress.stream.hub as hub_module

    monkeypatch.setattr(hub_module, "TRUST_SECONDS", 0.3)

    async def test(hub, store, notices):
        follower, _ = await hub.follow("acme-token", None)
        assert hub.keepalive(follower) is not None
        await asyncio.sleep(0.4)  # the notices' connection said nothing for too long
        assert hub.keepalive(follower) is None
        with pytest.raises(Unavailable):
            await hub.follow("acme-token", None)
        for _ in range(30):  # the watch gives everything up within a second or so
            await asyncio.sleep(0.1)
            if not hub.organisations:
                break
        assert not hub.organisations and lines(follower)[-1] is None

    running(test)


def test_the_barrier_names_a_generation_that_holds_every_change_noticed_before_it():
    async def test(hub, store, notices):
        follower, first = await hub.follow("acme-token", None)
        store.agents_of[ACME][2] = agent(2, entries=("new.test",))
        notices.send(Change(ACME, 2))  # committed before the barrier is asked
        generation = await hub.sync("acme-token")
        (delta,) = lines(follower)
        assert delta.generation == generation != parsed(first).generation
        # Nothing changed since: the barrier names the generation held.
        assert await hub.sync("acme-token") == generation
        with pytest.raises(Unauthorized):
            await hub.sync("no-such-token")

    running(test)
