"""The program that runs inside probe containers, with the sandbox image's ``python3`` as the
sandbox's user: the standard library only, nothing of covey (the image has none of it), and
nothing newer than Python 3.7 (ruff checks this file against 3.7; a test parses it as 3.7). The
runner host sends this file's own source (``python3 -c <source> <mode> ...``), so what runs is
what ruff, mypy and the tests see.

Modes:

- ``probe``: read the plan from ``COVEY_PROBE`` (:func:`runners.probe.checks.plan_json`), try
  every check at once, print ``{"observations": [...]}`` as one line.
- ``peer PORT``: listen on PORT and close every connection (another sandbox, to be reached or
  not); prints ``ready`` once it listens.
- ``proxy-check HOST PORT``: does an HTTP proxy answer at HOST:PORT; exit status 0 when it does.
"""

import base64
import json
import os
import random
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

Seen = Dict[str, Any]


def why(exc: OSError) -> str:
    return os.strerror(exc.errno) if exc.errno else str(exc)


def tcp(host: str, port: int, timeout: float, family: int = socket.AF_INET) -> Seen:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        return {"outcome": "connected"}
    except ConnectionRefusedError:
        return {"outcome": "refused"}
    except (socket.timeout, TimeoutError):  # one class only from Python 3.10
        return {"outcome": "timeout", "detail": f"no answer in {timeout:g} s"}
    except OSError as exc:
        return {"outcome": "unreachable", "detail": why(exc)}
    finally:
        s.close()


def read_head(s: socket.socket) -> Tuple[int, Dict[str, str]]:
    """An HTTP response's status and headers (lower-case names)."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 65536:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    lines = head.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


def proxy(plan: Dict[str, Any], host: str, port: int, timeout: float) -> Seen:
    """Ask the proxy for host:port as the plan's agent (CONNECT, or GET for port 80)."""
    p_host, _, p_port = str(plan["proxy"]).rpartition(":")
    if not p_host:
        return {"outcome": "no-proxy", "detail": "no proxy to ask"}
    auth = base64.b64encode(str(plan["credentials"]).encode()).decode()
    shown = f"[{host}]" if ":" in host else host
    deadline = time.monotonic() + 3 * timeout
    while True:
        s = socket.socket()
        s.settimeout(timeout)
        try:
            s.connect((p_host.strip("[]"), int(p_port)))
            if port == 80:
                head = f"GET http://{shown}/ HTTP/1.1\r\nHost: {shown}\r\nConnection: close"
            else:
                head = f"CONNECT {shown}:{port} HTTP/1.1\r\nHost: {shown}:{port}"
            s.sendall(f"{head}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
            status, headers = read_head(s)
            if status == 407 and time.monotonic() < deadline:
                time.sleep(0.2)  # the proxy may not have this token's policy yet
                continue
            gateway_error = status in (502, 503, 504) and not headers.get("x-covey-deny-reason")
            if gateway_error and time.monotonic() < deadline:
                # Not covey's refusal: its way to the upstream may still be coming up (a
                # network just remade). Asking again can only show more: reached, or a leak.
                time.sleep(0.5)
                continue
            seen: Seen = {
                "outcome": "answered",
                "status": status,
                "deny_reason": headers.get("x-covey-deny-reason", ""),
            }
            if status == 200 and port != 80:
                try:
                    context = ssl.create_default_context()
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                    sni = None if host.replace(".", "").isdigit() else host
                    context.wrap_socket(s, server_hostname=sni).close()
                    seen["upstream"] = "ok"
                except (OSError, ssl.SSLError) as exc:
                    seen["upstream"] = f"TLS handshake failed: {exc}"
            return seen
        except OSError as exc:
            return {"outcome": "unreachable", "detail": f"{type(exc).__name__}: {exc}"}
        finally:
            s.close()


def dns(server: str, port: int, name: str, timeout: float) -> Seen:
    """One A query for name, over UDP, to server:port."""
    ident = random.randrange(65536)  # noqa: S311 - a query id, not a secret
    labels = name.strip(".").split(".")
    question = b"".join(bytes([len(p)]) + p.encode() for p in labels) + b"\0"
    query = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question + b"\0\1\0\1"
    family = socket.AF_INET6 if ":" in server else socket.AF_INET
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.sendto(query, (server, port))
        while True:
            reply = s.recv(4096)
            if len(reply) >= 12 and struct.unpack(">H", reply[:2])[0] == ident:
                return {
                    "outcome": "reply",
                    "rcode": reply[3] & 15,
                    "answers": struct.unpack(">H", reply[6:8])[0],
                }
    except (socket.timeout, TimeoutError):
        return {"outcome": "timeout", "detail": f"no reply in {timeout:g} s"}
    except OSError as exc:
        return {"outcome": "unreachable", "detail": why(exc)}
    finally:
        s.close()


def ipv6(host: str, port: int, timeout: float) -> Seen:
    """The container's IPv6 addresses (but loopback's), and whether host:port answers."""
    addresses: List[str] = []
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if fields and fields[-1] != "lo":
                    raw = fields[0]
                    address = ":".join(raw[i : i + 4] for i in range(0, 32, 4))
                    addresses.append(f"{address}%{fields[-1]}")
    except OSError:
        pass  # no IPv6 in this kernel at all
    seen: Seen = {"addresses": addresses}
    if host:
        try:
            seen.update(tcp(host, port, timeout, socket.AF_INET6))
        except OSError as exc:
            seen.update({"outcome": "unreachable", "detail": str(exc)})
    return seen


def observe(plan: Dict[str, Any], check: Dict[str, Any]) -> Seen:
    timeout = float(plan["timeout"])
    kind = check["kind"]
    if kind == "tcp":
        return tcp(check["host"], check["port"], timeout)
    if kind == "proxy":
        return proxy(plan, check["host"], check["port"], timeout)
    if kind == "dns":
        return dns(check["host"], check["port"], check["name"], timeout)
    if kind == "ipv6":
        return ipv6(check["host"], check["port"], timeout)
    return {"error": f"unknown kind {kind}"}


def probe(plan: Dict[str, Any]) -> List[Optional[Seen]]:
    """Every check of the plan, at once; one observation each, in order."""
    checks = plan["checks"]
    out: List[Optional[Seen]] = [None] * len(checks)

    def run(index: int, check: Dict[str, Any]) -> None:
        try:
            out[index] = observe(plan, check)
        except Exception as exc:
            out[index] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(checks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def peer(port: int) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))  # noqa: S104 - to be reached (or not) from other sandboxes
    s.listen(64)
    print("ready", flush=True)
    while True:
        s.accept()[0].close()


def proxy_check(host: str, port: int) -> int:
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.settimeout(5)
            s.sendall(b"CONNECT covey-proxy-check.invalid:443 HTTP/1.1\r\n\r\n")
            answer = s.recv(64)
    except OSError as exc:
        print(f"{type(exc).__name__}: {exc.strerror or exc}")
        return 1
    if not answer.startswith(b"HTTP/"):
        print(f"something answers there, but not an HTTP proxy: {answer[:40]!r}")
        return 1
    print("answered", answer.split(b"\r\n")[0].decode(errors="replace"))
    return 0


def main(argv: List[str]) -> int:
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "probe":
        observations = probe(json.loads(os.environ["COVEY_PROBE"]))
        print(json.dumps({"observations": observations}), flush=True)
        return 0
    if mode == "peer" and len(argv) == 3:
        peer(int(argv[2]))
        return 0
    if mode == "proxy-check" and len(argv) == 4:
        return proxy_check(argv[2], int(argv[3]))
    print("usage: program.py probe | peer PORT | proxy-check HOST PORT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
