"""The host firewall rules of hard isolation: what ``--internal`` leaves open, closed.

Each rule carries the comment ``covey:<runner>``, so covey finds, checks and removes its own
and nothing else; each says why it is there (``Rule.why``; docs/isolation.md, what Docker
leaves open). This module installs them with the ``iptables``/``ip6tables`` commands (root) and
checks they hold: every rule present, in order, and nothing ahead of them that could let the
bridge's traffic through.
"""

import shlex
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DOCKER_USER = "DOCKER-USER"
SETTLE_SECONDS = 2.0  # how long ensure_rules looks again while Docker reorders FORWARD
IPV6 = Path("/proc/net/if_inet6")


class FirewallError(Exception):
    """A rule could not be listed, installed or removed; the message says which and why."""


@dataclass(frozen=True)
class Wall:
    """What the rules of one runner's internal network are made from."""

    runner: str
    bridge: str  # the internal network's interface on the host
    subnet: str
    proxy_ip: str
    proxy_port: int


@dataclass(frozen=True)
class Rule:
    """One host firewall rule, spelled as ``iptables -S`` prints it (without ``-A CHAIN``)."""

    binary: str  # iptables or ip6tables
    chain: str
    spec: tuple[str, ...]
    why: str

    def line(self) -> str:
        """The rule as a command line appending it."""
        return shlex.join([self.binary, "-A", self.chain, *self.spec])


def comment(runner: str) -> str:
    """The comment every firewall rule of the runner carries."""
    return f"covey:{runner}"


def rules(wall: Wall) -> list[Rule]:
    """The host firewall rules of a wall, in the order they must be in each chain."""
    bridge, subnet, proxy = wall.bridge, wall.subnet, f"{wall.proxy_ip}/32"
    tag = ("-m", "comment", "--comment", comment(wall.runner))
    on_bridge, port = f"-i {bridge} -o {bridge}", wall.proxy_port
    accept = (*tag, "-j", "ACCEPT")
    found = [
        Rule(
            "iptables",
            DOCKER_USER,
            (*f"-s {subnet} -d {proxy} {on_bridge} -p tcp -m tcp --dport {port}".split(), *accept),
            "sandbox -> the proxy's port, the one way out (ICC off drops it otherwise)",
        ),
        Rule(
            "iptables",
            DOCKER_USER,
            (
                *f"-s {proxy} -d {subnet} {on_bridge} -p tcp -m tcp --sport {port}"
                f" -m conntrack --ctstate RELATED,ESTABLISHED".split(),
                *accept,
            ),
            "the proxy's replies on connections a sandbox opened",
        ),
        Rule(
            "iptables",
            DOCKER_USER,
            ("-i", bridge, *tag, "-j", "DROP"),
            "anything else from the bridge: sandbox <-> sandbox, sandbox -> anywhere",
        ),
        Rule(
            "iptables",
            DOCKER_USER,
            ("-o", bridge, *tag, "-j", "DROP"),
            "anything else into the bridge: other networks and forwarded traffic",
        ),
        Rule(
            "iptables",
            "INPUT",
            ("-i", bridge, *tag, "-j", "DROP"),
            "sandbox -> the host itself: the gateway and every other host address",
        ),
    ]
    if _has_ipv6():
        found += [
            Rule("ip6tables", "INPUT", ("-i", bridge, *tag, "-j", "DROP"), "IPv6 to the host"),
            Rule("ip6tables", "FORWARD", ("-i", bridge, *tag, "-j", "DROP"), "IPv6 out"),
            Rule("ip6tables", "FORWARD", ("-o", bridge, *tag, "-j", "DROP"), "IPv6 in"),
        ]
    return found


def check_rules(wall: Wall) -> list[str]:
    """What is missing or out of place among the wall's firewall rules; empty when every
    rule is there, in order, with nothing that could let the bridge's traffic through ahead
    of it."""
    problems = []
    tag = comment(wall.runner)
    for (binary, chain), wanted in _by_chain(rules(wall)).items():
        try:
            listed = _list(binary, chain)
        except FirewallError as exc:
            problems.append(str(exc))
            continue
        ours = [spec for spec in listed if _comment_of(spec) == tag]
        if ours != wanted:
            missing = [shlex.join(spec) for spec in wanted if spec not in ours]
            extra = [shlex.join(spec) for spec in ours if spec not in wanted]
            detail = "; ".join(
                [f"missing {m}" for m in missing]
                + [f"unexpected {e}" for e in extra]
                + ([] if missing or extra else ["out of order"])
            )
            problems.append(f"{binary} {chain}: {detail}")
            continue
        first = listed.index(wanted[0])
        for spec in listed[:first]:
            if not _harmless(spec, wall.bridge):
                problems.append(f"{binary} {chain}: {shlex.join(spec)} comes before covey's rules")
    try:
        forward = _list("iptables", "FORWARD")
    except FirewallError as exc:
        problems.append(str(exc))
    else:
        jump = ["-j", DOCKER_USER]
        if jump not in forward:
            problems.append(f"iptables FORWARD does not jump to {DOCKER_USER}")
        else:
            for spec in forward[: forward.index(jump)]:
                if not _harmless(spec, wall.bridge):
                    problems.append(
                        f"iptables FORWARD: {shlex.join(spec)} comes before {DOCKER_USER}"
                    )
    return problems


def ensure_rules(wall: Wall) -> None:
    """Install the wall's firewall rules (idempotent: rules in place are left alone)."""
    if not check_rules(wall):
        return
    remove_rules(wall.runner)
    for (binary, chain), specs in _by_chain(rules(wall)).items():
        for spec in reversed(specs):  # each at the top: the first ends up first
            _iptables(binary, "-I", chain, "1", *spec)
    if problems := settled_problems(wall):
        raise FirewallError(f"the firewall rules did not hold: {'; '.join(problems)}")


def settled_problems(wall: Wall) -> list[str]:
    """:func:`check_rules`, looked at again for up to SETTLE_SECONDS while it finds problems:
    Docker moves its DOCKER-USER jump back to the top of FORWARD whenever it makes a network
    (delete, then insert), so for a moment another rule is first. What stays out of place is
    still a problem."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while (problems := check_rules(wall)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return problems


def remove_rules(runner: str) -> None:
    """Remove every firewall rule carrying the runner's comment; none is fine."""
    tag = comment(runner)
    binaries = ("iptables", "ip6tables") if _has_ipv6() else ("iptables",)
    for binary in binaries:
        for chain in (DOCKER_USER, "INPUT", "FORWARD"):
            try:
                listed = _list(binary, chain)
            except FirewallError:
                continue  # no such chain (DOCKER-USER without Docker's iptables): nothing of ours
            for spec in listed:
                if _comment_of(spec) == tag:
                    _iptables(binary, "-D", chain, *spec)


def _by_chain(found: Iterable[Rule]) -> dict[tuple[str, str], list[list[str]]]:
    chains: dict[tuple[str, str], list[list[str]]] = {}
    for rule in found:
        chains.setdefault((rule.binary, rule.chain), []).append(list(rule.spec))
    return chains


def _iptables(binary: str, *args: str) -> str:
    try:
        result = subprocess.run(  # noqa: S603 - fixed binary, arguments covey built
            [binary, "-w", "10", *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FirewallError(f"cannot run {binary}: {exc}") from exc
    if result.returncode != 0:
        raise FirewallError(
            f"{binary} {shlex.join(args)} failed: {(result.stderr or result.stdout).strip()}"
        )
    return result.stdout


def _list(binary: str, chain: str) -> list[list[str]]:
    """The chain's rules as ``-S`` prints them, without ``-A CHAIN``, in order."""
    specs = []
    for line in _iptables(binary, "-S", chain).splitlines():
        args = shlex.split(line)
        if len(args) > 2 and args[0] == "-A" and args[1] == chain:
            specs.append(args[2:])
    return specs


def _comment_of(spec: list[str]) -> str | None:
    if "--comment" in spec:
        index = spec.index("--comment")
        return spec[index + 1] if index + 1 < len(spec) else None
    return None


def _harmless(spec: list[str], bridge: str) -> bool:
    """Whether a rule ahead of covey's cannot let the bridge's traffic through."""
    if (_comment_of(spec) or "").startswith("covey:"):
        return True
    target = spec[spec.index("-j") + 1] if "-j" in spec[:-1] else None
    if target in ("DROP", "REJECT", "LOG"):
        return True
    if "-i" in spec[:-1]:
        index = spec.index("-i")
        interface = spec[index + 1]
        negated = index > 0 and spec[index - 1] == "!"
        matches = (
            bridge.startswith(interface[:-1]) if interface.endswith("+") else (interface == bridge)
        )
        if not negated and not matches:
            return True
    return False


def _has_ipv6() -> bool:
    return IPV6.exists()
