"""make run's supervisor (covey/supervisor.py): which lines are routine, and, with real
processes, the box once they are up, the log file that keeps everything, and a Ctrl-C that ends
with one line and exit code 0, also under make on a terminal."""

import contextlib
import io
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from covey import supervisor
from covey.supervisor import STOPPED, Supervisor
from tests.processes import ROOT, VENV_BIN, wait_for

ACCESS = '127.0.0.1 - - [06/Dec/2026:02:52:39 +0000] "{} HTTP/1.1" {} 171 "-" "python-httpx/0.28.1"'
CELERY = "[2026-12-06 02:48:33,418: {}] {}"


@pytest.mark.parametrize(
    ("process", "line", "is_routine"),
    [
        ("web", ACCESS.format("POST /api/v1/runner/", 200), True),  # a heartbeat
        ("web", ACCESS.format("GET /api/v1/runner/runs/", 200), True),
        ("web", ACCESS.format("GET /admin/", 302), True),
        ("web", ACCESS.format("POST /api/v1/runner/runs/x/start/", 409), False),  # errors stay
        ("web", ACCESS.format("GET /api/v1/runs/", 500), False),
        ("web", "[2026-12-06 02:48:20 +0000] [5405] [INFO] Listening at: http://x (5405)", False),
        ("proxy", ACCESS.format("POST /api/v1/runner/", 200), False),  # web's lines only
        ("worker", CELERY.format("INFO/Beat", "Scheduler: Sending due task p (runs.p)"), True),
        ("worker", CELERY.format("INFO/MainProcess", "Task runs.p[26-9a] received"), True),
        ("runner", CELERY.format("INFO/ForkPoolWorker-2", "Task a.b[d5] succeeded in 0.1s"), True),
        ("worker", CELERY.format("ERROR/ForkPoolWorker-2", "Task a.b[d5] raised: x"), False),
        ("worker", CELERY.format("INFO/MainProcess", "celery@vm ready."), False),
        ("web", "WARNING kombu: No hostname was supplied. Reverting to default 'localhost'", True),
        ("proxy", "INFO egress.proxy.feed: covey: egress policy 6ea1e9 loaded (1 agents)", True),
        ("proxy", "covey egress proxy listening on 172.17.0.1:3128, policy from the web", False),
        ("runner", "covey runner builtin taking orders from queue runners.builtin", False),
        ("runner", "covey runner 1: PROXY CHECK FAILED, launches are refused: ...", False),
        # Celery's start banner.
        ("worker", " -------------- celery@vm v5.7.0 (collider)", True),
        ("worker", "- ** ---------- .> transport:   filesystem://:**@localhost//", True),
        ("worker", "                .> celery           exchange=celery(direct) key=celery", True),
        ("runner", "[tasks]", True),
        ("runner", "  . covey.runner.launch", True),
        ("worker", "", True),
        ("web", "", False),
    ],
)  # fmt: skip
def test_routine_lines_are_told_apart(process, line, is_routine):
    assert supervisor.routine(process, line) is is_routine


def test_the_box_leaves_each_line_whole():
    lines = supervisor.box(["admin at http://x/", "  export COVEY_TOKEN=abc"], width=10)
    assert lines == ["─" * 10, "admin at http://x/", "  export COVEY_TOKEN=abc", "─" * 10]


HEARTBEAT = ACCESS.format("POST /api/v1/runner/", 200)


class Terminal(io.StringIO):
    """What a person sees, read while the supervisor writes (from another thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            return super().write(text)

    def text(self) -> str:
        with self.lock:
            return self.getvalue()


_supervising: list[tuple[Supervisor, threading.Thread]] = []


def supervise(
    commands: dict[str, str], **options
) -> tuple[Supervisor, Terminal, io.StringIO, threading.Thread, list[int]]:
    terminal, log = Terminal(), io.StringIO()
    running = Supervisor(commands, log, terminal, **options)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(running.run()), daemon=True)
    _supervising.append((running, thread))
    return running, terminal, log, thread, result


@pytest.fixture(autouse=True)
def _nothing_left_running() -> Iterator[None]:
    """A test that failed before stopping its supervisor leaves no command running: it is
    stopped, and killed at once (the second ask)."""
    yield
    while _supervising:
        running, thread = _supervising.pop()
        if thread.is_alive():
            running.ask_stop(signal.SIGTERM)
            running.ask_stop(signal.SIGTERM)
            thread.join(timeout=35)


def test_routine_lines_go_to_the_log_file_only_and_the_box_comes_once_every_process_is_up(tmp_path):
    commands = {
        # "web" is up once it says it listens; its heartbeats' access lines are routine.
        "web": f"sleep 0.5; echo 'Listening at: http://x';"
        f" while true; do echo '{HEARTBEAT}'; sleep 0.1; done",
        "gateway": "echo 'covey: model gateway on http://y/'; exec sleep 600",
        "other": "exec sleep 600",  # no line says it is up: up once started
    }
    running, terminal, log, thread, result = supervise(commands)
    running.say("covey: admin at http://x/admin/")
    running.announce("echo 'password: hunter2'")
    thread.start()
    wait_for(lambda: terminal.text().count("hunter2") == 2, 10, "the box")
    running.ask_stop(signal.SIGINT)
    thread.join(30)
    assert result == [0]
    shown = terminal.text().splitlines()
    assert shown[:2] == ["covey: admin at http://x/admin/", "password: hunter2"]  # at once
    # Then once all are up, again, in a box as wide as the terminal (up to 100).
    start = next(i for i, line in enumerate(shown) if line and set(line) == {"─"})
    rule = shown[start]
    assert shown[start : start + 4] == [
        rule,
        "covey: admin at http://x/admin/",
        "password: hunter2",
        rule,
    ]
    assert any("web     | Listening at: http://x" in line for line in shown[2:start])
    assert shown[-1] == STOPPED  # and nothing else after the stop
    assert HEARTBEAT not in terminal.text()
    written = log.getvalue()
    assert HEARTBEAT in written and "Listening at" in written
    assert "hunter2" not in written  # what is said is for the terminal only
    assert written.splitlines()[-1].endswith(f"| {STOPPED}")


def test_with_debug_the_terminal_shows_routine_lines_too():
    commands = {"web": f"echo 'Listening at: x'; echo '{HEARTBEAT}'; exec sleep 600"}
    running, terminal, _log, thread, result = supervise(commands, show_routine=True)
    thread.start()
    wait_for(lambda: HEARTBEAT in terminal.text(), 10, "the heartbeat on the terminal")
    running.ask_stop(signal.SIGTERM)
    thread.join(30)
    assert result == [0]


def test_a_stop_waits_for_what_the_shell_started_and_keeps_its_last_words_in_the_log():
    """SIGTERM reaches the whole process (a shell that did not exec its command, and the
    command), and the supervisor waits for all of it: the runner removes its sandboxes then."""
    commands = {
        "runner": "sh -c \"trap 'sleep 1; echo removed 1 sandbox at exit; exit 0' TERM;"
        ' echo started; while true; do sleep 0.1; done"; echo after',
    }
    running, terminal, log, thread, result = supervise(commands)
    thread.start()
    wait_for(lambda: "started" in terminal.text(), 10, "the process start")
    running.ask_stop(signal.SIGINT)
    thread.join(30)
    assert result == [0]
    assert "removed 1 sandbox at exit" in log.getvalue()
    assert "removed 1 sandbox" not in terminal.text()  # after Ctrl-C: one line
    assert terminal.text().splitlines()[-1] == STOPPED


CHILD = """
import signal, time
signal.signal(signal.SIGTERM, lambda *_: print("TERM reached the child", flush=True))
while True:
    time.sleep(0.05)
"""
PARENT = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", CHILD])
def stop(*_):
    time.sleep(0.5)  # what a TERM of the child's own would have said by now
    child.send_signal(signal.SIGKILL)
    child.wait()
    print("the parent stopped its child", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("started", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_stop_tells_the_command_alone_which_stops_its_own_children(tmp_path):
    """As gunicorn and Celery do: a SIGTERM of their own for Celery's pool and beat made its
    shutdown hang (and honcho killed it after 5 s)."""
    (tmp_path / "parent.py").write_text(f"CHILD = {CHILD!r}\n{PARENT}")
    commands = {"worker": f"exec {sys.executable} {tmp_path / 'parent.py'}"}
    running, terminal, log, thread, result = supervise(commands)
    thread.start()
    wait_for(lambda: "started" in terminal.text(), 10, "the process start")
    running.ask_stop(signal.SIGINT)
    thread.join(30)
    assert result == [0]
    assert "the parent stopped its child" in log.getvalue()
    assert "TERM reached the child" not in log.getvalue()


def test_a_process_that_ignores_the_stop_is_killed_and_that_is_said():
    commands = {"stubborn": "trap '' TERM; echo started; while true; do sleep 0.1; done"}
    running, terminal, _log, thread, result = supervise(commands, stop_seconds=1)
    thread.start()
    wait_for(lambda: "started" in terminal.text(), 10, "the process start")
    running.ask_stop(signal.SIGINT)
    thread.join(30)
    assert result == [0]
    assert terminal.text().splitlines()[-2:] == [
        "covey: killed stubborn, not stopped within 1 s",
        STOPPED,
    ]


def test_a_process_that_exits_by_itself_stops_the_others_with_its_exit_code():
    commands = {
        "web": "echo 'cannot listen: address in use'; exit 3",
        "worker": "exec sleep 600",
    }
    _running, terminal, _log, thread, result = supervise(commands)
    thread.start()
    thread.join(30)
    assert result == [3]
    shown = terminal.text()
    assert "web    | cannot listen: address in use" in shown  # what it said before, then why
    assert "covey: web exited (exit code 3), so covey stops" in shown
    assert shown.splitlines()[-1] == STOPPED
    assert "─" not in shown  # never up: no box


def test_a_failed_announcement_starts_nothing(tmp_path):
    path = tmp_path / "Procfile"
    path.write_text(f"web: touch {tmp_path / 'started'}; exec sleep 600\n")
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-m", "covey.supervisor", "--procfile", str(path),
         "--log", str(tmp_path / "log"), "--say", "hello", "--announce", "echo broken; exit 4"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 4
    assert done.stdout.splitlines() == ["hello", "broken"]
    assert not (tmp_path / "started").exists()


def test_the_log_file_of_the_previous_start_is_kept(tmp_path):
    path = tmp_path / "var" / "make-run.log"
    with supervisor.open_log(path) as first:
        first.write("first start\n")
    with supervisor.open_log(path) as second:
        second.write("second start\n")
    assert path.read_text() == "second start\n"
    assert (tmp_path / "var" / "make-run.log.1").read_text() == "first start\n"


@pytest.mark.skipif(sys.platform != "linux", reason="a pseudo-terminal and GNU make")
def test_ctrl_c_on_a_terminal_ends_make_with_one_line_and_exit_code_0(tmp_path):
    """As a person runs it: make in a terminal, Ctrl-C typed. The terminal's SIGINT reaches the
    supervisor alone (it took the foreground), so make sees it end with 0 and says nothing
    (before: make died of the SIGINT too, saying 'make: *** [Makefile:44: run] Error 130')."""
    (tmp_path / "Procfile").write_text("web: echo 'Listening at: x'; exec sleep 600\n")
    (tmp_path / "Makefile").write_text(
        f"run:\n\t@cd {ROOT} && {VENV_BIN / 'python'} -m covey.supervisor"
        f" --procfile {tmp_path / 'Procfile'} --log {tmp_path / 'log'} --say up\n"
    )
    pid, fd = pty.fork()
    if pid == 0:  # the terminal's shell: Ctrl-C is not ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        make = ["make", "--no-print-directory", "-C", str(tmp_path), "run"]
        os.execvp("make", make)  # noqa: S606 - make itself, as a person's shell starts it
    output = b""

    def read(seconds: float) -> None:
        nonlocal output
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    return
                if not chunk:
                    return
                output += chunk
                if STOPPED.encode() in output:
                    return

    try:
        deadline = time.monotonic() + 30
        while "─" * 10 not in output.decode(errors="replace") and time.monotonic() < deadline:
            read(0.5)
        assert "─" * 10 in output.decode(errors="replace"), output
        os.write(fd, b"\x03")  # Ctrl-C
        read(30)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    text = output.decode(errors="replace").replace("\r\n", "\n")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert text.rstrip("\n").split("\n")[-1].split("\r")[-1] == STOPPED, text
    assert "Error" not in text and "make:" not in text, text


def test_a_closed_terminal_stops_every_process(tmp_path):
    """SIGHUP (the terminal closed, an ssh connection dropped) stops everything as Ctrl-C
    does: before, the supervisor died of it and left every command running."""
    path = tmp_path / "Procfile"
    path.write_text(f"web: echo $$ > {tmp_path / 'pid'}; exec sleep 600\n")
    running = subprocess.Popen(
        [str(VENV_BIN / "python"), "-m", "covey.supervisor", "--procfile", str(path),
         "--log", str(tmp_path / "log")],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    child = 0
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text().strip():
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        child = int((tmp_path / "pid").read_text())
        running.send_signal(signal.SIGHUP)
        assert running.wait(timeout=30) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
        child = 0  # gone, and reaped: its number may be another's now
    finally:
        if running.poll() is None:
            running.kill()
            running.wait(timeout=10)
        if child:  # the stop failed: its command is still running
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
