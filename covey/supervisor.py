"""``make run``'s processes in the foreground (scripts/run): the Procfile's processes started
together and stopped together, everything they write kept in a log file, and the terminal kept
for what a person must read.

- Each line is prefixed with the time and its process; every line goes to the log file
  (``--log``: make run's is ``var/make-run.log``, the previous start's kept as
  ``make-run.log.1``). The terminal gets them too, except the routine ones (:data:`ROUTINE`:
  an access line for every heartbeat and poll, Celery's beat and its tasks, ...), which it shows
  only with ``COVEY_LOG_LEVEL=DEBUG``.
- What is said before the processes start (``--say``, and what each ``--announce`` command
  prints: the generated password, the demo's lines with their token) is said again in a box
  once every process is up (:data:`READY`), below their start's output rather than lost above
  it. It goes to the terminal only: a secret never reaches the log file.
- Ctrl-C (or SIGTERM) stops every process (SIGTERM to the command, which the Procfile's line
  execs, then to the rest of its group if its shell did not; SIGKILL after
  :data:`STOP_SECONDS`, or at a second Ctrl-C), waits until nothing of it is left (the runner
  removes its sandboxes) and ends with one line, ``covey stopped.``, and exit code 0.
  A process that exits by itself stops the others, and its exit code is the supervisor's.
- On a terminal it takes the foreground (a process group of its own): Ctrl-C reaches it, and
  not the ``make`` that started it, which would otherwise end with ``Error 130``.

No Django: it starts the processes that use it. Honcho reads the Procfile.
"""

import argparse
import contextlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from honcho.environ import parse_procfile  # type: ignore[import-untyped]

# A process told to stop gets this long before it is killed: the runner removes its sandboxes,
# Celery's beat writes its schedule.
STOP_SECONDS = 30.0
# Without every process up by then, the box comes anyway, naming those still starting.
READY_SECONDS = 180.0
STOPPED = "covey stopped."


@dataclass(frozen=True)
class Routine:
    """Lines a person need not read as they come (they stay in the log file): those of the
    ``processes`` named (all when empty) that ``pattern`` finds."""

    processes: frozenset[str]
    pattern: re.Pattern[str]
    why: str

    def matches(self, process: str, line: str) -> bool:
        return (not self.processes or process in self.processes) and bool(self.pattern.search(line))


CELERY = frozenset({"worker", "runner"})  # the runner host takes its orders with a Celery worker
ROUTINE = (
    Routine(
        frozenset({"web"}),
        re.compile(r'^\S+ \S+ \S+ \[[^\]]*\] "[A-Z]+ [^"]*" [123]\d\d '),
        "an answered request (errors stay): every runner's heartbeat and polls, scripts/run-log's"
        " polls, every page and static file",
    ),
    Routine(CELERY, re.compile(r"Scheduler: Sending due task "), "beat's schedule, every 10 s"),
    Routine(
        CELERY,
        re.compile(r"\] Task [\w.]+\[[0-9a-f-]+\] (received|succeeded in )"),
        "a task received or done (a failed one stays)",
    ),
    Routine(
        frozenset(),
        re.compile(r"No hostname was supplied\. Reverting to default 'localhost'"),
        "kombu on make run's broker, the file system, which has no host name",
    ),
    Routine(
        frozenset({"proxy"}),
        re.compile(r"covey: egress policy \w+ loaded "),
        "the proxy taking a new policy, at each change (each run's credential comes and goes)",
    ),
    # Celery's start banner: its art, its settings, its queues and its tasks.
    Routine(CELERY, re.compile(r"^\s*$|^ ?[-*][-* ]{12,}(\S.*)?$|^\s+\.> "), "the banner"),
    Routine(CELERY, re.compile(r"^\[tasks\]$|^  \. [\w.]+$"), "the banner's list of tasks"),
)

# What each process writes once it serves (one not named here is up once started); the runner
# host's Celery worker starts last, once it has checked its proxy.
CELERY_READY = re.compile(r"@\S+ ready\.$")
READY = {
    "web": re.compile(r"Listening at: "),
    "worker": CELERY_READY,
    "runner": CELERY_READY,
    "proxy": re.compile(r"egress proxy listening on "),
    "gateway": re.compile(r"model gateway on "),
    "forge": re.compile(r"demo forge on "),
}


def routine(process: str, line: str) -> bool:
    """Whether a process's line is routine (:data:`ROUTINE`)."""
    return any(rule.matches(process, line) for rule in ROUTINE)


def box(lines: Sequence[str], width: int = 78) -> list[str]:
    """``lines`` between two rules, each line as it is (a command in it pastes whole)."""
    rule = "─" * width
    return [rule, *lines, rule]


@dataclass
class Process:
    """One of the Procfile's processes, running."""

    name: str
    popen: subprocess.Popen[bytes]
    reader: threading.Thread
    ready: bool = False
    killed: bool = False
    group_told: bool = False  # its group was sent SIGTERM


class Supervisor:
    """Starts the processes, passes on their lines, says the box, stops them all."""

    def __init__(
        self,
        commands: dict[str, str],
        log: IO[str],
        terminal: IO[str],
        *,
        show_routine: bool = False,
        stop_seconds: float = STOP_SECONDS,
        ready_seconds: float = READY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.commands = commands
        self.log = log
        self.terminal = terminal
        self.show_routine = show_routine
        self.stop_seconds = stop_seconds
        self.ready_seconds = ready_seconds
        self.clock = clock
        self.said: list[str] = []  # said before the start, said again in the box
        self.processes: dict[str, Process] = {}
        self.lines: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.width = max(len(name) for name in commands) if commands else 0
        self._stop_asked: list[int] = []  # signals received (a list: a handler may append)
        self._stopping_since: float | None = None
        self._first_exit: tuple[str, int] | None = None
        self._boxed = False

    # --- before the start ------------------------------------------------------------------

    def say(self, text: str) -> None:
        """Print now, and again in the box."""
        lines = text.rstrip("\n").splitlines()
        self.said.extend(lines)
        self._terminal(lines)

    def announce(self, command: str) -> int:
        """Run a command (its output is said: :meth:`say`); its exit code."""
        done = subprocess.run(  # noqa: S602 - scripts/run's own command line
            command, shell=True, stdout=subprocess.PIPE, check=False
        )
        output = done.stdout.decode(errors="replace")
        if done.returncode:
            self._terminal(output.rstrip("\n").splitlines())
            return done.returncode
        if output.strip():
            self.say(output)
        return 0

    # --- running ---------------------------------------------------------------------------

    def run(self) -> int:
        """Start every process and pass their lines on until they have stopped; the exit code
        (0 when stopped by a signal, else that of the process that exited first)."""
        started = self.clock()
        try:
            for name, command in self.commands.items():
                self._start(name, command)
            return self._supervise(started)
        except BaseException:
            self._abandon()  # nothing of covey outlives the supervisor
            raise

    def _abandon(self) -> None:
        """The supervisor fails (its terminal gone, say): each command is stopped as at
        Ctrl-C, given stop_seconds to finish (the runner removes its sandboxes), then killed."""
        self._stop()
        for _ in range(int(self.stop_seconds / 0.2) + 1):
            self._stop_leftovers()
            if not any(self._alive(p) for p in self.processes.values()):
                return
            time.sleep(0.2)
        self._kill()

    def _supervise(self, started: float) -> int:
        while True:
            self._pass_lines(timeout=0.2)
            if not self._boxed and self._stopping_since is None:
                if all(p.ready for p in self.processes.values()):
                    self._say_box([])
                elif self.clock() - started >= self.ready_seconds:
                    waiting = [p.name for p in self.processes.values() if not p.ready]
                    self._say_box([f"(still starting: {', '.join(waiting)})"])
            self._watch_exits()
            if self._stop_asked and self._stopping_since is None:
                self._stop()
            if len(self._stop_asked) > 1 or (
                self._stopping_since is not None
                and self.clock() - self._stopping_since >= self.stop_seconds
            ):
                self._kill()
            if self._stopping_since is not None:
                self._stop_leftovers()
                if self._all_done():
                    break
        self._pass_lines(timeout=0)
        return self._end()

    def ask_stop(self, signum: int, _frame: Any = None) -> None:
        """A signal handler: stop everything (kill it all at the second)."""
        self._stop_asked.append(signum)

    def _start(self, name: str, command: str) -> None:
        popen = subprocess.Popen(  # noqa: S602 - the Procfile's command line, as honcho runs it
            command,
            shell=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Its own session: no terminal signal reaches it; it stops when told (SIGTERM).
            start_new_session=True,
        )
        reader = threading.Thread(target=self._read, args=(name, popen), daemon=True)
        self.processes[name] = Process(name, popen, reader, ready=name not in READY)
        reader.start()

    def _read(self, name: str, popen: subprocess.Popen[bytes]) -> None:
        for line in popen.stdout or ():
            self.lines.put((name, line))

    def _pass_lines(self, timeout: float) -> None:
        deadline = self.clock() + timeout
        while True:
            try:
                name, raw = self.lines.get(timeout=max(0.0, deadline - self.clock()))
            except queue.Empty:
                return
            line = raw.decode(errors="replace").rstrip("\r\n")
            prefixed = f"{datetime.now():%H:%M:%S} {name:<{self.width}} | {line}"
            self.log.write(prefixed + "\n")
            process = self.processes[name]
            if not process.ready and READY[name].search(line):
                process.ready = True
            if self._stopping_since is None and (self.show_routine or not routine(name, line)):
                self._terminal([prefixed])
            if self.lines.empty():
                self.log.flush()

    def _watch_exits(self) -> None:
        for process in self.processes.values():
            code = process.popen.poll()
            if code is None or self._first_exit is not None or self._stopping_since is not None:
                continue
            self._first_exit = (process.name, code)
            process.reader.join(timeout=1)  # its last lines before the note of its end
            self._pass_lines(timeout=0)
            self._terminal(
                [
                    f"covey: {process.name} exited ({self._exit_text(code)}), so covey stops;"
                    f" its output is above, and all of it in {getattr(self.log, 'name', 'the log')}"
                ]
            )
            self._stop()

    def _stop(self) -> None:
        self._stopping_since = self.clock()
        for process in self.processes.values():
            if process.popen.poll() is None:
                # The command itself (the Procfile's lines exec it): it stops its own children
                # (gunicorn's workers, Celery's pool and beat), which a SIGTERM of their own
                # would make Celery's shutdown hang.
                with contextlib.suppress(ProcessLookupError):
                    process.popen.terminate()

    def _stop_leftovers(self) -> None:
        """A shell that did not exec its command died of the SIGTERM alone: the rest of its
        group is told too, once."""
        for process in self.processes.values():
            if not process.group_told and process.popen.poll() is not None:
                process.group_told = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.popen.pid, signal.SIGTERM)

    def _kill(self) -> None:
        for process in self.processes.values():
            if self._alive(process):
                process.killed = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.popen.pid, signal.SIGKILL)

    def _all_done(self) -> bool:
        if any(self._alive(p) for p in self.processes.values()):
            return False
        for process in self.processes.values():
            process.reader.join(timeout=1)  # its last lines
        return True

    @staticmethod
    def _alive(process: Process) -> bool:
        """Whether anything of the process's group still runs (the command the shell started,
        gunicorn's workers, the runner removing its sandboxes)."""
        if process.popen.poll() is None:
            return True
        try:
            os.killpg(process.popen.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _end(self) -> int:
        killed = [p.name for p in self.processes.values() if p.killed]
        said = [STOPPED]
        if killed and len(self._stop_asked) < 2:
            said.insert(
                0, f"covey: killed {', '.join(killed)}, not stopped within {self.stop_seconds:g} s"
            )
        # On a terminal, over the ^C it echoed.
        if signal.SIGINT in self._stop_asked and self.terminal.isatty():
            said[0] = "\r" + said[0]
        self._terminal(said)
        self.log.write(f"{datetime.now():%H:%M:%S} {'':<{self.width}} | {STOPPED}\n")
        self.log.flush()
        if self._first_exit is None:
            return 0
        code = self._first_exit[1]
        return code if code > 0 else 1

    def _say_box(self, more: list[str]) -> None:
        self._boxed = True
        width = min(shutil.get_terminal_size((78, 24)).columns, 100)
        self._terminal(box([*self.said, *more], width))

    def _terminal(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.terminal.write(line + "\n")
        self.terminal.flush()

    @staticmethod
    def _exit_text(code: int) -> str:
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


@contextlib.contextmanager
def foreground(stream: IO[str]) -> Iterator[None]:
    """On a terminal where this process is in the foreground: this process alone (a group of
    its own) in the foreground, so that Ctrl-C reaches it and not the ``make`` that started it
    (make would die of it, saying ``Error 130``); the terminal goes back at the end."""
    try:
        fd = stream.fileno()
        ours = os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp()
    except (OSError, ValueError):
        ours = False
    if not ours:
        yield
        return
    before = os.getpgrp()
    # A process of a background group that sets the terminal's foreground gets SIGTTOU.
    ttou = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    # Ctrl-Z would stop a group the shell that started make does not watch: the terminal would
    # hang.
    tstp = signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    try:
        os.setpgid(0, 0)
        os.tcsetpgrp(fd, os.getpgrp())
    except OSError:  # a session leader keeps its group: as it was
        signal.signal(signal.SIGTTOU, ttou)
        signal.signal(signal.SIGTSTP, tstp)
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(fd, before)
        signal.signal(signal.SIGTTOU, ttou)
        signal.signal(signal.SIGTSTP, tstp)


def open_log(path: Path) -> IO[str]:
    """The log file, new for this start; the previous start's is kept as ``NAME.1``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.replace(path.with_name(path.name + ".1"))
    return path.open("w", encoding="utf-8", errors="replace")


class _Step(argparse.Action):
    """--say and --announce, kept in the order given."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        steps = getattr(namespace, "steps", None) or []
        steps.append((self.dest, value))
        namespace.steps = steps


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m covey.supervisor --procfile Procfile --log FILE [--say TEXT]
    [--announce COMMAND]``."""
    parser = argparse.ArgumentParser(prog="python -m covey.supervisor", description=__doc__)
    parser.add_argument("--procfile", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True, help="every line, routine or not")
    parser.add_argument("--say", action=_Step, help="text to print, and again in the box")
    parser.add_argument(
        "--announce", action=_Step, help="a command whose output is said (--say) when it succeeds"
    )
    parser.set_defaults(steps=[])
    args = parser.parse_args(argv)
    try:
        commands = dict(parse_procfile(args.procfile.read_text()).processes)
    except OSError as exc:
        parser.error(f"cannot read the Procfile: {exc}")
    if not commands:
        parser.error(f"{args.procfile} names no process")
    level = os.environ.get("COVEY_LOG_LEVEL", "INFO").upper()
    with open_log(args.log) as log, foreground(sys.stdin):
        supervisor = Supervisor(commands, log, sys.stdout, show_routine=level == "DEBUG")
        try:
            for kind, value in args.steps:
                if kind == "say":
                    supervisor.say(value)
                elif code := supervisor.announce(value):
                    return code
        except KeyboardInterrupt:  # Ctrl-C before anything started: nothing to stop
            print(STOPPED, flush=True)
            return 0
        # A closed terminal (SIGHUP) or a quit stops everything as Ctrl-C does.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, supervisor.ask_stop)
        return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
