"""Name resolution for the proxy, through dnspython (COVEY_EGRESS_NAMESERVERS when set).

Addresses are cached for their TTL, at most MAX_TTL seconds, as any resolver does. That changes
nothing for safety: every decision classifies the addresses it is about to use, cached or not,
and a name served with TTL 0 (the usual rebinding trick) is asked again every time. "No such
name" and "no address of this type" are kept only as long as the zone's SOA says (negative
caching, RFC 2308); without an SOA they are asked again every time.
"""

import asyncio
import time
from collections.abc import Sequence

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

    def forget(self) -> None:
        """Drop every cached answer."""
        self._resolver.cache.flush()

    async def resolve(self, host: str) -> list[str]:
        """Every address the name has (IPv4 first); [] when it has none."""
        answers = await asyncio.gather(
            self._query(host, dns.rdatatype.A), self._query(host, dns.rdatatype.AAAA)
        )
        return [address for family in answers for address in family]

    async def _query(self, host: str, rdtype: dns.rdatatype.RdataType) -> list[str]:
        try:
            answer = await self._resolver.resolve(host + ".", rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:
            raise ResolutionError(f"{host}: {exc}") from exc
        return [record.to_text() for record in answer]
