"""The egress probe: what a sandbox can reach, tried from inside one.

A probe is a list of :class:`Check`. Each names a category, a target and what must happen:
``reach`` (the allowed vendor, through the proxy, must work), ``refuse`` (the proxy must refuse
it with covey's own answer) or ``block`` (no packet may get there and back). The runner host
turns the list into JSON, runs :data:`SCRIPT` in a container placed exactly like a sandbox, and
reads back one observation per check; :func:`judge` says, for each, whether it held.

What counts as blocked is strict, because a probe can only prove what answers: a TCP connect
that times out or finds no route is blocked; one that is refused is a leak (a reset came back,
so packets got there). A DNS query that gets any reply from an outside resolver is a leak; from
Docker's embedded resolver, a reply that names addresses is.

Pure Python, no Django: runner hosts (no database) use it, and so does the control plane to
print what a runner reported.
"""

import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from allowlists.entries import split_host_port


class Category(StrEnum):
    """What a check is about; the order is the order the lines are printed in."""

    ALLOWED = "allowed"  # the allowed vendor endpoint, through the proxy: must work
    OFF_LIST = "off-list"  # a name not on the allowlist, through the proxy
    RAW_IP = "raw-ip"  # an IP address, through the proxy
    INTERNET = "internet"  # a public address, directly
    PRIVATE = "private"  # private ranges, directly
    METADATA = "metadata"  # the cloud metadata address, directly
    HOST = "host"  # the runner host's own addresses and listening ports
    CONTROL_PLANE = "control-plane"  # the control plane's web, database, broker
    PEER = "peer"  # another agent's sandbox on the same network
    DNS_EMBEDDED = "dns-embedded"  # Docker's resolver in the container, for an outside name
    DNS_OUTSIDE = "dns-outside"  # a resolver outside, directly
    IPV6 = "ipv6"  # any IPv6 address in the sandbox, any IPv6 path out


class Expect(StrEnum):
    REACH = "reach"
    REFUSE = "refuse"
    BLOCK = "block"


class Verdict(StrEnum):
    OK = "ok"
    LEAK = "LEAK"  # something that must be blocked or refused was not
    FAIL = "FAIL"  # the probe could not show what it had to (the allowed vendor failed…)
    SKIP = "skip"  # nothing to try it with (said why)


@dataclass(frozen=True)
class Check:
    """One thing to try from inside the sandbox."""

    category: Category
    kind: str  # tcp, proxy, dns, ipv6
    host: str = ""  # address (tcp, dns server) or name (proxy)
    port: int = 0
    name: str = ""  # dns: the name asked for
    expect: Expect = Expect.BLOCK
    skip: str = ""  # why it is not tried

    @property
    def target(self) -> str:
        if not self.host and self.kind != "ipv6":
            return f"{self.kind} (nothing)"
        if self.kind == "ipv6":
            return "the sandbox's interfaces" + (f", {self.host}" if self.host else "")
        if self.kind == "dns":
            return f"udp {_join(self.host, self.port)} for {self.name}"
        via = "via proxy " if self.kind == "proxy" else "tcp "
        return via + _join(self.host, self.port)


@dataclass(frozen=True)
class Result:
    """What happened to one check, and whether that is what had to happen."""

    category: str
    target: str
    verdict: Verdict
    observed: str

    def line(self) -> str:
        return f"{self.verdict.value:<4}  {self.category:<13}  {self.target:<44}  {self.observed}"

    def as_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Result":
        return cls(
            category=str(data["category"]),
            target=str(data["target"]),
            verdict=Verdict(str(data["verdict"])),
            observed=str(data["observed"]),
        )


def passed(results: Sequence[Result]) -> bool:
    """Nothing leaked and nothing failed (skipped checks said why)."""
    return bool(results) and all(r.verdict in (Verdict.OK, Verdict.SKIP) for r in results)


def failure_line(detail: str) -> str:
    """The one line of a probe that could not run."""
    return f"{Verdict.FAIL.value:<4}  {detail}"


def summary(results: Sequence[Result]) -> str:
    """One line: how many checks, leaks and failures, and the first of them."""
    leaks = [r for r in results if r.verdict is Verdict.LEAK]
    fails = [r for r in results if r.verdict is Verdict.FAIL]
    text = f"{len(results)} checks, {len(leaks)} leaks, {len(fails)} failed"
    if first := (leaks or fails):
        text += f"; first: {first[0].category} {first[0].target}: {first[0].observed}"
    return text


def parse_address(text: str, default_port: int | None = None) -> tuple[str, int]:
    """``ip:port`` or ``[v6]:port`` (the port may be left out when there is a default);
    ValueError saying what is wrong."""
    text = text.strip()
    host, port = split_host_port(text, default_port)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address with a port") from None
    return host, port


def parse_host_port(text: str, default_port: int = 443) -> tuple[str, int]:
    """``name[:port]`` for targets through the proxy."""
    try:
        host, port = split_host_port(text.strip(), default_port)
    except ValueError as exc:
        raise ValueError(f"{text!r} must be host or host:port ({exc})") from None
    if not host:
        raise ValueError(f"{text!r} must be host or host:port")
    return host.lower(), port


def judge(checks: Sequence[Check], observations: Sequence[Mapping[str, Any]]) -> list[Result]:
    """Each check with what was seen of it (``observations`` in the same order, as the
    script printed them); a missing observation is a failure."""
    results = []
    for index, check in enumerate(checks):
        seen: Any = observations[index] if index < len(observations) else None
        if check.skip:
            results.append(Result(check.category, check.target, Verdict.SKIP, check.skip))
        elif not isinstance(seen, Mapping):
            results.append(Result(check.category, check.target, Verdict.FAIL, "no observation"))
        else:
            verdict, words = _verdict(check, seen)
            results.append(Result(check.category, check.target, verdict, words))
    return results


def _verdict(check: Check, seen: Mapping[str, Any]) -> tuple[Verdict, str]:
    if "error" in seen:
        return Verdict.FAIL, f"the probe broke: {seen['error']}"
    if check.kind == "tcp":
        outcome = str(seen.get("outcome"))
        if outcome in ("timeout", "unreachable"):
            return Verdict.OK, f"blocked ({seen.get('detail') or outcome})"
        if outcome == "connected":
            return Verdict.LEAK, "connected"
        if outcome == "refused":
            return Verdict.LEAK, "refused: a reset came back, so packets got there"
        return Verdict.FAIL, f"unexpected: {seen}"
    if check.kind == "proxy":
        return _proxy_verdict(check, seen)
    if check.kind == "dns":
        if seen.get("outcome") != "reply":
            return Verdict.OK, f"no reply ({seen.get('detail') or seen.get('outcome')})"
        answers, rcode = int(seen.get("answers", 0)), seen.get("rcode")
        if check.category == Category.DNS_EMBEDDED and answers == 0:
            return Verdict.OK, f"no addresses (rcode {rcode})"
        return Verdict.LEAK, f"a reply: rcode {rcode}, {answers} answers"
    if check.kind == "ipv6":
        addresses = [str(a) for a in seen.get("addresses") or []]
        if addresses:
            return Verdict.LEAK, f"IPv6 addresses: {', '.join(addresses)}"
        v6_outcome = seen.get("outcome")
        if v6_outcome in ("connected", "refused"):
            return Verdict.LEAK, f"an IPv6 connect was {v6_outcome}"
        return Verdict.OK, "no IPv6 address" + (f", connect {v6_outcome}" if v6_outcome else "")
    return Verdict.FAIL, f"unknown kind {check.kind}"


def _proxy_verdict(check: Check, seen: Mapping[str, Any]) -> tuple[Verdict, str]:
    outcome = str(seen.get("outcome"))
    if outcome != "answered":
        return Verdict.FAIL, f"the proxy did not answer ({seen.get('detail') or outcome})"
    status, reason = int(seen.get("status", 0)), str(seen.get("deny_reason") or "")
    if check.expect is Expect.REACH:
        if status == 200 and seen.get("upstream", "ok") == "ok":
            return Verdict.OK, "reached through the proxy"
        if status == 200:
            return Verdict.FAIL, f"the proxy let it through, then: {seen.get('upstream')}"
        return Verdict.FAIL, f"the proxy answered {status} {reason}".rstrip()
    if status == 200 or (status and not reason and check.port == 80 and status < 400):
        return Verdict.LEAK, f"the proxy let it through ({status})"
    if reason:
        return Verdict.OK, f"refused: {status} {reason}"
    return Verdict.FAIL, f"refused with {status} but not by covey (no X-Covey-Deny-Reason)"


def _join(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}" if port else shown


def plan_json(checks: Sequence[Check], proxy: str, credentials: str, timeout: float) -> str:
    """What :data:`SCRIPT` reads from ``COVEY_PROBE``."""
    return json.dumps(
        {
            "proxy": proxy,
            "credentials": credentials,
            "timeout": timeout,
            "checks": [
                {"kind": c.kind, "host": c.host, "port": c.port, "name": c.name}
                for c in checks
                if not c.skip
            ],
        }
    )


def observations(checks: Sequence[Check], printed: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Spread the script's observations (one per check tried) over every check."""
    found = iter(printed)
    return [{} if c.skip else next(found, None) for c in checks]


# Runs in the probe container (python3 of the sandbox image, as the sandbox's user). Reads the
# plan from COVEY_PROBE, tries every check at once, prints {"observations": [...]} as one line.
SCRIPT = r"""
import base64, json, os, random, socket, ssl, struct, threading, time
plan = json.loads(os.environ["COVEY_PROBE"])
T = float(plan["timeout"])
out = [None] * len(plan["checks"])

def why(exc):
    return os.strerror(exc.errno) if exc.errno else str(exc)

def tcp(host, port, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(T)
    try:
        s.connect((host, port))
        return {"outcome": "connected"}
    except ConnectionRefusedError:
        return {"outcome": "refused"}
    except (socket.timeout, TimeoutError):
        return {"outcome": "timeout", "detail": f"no answer in {T:g} s"}
    except OSError as exc:
        return {"outcome": "unreachable", "detail": why(exc)}
    finally:
        s.close()

def proxy(host, port):
    p_host, _, p_port = plan["proxy"].rpartition(":")
    if not p_host:
        return {"outcome": "no-proxy", "detail": "no proxy to ask"}
    auth = base64.b64encode(plan["credentials"].encode()).decode()
    shown = f"[{host}]" if ":" in host else host
    deadline = time.monotonic() + 3 * T
    while True:
        s = socket.socket()
        s.settimeout(T)
        try:
            s.connect((p_host, int(p_port)))
            if port == 80:
                head = f"GET http://{shown}/ HTTP/1.1\r\nHost: {shown}\r\nConnection: close"
            else:
                head = f"CONNECT {shown}:{port} HTTP/1.1\r\nHost: {shown}:{port}"
            s.sendall(f"{head}\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
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
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            if status == 407 and time.monotonic() < deadline:
                time.sleep(0.2)  # the proxy may not have this token's policy yet
                continue
            seen = {"outcome": "answered", "status": status,
                    "deny_reason": headers.get("x-covey-deny-reason", "")}
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

def dns(server, port, name):
    ident = random.randrange(65536)
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.strip(".").split(".")) + b"\0"
    query = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question + b"\0\1\0\1"
    family = socket.AF_INET6 if ":" in server else socket.AF_INET
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.settimeout(T)
    try:
        s.sendto(query, (server, port))
        while True:
            reply = s.recv(4096)
            if len(reply) >= 12 and struct.unpack(">H", reply[:2])[0] == ident:
                return {"outcome": "reply", "rcode": reply[3] & 15,
                        "answers": struct.unpack(">H", reply[6:8])[0]}
    except (socket.timeout, TimeoutError):
        return {"outcome": "timeout", "detail": f"no reply in {T:g} s"}
    except OSError as exc:
        return {"outcome": "unreachable", "detail": why(exc)}
    finally:
        s.close()

def ipv6(host, port):
    seen = {"addresses": []}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if fields and fields[-1] != "lo":
                    raw = fields[0]
                    address = ":".join(raw[i:i + 4] for i in range(0, 32, 4))
                    seen["addresses"].append(f"{address}%{fields[-1]}")
    except OSError:
        pass  # no IPv6 in this kernel at all
    if host:
        try:
            seen.update(tcp(host, port, socket.AF_INET6))
        except OSError as exc:
            seen.update({"outcome": "unreachable", "detail": str(exc)})
    return seen

def run(index, check):
    try:
        kind = check["kind"]
        if kind == "tcp":
            out[index] = tcp(check["host"], check["port"])
        elif kind == "proxy":
            out[index] = proxy(check["host"], check["port"])
        elif kind == "dns":
            out[index] = dns(check["host"], check["port"], check["name"])
        elif kind == "ipv6":
            out[index] = ipv6(check["host"], check["port"])
        else:
            out[index] = {"error": f"unknown kind {kind}"}
    except Exception as exc:
        out[index] = {"error": f"{type(exc).__name__}: {exc}"}

threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(plan["checks"])]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"observations": out}), flush=True)
"""
