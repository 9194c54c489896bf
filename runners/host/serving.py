"""A runner host serving the homes it holds to people outside: each home order (homes/ on the
control plane sends one per operation) is taken from the control plane, carried out on the home
(runners/host/homes.py, which confines every path to it), and answered: small answers as JSON,
downloads streamed to the control plane in chunks, uploads fetched from it in chunks, so neither
side ever holds a whole file. This works while no sandbox runs, and on a paused runner.

Orders are served on a pool of their own, so a long transfer never holds up a launch. A change
is refused (409) while a sandbox of the agent runs or is being launched here, unless the order
says changes are allowed then; a change and a launch of the same home take its lock in turn, so
none lands between a run's manifest-before and its sandbox. No Django.
"""

import logging
import threading
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
    turn."""

    def __init__(self) -> None:
        self._locks: dict[Path, threading.Lock] = {}
        self._guard = threading.Lock()

    def of(self, home: Path) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(home, threading.Lock())


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
        pool_size: int = POOL_SIZE,
    ) -> None:
        self._home_of = home_of
        self._busy = busy
        self.locks = locks
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
            try:
                client.answer_home(operation, HomeAnswer(500, "the runner failed; see its log"))
            except ControlPlaneError as exc:
                logger.warning("covey runner: home operation %s: %s", operation, exc)

    def _serve(self, runner_id: int, client: ControlPlaneClient, order: HomeOrder) -> None:
        root = self._home_of(runner_id, order.agent)
        home = Home(root)
        if order.kind in CHANGING:
            with self.locks.of(root):
                busy = "" if order.during_runs else self._busy(runner_id, order.agent)
                if busy:
                    answer = HomeAnswer(409, f"{busy}: the home is not changed while it runs")
                else:
                    answer = _attempt(lambda: self._change(client, home, order))
            client.answer_home(order.operation, answer)
            return
        if order.kind == HomeOp.READ:
            self._send(client, order, lambda: _read(home, order))
            return
        if order.kind == HomeOp.ARCHIVE:
            self._send(client, order, lambda: _archive(home, order))
            return
        client.answer_home(order.operation, _attempt(lambda: _look(home, order)))

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
        finally:
            chunks.close()

    def _change(self, client: ControlPlaneClient, home: Home, order: HomeOrder) -> HomeAnswer:
        if order.kind == HomeOp.WRITE:
            with client.home_upload(order.operation) as chunks:
                written = home.write(order.path, chunks, replace=order.replace, room=order.room)
            replaced = written.replaced
            answer = HomeAnswer(
                200 if replaced is not None else 201,
                entry=_entry(written.entry),
                bytes_delta=written.entry.size - (replaced or 0),
                files_delta=0 if replaced is not None else 1,
            )
        elif order.kind == HomeOp.MKDIR:
            answer = HomeAnswer(201, entry=_entry(home.mkdir(order.path)))
        elif order.kind == HomeOp.MOVE:
            answer = HomeAnswer(200, entry=_entry(home.move(order.path, order.target)))
        else:
            removed = home.delete(order.path)
            answer = HomeAnswer(200, bytes_delta=-removed.bytes, files_delta=-removed.files)
        if order.measure:
            usage = home.usage()
            if usage.whole:
                answer = _with_usage(answer, HomeUsage(usage.bytes, usage.files))
        return answer


def _with_usage(answer: HomeAnswer, usage: HomeUsage) -> HomeAnswer:
    return HomeAnswer(
        answer.status,
        answer.detail,
        answer.entry,
        answer.entries,
        answer.total,
        answer.space,
        answer.bytes_delta,
        answer.files_delta,
        usage,
    )


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
    entry = home.stat(order.path)
    stream = home.read(order.path)
    return HomeAnswer(entry=_entry(replace(entry, size=stream.size))), stream, stream.size


def _archive(home: Home, order: HomeOrder) -> tuple[HomeAnswer, Chunks, int | None]:
    entry = home.stat(order.path)
    return HomeAnswer(entry=_entry(entry)), home.archive(order.path), None


def _entry(entry: Entry) -> HomeEntry:
    return HomeEntry(entry.name, entry.type, entry.size, entry.modified, entry.usable, entry.target)


def _space(path: str, usage: Usage) -> HomeSpace:
    return HomeSpace(
        path=path,
        bytes=usage.bytes,
        files=usage.files,
        directories=usage.directories,
        largest_files=tuple(Sized(p, n) for p, n in usage.largest_files),
        largest_directories=tuple(Sized(p, n) for p, n in usage.largest_directories),
        measured_at=datetime.fromtimestamp(usage.measured_at, UTC),
        seconds=usage.seconds,
        unmeasured=usage.unmeasured,
        problems=tuple(Unmeasured(p, why) for p, why in usage.problems),
    )
