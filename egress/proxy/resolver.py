"""Name resolution for the proxy, through dnspython (COVEY_EGRESS_NAMESERVERS when set).

Addresses are cached for their TTL, at most MAX_TTL seconds, as any resolver does. That changes
nothing for safety: every decision classifies the addresses it is about to use, cached or not,
and a name served with TTL 0 (the usual rebinding trick) is asked again every time. "No such
name" and "no address of this type" are kept only as long as the zone's SOA says (negative
caching, RFC 2308); without an SOA they are asked again every time.
"""

import asyncio
import contextlib
import ipaddress
import time
from collections.abc import Sequence
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver


class ResolutionError(Exception):
    """The name could not be resolved (time-out, server failure)."""


def parse_nameserver(text: str) -> tuple[str, int]:
    """``addr`` or ``addr@port`` → (address, port)."""
    address, _, port = text.strip().partition("@")
    return address, int(port) if port else 53


MAX_TTL = 300
CACHE_SIZE = 10_000


class _Cache(dns.resolver.LRUCache):
    """dnspython's LRU cache, answers kept no longer than MAX_TTL, negative ones only with an
    SOA (dnspython would otherwise keep them for five minutes)."""

    def put(self, key: dns.resolver.CacheKey, value: dns.resolver.Answer) -> None:
        if value.rrset is None and not any(
            rrset.rdtype == dns.rdatatype.SOA for rrset in value.response.authority
        ):
            return
        value.expiration = min(value.expiration, time.time() + MAX_TTL)
        super().put(key, value)


class Resolver:
    """Resolves a name to all its A and AAAA addresses, with a bounded time."""

    def __init__(self, nameservers: Sequence[str] = (), timeout: float = 3.0) -> None:
        if nameservers:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [
                dns.nameserver.Do53Nameserver(*parse_nameserver(text)) for text in nameservers
            ]
        else:
            self._resolver = dns.asyncresolver.Resolver()
        self._resolver.lifetime = timeout
        self._resolver.cache = _Cache(CACHE_SIZE)
        # host → (expires at, every address): both families, as resolve() returns them, so
        # that a cached name is answered without a task (the proxy's connect path asks this
        # first). Kept as long as the shorter-lived of the two answers, at most MAX_TTL.
        self._known: dict[str, tuple[float, list[str]]] = {}

    def forget(self) -> None:
        """Drop every cached answer."""
        self._resolver.cache.flush()
        self._known.clear()

    def cached(self, host: str) -> list[str] | None:
        """The addresses resolve() would return now, when both answers are still cached (an
        IP address is its own answer); None when it would have to ask."""
        known = self._known.get(host)
        if known is None:
            with contextlib.suppress(ValueError):  # a built-in destination may be one
                return [str(ipaddress.ip_address(host))]
            return None
        if known[0] <= time.time():
            self._known.pop(host, None)
            return None
        return known[1]

    async def resolve(self, host: str) -> list[str]:
        """Every address the name has (IPv4 first); [] when it has none."""
        if (known := self.cached(host)) is not None:
            return known
        answers = await asyncio.gather(
            self._query(host, dns.rdatatype.A), self._query(host, dns.rdatatype.AAAA)
        )
        addresses = [address for family, _ in answers for address in family]
        expiries = [expires for _, expires in answers]
        if all(e is not None for e in expiries):
            expires = min(e for e in expiries if e is not None)
            if expires > time.time():
                if len(self._known) >= CACHE_SIZE:
                    self._known.pop(next(iter(self._known)))  # the oldest entry
                self._known[host] = (expires, addresses)
        return addresses

    async def _query(
        self, host: str, rdtype: dns.rdatatype.RdataType
    ) -> tuple[list[str], float | None]:
        """The addresses of one type, and until when they may be kept (None: not at all)."""
        try:
            answer = await self._resolver.resolve(host + ".", rdtype, search=False)
        except dns.resolver.NoAnswer as exc:
            return [], _negative_expiry(exc.kwargs.get("response"))
        except dns.resolver.NXDOMAIN as exc:
            responses = list((exc.kwargs.get("responses") or {}).values())
            return [], _negative_expiry(responses[0] if responses else None)
        except dns.exception.DNSException as exc:
            raise ResolutionError(f"{host}: {exc}") from exc
        expires = min(answer.expiration, time.time() + MAX_TTL)
        return [record.to_text() for record in answer], expires


def _negative_expiry(response: Any) -> float | None:
    """Until when an empty answer may be kept: the zone's SOA says (RFC 2308), else never."""
    for rrset in getattr(response, "authority", None) or []:
        if rrset.rdtype == dns.rdatatype.SOA and len(rrset):
            ttl = min(rrset.ttl, rrset[0].minimum, MAX_TTL)
            return time.time() + ttl
    return None
