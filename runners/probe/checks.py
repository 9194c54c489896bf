"""The egress probe: what a sandbox can reach, tried from inside one.

A probe is a list of :class:`Check`. Each names a category, a target and what must happen:
``reach`` (the allowed vendor, through the proxy, must work), ``refuse`` (the proxy must refuse
it with covey's own answer) or ``block`` (no packet may get there and back). The runner host
turns the list into JSON, runs :mod:`runners.probe.program` in a container placed exactly like
a sandbox, and reads back one observation per check; :func:`judge` says, for each, whether it
held.

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

import environ

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
    program printed them); a missing observation is a failure."""
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
    """What :mod:`runners.probe.program` reads from ``COVEY_PROBE``."""
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
    """Spread the program's observations (one per check tried) over every check."""
    found = iter(printed)
    return [{} if c.skip else next(found, None) for c in checks]


@dataclass(frozen=True)
class Targets:
    """What stands for the outside world, from this host's settings (``ip:port`` each).

    The defaults are real public addresses and the cloud metadata address; tests and
    air-gapped sites set their own (COVEY_EGRESS_PROBE_*).
    """

    internet: Sequence[str] = ("1.1.1.1:443", "8.8.8.8:443")
    private: Sequence[str] = ("10.0.0.1:80", "172.16.0.1:80", "192.168.0.1:80", "192.168.1.1:80")
    metadata: Sequence[str] = ("169.254.169.254:80",)
    resolvers: Sequence[str] = ("1.1.1.1:53", "8.8.8.8:53")
    ipv6: Sequence[str] = ("[2606:4700:4700::1111]:443",)

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] | None = None) -> "Targets":
        """The targets in ``environment`` (the process's by default), unchecked: the runner
        host checks them at start, the control plane in a system check."""
        env = environ.Env()
        if environment is not None:
            env.ENVIRON = dict(environment)
        default = cls()
        return cls(
            internet=tuple(env.list("COVEY_EGRESS_PROBE_INTERNET", default=default.internet)),
            private=tuple(env.list("COVEY_EGRESS_PROBE_PRIVATE", default=default.private)),
            metadata=tuple(env.list("COVEY_EGRESS_PROBE_METADATA", default=default.metadata)),
            resolvers=tuple(env.list("COVEY_EGRESS_PROBE_RESOLVERS", default=default.resolvers)),
            ipv6=tuple(env.list("COVEY_EGRESS_PROBE_IPV6", default=default.ipv6)),
        )

    def check(self) -> None:
        """ValueError naming the first entry that is not ``ip:port``."""
        for name in ("internet", "private", "metadata", "resolvers", "ipv6"):
            for text in getattr(self, name):
                parse_address(text)
