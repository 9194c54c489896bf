"""Benchmark the covey egress proxy against Squid and a direct connection, on loopback only.

Run it from the project root; it sets everything up itself and stops by itself::

    .venv/bin/python bench/egress.py            # about 90 s: 300 tunnels, 3 transfers, 10 changes
    .venv/bin/python bench/egress.py --quick    # about 60 s: 50 tunnels, 1 transfer, 3 changes

In one run, side by side, it measures a direct TLS connection to the upstream (the floor), two
Squids of its own (Debian's ``squid``, installed with apt-get when missing; generated config,
pid file and logs in a temporary directory, no cache, CONNECT allowed only to the allowlist):
``squid`` without authentication, and ``squid-auth``, which checks every CONNECT's Basic
credentials with Debian's ``basic_ncsa_auth`` helper, as covey checks the agent's token (the
like-for-like peer the targets compare with); and the real covey proxy (``manage.py
egress_proxy`` on a SQLite database of its own):

1. connect latency per TLS tunnel: from the TCP connect to the proxy until the TLS handshake
   with the upstream completes (CONNECT, 200, handshake); N tunnels one after another, the
   paths interleaved; p50 and p99, the latency each proxy adds over direct, and the proxy's
   CPU time per tunnel;
2. throughput of one 200 MiB transfer through one tunnel, from an upstream that streams
   1 MiB writes right after the handshake (MiB/s, the median of the runs; proxy CPU time);
3. 1,000 tunnels held open at once (asyncio: CONNECT, TLS handshake and a one-byte echo on
   each, a second echo on all while held, then close): errors, and the RSS of the proxy's
   processes (Squid's helpers included) before and while holding;
4. policy propagation: the time from a PATCH of the agent's allowlist through the REST API
   (gunicorn on the same database) until a CONNECT to the newly added host succeeds through
   the running covey proxy, polled every 10 ms.

It ends with a table of the figures, the ratios and the targets, against ``squid-auth``: CPU
per tunnel at most 2x, added latency p50 at most 0.5 ms more, throughput at least 1x, memory at
start at most 2x; and 1,000 tunnels without errors, propagation under 1 s. Nothing leaves
127.0.0.0/8 and every name is a ``.test`` name: the upstream (threaded TLS servers on
127.0.0.2) and a small DNS server run in two child processes. Every process it starts is
stopped by its id, its temporary directory is removed, and every loop is bounded in time, the
whole run too (an alarm; SIGTERM stops it cleanly).
"""

import argparse
import asyncio
import contextlib
import http.client
import io
import json
import multiprocessing
import os
import platform
import pwd
import resource
import shutil
import signal
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
# Run as a script, this folder would come first on sys.path and this file would shadow the
# project's ``egress`` package: the project root goes there instead.
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR)]

from bench.support import (  # noqa: E402 - after the path is set
    BenchError,
    BenchStop,
    Processes,
    accepts,
    alive,
    covey_env,
    django_here,
    fmt,
    free_port,
    percentile,
    process_tree,
    ratio,
    run_bench,
    step,
    verdict,
    wait_listening,
    wait_until,
)

UPSTREAM_IP = "127.0.0.2"  # "the internet"; covey may reach it (COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS)
DNS_IP = "127.0.0.1"
# A common TTL for real names. covey keeps answers for their TTL (TTL 0 is never kept), as
# Squid's ipcache does; the uncached cost of a lookup is measured and printed on its own.
DNS_TTL = 60
DOMAIN = "bench.test"
ECHO_NAME = f"api.{DOMAIN}"  # the echo upstream: latency, held tunnels, propagation
BULK_NAME = f"bulk.{DOMAIN}"  # the streaming upstream: throughput
MAX_TRIALS = 10
NEW_NAMES = [f"new-{i}.{DOMAIN}" for i in range(MAX_TRIALS)]  # added during propagation
ALL_NAMES = [ECHO_NAME, BULK_NAME, *NEW_NAMES]

MIB = 1024 * 1024
STREAM_BYTES = 200 * MIB
CHUNK = MIB
HELD_TUNNELS = 1000
OPEN_CONCURRENCY = 100  # tunnels being opened at once while building up the 1,000
IO_TIMEOUT = 30.0
HOLD_TIMEOUT = 180.0  # the whole 1,000-tunnel phase, for one proxy
POLL_INTERVAL = 0.010
PROPAGATION_TIMEOUT = 10.0
MAX_TUNNELS = 4000
MAX_TUNNELS_PER_AGENT = 2000  # above HELD_TUNNELS (the default, 500, would refuse half)
FD_LIMIT = 16384

SQUID_AUTH_HELPER = "/usr/lib/squid/basic_ncsa_auth"
PROXIES = ("squid", "squid-auth", "covey")
ROUTES = ("direct", *PROXIES)
PEER = "squid-auth"  # like for like: a proxy that checks every CONNECT's credentials

# Targets, against Squid with authentication
CPU_RATIO = 2.0  # covey's CPU per tunnel at most twice Squid's
CONNECT_GAP_MS = 0.5  # covey's added latency p50 at most this much above Squid's
THROUGHPUT_RATIO = 1.0
MEMORY_RATIO = 2.0  # resident memory at start
PROPAGATION_LIMIT_S = 1.0


class TunnelError(Exception):
    """A tunnel could not be opened (a refusal, or a broken answer)."""


@dataclass(frozen=True)
class Plan:
    """How many samples to take."""

    latency_samples: int
    throughput_runs: int
    propagation_trials: int
    time_limit: int  # seconds for the whole run

    @classmethod
    def make(cls, quick: bool) -> "Plan":
        if quick:
            return cls(latency_samples=50, throughput_runs=1, propagation_trials=3, time_limit=600)
        return cls(latency_samples=300, throughput_runs=3, propagation_trials=10, time_limit=1200)


# --------------------------------------------------------------------------------------------
# The upstream side, in two child processes: a DNS server, and two threaded TLS servers
# --------------------------------------------------------------------------------------------


class TlsServer:
    """A TLS server on loopback, one thread per connection, running ``handle`` on each."""

    def __init__(
        self, host: str, context: ssl.SSLContext, handle: Callable[[ssl.SSLSocket], None]
    ) -> None:
        self.context = context
        self.handle = handle
        self.sock = socket.create_server((host, 0), backlog=4096)
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="bench-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(IO_TIMEOUT)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with (
            contextlib.suppress(OSError, ValueError),
            conn,
            self.context.wrap_socket(conn, server_side=True) as tls,
        ):
            self.handle(tls)


def echo(tls: ssl.SSLSocket) -> None:
    """Send back whatever arrives, until the client closes."""
    while data := tls.recv(65536):
        tls.sendall(data)


def stream(total: int, tls: ssl.SSLSocket) -> None:
    """Send ``total`` bytes in 1 MiB writes, then wait for the client to close."""
    chunk = memoryview(bytes(CHUNK))
    sent = 0
    while sent < total:
        n = min(CHUNK, total - sent)
        tls.sendall(chunk[:n])
        sent += n
    tls.recv(1)  # closing first, with bytes still unread, could reset the connection


def dns_answer(query: bytes, table: dict[str, str]) -> bytes | None:
    """The answer to one DNS query: A from the table (TTL DNS_TTL), no AAAA (with an SOA, as
    authoritative servers give, so that the empty answer may be cached), NXDOMAIN for the rest."""
    if len(query) < 12:
        return None
    ident, flags, questions = struct.unpack(">HHH", query[:6])
    if flags & 0x8000 or questions != 1:
        return None
    labels, i = [], 12
    while i < len(query) and query[i] != 0:
        if query[i] & 0xC0:
            return None
        labels.append(query[i + 1 : i + 1 + query[i]])
        i += 1 + query[i]
    end = i + 5
    if end > len(query):
        return None
    qtype, qclass = struct.unpack(">HH", query[i + 1 : end])
    address = table.get(b".".join(labels).decode("ascii", "replace").lower())
    answer = authority = b""
    if address is not None and qtype == 1 and qclass == 1:
        answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, DNS_TTL, 4) + socket.inet_aton(address)
    elif address is not None:  # the name exists, without records of this type
        soa = b"\x00\x00" + struct.pack(">IIIII", 1, DNS_TTL, DNS_TTL, DNS_TTL, DNS_TTL)
        authority = b"\xc0\x0c" + struct.pack(">HHIH", 6, 1, DNS_TTL, len(soa)) + soa
    rcode = 0 if address is not None else 3
    header = struct.pack(
        ">HHHHHH",
        ident,
        0x8000 | 0x0400 | (flags & 0x0100) | rcode,
        1,
        int(bool(answer)),
        int(bool(authority)),
        0,
    )
    return header + query[12:end] + answer + authority


def serve_dns(pipe: Connection, lifetime: float) -> None:
    """Child process: a single-threaded UDP DNS server on loopback for the bench names."""
    table = dict.fromkeys(ALL_NAMES, UPSTREAM_IP)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((DNS_IP, 0))
        sock.settimeout(0.2)
        pipe.send(int(sock.getsockname()[1]))
        deadline = time.monotonic() + lifetime
        next_check = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_check:
                if pipe.poll():  # "stop", or the parent went away
                    return
                next_check = time.monotonic() + 0.2
            try:
                query, peer = sock.recvfrom(4096)
            except TimeoutError:
                continue
            reply = dns_answer(query, table)
            if reply is not None:
                sock.sendto(reply, peer)


def serve_upstream(pipe: Connection, cert_file: str, stream_bytes: int, lifetime: float) -> None:
    """Child process: an echo and a streaming TLS upstream on UPSTREAM_IP."""
    threading.stack_size(512 * 1024)  # a thread per held tunnel
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file)
    echo_server = TlsServer(UPSTREAM_IP, context, echo)
    bulk_server = TlsServer(UPSTREAM_IP, context, lambda tls: stream(stream_bytes, tls))
    echo_server.start()
    bulk_server.start()
    pipe.send((echo_server.port, bulk_server.port))
    pipe.poll(lifetime)  # until the parent says stop, goes away, or the run's time is up
    echo_server.stop()
    bulk_server.stop()


@dataclass
class Child:
    """A helper process of this run (multiprocessing, spawned), told to stop through a pipe."""

    process: multiprocessing.process.BaseProcess
    pipe: Connection

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.pipe.send("stop")
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def start_child(name: str, target: Callable[..., None], *args: object) -> tuple[Child, Any]:
    """Start target(pipe, *args) in a new process; returns it and the first thing it sends."""
    spawn = multiprocessing.get_context("spawn")
    parent, child_end = spawn.Pipe()
    process = spawn.Process(target=target, args=(child_end, *args), name=name, daemon=True)
    process.start()
    if not parent.poll(60):
        process.kill()
        raise BenchError(f"the {name} process did not start")
    return Child(process, parent), parent.recv()


# --------------------------------------------------------------------------------------------
# Processes: started in their own session, stopped by their id
# --------------------------------------------------------------------------------------------


def rss_mib(pids: Sequence[int]) -> float:
    """Sum of VmRSS over the processes, in MiB."""
    total_kib = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
    return total_kib / 1024


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of the process and its descendants so far, in seconds."""
    if pid is None:
        return 0.0
    ticks = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rpartition(")")[2].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------------------------
# Squid
# --------------------------------------------------------------------------------------------


def squid_binary() -> str:
    """The squid executable; installed with apt-get when missing (root only)."""
    found = shutil.which("squid") or shutil.which("squid", path="/usr/sbin:/sbin")
    if found:
        return found
    if os.geteuid() != 0:
        raise BenchError("squid is not installed: apt-get install squid (as root)")
    print("squid is missing: installing the Debian package", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "squid"]):
        apt = [shutil.which(command[0]) or "/usr/bin/apt-get", *command[1:]]
        subprocess.run(apt, env=env, check=True, timeout=600, capture_output=True)  # noqa: S603
    found = shutil.which("squid", path="/usr/sbin:/sbin:/usr/bin")
    if not found:
        raise BenchError("apt-get installed squid, but no squid executable was found")
    return found


def squid_config(
    directory: Path, port: int, allowlist: Sequence[tuple[str, int]], *, auth: bool
) -> str:
    """Squid's configuration: CONNECT to the allowlist only; with ``auth``, only for a client
    whose Basic credentials Debian's ``basic_ncsa_auth`` helper accepts from ``passwd`` (Squid
    keeps an accepted pair for ``credentialsttl``, as covey keeps a known token)."""
    lines = [
        f"http_port 127.0.0.1:{port}",
        f"pid_filename {directory}/squid.pid",
        f"cache_log {directory}/cache.log",
        f"access_log stdio:{directory}/access.log squid",  # like covey's decision log
        "logfile_rotate 0",
        f"coredump_dir {directory}",
        "cache deny all",  # no disk cache (no cache_dir), nothing cached in memory either
        "cache_mem 8 MB",
        "pinger_enable off",
        "netdb_filename none",
        "icp_port 0",
        # Names come from hosts_file; any other lookup goes to 127.0.0.1:53 (nothing there).
        f"hosts_file {directory}/hosts",
        "dns_nameservers 127.0.0.1",
        "visible_hostname covey-bench-squid",
        f"max_filedescriptors {FD_LIMIT}",
        "shutdown_lifetime 1 seconds",
        "acl CONNECT method CONNECT",
    ]
    who = ""
    if auth:
        lines += [
            f"auth_param basic program {SQUID_AUTH_HELPER} {directory}/passwd",
            "auth_param basic children 5 startup=1",
            "auth_param basic realm covey-bench",
            "auth_param basic credentialsttl 2 hours",
            "acl agents proxy_auth REQUIRED",
        ]
        who = " agents"
    for i, (host, host_port) in enumerate(allowlist):
        lines += [
            f"acl allow{i}_host dstdomain {host}",
            f"acl allow{i}_port port {host_port}",
            f"http_access allow CONNECT allow{i}_host allow{i}_port{who}",
        ]
    lines.append("http_access deny all")
    return "\n".join(lines) + "\n"


def start_squid(
    processes: Processes,
    work: Path,
    allowlist: Sequence[tuple[str, int]],
    credentials: str | None = None,
) -> tuple[subprocess.Popen[bytes], int, str]:
    """A Squid of its own in ``work``; with ``credentials`` (user:password), Basic proxy
    authentication through Debian's helper, its password file an Apache MD5 hash (openssl)."""
    binary = squid_binary()
    version = subprocess.run(  # noqa: S603 - the squid binary found above
        [binary, "-v"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.splitlines()[0]
    auth = credentials is not None
    name = "squid-auth" if auth else "squid"
    directory = work / name
    directory.mkdir()
    port = free_port()
    (directory / "squid.conf").write_text(squid_config(directory, port, allowlist, auth=auth))
    (directory / "hosts").write_text("".join(f"{UPSTREAM_IP} {h}\n" for h, _ in allowlist))
    if credentials is not None:
        if not os.access(SQUID_AUTH_HELPER, os.X_OK):
            raise BenchError(f"{SQUID_AUTH_HELPER} is missing (Debian's squid package has it)")
        agent, password = credentials.split(":", 1)
        hashed = subprocess.run(  # openssl from PATH, the password on its stdin
            ["openssl", "passwd", "-apr1", "-stdin"],  # noqa: S607 - a system tool
            input=password,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        (directory / "passwd").write_text(f"{agent}:{hashed}\n")
    if os.geteuid() == 0:  # squid drops to its own user, which must write its logs here
        user = pwd.getpwnam("proxy")
        for path in (directory, *directory.iterdir()):
            os.chown(path, user.pw_uid, user.pw_gid)
    args = [binary, "-N", "-f", str(directory / "squid.conf")]
    process = processes.start(name, args, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    cache_log = directory / "cache.log"
    wait_until(
        lambda: alive(process, "squid", processes) and accepts(port),
        30,
        f"{name} listening",
        lambda: cache_log.read_text(errors="replace") if cache_log.exists() else "",
    )
    return process, port, version


# --------------------------------------------------------------------------------------------
# covey: database, proxy, control plane
# --------------------------------------------------------------------------------------------


def django_env(var_dir: Path) -> dict[str, str]:
    """The environment of every covey process: a SQLite database of its own, no outside name."""
    # The base allowlist is only a default for new organisations.
    return covey_env(var_dir, COVEY_EGRESS_BASE_ALLOWLIST=ECHO_NAME)


@dataclass
class Setup:
    """What the database holds for the run."""

    agent_id: int
    credentials: str  # username:token for Proxy-Authorization
    api_token: str  # DRF token of a superuser
    allowlist: list[str]


def prepare_database(var_dir: Path, allowlist: list[str]) -> Setup:
    """Migrate the SQLite database; make the organisation, agent, tokens and a superuser."""
    django_here(django_env(var_dir), var_dir)
    import secrets

    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connections
    from rest_framework.authtoken.models import Token

    from agents import services
    from organisations import services as organisations

    call_command("migrate", verbosity=0, interactive=False)
    organisation = organisations.create_organisation("Bench", base_allowlist=[])
    agent = services.create_agent(organisation, "builder", allowlist=allowlist)
    out = io.StringIO()
    call_command("egress_token", f"{organisation.slug}/{agent.slug}", stdout=out)
    user = get_user_model().objects.create_superuser(
        "bench", "bench@example.test", secrets.token_urlsafe(24)
    )
    token = Token.objects.create(user=user)
    setup = Setup(agent.pk, out.getvalue().strip(), token.key, allowlist)
    connections.close_all()
    return setup


def start_covey(
    processes: Processes, env: dict[str, str], nameserver: str
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {
        **env,
        "COVEY_EGRESS_NAMESERVERS": nameserver,
        "COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": f"{UPSTREAM_IP}/32",
        "COVEY_EGRESS_MAX_TUNNELS": str(MAX_TUNNELS),
        "COVEY_EGRESS_MAX_TUNNELS_PER_AGENT": str(MAX_TUNNELS_PER_AGENT),
    }
    args = [sys.executable, "manage.py", "egress_proxy", "--listen", f"127.0.0.1:{port}"]
    process = processes.start("covey", args, env)
    wait_until(
        lambda: (
            alive(process, "covey", processes)
            and "covey egress proxy listening" in processes.log("covey")
        ),
        60,
        "the covey proxy listening",
        lambda: processes.log("covey"),
    )
    return process, port


def start_control_plane(processes: Processes, env: dict[str, str]) -> int:
    port = free_port()
    gunicorn = str(Path(sys.executable).parent / "gunicorn")
    args = [gunicorn, "covey.wsgi", "--bind", f"127.0.0.1:{port}", "--workers", "1"]
    process = processes.start("control-plane", args, env)
    wait_listening(processes, process, "control-plane", port, "the control plane listening", 60)
    return port


def patch_allowlist(port: int, token: str, agent_id: int, allowlist: list[str]) -> None:
    """PATCH /api/v1/agents/{id}/ {"allowlist": [...]} as the superuser."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(
            "PATCH",
            f"/api/v1/agents/{agent_id}/",
            body=json.dumps({"allowlist": allowlist}),
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise BenchError(f"PATCH agent {agent_id}: {response.status} {body[:500]!r}")


# --------------------------------------------------------------------------------------------
# The client side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """One way to reach the upstream: straight, or through a proxy."""

    name: str
    proxy: tuple[str, int] | None = None
    credentials: str | None = None
    pid: int | None = None  # the proxy's main process; RSS counts it and its descendants


def connect_request(host: str, port: int, credentials: str | None) -> bytes:
    import base64

    auth = ""
    if credentials:
        basic = base64.b64encode(credentials.encode()).decode()
        auth = f"Proxy-Authorization: Basic {basic}\r\n"
    return f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}\r\n".encode()


def status_of(head: bytes) -> int:
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise TunnelError(f"not an HTTP answer: {head[:80]!r}")
    return int(parts[1])


def read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise TunnelError(f"the proxy closed the connection after {data[:80]!r}")
        data += chunk
        if len(data) > 65536:
            raise TunnelError("the proxy's answer has no end")
    return data


def open_tunnel(
    route: Route, host: str, port: int, context: ssl.SSLContext, timeout: float = IO_TIMEOUT
) -> tuple[ssl.SSLSocket, float]:
    """A TLS connection to host:port over the route, and the seconds it took to open."""
    started = time.perf_counter()
    sock = socket.create_connection(route.proxy or (UPSTREAM_IP, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if route.proxy is not None:
            sock.sendall(connect_request(host, port, route.credentials))
            status = status_of(read_head(sock))
            if status != 200:
                raise TunnelError(f"{route.name}: CONNECT {host}:{port} answered {status}")
        tls = context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
    return tls, time.perf_counter() - started


def connect_status(route: Route, host: str, port: int, timeout: float = 2.0) -> int:
    """The proxy's status for a CONNECT to host:port (the connection is closed after)."""
    assert route.proxy is not None  # noqa: S101 - a programming error, not a condition
    with socket.create_connection(route.proxy, timeout=timeout) as sock:
        sock.sendall(connect_request(host, port, route.credentials))
        return status_of(read_head(sock))


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


@dataclass
class Latency:
    samples: list[float] = field(default_factory=list)  # seconds
    errors: Counter[str] = field(default_factory=Counter)
    cpu_seconds: float = 0.0  # the proxy's CPU time over the measured tunnels

    def p(self, q: float) -> float | None:
        return percentile(self.samples, q) * 1000 if self.samples else None


def measure_latency(
    routes: Sequence[Route], context: ssl.SSLContext, port: int, samples: int, budget: float
) -> dict[str, Latency]:
    """Open tunnels one after another, the routes interleaved so drift hits all alike."""
    results = {route.name: Latency() for route in routes}
    for route in routes:  # warm up: first connections, imports, caches
        for _ in range(10):
            with contextlib.suppress(OSError, TunnelError):
                open_tunnel(route, ECHO_NAME, port, context)[0].close()
    cpu_before = {route.name: cpu_seconds(route.pid) for route in routes}
    deadline = time.monotonic() + budget
    for i in range(samples):
        if time.monotonic() > deadline:
            print(f"  latency: time is up after {i} rounds", flush=True)
            break
        for route in (*routes[i % len(routes) :], *routes[: i % len(routes)]):
            try:
                tls, seconds = open_tunnel(route, ECHO_NAME, port, context)
            except (OSError, TunnelError) as exc:
                results[route.name].errors[type(exc).__name__ + ": " + str(exc)[:80]] += 1
                continue
            tls.close()
            results[route.name].samples.append(seconds)
    for route in routes:
        results[route.name].cpu_seconds = cpu_seconds(route.pid) - cpu_before[route.name]
    return results


def measure_throughput(
    route: Route, context: ssl.SSLContext, port: int, total: int = STREAM_BYTES
) -> tuple[float, float]:
    """MiB/s of one transfer of ``total`` bytes through one tunnel (after the handshake),
    and the proxy's CPU seconds for it."""
    tls, _ = open_tunnel(route, BULK_NAME, port, context)
    cpu_before = cpu_seconds(route.pid)
    buffer = memoryview(bytearray(CHUNK))
    received = 0
    deadline = time.monotonic() + 120
    with tls:
        started = time.perf_counter()
        while received < total:
            n = tls.recv_into(buffer)
            if n == 0:
                raise TunnelError(f"{route.name}: the transfer ended after {received} bytes")
            received += n
            if time.monotonic() > deadline:
                raise TunnelError(f"{route.name}: the transfer took over 120 s")
        seconds = time.perf_counter() - started
    return total / MIB / seconds, cpu_seconds(route.pid) - cpu_before


@dataclass
class Held:
    opened: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    open_seconds: float = 0.0
    rss_before: float = 0.0
    rss_holding: float = 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


async def hold_tunnels(
    route: Route, context: ssl.SSLContext, port: int, count: int = HELD_TUNNELS
) -> Held:
    """Open ``count`` tunnels (CONNECT, TLS, echo), hold them all, echo again, close."""
    result = Held()
    pids = process_tree(route.pid) if route.pid else []
    result.rss_before = rss_mib(pids)
    gate = asyncio.Semaphore(OPEN_CONCURRENCY)
    writers: list[asyncio.StreamWriter] = []  # every connection, to abort what is left

    def failed(exc: BaseException) -> None:
        result.errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1

    async def ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"p")
        await writer.drain()
        if await reader.readexactly(1) != b"p":
            raise TunnelError("the echo came back wrong")

    async def open_one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        assert route.proxy is not None  # noqa: S101 - a programming error, not a condition
        async with gate:
            writer: asyncio.StreamWriter | None = None
            try:
                async with asyncio.timeout(IO_TIMEOUT):
                    reader, writer = await asyncio.open_connection(*route.proxy)
                    writers.append(writer)
                    writer.write(connect_request(ECHO_NAME, port, route.credentials))
                    status = status_of(await reader.readuntil(b"\r\n\r\n"))
                    if status != 200:
                        raise TunnelError(f"CONNECT answered {status}")
                    await writer.start_tls(context, server_hostname=ECHO_NAME)
                    await ping(reader, writer)
            except (OSError, TimeoutError, TunnelError, asyncio.IncompleteReadError) as exc:
                failed(exc)
                if writer is not None:
                    writer.transport.abort()
                return None
            return reader, writer

    async def ping_held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(IO_TIMEOUT):
                await ping(reader, writer)
        except (OSError, TimeoutError, TunnelError, asyncio.IncompleteReadError) as exc:
            failed(exc)

    try:
        started = time.perf_counter()
        opened = await asyncio.gather(*(open_one() for _ in range(count)))
        result.open_seconds = time.perf_counter() - started
        held = [pair for pair in opened if pair is not None]
        result.opened = len(held)
        await asyncio.sleep(1.0)  # let the proxy settle with all of them open
        result.rss_holding = rss_mib(pids)
        await asyncio.gather(*(ping_held(reader, writer) for reader, writer in held))
        result.rss_holding = max(result.rss_holding, rss_mib(pids))
        for _, writer in held:
            writer.close()
        closing = [asyncio.ensure_future(writer.wait_closed()) for _, writer in held]
        if closing:
            await asyncio.wait(closing, timeout=IO_TIMEOUT)
    finally:  # also when cancelled: nothing stays open, nothing waits for a TLS goodbye
        for writer in writers:
            writer.transport.abort()
    return result


def run_async[T](coroutine: Coroutine[Any, Any, T], limit: float) -> T:
    """asyncio.run(coroutine) within ``limit`` seconds. Inside the loop, SIGALRM (the run's
    time limit) and SIGTERM cancel it cleanly; BenchStop is raised once the loop is done."""
    signals = (signal.SIGALRM, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    stopped_by: list[int] = []

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def stop(sig: int) -> None:
            stopped_by.append(sig)
            if task is not None:
                task.cancel()

        for sig in signals:
            loop.add_signal_handler(sig, stop, sig)
        try:
            return await asyncio.wait_for(coroutine, limit)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if not stopped_by:
            raise
        if stopped_by[0] == signal.SIGALRM:
            raise BenchStop("the benchmark ran over its time limit") from None
        raise BenchStop(f"stopped by signal {stopped_by[0]}") from None
    finally:
        for sig, handler in previous.items():  # remove_signal_handler left SIG_DFL
            signal.signal(sig, handler)


def measure_resolver(nameserver: str, samples: int) -> float:
    """p50 ms of covey's own resolver (A+AAAA, its cache emptied each time) against the
    loopback DNS server: what a CONNECT to a name served with TTL 0 pays."""
    from egress.proxy.resolver import Resolver

    async def run() -> list[float]:
        resolver = Resolver([nameserver])
        times = []
        for _ in range(samples):
            resolver.forget()
            started = time.perf_counter()
            await resolver.resolve(ECHO_NAME)
            times.append(time.perf_counter() - started)
        return times

    return statistics.median(run_async(run(), IO_TIMEOUT)) * 1000


@dataclass
class Propagation:
    seconds: list[float] = field(default_factory=list)
    patch_seconds: list[float] = field(default_factory=list)
    failures: int = 0


def measure_propagation(
    covey: Route, api_port: int, setup: Setup, context: ssl.SSLContext, port: int, trials: int
) -> Propagation:
    """PATCH a new host onto the allowlist; time until a CONNECT to it gets 200."""
    result = Propagation()
    allowlist = list(setup.allowlist)
    for i in range(trials):
        host = NEW_NAMES[i]
        before = connect_status(covey, host, port)
        if before != 403:
            raise BenchError(f"{host} was not refused before the change (status {before})")
        allowlist.append(f"{host}:{port}")
        started = time.perf_counter()
        patch_allowlist(api_port, setup.api_token, setup.agent_id, allowlist)
        result.patch_seconds.append(time.perf_counter() - started)
        deadline = started + PROPAGATION_TIMEOUT
        while True:
            attempt = time.perf_counter()
            with contextlib.suppress(OSError, TunnelError):
                if connect_status(covey, host, port) == 200:
                    result.seconds.append(time.perf_counter() - started)
                    break
            if attempt > deadline:
                result.failures += 1
                break
            time.sleep(max(0.0, attempt + POLL_INTERVAL - time.perf_counter()))
        # Untimed: the new tunnel really reaches the upstream.
        with contextlib.suppress(OSError, TunnelError):
            open_tunnel(covey, host, port, context)[0].close()
        time.sleep(0.1 + (i * 0.071) % 0.25)  # spread the changes over the proxy's poll cycle
    return result


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass
class Results:
    quick: bool = False
    versions: dict[str, str] = field(default_factory=dict)
    resolution: dict[str, str] = field(default_factory=dict)
    resolver_ms: float | None = None
    latency: dict[str, Latency] = field(default_factory=dict)
    throughput: dict[str, list[float]] = field(default_factory=dict)  # MiB/s per run
    throughput_cpu: dict[str, list[float]] = field(default_factory=dict)  # proxy CPU s per run
    load: float | None = None
    held: dict[str, Held] = field(default_factory=dict)
    propagation: Propagation | None = None
    poll_seconds: float | None = None


def report(results: Results) -> str:
    out: list[str] = []
    add = out.append
    lat = results.latency
    p50 = {name: lat[name].p(50) if name in lat else None for name in ROUTES}
    p99 = {name: lat[name].p(99) if name in lat else None for name in ROUTES}

    def added(values: dict[str, float | None], name: str) -> float | None:
        own, floor = values.get(name), values.get("direct")
        return None if own is None or floor is None else own - floor

    tput = {name: statistics.median(v) if v else None for name, v in results.throughput.items()}
    for name in ROUTES:
        tput.setdefault(name, None)

    n = {name: len(lat[name].samples) for name in lat}
    add("")
    add("=" * 100)
    add(
        "covey egress proxy vs Squid vs direct: loopback only"
        + (" (--quick)" if results.quick else "")
    )
    for key, value in results.versions.items():
        add(f"  {key:<10} {value}")
    if results.load is not None:
        add(f"  {'machine':<10} {os.cpu_count()} cores, load average {results.load:.2f} at start")
    add("name resolution:")
    for key, value in results.resolution.items():
        add(f"  {key:<10} {value}")
    if results.resolver_ms is not None:
        add(
            f"  {'':<10} (covey's resolver alone, uncached A+AAAA, as for a TTL-0 name: "
            f"p50 {results.resolver_ms:.2f} ms)"
        )
    add(
        "auth/logging: covey checks the agent's Basic token on every CONNECT and logs every "
        "decision to its database;"
    )
    add("  squid has no auth (the same header is sent and ignored) and logs to access.log;")
    add(
        "  squid-auth checks it (proxy_auth REQUIRED, basic_ncsa_auth, credentials kept 2 h) and"
        " logs to access.log."
    )
    add("")
    head = (
        f"{'metric':<42}"
        + "".join(f"{name:>11}" for name in ROUTES)
        + f"{'covey/direct':>14}{'covey/squid':>13}{'covey/squid-auth':>18}"
    )
    add(head)
    add("-" * len(head))

    def row(
        label: str, values: Mapping[str, float | None], digits: int = 2, ratios: bool = True
    ) -> None:
        cells = "".join(f"{fmt(values.get(k), digits):>11}" for k in ROUTES)
        extra = ""
        if ratios:
            extra = (
                f"{ratio(values.get('covey'), values.get('direct')):>14}"
                f"{ratio(values.get('covey'), values.get('squid')):>13}"
                f"{ratio(values.get('covey'), values.get(PEER)):>18}"
            )
        add(f"{label:<42}{cells}{extra}")

    samples = "/".join(str(n.get(k, 0)) for k in ROUTES)
    row(f"connect p50 (ms, n={samples})", p50)
    row("connect p99 (ms)", p99)
    added50 = {k: added(p50, k) for k in PROXIES}
    added99 = {k: added(p99, k) for k in PROXIES}
    row("added latency p50 (ms, vs direct)", added50, ratios=False)
    row("added latency p99 (ms, vs direct)", added99, ratios=False)
    errors = {k: float(sum(v.errors.values())) for k, v in lat.items()}
    row("latency errors", errors, digits=0, ratios=False)
    row(
        "proxy CPU per tunnel (ms)",
        {
            k: v.cpu_seconds * 1000 / len(v.samples)
            for k, v in lat.items()
            if k != "direct" and v.samples
        },
    )
    runs = len(results.throughput.get("covey", []))
    row(f"throughput 200 MiB (MiB/s, median of {runs})", tput, digits=0)
    row(
        "proxy CPU per 200 MiB (s)",
        {k: statistics.median(v) for k, v in results.throughput_cpu.items() if k != "direct"},
    )
    held = results.held
    row(
        f"{HELD_TUNNELS} tunnels: errors",
        {k: float(v.error_count) for k, v in held.items()},
        digits=0,
        ratios=False,
    )
    row("  opened", {k: float(v.opened) for k, v in held.items()}, digits=0, ratios=False)
    row(
        f"  time to open all (s, {OPEN_CONCURRENCY} at a time)",
        {k: v.open_seconds for k, v in held.items()},
        ratios=False,
    )
    row("  RSS before (MiB)", {k: v.rss_before for k, v in held.items()}, digits=1)
    row("  RSS holding (MiB)", {k: v.rss_holding for k, v in held.items()}, digits=1)
    row(
        "  RSS per tunnel (KiB)",
        {k: (v.rss_holding - v.rss_before) * 1024 / max(v.opened, 1) for k, v in held.items()},
        digits=1,
    )
    prop = results.propagation
    prop50 = statistics.median(prop.seconds) * 1000 if prop and prop.seconds else None
    propmax = max(prop.seconds) * 1000 if prop and prop.seconds else None
    trials = len(prop.seconds) + prop.failures if prop else 0
    row(f"propagation p50 (ms, n={trials})", {"covey": prop50}, digits=0, ratios=False)
    row("propagation max (ms)", {"covey": propmax}, digits=0, ratios=False)
    if prop and prop.patch_seconds:
        row(
            "  of which the PATCH, p50 (ms)",
            {"covey": statistics.median(prop.patch_seconds) * 1000},
            digits=0,
            ratios=False,
        )
    if results.poll_seconds is not None:
        add(f"  (the proxy polls the database every {results.poll_seconds:g} s: the default)")
    add("")
    add("targets")

    def target(name: str, figures: str, ok: bool | None) -> None:
        add(f"  {name:<40}{figures:<52}{verdict(ok)}")

    def share(values: Mapping[str, float | None]) -> float | None:
        own, peer = values.get("covey"), values.get(PEER)
        return None if own is None or not peer else own / peer

    cpu = {k: v.cpu_seconds * 1000 / len(v.samples) for k, v in lat.items() if v.samples}
    cpu_share = share(cpu)
    target(
        f"CPU per tunnel <= {CPU_RATIO:g}x squid-auth's",
        f"covey {fmt(cpu.get('covey'), 2)} ms, squid-auth {fmt(cpu.get(PEER), 2)} ms:"
        f" {fmt(cpu_share, 2)}x",
        None if cpu_share is None else cpu_share <= CPU_RATIO,
    )
    sq, cv = added50.get(PEER), added50.get("covey")
    gap = None if sq is None or cv is None else cv - sq
    target(
        f"added latency p50 <= squid-auth's + {CONNECT_GAP_MS:g} ms",
        f"covey +{fmt(cv, 2)} ms, squid-auth +{fmt(sq, 2)} ms: gap {fmt(gap, 2)} ms",
        None if gap is None else gap <= CONNECT_GAP_MS,
    )
    tput_share = share(tput)
    target(
        f"throughput >= {THROUGHPUT_RATIO:g}x squid-auth's",
        f"covey/squid-auth = {fmt(tput_share, 2)}",
        None if tput_share is None else tput_share >= THROUGHPUT_RATIO,
    )
    rss_share = share({k: v.rss_before for k, v in held.items()})
    target(
        f"memory at start <= {MEMORY_RATIO:g}x squid-auth's",
        f"covey/squid-auth = {fmt(rss_share, 2)}",
        None if rss_share is None else rss_share <= MEMORY_RATIO,
    )
    cv_held, sq_held = held.get("covey"), held.get(PEER)
    target(
        f"{HELD_TUNNELS:,} tunnels with no errors (covey)",
        f"covey {fmt(float(cv_held.error_count) if cv_held else None, 0)} errors, "
        f"squid-auth {fmt(float(sq_held.error_count) if sq_held else None, 0)}",
        None if cv_held is None else cv_held.error_count == 0 and cv_held.opened == HELD_TUNNELS,
    )
    failures = prop.failures if prop else 0
    target(
        "propagation < 1 s (every trial)",
        f"p50 {fmt(prop50, 0)} ms, max {fmt(propmax, 0)} ms, {failures} timed out",
        None if propmax is None else propmax < PROPAGATION_LIMIT_S * 1000 and not failures,
    )
    kinds: list[tuple[str, Counter[str]]] = [
        *((f"{k}, latency", v.errors) for k, v in lat.items()),
        *((f"{k}, {HELD_TUNNELS} tunnels", v.errors) for k, v in held.items()),
    ]
    for name, errors_seen in kinds:
        for error, count in errors_seen.most_common(3):
            add(f"  {name}: {count} x {error}")
    add("=" * 100)
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FD_LIMIT if hard == resource.RLIM_INFINITY else min(FD_LIMIT, hard)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))  # the proxies inherit it
    if wanted < 2 * HELD_TUNNELS + 200:
        raise BenchError(f"the open-file limit ({hard}) is too low for {HELD_TUNNELS} tunnels")


def make_ca(work: Path) -> tuple[ssl.SSLContext, Path]:
    """A test CA (trustme); the upstream's certificate names every bench name."""
    from tests.netfixtures import TestCA

    ca = TestCA(work)
    cert_file = work / "upstream.pem"
    ca.ca.issue_cert(*ALL_NAMES).private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    return ca.client_context(), cert_file


def run(
    plan: Plan,
    results: Results,
    work: Path,
    processes: Processes,
    stack: contextlib.ExitStack,
) -> None:
    results.load = os.getloadavg()[0]
    step(f"working in {work}; load average {results.load:.2f} on {os.cpu_count()} cores")
    context, cert_file = make_ca(work)
    dns, dns_port = start_child("bench-dns", serve_dns, float(plan.time_limit))
    stack.callback(dns.stop)
    nameserver = f"{DNS_IP}@{dns_port}"
    upstream, (echo_port, bulk_port) = start_child(
        "bench-upstream", serve_upstream, str(cert_file), STREAM_BYTES, float(plan.time_limit)
    )
    stack.callback(upstream.stop)
    step(
        f"DNS pid {dns.process.pid} on {nameserver}; "
        f"upstream pid {upstream.process.pid} on {UPSTREAM_IP}:{echo_port} and :{bulk_port}"
    )
    allowlist = [(ECHO_NAME, echo_port), (BULK_NAME, bulk_port)]

    step("migrating a SQLite database and creating the agent")
    var_dir = work / "var"
    setup = prepare_database(var_dir, [f"{h}:{p}" for h, p in allowlist])
    env = django_env(var_dir)
    from django.conf import settings

    results.poll_seconds = settings.COVEY_EGRESS_POLICY_POLL

    squid_process, squid_port, squid_version = start_squid(processes, work, allowlist)
    step(f"squid pid {squid_process.pid} on 127.0.0.1:{squid_port}")
    authed_process, authed_port, _ = start_squid(processes, work, allowlist, setup.credentials)
    step(f"squid-auth pid {authed_process.pid} on 127.0.0.1:{authed_port}")
    covey_process, covey_port = start_covey(processes, env, nameserver)
    step(f"covey proxy pid {covey_process.pid} on 127.0.0.1:{covey_port}")
    api_port = start_control_plane(processes, env)
    step(f"control plane (gunicorn) on 127.0.0.1:{api_port}")

    import mitmproxy.version

    results.versions = {
        "python": platform.python_version(),
        "squid": squid_version,
        "mitmproxy": mitmproxy.version.VERSION,
        "openssl": ssl.OPENSSL_VERSION,
    }
    results.resolution = {
        "direct": f"none: the client dials {UPSTREAM_IP} itself",
        "squid": "hosts_file (in memory, no DNS query: what its ipcache gives once warm)",
        "squid-auth": "the same",
        "covey": f"COVEY_EGRESS_NAMESERVERS={nameserver}: the bench's UDP DNS server "
        f"(own process, TTL {DNS_TTL}); A+AAAA, kept for the TTL like any resolver's",
    }
    direct = Route("direct")
    squid = Route("squid", ("127.0.0.1", squid_port), setup.credentials, squid_process.pid)
    authed = Route("squid-auth", ("127.0.0.1", authed_port), setup.credentials, authed_process.pid)
    covey = Route("covey", ("127.0.0.1", covey_port), setup.credentials, covey_process.pid)
    routes = (direct, squid, authed, covey)
    for route in routes:  # every path works before anything is timed
        open_tunnel(route, ECHO_NAME, echo_port, context)[0].close()
    results.resolver_ms = measure_resolver(nameserver, 100)

    step(f"1. connect latency: {plan.latency_samples} tunnels per path, interleaved")
    results.latency = measure_latency(
        routes, context, echo_port, plan.latency_samples, budget=plan.time_limit / 4
    )
    step(f"2. throughput: {plan.throughput_runs} x 200 MiB per path")
    for _ in range(plan.throughput_runs):
        for route in routes:
            rate, cpu = measure_throughput(route, context, bulk_port)
            results.throughput.setdefault(route.name, []).append(rate)
            results.throughput_cpu.setdefault(route.name, []).append(cpu)
    step(f"3. {HELD_TUNNELS} tunnels held at once, squid, squid-auth, then covey")
    for route in (squid, authed, covey):
        holding = hold_tunnels(route, context, echo_port)
        results.held[route.name] = run_async(holding, HOLD_TIMEOUT)
        time.sleep(2)  # let the proxy close its upstream side
    step(f"4. policy propagation: {plan.propagation_trials} allowlist changes through the API")
    results.propagation = measure_propagation(
        covey, api_port, setup, context, echo_port, plan.propagation_trials
    )
    step("done; stopping everything")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = parser.parse_args(argv)
    plan = Plan.make(args.quick)
    results = Results(quick=args.quick)
    raise_fd_limit()
    failed = run_bench(
        "covey-bench-",
        plan.time_limit,
        lambda work, processes, stack: run(plan, results, work, processes, stack),
    )
    print(report(results), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
