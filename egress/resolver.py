"""Name resolution for the proxy, through dnspython (COVEY_EGRESS_NAMESERVERS when set)."""

import asyncio
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
        self._resolver.cache = None  # every decision sees the answer it acts on

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
