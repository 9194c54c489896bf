"""Home quotas of the runs launched on a runner host: what each home held before its run (what
the run changed, at its end), measured again while the run goes, and a run whose home passes its
quota, or cannot be measured whole, stopped (fail closed). Part of :class:`RunnerHost`, as
:class:`Shapes`, :class:`Trust` and :class:`Outputs` are."""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import logs
from runners.host.homes import Changes, Home, HomeError, Manifest, changes, shown
from runners.host.serving import HomeLocks, Ledger
from runners.protocol import MAX_LISTED_CHANGES, HomeChanges, HomeUsage

logger = logging.getLogger(__name__)


@dataclass
class Quotas:
    """The homes of the runs launched here, watched until their runs are over."""

    ledger: Ledger  # what each home holds, for changes from outside (runners/host/serving.py)
    home_locks: HomeLocks  # a home is not measured while a change from outside is made
    stop_run: Callable[[int, str, int], None]  # (runner id, run id, grace seconds): stop it
    clock: Callable[[], float] = time.monotonic
    _watched: dict[str, "Watched"] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def note(self, runner_id: int, run_id: str, home: Path, quota: int) -> HomeUsage:
        """The home's manifest before the run (kept in memory: a runner restarted meanwhile
        reports no changes for it, rather than wrong ones), and what the home holds.
        OverQuota when it holds more than ``quota`` (0: none), or when a quota cannot be
        vouched for because the home cannot be walked whole (fail closed)."""
        started = self.clock()
        self.ledger.set(home, None)  # the sandbox changes it: known again at its end
        try:
            manifest = Home(home).manifest()
        except (OSError, HomeError) as exc:
            raise OverQuota(f"the home could not be read: {exc}") from None
        usage = _usage(manifest)
        if quota and not manifest.whole:
            where, why = manifest.problems[0]
            raise OverQuota(
                f"the home could not be measured whole ({len(manifest.problems)} places, the"
                f" first {shown(where)}: {why}), so its quota cannot be vouched for",
                usage,
            )
        if quota and usage.bytes > quota:
            raise OverQuota(
                f"the home holds {_size(usage.bytes)}, more than its quota of {_size(quota)}:"
                " delete some of what it holds, or raise the agent's home quota",
                usage,
            )
        took = self.clock() - started
        with self._lock:
            self._watched[run_id] = Watched(
                runner_id, home, quota, manifest, started + _check_after(took)
            )
        return usage

    def run(self) -> None:
        """Until :meth:`stop`: :meth:`check` every second (its own thread: a large home takes a
        while to walk, and heartbeats must not wait for it)."""
        while not self._stop.is_set():
            self.check()
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> None:
        """Measure the homes of running sandboxes when due, and stop a run whose home holds
        more than its quota, or cannot be measured whole (fail closed)."""
        with self._lock:
            due = [
                (run_id, watched)
                for run_id, watched in self._watched.items()
                if watched.quota
                and watched.ended is None  # its report may be sent again: its home is not its
                and not watched.stopped_for
                and watched.next_check <= self.clock()
            ]
        for run_id, watched in due:
            try:
                self._check(run_id, watched)
            except Exception:  # a defect, or the engine: the next round tries again
                logger.exception(
                    "covey runner: run %s: its home quota could not be checked", run_id
                )

    def _check(self, run_id: str, watched: "Watched") -> None:
        started = self.clock()
        try:
            usage = Home(watched.home).usage()
        except (OSError, HomeError) as exc:
            usage, why = None, f"its home could not be read ({exc})"
        watched.next_check = self.clock() + _check_after(self.clock() - started)
        if usage is not None and not usage.whole:
            where, problem = usage.problems[0]
            why = f"its home could not be measured whole ({where}: {problem})"
        elif usage is not None and usage.bytes <= watched.quota:
            return
        elif usage is not None:
            why = f"its home passed its quota ({_size(usage.bytes)} of {_size(watched.quota)})"
        with self._lock:
            if self._watched.get(run_id) is not watched:
                return  # it ended meanwhile
            watched.stopped_for = why
        with logs.bound(run_id=run_id, runner_id=watched.runner_id):
            logger.info("covey runner: run %s: %s; stopping", run_id, why)
        self.stop_run(watched.runner_id, run_id, QUOTA_STOP_GRACE_SECONDS)

    def after(self, run_id: str, home: Path) -> tuple[HomeChanges | None, HomeUsage | None]:
        """What the run changed in its home (when it was seen before), and what it holds now:
        measured once, when the sandbox has ended (a report that failed is sent again as is)."""
        with self._lock:
            watched = self._watched.get(run_id)
        if watched is not None and watched.ended is not None:
            return watched.ended
        try:
            after = Home(home).manifest()
        except (OSError, HomeError) as exc:
            logger.warning("covey runner: run %s: the home could not be read: %s", run_id, exc)
            return None, None
        usage = _usage(after)
        with self.home_locks.of(home):  # what it holds, for changes from outside from now on
            self.ledger.set(home, usage if after.whole else None)
        if watched is None:
            return None, usage
        watched.ended = (_changes(changes(watched.manifest, after)), usage)
        return watched.ended

    def stopped_for(self, run_id: str) -> str:
        """Why the run was stopped for its home ('' when it was not)."""
        with self._lock:
            watched = self._watched.get(run_id)
        return watched.stopped_for if watched else ""

    def active_run(self, home: Path) -> str:
        """A run launched here whose sandbox uses ``home`` and has not ended ('' when none)."""
        with self._lock:
            for run_id, watched in self._watched.items():
                if watched.home == home and watched.ended is None:
                    return run_id
        return ""

    def forget(self, run_id: str) -> None:
        """What was kept about a run that is over (or was never ours)."""
        with self._lock:
            self._watched.pop(run_id, None)


# A running sandbox's home is measured at most this often (and, for a home that takes long to
# walk, no more than a twentieth of the time): a run can pass its quota by what it writes
# between two measurements before it is stopped.
HOME_CHECK_SECONDS = 10.0
HOME_CHECK_MOST_SECONDS = 120.0  # however long the walk: a run is never left longer unmeasured
QUOTA_STOP_GRACE_SECONDS = 1  # a run that passed its quota is not given time to write more


def _check_after(walk: float) -> float:
    return min(max(HOME_CHECK_SECONDS, 20 * walk), HOME_CHECK_MOST_SECONDS)


@dataclass
class Watched:
    """A sandbox launched here: its runner, home and quota, the manifest from before it ran,
    when its home is measured next, why it was stopped for its home, and once it has ended,
    what it changed there and what the home holds."""

    runner_id: int
    home: Path
    quota: int
    manifest: Manifest
    next_check: float
    stopped_for: str = ""
    ended: tuple[HomeChanges | None, HomeUsage | None] | None = None


class OverQuota(Exception):
    """The home holds more than its quota (or cannot be vouched for): no sandbox is built."""

    def __init__(self, message: str, usage: HomeUsage | None = None) -> None:
        super().__init__(message)
        self.usage = usage


def _size(count: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def _usage(manifest: Manifest) -> HomeUsage:
    entries = manifest.entries.values()
    sizes = [size for kind, size, _ in entries if kind != "directory"]
    files = sum(1 for kind, _, _ in entries if kind == "file")
    return HomeUsage(bytes=sum(sizes), files=files)


MAX_CHANGED_PATH = 1024  # characters of one listed path (longer ones are cut, and say so)
MAX_CHANGES_TEXT = 256 * 1024  # characters of all listed paths of a report together


def _changes(found: Changes) -> HomeChanges:
    budget = [MAX_CHANGES_TEXT]

    def listed(paths: list[str]) -> tuple[str, ...]:
        kept = []
        for path in paths[:MAX_LISTED_CHANGES]:
            shown = path if len(path) <= MAX_CHANGED_PATH else path[: MAX_CHANGED_PATH - 1] + "…"
            if len(shown) > budget[0]:
                break
            budget[0] -= len(shown)
            kept.append(shown)
        return tuple(kept)

    return HomeChanges(
        added=listed(found.added),
        changed=listed(found.changed),
        removed=listed(found.removed),
        added_total=len(found.added),
        changed_total=len(found.changed),
        removed_total=len(found.removed),
    )
