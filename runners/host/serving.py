"""A runner host serving the homes it holds to people outside: each home order (homes/ on the
control plane sends one per operation) is taken from the control plane, carried out on the home
(runners/host/homes.py, which confines every path to it), and answered: small answers as JSON,
downloads streamed to the control plane in chunks, uploads fetched from it in chunks, so neither
side ever holds a whole file. This works while no sandbox runs, and on a paused runner.

Orders are served on a pool of their own, so a long transfer never holds up a launch. A change
is refused (409) while a sandbox of the agent runs or is being launched here, unless the order
says changes are allowed then; a change and a launch of the same home take its lock in turn, so
none lands between a run's manifest-before and its sandbox.

The host keeps what each home holds (:class:`Ledger`): walked once when first needed, then
counted with every change it makes, and forgotten while a sandbox uses the home (its runner
walks it at the start and end of every run and tells the ledger). Changes to one home are made
one at a time under its lock, so a write is held to the quota exactly, however many uploads
come at once; a home that cannot be measured whole takes no write under a quota (fail closed).
No Django.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from runners.host.client import ControlPlaneClient, ControlPlaneError
from runners.host.homes import Entry, Home, HomeError, Usage
from runners.protocol import (
    CHANGING,
    HOME_LISTING_MAX,
    HomeAnswer,
    HomeEntry,
    HomeOp,
    HomeOrder,
    HomeSpace,
    HomeUsage,
    Sized,
    Unmeasured,
)

logger = logging.getLogger(__name__)


class Chunks(Protocol):
    """A download's bytes (a file's Stream or an Archive), closed once sent."""

    def __iter__(self) -> Iterator[bytes]: ...

    def close(self) -> None: ...


POOL_SIZE = 8  # home operations at once on one host


class HomeLocks:
    """One lock per home: a change from outside and a launch's look at the home take it in
    turn (one small lock per home this host holds, kept for the life of the process)."""

    def __init__(self) -> None:
        self._locks: dict[Path, threading.Lock] = {}
        self._guard = threading.Lock()

    def of(self, home: Path) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(home, threading.Lock())


LEDGER_SECONDS = 600.0  # what a walk found is trusted this long, then the home is walked again


class Ledger:
    """What each home holds as far as this host knows (None: unknown, walk it): from a walk at
    most LEDGER_SECONDS ago and the changes this host made since. Read and changed under the
    home's lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._known: dict[Path, tuple[HomeUsage, float]] = {}
        self._clock = clock

    def get(self, home: Path) -> HomeUsage | None:
        known = self._known.get(home)
        if known is None or self._clock() - known[1] > LEDGER_SECONDS:
            return None
        return known[0]

    def set(self, home: Path, usage: HomeUsage | None) -> None:
        """What a walk found (None: forget it)."""
        if usage is None:
            self._known.pop(home, None)
        else:
            self._known[home] = (usage, self._clock())

    def add(self, home: Path, bytes_delta: int, files_delta: int) -> HomeUsage | None:
        known = self._known.get(home)
        if known is None:
            return None
        usage = HomeUsage(known[0].bytes + bytes_delta, known[0].files + files_delta)
        self._known[home] = (usage, known[1])
        return usage


class HomeServer:
    """Carries out home orders for the runners of one host.

    ``home_of(runner_id, agent_id)`` is where an agent's home is; ``busy(runner_id, agent_id)``
    why it may not be changed now ('' when it may: no sandbox of the agent runs)."""

    def __init__(
        self,
        home_of: Callable[[int, int], Path],
        busy: Callable[[int, int], str],
        locks: HomeLocks,
        *,
        owner: tuple[int, int] | None = None,
        pool_size: int = POOL_SIZE,
    ) -> None:
        self._home_of = home_of
        self._busy = busy
        self.locks = locks
        self.ledger = Ledger()
        self._owner = owner  # (uid, gid) of what is written: the sandbox's user
        self._pool = ThreadPoolExecutor(pool_size, thread_name_prefix="covey-home")

    def submit(self, runner_id: int, client: ControlPlaneClient, operation: str) -> None:
        """Serve the order on the pool (the Celery order is done once it is handed over)."""
        self._pool.submit(self.serve, runner_id, client, operation)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def serve(self, runner_id: int, client: ControlPlaneClient, operation: str) -> None:
        try:
            order = client.take_home(operation)
            if order is None:
                logger.info("covey runner: home operation %s is no longer wanted", operation)
                return
            self._serve(runner_id, client, order)
        except ControlPlaneError as exc:
            logger.warning("covey runner: home operation %s: %s", operation, exc)
        except Exception:
            logger.exception("covey runner: home operation %s failed", operation)
            _answer_failure(client, operation, "the runner failed; see its log")

    def _serve(self, runner_id: int, client: ControlPlaneClient, order: HomeOrder) -> None:
        root = self._home_of(runner_id, order.agent)
        home = Home(root, owner=self._owner)
        if order.kind in CHANGING:
            with self.locks.of(root):
                busy = self._busy(runner_id, order.agent)
                if busy and not order.during_runs:
                    answer = HomeAnswer(409, f"{busy}: the home is not changed while it runs")
                else:
                    answer = _attempt(lambda: self._change(client, home, order, trusted=not busy))
            client.answer_home(order.operation, answer)
            return
        if order.kind == HomeOp.READ:
            self._send(client, order, lambda: _read(home, order))
            return
        if order.kind == HomeOp.USAGE and not order.path:
            with self.locks.of(root):  # the whole home's walk: what the ledger knows from now
                answer = _attempt(lambda: _look(home, order))
                if not self._busy(runner_id, order.agent):
                    self.ledger.set(root, answer.usage)
        else:
            answer = _attempt(lambda: _look(home, order))
        client.answer_home(order.operation, answer)

    def _send(
        self,
        client: ControlPlaneClient,
        order: HomeOrder,
        opening: Callable[[], tuple[HomeAnswer, "Chunks", int | None]],
    ) -> None:
        try:
            answer, chunks, size = opening()
        except HomeError as exc:
            client.answer_home(order.operation, HomeAnswer(exc.status, str(exc)))
            return
        try:
            client.send_home(order.operation, answer, chunks, size)
        except ControlPlaneError as exc:  # (one no longer wanted is no error: see send_home)
            logger.warning("covey runner: home operation %s: %s", order.operation, exc)
            _answer_failure(client, order.operation, f"the runner could not send it: {exc}")
        finally:
            chunks.close()

    def _change(
        self, client: ControlPlaneClient, home: Home, order: HomeOrder, *, trusted: bool
    ) -> HomeAnswer:
        """Make the change (the home's lock is held). ``trusted``: no sandbox uses the home,
        so what the ledger knows of it holds."""
        known = self.ledger.get(home.root) if trusted else None
        if known is None and (order.quota or trusted):
            usage = home.usage()
            if usage.whole:
                known = HomeUsage(usage.bytes, usage.files)
            elif order.quota:
                where, why = usage.problems[0]
                raise HomeError(
                    507,
                    f"the home cannot be measured whole ({usage.unmeasured} places, the first"
                    f" {where}: {why}), so its quota cannot be vouched for",
                )
            if trusted:
                self.ledger.set(home.root, known)
        answer = self._make(client, home, order, known)
        if trusted:
            known = self.ledger.add(home.root, answer.bytes_delta, answer.files_delta)
        elif known is not None:
            known = HomeUsage(known.bytes + answer.bytes_delta, known.files + answer.files_delta)
        return replace(answer, usage=known)

    def _make(
        self, client: ControlPlaneClient, home: Home, order: HomeOrder, known: HomeUsage | None
    ) -> HomeAnswer:
        if order.kind == HomeOp.WRITE:
            room = order.quota - known.bytes if order.quota and known is not None else None
            with client.home_upload(order.operation) as chunks:
                written = home.write(order.path, chunks, replace=order.replace, room=room)
            replaced = written.replaced
            return HomeAnswer(
                200 if replaced is not None else 201,
                entry=_entry(written.entry),
                bytes_delta=written.entry.size - (replaced or 0),
                files_delta=0 if written.replaced_file else 1,
            )
        if order.kind == HomeOp.MKDIR:
            return HomeAnswer(201, entry=_entry(home.mkdir(order.path)))
        if order.kind == HomeOp.MOVE:
            return HomeAnswer(200, entry=_entry(home.move(order.path, order.target)))
        try:
            removed = home.delete(order.path)
        except HomeError as exc:
            if exc.removed is None or not (exc.removed.bytes or exc.removed.files):
                raise
            went = exc.removed
            return HomeAnswer(
                exc.status,
                f"{exc} ({went.files} files, {went.bytes} bytes, were deleted before it stopped)",
                bytes_delta=-went.bytes,
                files_delta=-went.files,
            )
        return HomeAnswer(200, bytes_delta=-removed.bytes, files_delta=-removed.files)


def _answer_failure(client: ControlPlaneClient, operation: str, detail: str) -> None:
    try:
        client.answer_home(operation, HomeAnswer(502, detail))
    except ControlPlaneError as exc:
        logger.warning("covey runner: home operation %s: %s", operation, exc)


def _attempt(doing: Callable[[], HomeAnswer]) -> HomeAnswer:
    try:
        return doing()
    except HomeError as exc:
        return HomeAnswer(exc.status, str(exc))
    except ControlPlaneError as exc:
        return HomeAnswer(502, f"the upload did not come whole from the control plane: {exc}")
    except OSError as exc:
        return HomeAnswer(500, f"the runner could not do it: {exc.strerror or exc}")


def _look(home: Home, order: HomeOrder) -> HomeAnswer:
    if order.kind == HomeOp.LIST:
        limit = max(1, min(order.limit, HOME_LISTING_MAX))
        listing = home.listing(order.path, offset=max(0, order.offset), limit=limit)
        entries = tuple(_entry(entry) for entry in listing.entries)
        return HomeAnswer(entries=entries, total=listing.total)
    if order.kind == HomeOp.STAT:
        return HomeAnswer(entry=_entry(home.stat(order.path)))
    if order.kind == HomeOp.USAGE:
        space = _space(order.path, home.usage(order.path))
        whole = not order.path and not space.unmeasured  # the figure the control plane keeps
        return HomeAnswer(space=space, usage=HomeUsage(space.bytes, space.files) if whole else None)
    return HomeAnswer(400, f"{order.kind} is not something a runner does to a home")


def _read(home: Home, order: HomeOrder) -> tuple[HomeAnswer, Chunks, int | None]:
    """A file's bytes (with their length), or a directory (the home, for no path) as a tar
    archive (whose length is known at its end); the answer's entry says which."""
    entry = home.stat(order.path)
    if entry.type == "directory":
        return HomeAnswer(entry=_entry(entry)), home.archive(order.path), None
    stream = home.read(order.path)
    return HomeAnswer(entry=_entry(replace(entry, size=stream.size))), stream, stream.size


def _entry(entry: Entry) -> HomeEntry:
    return HomeEntry(
        entry.name, entry.type, entry.size, entry.modified, entry.usable, entry.target, entry.links
    )


def _space(path: str, usage: Usage) -> HomeSpace:
    return HomeSpace(
        path=path,
        bytes=usage.bytes,
        files=usage.files,
        directories=usage.directories,
        largest_files=tuple(Sized(p, n, p not in usage.unusable) for p, n in usage.largest_files),
        largest_directories=tuple(
            Sized(p, n, p not in usage.unusable) for p, n in usage.largest_directories
        ),
        measured_at=datetime.fromtimestamp(usage.measured_at, UTC),
        seconds=usage.seconds,
        unmeasured=usage.unmeasured,
        problems=tuple(Unmeasured(p, why) for p, why in usage.problems),
    )
