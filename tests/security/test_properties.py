"""Properties that must hold for every input, not only the ones a person thought of
(hypothesis): nothing the entry grammar accepts is an IP address in any notation, and
normalising twice changes nothing; no address in a special-purpose block, nor any IPv6 form
that carries one, is called public; and no path, however spelled, reads or writes outside a
home, even with links planted in it."""

import contextlib
import ipaddress
import os
import socket
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allowlists.entries import EntryError, parse_entry
from egress.policy import is_public
from runners.host.homes import Home, HomeError, names

pytestmark = pytest.mark.suite("properties")

# The fixture counts examples across a test's runs on purpose (the suite's cases); nothing is
# kept between sessions (no example database in the checkout).
MANY = settings(
    max_examples=1500,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


# --- the entry grammar ----------------------------------------------------------------------


def ipv4_spellings(value: int) -> list[str]:
    """One IPv4 address as the C library and browsers read it: dotted, octal, hex, the
    short forms and a single number, in either case, with a trailing dot."""
    a, b, c, d = value.to_bytes(4, "big")
    forms = [
        f"{a}.{b}.{c}.{d}",
        f"0{a:o}.0{b:o}.0{c:o}.0{d:o}",
        f"0x{a:x}.0x{b:x}.0x{c:x}.0x{d:x}",
        f"0X{a:X}.{b}.0{c:o}.{d}",
        f"{a}.{(b << 16) | (c << 8) | d}",
        f"{a}.{b}.{(c << 8) | d}",
        str(value),
        f"0x{value:x}",
        f"0{value:o}",
    ]
    return forms + [f + "." for f in forms]


def ipv6_spellings(value: int) -> list[str]:
    address = ipaddress.IPv6Address(value)
    v4 = ipaddress.IPv4Address(value & 0xFFFFFFFF)
    return [
        str(address),
        address.exploded,
        f"[{address}]",
        f"[{address}]:443",
        f"::ffff:{v4}",
        f"[::ffff:{v4}]",
        f"64:ff9b::{v4}",
        f"::{v4}",
    ]


FULL_WIDTH = str.maketrans("0123456789.", "０１２３４５６７８９．")


@MANY
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**128 - 1), st.booleans(), st.booleans())
def test_no_spelling_of_an_ip_address_is_accepted_as_an_entry(cases, v4, v6, port, wide):
    for text in [*ipv4_spellings(v4), *ipv6_spellings(v6)]:
        cases.add()
        spelled = text.translate(FULL_WIDTH) if wide else text
        spelled = f"{spelled}:8443" if port and not spelled.endswith("]:443") else spelled
        with pytest.raises(EntryError):
            parse_entry(spelled)


# Names made of what DNS names are made of, and of what they must not hold.
LABEL = st.text(alphabet=st.sampled_from("abcxyz019-_ÄéßｘＡ．.\u200d0xX"), min_size=1, max_size=12)
ENTRY_TEXT = st.one_of(
    st.builds(".".join, st.lists(LABEL, min_size=1, max_size=5)),
    st.builds(
        lambda host, port: f"{host}:{port}",
        st.builds(".".join, st.lists(LABEL, min_size=1, max_size=4)),
        st.integers(-5, 70000),
    ),
    st.text(max_size=40),
)


def an_ip_literal(host: str) -> bool:
    """Whether a host would be taken for an address by a resolver or an HTTP client."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return True
    try:
        socket.inet_aton(host)  # the C library's reading: octal, hex, short forms
    except OSError:
        return host.rsplit(".", 1)[-1].isdigit()
    return True


@MANY
@given(ENTRY_TEXT)
def test_what_the_grammar_accepts_is_a_name_and_stays_itself_when_normalised_again(cases, text):
    cases.add()
    try:
        entry = parse_entry(text)
    except EntryError:
        return
    assert not an_ip_literal(entry.host), (text, entry)
    assert 1 <= entry.port <= 65535
    assert entry.host == entry.host.lower() and not entry.host.endswith(".")
    assert entry.host.isascii() and len(entry.host) <= 253
    assert parse_entry(str(entry)) == entry  # normalising twice changes nothing
    assert parse_entry(entry.host_port) == entry


# --- address classification -----------------------------------------------------------------

# IANA's special-purpose address registries (IPv4 and IPv6), the blocks they do not list as
# globally reachable (AS112's and AMT's anycast blocks are; 6to4's relay is deprecated), and
# multicast: written here apart from covey's own table.
SPECIAL = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16",
    "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
    "255.255.255.255/32",
    "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b:1::/48", "100::/64", "2001::/23",
    "2001:2::/48", "2001:10::/28", "2001:db8::/32", "2002::/16", "3fff::/20", "5f00::/16",
    "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
]  # fmt: skip
SPECIAL_V4 = [n for n in map(ipaddress.ip_network, SPECIAL) if n.version == 4]
SPECIAL_V6 = [n for n in map(ipaddress.ip_network, SPECIAL) if n.version == 6]


def inside(network: ipaddress.IPv4Network | ipaddress.IPv6Network, offset: int) -> str:
    return str(network.network_address + offset % network.num_addresses)


@MANY
@given(st.sampled_from(SPECIAL_V4 + SPECIAL_V6), st.integers(0, 2**128 - 1))
def test_no_address_of_a_special_purpose_block_is_public(cases, network, offset):
    cases.add()
    address = ipaddress.ip_address(inside(network, offset))
    assert not is_public(address), address


@MANY
@given(st.sampled_from(SPECIAL_V4), st.integers(0, 2**32 - 1))
def test_an_ipv6_form_that_carries_a_non_public_ipv4_address_is_not_public(cases, network, n):
    inner = ipaddress.IPv4Address(inside(network, n))
    packed = int(inner)
    forms = [
        f"::ffff:{inner}",  # IPv4-mapped
        f"64:ff9b::{inner}",  # NAT64, well-known prefix
        str(ipaddress.IPv6Address((0x64FF9B0001 << 80) | packed)),  # NAT64, local-use
        str(ipaddress.IPv6Address((0x2002 << 112) | (packed << 80))),  # 6to4
        f"::{inner}",  # IPv4-compatible (deprecated)
    ]
    for form in forms:
        cases.add()
        assert not is_public(ipaddress.ip_address(form)), (form, inner)


@MANY
@given(st.integers(0, 2**32 - 1))
def test_a_public_ipv4_address_is_public_and_so_is_its_nat64_form(cases, n):
    address = ipaddress.IPv4Address(n)
    if any(address in net for net in SPECIAL_V4):
        return
    cases.add()
    assert is_public(address), address
    # Where an IPv6-only host's NAT64 gateway connects for it (its DNS64 answers so).
    assert is_public(ipaddress.ip_address(f"64:ff9b::{address}")), address


# --- home paths -------------------------------------------------------------------------------

PIECES = st.sampled_from(
    ["a", "b", "note.txt", "link", "dirlink", "..", ".", "", "/", "a/..", "\x00", "\n",
     "\u202e", "\udcff", "secret", "x" * 300, "~", "%2e%2e", "…"]
)  # fmt: skip
HOSTILE_PATH = st.builds("/".join, st.lists(PIECES, min_size=1, max_size=6)) | st.text(max_size=30)
SECRET = b"outside the home: never to be read or written through it"


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Home, Path]:
    """A home holding files, and links an agent planted pointing out of it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    root = tmp_path / "home"
    (root / "a").mkdir(parents=True)
    (root / "a" / "note.txt").write_bytes(b"inside")
    (root / "link").symlink_to(outside / "secret")
    (root / "dirlink").symlink_to(outside)
    (root / "a" / "b").symlink_to("../../outside")
    os.link(outside / "secret", root / "a" / "hard")
    return Home(root), outside


@MANY
@given(path=HOSTILE_PATH)
def test_no_path_reads_or_lists_or_writes_outside_the_home(cases, planted, path):
    cases.add()
    home, outside = planted
    try:
        parts = names(path)
    except HomeError:
        parts = None
    if parts is not None:
        assert all(p not in ("", ".", "..") and "/" not in p and "\0" not in p for p in parts)
    for look in (home.stat, home.read):
        try:
            found = look(path)
        except (HomeError, OSError):
            continue
        if look == home.read:
            assert SECRET not in b"".join(found), path
    with contextlib.suppress(HomeError, OSError):
        home.write(path, [b"written from outside"], replace=True)
    assert (outside / "secret").read_bytes() == SECRET, path
    assert sorted(p.name for p in outside.iterdir()) == ["secret"], path
