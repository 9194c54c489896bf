"""The program probe containers run (runners/probe/program.py), run here the way a container
runs it (its source through ``python3 -c``), against loopback servers this test starts. The
real containers, networks and firewall are in test_probe.py."""

import ast
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

from runners.probe import program
from runners.probe.host import command
from tests.processes import free_port


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    line = command(*args)
    assert line[:2] == ["python3", "-c"]
    return subprocess.run(
        [sys.executable, *line[1:]], capture_output=True, text=True, timeout=30, env=env
    )


class Answering:
    """A loopback TCP server that answers every connection with ``reply`` and closes."""

    def __init__(self, reply: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with client:
                client.recv(4096)
                client.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


def test_the_proxy_check_passes_on_an_http_answer_and_fails_saying_why_otherwise():
    proxy = Answering(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
    other = Answering(b"SSH-2.0-OpenSSH\r\n")
    try:
        answered = run("proxy-check", "127.0.0.1", str(proxy.port))
        assert answered.returncode == 0 and "answered HTTP/1.1 407" in answered.stdout
        not_http = run("proxy-check", "127.0.0.1", str(other.port))
        assert not_http.returncode == 1 and "not an HTTP proxy" in not_http.stdout
    finally:
        proxy.close()
        other.close()
    nobody = run("proxy-check", "127.0.0.1", str(free_port()))
    assert nobody.returncode == 1 and "ConnectionRefusedError" in nobody.stdout


def test_the_probe_prints_one_observation_per_check_in_order():
    listening = Answering(b"")
    proxy = Answering(b"HTTP/1.1 403 Forbidden\r\nX-Covey-Deny-Reason: not-on-allowlist\r\n\r\n")
    plan = {
        "proxy": f"127.0.0.1:{proxy.port}",
        "credentials": "agent:token",
        "timeout": 2,
        "checks": [
            {"kind": "tcp", "host": "127.0.0.1", "port": listening.port, "name": ""},
            {"kind": "tcp", "host": "127.0.0.1", "port": free_port(), "name": ""},
            {"kind": "proxy", "host": "off.test", "port": 443, "name": ""},
            {"kind": "nonsense", "host": "", "port": 0, "name": ""},
        ],
    }
    try:
        done = run("probe", env={"COVEY_PROBE": json.dumps(plan), "PATH": "/usr/bin:/bin"})
    finally:
        listening.close()
        proxy.close()
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)["observations"]
    assert [o.get("outcome") for o in seen] == ["connected", "refused", "answered", None]
    assert (seen[2]["status"], seen[2]["deny_reason"]) == (403, "not-on-allowlist")
    assert seen[3] == {"error": "unknown kind nonsense"}


def test_a_wrong_call_says_how_to_call_it():
    wrong = run("nothing")
    assert wrong.returncode == 2 and "usage: program.py probe" in wrong.stderr


def test_it_is_python_any_sandbox_image_runs():
    """Sandbox images bring their own python3: nothing in the program needs more than 3.7,
    neither its grammar nor what it evaluates when it loads (subscripted builtins, ``X | Y``)."""
    source = Path(program.__file__).read_text()
    tree = ast.parse(source, feature_version=(3, 7))
    assert not [
        n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "__future__"
    ]
    evaluated = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("dict", "list", "tuple", "set", "type")
    ]
    assert evaluated == []
    unions = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitOr)]
    assert unions == []
