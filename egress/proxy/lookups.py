"""Bounds on the look-ups a proxy makes for tokens it has not seen (no Django, no mitmproxy).

A run's egress token is issued moments before its sandbox's first request, so a proxy that
has not polled since asks its policy source once before it answers 407. Those look-ups must not
let a sandbox hammer the control plane or crowd out other agents' new runs:

- a token must look like one covey issues (``secrets.token_urlsafe(32)``), or it is refused;
- a token the source did not know when asked was never handed out: not asked about for
  ``remember`` seconds;
- a client (its address) may have ``per_client`` look-ups that found nothing, or are in
  flight, per ``window`` seconds; look-ups that find their token cost it nothing, so sandboxes
  behind one address never lose a real credential to the bound;
- at most ``max_in_flight`` look-ups wait at once, whoever asks. A look-up counts as in
  flight until it ends or ``stale`` seconds have passed (a caller that never ended one cannot
  hold its slot for ever).

Look-ups in flight together share one ask of the source (PolicyFeed.refresh_soon).
"""

import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

TOKEN_SHAPE = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(32)


@dataclass(frozen=True)
class LookUp:
    """The credential's token is not in the policy: ask the policy source once, then decide
    again (a run's token is issued moments before its sandbox's first request). Its slot in
    :class:`TokenLookups` is held until the look-up ends (the addon's ``_look_up``)."""

    token_hash: str
    client: str


class TokenLookups:
    """Who may have an unknown token looked up now; see the module's docstring."""

    def __init__(
        self,
        *,
        per_client: int = 10,
        window: float = 10.0,
        remember: float = 60.0,
        max_in_flight: int = 256,
        stale: float = 10.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._per_client, self._window, self._remember = per_client, window, remember
        self._max_in_flight, self._stale = max_in_flight, stale
        self._max_entries, self._clock = max_entries, clock
        self._missed: OrderedDict[str, float] = OrderedDict()  # token hash -> when
        # client -> when its look-ups missed (recent ones), oldest client first
        self._clients: OrderedDict[str, deque[float]] = OrderedDict()
        self._in_flight: dict[str, deque[float]] = {}  # client -> when its waiting ones began
        self._all_in_flight: deque[float] = deque()
        self.refused = 0

    @property
    def in_flight(self) -> int:
        """Look-ups waiting now, whoever asked."""
        self._expire(self._all_in_flight, self._clock())
        return len(self._all_in_flight)

    def begin(self, secret: str, token_hash: str, client: str) -> bool:
        """Whether this unknown token may be looked up now; if so it counts as in flight
        until :meth:`end`."""
        now = self._clock()
        missed = self._missed.get(token_hash)
        waiting = self._expire(self._in_flight.get(client, deque()), now)
        if (
            not TOKEN_SHAPE.fullmatch(secret)
            or (missed is not None and now - missed < self._remember)
            or len(self._recent(client, now)) + len(waiting) >= self._per_client
            or self.in_flight >= self._max_in_flight
        ):
            self.refused += 1
            return False
        self._in_flight.setdefault(client, waiting).append(now)
        self._all_in_flight.append(now)
        return True

    def end(self, token_hash: str, client: str, *, found: bool | None) -> None:
        """A look-up is over: it found the token, found that the source has no such token
        (``found=False``: held against the token and the client), or got no answer (None:
        held against neither, as the source never said no)."""
        waiting = self._in_flight.get(client)
        if waiting:
            waiting.popleft()
            if not waiting:
                del self._in_flight[client]
            if self._all_in_flight:
                self._all_in_flight.popleft()
        if found is not False:
            return
        now = self._clock()
        self._missed[token_hash] = now
        self._missed.move_to_end(token_hash)
        while len(self._missed) > self._max_entries:
            self._missed.popitem(last=False)
        self._recent(client, now, keep=True).append(now)
        while len(self._clients) > self._max_entries:
            self._clients.popitem(last=False)  # the client heard from least recently

    def _expire(self, times: deque[float], now: float) -> deque[float]:
        while times and now - times[0] >= self._stale:
            times.popleft()
        return times

    def _recent(self, client: str, now: float, *, keep: bool = False) -> deque[float]:
        """The client's misses within the window (older ones dropped); ``keep``: it stays
        recorded (as the client heard from last) even when it has none."""
        recent = self._clients.get(client)
        if recent is None:
            recent = deque()
            if keep:
                self._clients[client] = recent
            return recent
        while recent and now - recent[0] >= self._window:
            recent.popleft()
        if recent or keep:
            self._clients.move_to_end(client)
        else:
            del self._clients[client]
        return recent
