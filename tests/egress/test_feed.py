"""The proxy's policy feed asked at once for an unknown token (egress/proxy/feed.py,
refresh_soon) and the bounds on such look-ups (egress/proxy/lookups.py): no database, no proxy
process."""

import queue
import re
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from egress.policy import Code
from egress.protocol import (
    AgentSnapshot,
    CloseEvent,
    ConnectionKind,
    Current,
    DecisionEvent,
    PolicyDelta,
    PolicySnapshot,
    ProxyEvent,
    TokenSnapshot,
)
from egress.proxy.config import ProxyConfig
from egress.proxy.feed import DecisionLog, PolicyFeed, Refused
from egress.proxy.lookups import LookUp, TokenLookups
from egress.proxy.server import ProxyError, serve


def snapshot(generation: str) -> PolicySnapshot:
    return PolicySnapshot(generation=generation, agents=())


def decision(host: str) -> DecisionEvent:
    """A decision event as the addon makes one (what it decided does not matter here)."""
    return DecisionEvent(
        id=str(uuid.uuid4()), kind=ConnectionKind.CONNECT, host=host, port=443, allowed=True,
        reason=Code.ALLOWED, at=time.time(),
    )  # fmt: skip


def as_json(events: list[ProxyEvent]) -> list[dict]:
    """Events as they go on the wire, for what the tests look at."""
    return [event.to_json() for event in events]


class CountingSource:
    """A policy source that counts its asks and can be held up."""

    def __init__(self, delay: float = 0.0) -> None:
        self.asks = 0
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, known):
        time.sleep(self.delay)
        with self.lock:
            self.asks += 1
            return snapshot(str(self.asks))


def refresh_now(feed: PolicyFeed, timeout: float) -> bool:
    """What a look-up does: ask for a round and wait for it (False: none ended in time)."""
    try:
        return feed.refresh_soon().result(timeout)
    except FutureTimeout:
        return False


def started(source, poll: float = 60.0) -> PolicyFeed:
    feed = PolicyFeed(source, poll=poll, grace=120)
    feed.start()
    assert feed.wait_ready(5)
    return feed


class CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_a_feed_without_a_stream_sleeps_until_its_next_poll():
    """A proxy that reads the database (no stream) once spun between its polls: its wait for
    a time to try a stream was always past, and it used a core while idle."""
    source = CountingSource()
    feed = PolicyFeed(source, poll=0.2, grace=120)
    feed._wake = CountingEvent()
    feed.start()
    try:
        assert feed.wait_ready(5)
        time.sleep(1.0)
        assert 3 <= source.asks <= 8
        assert feed._wake.waits <= 3 * source.asks, feed._wake.waits
    finally:
        feed.stop()


def test_refresh_soon_asks_the_source_at_once_not_at_the_next_poll():
    source = CountingSource()
    feed = started(source)
    try:
        assert source.asks == 1
        began = time.monotonic()
        assert refresh_now(feed, timeout=2)
        assert time.monotonic() - began < 1  # the poll is a minute
        assert source.asks == 2
        assert feed.current().generation == "2"
    finally:
        feed.stop()


def test_callers_that_come_together_share_one_ask():
    source = CountingSource(delay=0.2)
    feed = started(source)
    try:
        before = source.asks
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(refresh_now(feed, timeout=5)))
            for _ in range(20)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [True] * 20
        # One ask may have been running when the first came; all share the next one.
        assert source.asks - before <= 2
    finally:
        feed.stop()


def test_a_refresh_that_started_before_the_ask_does_not_count():
    """A token issued while a refresh runs may be missing from it: wait for the next."""
    gate = threading.Event()
    asks = []

    def source(known):
        asks.append(time.monotonic())
        if len(asks) == 2:
            gate.wait(5)  # the second refresh is running when refresh_now is called
        return snapshot(str(len(asks)))

    feed = started(source, poll=0.01)
    try:
        while len(asks) < 2:
            time.sleep(0.01)
        done = []
        waiter = threading.Thread(target=lambda: done.append(refresh_now(feed, timeout=5)))
        waiter.start()
        time.sleep(0.2)
        assert not done  # the running refresh started before the ask
        gate.set()
        waiter.join()
        assert done == [True]
        assert len(asks) >= 3
    finally:
        gate.set()
        feed.stop()


def test_a_source_that_hangs_is_waited_for_only_so_long():
    gate = threading.Event()
    calls = []

    def source(known):
        calls.append(1)
        if len(calls) > 1:
            gate.wait(5)
        return snapshot("1")

    feed = started(source)
    try:
        began = time.monotonic()
        assert not refresh_now(feed, timeout=0.3)
        assert time.monotonic() - began < 1
    finally:
        gate.set()
        feed.stop()


SECRET = "A" * 43  # the shape of a token covey issues


def test_a_failed_round_says_so_and_is_not_a_no():
    calls = []

    def source(known):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("the control plane is restarting")
        return snapshot("1")

    feed = started(source)
    try:
        assert refresh_now(feed, timeout=2) is False
    finally:
        feed.stop()


def test_an_unknown_token_is_looked_up_once_and_a_client_only_so_often():
    now = [0.0]
    lookups = TokenLookups(per_client=3, window=10, remember=60, clock=lambda: now[0])

    def miss(token, client):
        assert lookups.begin(SECRET, token, client)
        lookups.end(token, client, found=False)

    miss("t1", "10.0.0.5")
    assert not lookups.begin(SECRET, "t1", "10.0.0.5")  # the same token: the source said no
    assert not lookups.begin(SECRET, "t1", "10.0.0.6")  # from anywhere
    miss("t2", "10.0.0.5")
    miss("t3", "10.0.0.5")
    assert not lookups.begin(SECRET, "t4", "10.0.0.5")  # three misses in ten seconds
    assert lookups.begin(SECRET, "t4", "10.0.0.6")  # another client has its own count
    now[0] = 11.0
    assert lookups.begin(SECRET, "t5", "10.0.0.5")  # the window moved on
    assert not lookups.begin(SECRET, "t1", "10.0.0.7")
    now[0] = 61.0
    assert lookups.begin(SECRET, "t1", "10.0.0.7")  # remembered for a minute only
    assert lookups.refused == 4


def test_look_ups_that_find_their_token_cost_the_client_nothing():
    """Many sandboxes behind one address (a NAT, a shared host) each start with a new token."""
    lookups = TokenLookups(per_client=3, window=10, clock=lambda: 0.0)
    for n in range(50):
        assert lookups.begin(SECRET, f"real{n}", "10.0.0.5")
        lookups.end(f"real{n}", "10.0.0.5", found=True)


def test_a_look_up_that_got_no_answer_is_held_against_nobody():
    lookups = TokenLookups(per_client=1, clock=lambda: 0.0)
    assert lookups.begin(SECRET, "t1", "c")
    lookups.end("t1", "c", found=None)
    assert lookups.begin(SECRET, "t1", "c")


def test_look_ups_in_flight_are_bounded_per_client_and_in_all():
    now = [0.0]
    lookups = TokenLookups(per_client=3, max_in_flight=5, stale=10, clock=lambda: now[0])
    assert [lookups.begin(SECRET, f"a{n}", "a") for n in range(4)] == [True] * 3 + [False]
    assert [lookups.begin(SECRET, f"b{n}", "b") for n in range(3)] == [True, True, False]
    assert lookups.in_flight == 5
    lookups.end("a0", "a", found=True)
    assert lookups.begin(SECRET, "c0", "c")
    now[0] = 10.0  # slots a caller never ended are free again
    assert lookups.in_flight == 0
    assert lookups.begin(SECRET, "a9", "a")


@pytest.mark.parametrize("secret", ["", "short", "A" * 42, "A" * 44, "A" * 42 + "!", "é" * 43])
def test_a_secret_that_covey_never_issues_is_not_looked_up(secret):
    assert not TokenLookups().begin(secret, "t", "c")


def test_what_is_remembered_is_bounded():
    lookups = TokenLookups(per_client=10**6, max_entries=100, clock=lambda: 0.0)
    for n in range(1000):
        assert lookups.begin(SECRET, f"t{n}", f"client{n}")
        lookups.end(f"t{n}", f"client{n}", found=False)
    assert len(lookups._missed) == 100 and len(lookups._clients) == 100
    assert lookups.begin(SECRET, "t0", "client0")  # forgotten, so asked again


def test_a_look_up_that_gives_up_leaves_the_round_and_the_polling_thread_alone(monkeypatch):
    """A look-up waits LOOKUP_SECONDS at most; the round it shares with others goes on, and
    the polling thread, which completes it, keeps polling."""
    import asyncio

    from egress.proxy import addon
    from egress.proxy.feed import DecisionLog

    monkeypatch.setattr(addon, "LOOKUP_SECONDS", 0.05)
    source = CountingSource(delay=0.3)
    feed = started(source)
    egress = addon.CoveyEgress(feed, DecisionLog(lambda events: None))
    try:
        assert egress.lookups.begin(SECRET, "t1", "c")
        asyncio.run(egress._look_up(LookUp("t1", "c")))  # gives up after 0.05 s
        time.sleep(0.5)  # the round it gave up on ends meanwhile
        assert feed._thread.is_alive()
        assert refresh_now(feed, timeout=2) is True
    finally:
        feed.stop()


def test_the_decision_log_numbers_decisions_between_its_start_and_its_stop():
    written: list[dict] = []
    log = DecisionLog(lambda events: written.extend(as_json(events)), interval=3600)
    log.start()
    assert [e["event"] for e in written] == ["start"]  # at once, before any batch
    for host in ("a.test", "b.test"):
        log.add(decision(host))
    log.add(CloseEvent(id=str(uuid.uuid4()), bytes_up=0, bytes_down=0, at=time.time()))
    log.stop()
    assert [(e["event"], e.get("seq")) for e in written] == [
        ("start", None), ("decision", 1), ("decision", 2), ("close", None), ("stop", 2),
    ]  # fmt: skip
    assert {e.get("boot") for e in written if e["event"] != "close"} == {log.boot}


def test_decision_ids_are_uuid4s_unique_within_a_log_and_apart_between_logs():
    first, second = DecisionLog(lambda events: None), DecisionLog(lambda events: None)
    texts = [first.new_id() for _ in range(1000)]
    ids = [uuid.UUID(text) for text in texts]
    assert [str(i) for i in ids] == texts  # written as a UUID writes itself
    assert len(set(ids)) == 1000
    assert {(i.version, i.variant) for i in ids} == {(4, uuid.RFC_4122)}
    assert ids[0].int >> 64 != uuid.UUID(second.new_id()).int >> 64  # 60 random bits each


def test_a_log_that_cannot_write_everything_never_says_it_stopped():
    written: list[dict] = []

    def sink(sent: list[ProxyEvent]) -> None:
        events = as_json(sent)
        if any(e["event"] == "decision" for e in events):
            raise OSError("the control plane is gone")
        written.extend(events)

    log = DecisionLog(sink, interval=3600)
    log.start()
    log.add(decision("a.test"))
    log.stop()  # the decision is not written: no stop, so the gap is admitted at the next start
    assert [e["event"] for e in written] == ["start"]
    assert log.waiting == 1


def test_a_control_plane_of_before_sessions_refuses_the_marks_and_gets_the_decisions():
    written: list[dict] = []

    def old_control_plane(sent: list[ProxyEvent]) -> None:  # as record_decisions was: 400
        events = as_json(sent)  # a start or stop has no kind
        if any("kind" not in e for e in events):
            raise Refused("400 malformed event: KeyError('kind')")
        written.extend(events)

    log = DecisionLog(old_control_plane, interval=3600)
    log.start()
    log.add(decision("a.test"))
    log.flush()  # not held up behind a start the control plane will never take
    log.stop()
    assert [(e["host"], e["seq"]) for e in written] == [("a.test", 1)]
    assert (log.waiting, log.dropped) == (0, 0)


def test_only_the_events_refused_for_good_are_dropped_and_the_rest_written():
    written: list[dict] = []
    asked = [0]

    def sink(sent: list[ProxyEvent]) -> None:
        events = as_json(sent)
        asked[0] += 1
        if any(e.get("host") == "bad" for e in events):
            raise Refused("400 malformed")
        written.extend(events)

    log = DecisionLog(sink, interval=3600)
    log.start()
    hosts = [f"h{n}" for n in range(64)]
    hosts[37] = "bad"
    for host in hosts:
        log.add(decision(host))
    log.flush()
    log.stop()
    assert [e["host"] for e in written if e["event"] == "decision"] == [
        h for h in hosts if h != "bad"
    ]  # the others, in order
    assert log.dropped == 1 and written[-1]["seq"] == 64  # the control plane admits no. 38
    assert asked[0] <= 2 + 2 * 6 + 1  # start, halving 64 down to one, stop


def test_a_failure_while_halving_puts_back_what_was_not_written():
    written: list[dict] = []
    up = [True]

    def sink(sent: list[ProxyEvent]) -> None:
        events = as_json(sent)
        if any(e.get("host") == "bad" for e in events):
            up[0] = False  # and then the control plane goes away
            raise Refused("400 malformed")
        if not up[0]:
            raise OSError("gone")
        written.extend(events)

    log = DecisionLog(sink, interval=3600)
    for host in ("a", "b", "bad", "c"):
        log.add(decision(host))
    with pytest.raises(OSError):
        log.flush()
    assert log.waiting == 4 and [e["event"] for e in written] == ["start"]
    assert log.dropped == 0  # nothing lost: all of it is tried again


def test_a_start_not_written_yet_is_owed_even_when_the_buffer_overflows():
    written: list[dict] = []
    up = False

    def sink(sent: list[ProxyEvent]) -> None:
        events = as_json(sent)
        if not up:
            raise OSError("the control plane is not there yet")
        written.extend(events)

    log = DecisionLog(sink, interval=3600, max_buffer=2)
    log.start()
    for host in ("a", "b", "c"):
        log.add(decision(host))
    up = True
    log.stop()
    assert [(e["event"], e.get("seq")) for e in written] == [
        ("start", None), ("decision", 2), ("decision", 3), ("stop", 3),
    ]  # fmt: skip
    assert log.dropped == 1


# --- following a stream of changes (egress/stream/ on the control plane's side) ---------------


def agent_snapshot(agent_id: int, host: str, token: str) -> AgentSnapshot:
    return AgentSnapshot(
        id=agent_id, username=f"acme.a{agent_id}", organisation="acme", enabled=True,
        budget_exhausted=False, lists=(), own=host,
        tokens=(TokenSnapshot(sha256=token, expires_at=4e9),),
    )  # fmt: skip


class FakeStream:
    """A stream the test writes lines to; ``fail()`` ends it with an error; a stream that is
    away (``away``) raises at once, as a refused connection does."""

    def __init__(self) -> None:
        self.lines: queue.Queue = queue.Queue()
        self.follows: list[str | None] = []
        self.away = False
        self.interrupted = threading.Event()

    def follow(self, known):
        self.follows.append(known)
        if self.away:
            raise OSError("connection refused")
        return self._lines()

    def _lines(self):
        while True:
            line = self.lines.get()
            if isinstance(line, Exception):
                raise line
            yield line

    barrier: str | None = None  # what sync() answers (None: it fails)
    synced = 0

    def sync(self) -> str:
        self.synced += 1
        if self.barrier is None:
            raise OSError("the barrier did not answer")
        return self.barrier

    def interrupt(self) -> None:
        self.interrupted.set()
        self.lines.put(OSError("interrupted"))

    def fail(self) -> None:
        self.lines.put(OSError("the stream broke"))


def eventually(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "never"
        time.sleep(0.005)


def test_a_feed_follows_the_stream_the_source_names_and_polls_no_more():
    source, stream = CountingSource(), FakeStream()
    feed = PolicyFeed(source, poll=0.05, grace=120, stream=stream)
    feed.start()
    try:
        eventually(lambda: feed.streaming)
        assert stream.follows == ["1"]  # what the first poll gave it
        asks = source.asks
        stream.lines.put(PolicySnapshot("s.0", (agent_snapshot(1, "a.test", "t1"),)))
        eventually(lambda: feed.current().generation == "s.0")
        stream.lines.put(
            PolicyDelta("s.0", "s.1", (agent_snapshot(2, "b.test", "t2"),), removed=(1,))
        )
        eventually(lambda: feed.current().generation == "s.1")
        policy = feed.current()
        assert set(policy.agents) == {2} and set(policy.tokens) == {"t2"}
        time.sleep(0.3)  # six polls' worth: none is made while the stream is followed
        assert source.asks == asks
        # A look-up asks the stream's barrier, not the source, and waits until the policy
        # holds the generation the barrier names.
        stream.barrier = "s.2"
        waiting = feed.refresh_soon()
        eventually(lambda: stream.synced == 1)
        time.sleep(0.1)
        assert not waiting.done()
        stream.lines.put(Current("s.1"))  # not yet
        time.sleep(0.1)
        assert not waiting.done()
        stream.lines.put(PolicyDelta("s.1", "s.2", (agent_snapshot(3, "c.test", "t3"),)))
        assert waiting.result(2) is True
        assert "t3" in feed.current().tokens
        assert source.asks == asks
        # One the policy holds already is answered at once; a barrier that fails is no answer.
        stream.barrier = "s.1"
        assert feed.refresh_soon().result(2) is True
        stream.barrier = None
        assert feed.refresh_soon().result(2) is False
    finally:
        feed.stop()
    assert stream.interrupted.is_set()  # stopping ended the follow in progress


def test_a_feed_polls_at_once_when_the_stream_fails_and_tries_it_again_later():
    source, stream = CountingSource(), FakeStream()
    feed = PolicyFeed(source, poll=30, grace=120, stream=stream, stream_retry=0.3)
    feed.start()
    try:
        eventually(lambda: feed.streaming)
        stream.lines.put(PolicySnapshot("s.0", ()))
        eventually(lambda: feed.current().generation == "s.0")
        asks = source.asks
        stream.away = True
        stream.fail()
        eventually(lambda: source.asks == asks + 1)  # at once, though the poll is 30 s
        assert feed.current().generation == str(asks + 1)
        eventually(lambda: len(stream.follows) >= 3)  # tried again, every 0.3 s
        stream.away = False
        eventually(lambda: feed.streaming)
        assert source.asks == asks + 1  # the poll stays at 30 s meanwhile
    finally:
        feed.stop()


def test_a_line_that_does_not_follow_what_the_feed_holds_drops_the_stream():
    source, stream = CountingSource(), FakeStream()
    feed = PolicyFeed(source, poll=30, grace=120, stream=stream, stream_retry=30)
    feed.start()
    try:
        eventually(lambda: feed.streaming)
        asks = source.asks
        stream.lines.put(PolicyDelta("not-this", "s.9", ()))
        eventually(lambda: not feed.streaming)
        eventually(lambda: source.asks == asks + 1)  # polled instead
        assert feed.current().generation == str(asks + 1)
    finally:
        feed.stop()


def test_each_line_of_the_stream_keeps_the_policy_trusted():
    now = [0.0]
    source, stream = CountingSource(), FakeStream()
    feed = PolicyFeed(source, poll=30, grace=10, stream=stream, clock=lambda: now[0])
    feed.start()
    try:
        eventually(lambda: feed.streaming)
        stream.lines.put(PolicySnapshot("s.0", ()))
        eventually(lambda: feed.current() is not None and feed.current().generation == "s.0")
        now[0] = 9.0
        stream.lines.put(Current("s.0"))
        eventually(lambda: feed.age() == 0.0)
        now[0] = 18.0  # 9 s after the last line: trusted
        assert feed.current() is not None
        now[0] = 19.5
        assert feed.current() is None  # no line for longer than the grace: refuse all
    finally:
        feed.stop()


def test_a_grace_too_short_for_the_streams_keepalive_polls_instead(caplog):
    source, stream = CountingSource(), FakeStream()
    feed = PolicyFeed(source, poll=0.05, grace=9, stream=stream)
    feed.start()
    try:
        eventually(lambda: source.asks >= 3)
        assert stream.follows == []
    finally:
        feed.stop()
    assert "shorter than twice the policy stream's keepalive" in caplog.text


@pytest.mark.parametrize(("poll", "grace"), [(60, 15), (15, 15), (10, 15)])
def test_a_proxy_that_would_poll_less_often_than_it_trusts_its_policy_does_not_start(poll, grace):
    """It would refuse every connection whenever its policy is older than the grace before
    the next poll's answer: it says so, and does not start (make run's proxy is the
    command's, whose system check says the same)."""
    config = ProxyConfig(poll=poll, grace=grace)
    refused: list[str] = []

    def start() -> None:
        try:
            serve(config, "127.0.0.1:9", "t", lambda known: None, lambda events: None, where="",
                  say=print)  # fmt: skip
        except ProxyError as exc:
            refused.append(str(exc))

    thread = threading.Thread(target=start, daemon=True)  # a proxy that starts fails, not hangs
    thread.start()
    thread.join(10)
    said = rf"GRACE \({grace} s\) is shorter than twice COVEY_EGRESS_POLICY_POLL \({poll} s\)"
    assert len(refused) == 1 and re.search(said, refused[0]), refused
