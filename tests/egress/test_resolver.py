"""The proxy's resolver against a real DNS server made by the test."""

import asyncio
import time

import pytest

from egress.proxy.resolver import MAX_TTL, ResolutionError, Resolver
from tests.netfixtures import DnsServer


@pytest.fixture
def dns():
    with DnsServer() as server:
        yield server


def resolve(resolver: Resolver, name: str) -> list[str]:
    return asyncio.run(resolver.resolve(name))


def test_it_returns_every_address_ipv4_first(dns):
    dns.set("both.test", "2001:db8::1", "192.0.2.1", "192.0.2.2")
    resolver = Resolver([dns.nameserver])
    assert resolve(resolver, "both.test") == ["192.0.2.1", "192.0.2.2", "2001:db8::1"]


def test_an_unknown_name_has_no_addresses(dns):
    assert resolve(Resolver([dns.nameserver]), "nowhere.test") == []


def test_answers_with_ttl_0_are_asked_again_every_time(dns):
    """Rebinding relies on TTL 0: each decision must see a fresh answer."""
    dns.set("fresh.test", "192.0.2.1")
    resolver = Resolver([dns.nameserver])
    resolve(resolver, "fresh.test")
    dns.set("fresh.test", "10.0.0.1")
    assert resolve(resolver, "fresh.test") == ["10.0.0.1"]
    assert dns.queries("fresh.test") == 4  # A and AAAA, twice


def test_answers_are_kept_for_their_ttl(dns):
    dns.set("kept.test", "192.0.2.1", ttl=60)
    resolver = Resolver([dns.nameserver])
    resolve(resolver, "kept.test")
    dns.set("kept.test", "192.0.2.9", ttl=60)
    assert resolve(resolver, "kept.test") == ["192.0.2.1"]
    assert dns.queries("kept.test") == 2  # the empty AAAA answer came with an SOA: kept too


def test_no_answer_is_kept_longer_than_max_ttl(dns):
    dns.set("long.test", "192.0.2.1", ttl=7 * 24 * 3600)
    resolver = Resolver([dns.nameserver])
    resolve(resolver, "long.test")
    cached = [node.value.expiration for node in resolver._resolver.cache.data.values()]
    cached += [expires for expires, _ in resolver._known.values()]
    assert len(cached) == 3  # A, AAAA, and the name's addresses
    assert all(expiration <= time.time() + MAX_TTL for expiration in cached)


def test_what_is_kept_is_answered_at_once_and_nothing_else(dns):
    dns.set("kept.test", "192.0.2.1", ttl=60)
    dns.set("fresh.test", "192.0.2.2")
    resolver = Resolver([dns.nameserver])
    assert resolver.cached("kept.test") is None  # never asked
    resolve(resolver, "kept.test")
    resolve(resolver, "fresh.test")
    resolve(resolver, "nowhere.test")  # NXDOMAIN without an SOA
    assert resolver.cached("kept.test") == ["192.0.2.1"]
    assert resolver.cached("fresh.test") is None  # TTL 0
    assert resolver.cached("nowhere.test") is None


def test_a_silent_nameserver_is_an_error_in_bounded_time():
    silent = DnsServer()  # never started: nothing answers on its port
    with silent:
        nameserver = silent.nameserver
    resolver = Resolver([nameserver], timeout=0.5)
    started = time.monotonic()
    with pytest.raises(ResolutionError):
        resolve(resolver, "any.test")
    assert time.monotonic() - started < 3


def test_forget_drops_what_was_kept(dns):
    dns.set("kept.test", "192.0.2.1", ttl=60)
    resolver = Resolver([dns.nameserver])
    resolve(resolver, "kept.test")
    dns.set("kept.test", "192.0.2.9", ttl=60)
    resolver.forget()
    assert resolve(resolver, "kept.test") == ["192.0.2.9"]


def test_negative_answers_without_an_soa_are_asked_again(dns):
    """dnspython would keep them five minutes; a name that appears must work at once."""
    resolver = Resolver([dns.nameserver])
    assert resolve(resolver, "later.test") == []
    dns.set("later.test", "192.0.2.1")
    assert resolve(resolver, "later.test") == ["192.0.2.1"]  # the NXDOMAIN was not kept
    dns.set("later.test", "192.0.2.1", "2001:db8::1")
    assert resolve(resolver, "later.test") == ["192.0.2.1", "2001:db8::1"]  # nor the empty AAAA


def test_an_empty_answer_with_an_soa_is_kept_for_its_ttl(dns):
    dns.set("v4only.test", "192.0.2.1", ttl=60)
    resolver = Resolver([dns.nameserver])
    resolve(resolver, "v4only.test")
    dns.set("v4only.test", "192.0.2.1", "2001:db8::1", ttl=60)
    assert resolve(resolver, "v4only.test") == ["192.0.2.1"]
    assert dns.queries("v4only.test") == 2


def test_an_address_is_its_own_answer_without_asking(dns):
    resolver = Resolver([dns.nameserver])
    assert resolve(resolver, "172.17.0.1") == ["172.17.0.1"]
    assert resolver.cached("::1") == ["::1"]
    assert dns.queries("172.17.0.1") == 0
