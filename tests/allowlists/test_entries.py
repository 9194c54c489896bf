"""The entry grammar, with the hostile spellings an allowlist must never let through."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allowlists.entries import (
    Entry,
    EntryError,
    _parse,
    normalise_entries,
    parse_entries,
    parse_entry,
    split_host_port,
)

ACCEPTED = [
    # (input, host, port)
    ("api.anthropic.com", "api.anthropic.com", 443),
    ("API.Anthropic.COM", "api.anthropic.com", 443),
    ("api.anthropic.com.", "api.anthropic.com", 443),
    ("deb.debian.org:80", "deb.debian.org", 80),
    ("example.com:443", "example.com", 443),
    ("example.com:65535", "example.com", 65535),
    ("example.com:1", "example.com", 1),
    ("Bücher.example", "xn--bcher-kva.example", 443),
    ("xn--bcher-kva.example", "xn--bcher-kva.example", 443),
    # A Cyrillic 'а' is not a Latin 'a': the homograph normalises to its own punycode name.
    ("аpple.com", "xn--pple-43d.com", 443),
    ("ｅｘａｍｐｌｅ.com", "example.com", 443),  # full-width letters
    ("example。com", "example.com", 443),  # ideographic full stop
    ("123.example.com", "123.example.com", 443),  # numeric labels are fine before the last
    ("a-b.example", "a-b.example", 443),
    ("x" * 63 + ".example", "x" * 63 + ".example", 443),
    ("localhost", "localhost", 443),  # a name; its address is refused when resolved
]


@pytest.mark.parametrize(("text", "host", "port"), ACCEPTED)
def test_it_normalises_accepted_spellings(text, host, port):
    assert parse_entry(text) == Entry(host, port)


REJECTED = [
    # (input, words the message must contain)
    ("", "empty"),
    (".", "empty"),
    ("*.example.com", "wildcard"),
    ("*", "wildcard"),
    ("example.*", "wildcard"),
    ("exa*mple.com", "wildcard"),
    # IPv4 in every notation a resolver or URL parser accepts
    ("127.0.0.1", "IP address"),
    ("8.8.8.8:443", "IP address"),
    ("2130706433", "IP address"),  # decimal
    ("0177.0.0.1", "IP address"),  # octal
    ("0x7f.0.0.1", "IP address"),  # hex
    ("0x7f000001", "IP address"),  # hex, one number
    ("127.1", "IP address"),  # short form
    ("10.1", "IP address"),
    ("169.254.169.254", "IP address"),  # cloud metadata
    ("１２７.０.０.１", "IP address"),  # full-width digits
    ("127.0.0.1.", "IP address"),
    ("example.0x10", "IP address"),  # ends in a number: parsed as IPv4 by URL parsers
    ("example.123", "IP address"),
    # IPv6, bracketed or not, with or without a port, and IPv4-mapped
    ("::1", "IP address"),
    ("[::1]", "IP address"),
    ("[::1]:443", "IP address"),
    ("2001:db8::1", "IP address"),
    ("::ffff:127.0.0.1", "IP address"),
    ("[::ffff:7f00:1]:80", "IP address"),
    ("[fe80::1%25eth0]", "IP address"),
    # labels
    ("a..example.com", "empty label"),
    (".example.com", "empty label"),
    ("example.com..", "empty label"),
    ("x" * 64 + ".example", "label"),
    (".".join(["abcdefghi"] * 26), "longer than 253"),
    ("-example.com", "hyphen"),
    ("example-.com", "hyphen"),
    ("ex_ample.com", "not a valid host name"),
    ("ex%41mple.com", "not a valid host name"),
    ("ex!ample.com", "not a valid host name"),
    ("xn--zz.example", "not a valid host name"),  # broken punycode
    # whitespace and control characters
    (" example.com", "whitespace"),
    ("example.com ", "whitespace"),
    ("exa mple.com", "whitespace"),
    ("example.com\n", "whitespace"),
    ("example.com\r\nHost: evil", "whitespace"),
    ("exam\tple.com", "whitespace"),
    ("example.com\x00.evil", "control"),
    ("exam\u00adple.com", "control"),  # soft hyphen, invisible
    ("ex\u200bample.com", "control"),  # zero-width space
    ("example.com\u202e", "control"),  # right-to-left override
    # ports
    ("example.com:0", "port"),
    ("example.com:65536", "port"),
    ("example.com:99999", "port"),
    ("example.com:-1", "port"),
    ("example.com:+443", "port"),
    ("example.com:0443", "port"),
    ("example.com:https", "port"),
    ("example.com:", "port"),
    ("example.com:44 3", "whitespace"),
    # not a host at all
    ("https://example.com", "not a URL"),
    ("example.com/path", "not a URL"),
    ("example.com?x=1", "not a URL"),
    ("example.com#frag", "not a URL"),
    ("192.168.1.0/24", "IP ranges are not allowed"),
    ("fd00::/8", "IP ranges are not allowed"),
    ("user@example.com", "user names"),
    ("user:pass@example.com", "user names"),
    (":443", "empty"),
]


@pytest.mark.parametrize(("text", "words"), REJECTED)
def test_it_rejects_hostile_spellings_with_a_message_saying_what_is_wrong(text, words):
    with pytest.raises(EntryError) as caught:
        parse_entry(text)
    message = str(caught.value)
    assert words.lower() in message.lower()
    # The message names the entry so a list of mistakes can be fixed one by one.
    assert repr(text) in message or text == ""


@pytest.mark.parametrize("value", [None, 443, ["example.com"], b"example.com"])
def test_it_rejects_values_that_are_not_strings(value):
    with pytest.raises(EntryError, match="must be a string"):
        parse_entry(value)


def test_an_entry_shows_its_port_only_when_it_is_not_443():
    assert str(Entry("example.com")) == "example.com"
    assert str(Entry("example.com", 80)) == "example.com:80"
    assert Entry("example.com").host_port == "example.com:443"


def test_a_list_is_normalised_deduplicated_and_sorted_by_host_then_port():
    assert normalise_entries(["b.example", "B.example.:80", "a.example:443", "a.example"]) == [
        "a.example",
        "b.example:80",
        "b.example",
    ]


def test_a_list_reports_every_bad_entry_at_once():
    with pytest.raises(EntryError) as caught:
        parse_entries(["good.example", "*.bad.example", "10.0.0.1", "also.good"])
    lines = str(caught.value).splitlines()
    assert len(lines) == 2
    assert "wildcard" in lines[0]
    assert "IP address" in lines[1]


def test_a_single_string_is_not_taken_for_a_list():
    with pytest.raises(EntryError, match="list"):
        parse_entries("example.com")


def test_label_boundaries_are_kept_exact():
    # evilexample.com is another name than example.com, and stays so after normalisation.
    assert parse_entry("evilexample.com") != parse_entry("example.com")
    assert parse_entry("example.com.evil.net").host == "example.com.evil.net"


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    [
        ("example.com", 443, ("example.com", 443)),
        ("example.com:8080", None, ("example.com", 8080)),
        ("10.0.0.1:53", None, ("10.0.0.1", 53)),
        ("[fd00::1]:3128", None, ("fd00::1", 3128)),
        ("[fd00::1]", 443, ("fd00::1", 443)),
        ("fd00::1", 443, ("fd00::1", 443)),  # a bare IPv6 address is all host
        (":8080", None, ("", 8080)),
    ],
)
def test_host_port_is_split_one_way_everywhere(text, default, expected):
    assert split_host_port(text, default) == expected


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("example.com", "has no port"),
        ("example.com:", "the port must be a number from 1 to 65535"),
        ("example.com:0", "the port must be a number from 1 to 65535"),
        ("example.com:65536", "the port must be a number from 1 to 65535"),
        ("example.com:http", "the port must be a number from 1 to 65535"),
        ("[fd00::1", "give [address] or [address]:port"),
        ("[fd00::1]x", "give [address] or [address]:port"),
        ("[fd00::1]:", "the port is missing"),
    ],
)
def test_a_bad_host_port_says_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        split_host_port(text)


def _outcome(parse, text):
    try:
        return parse(text)
    except EntryError as exc:
        return type(exc), str(exc)


# Names near the fast path's edges: hyphens 3rd and 4th (``xn--``), numeric last labels, long
# labels and names, ports out of range, upper case, a trailing dot.
_NEAR_PLAIN = st.text(alphabet="abx0123456789-.:nA", min_size=1, max_size=12)
_LONG = st.builds(
    lambda label, count, port: ".".join([label] * count) + port,
    st.text(alphabet="ab-1", min_size=1, max_size=70),
    st.integers(1, 6),
    st.sampled_from(["", ":443", ":0", ":65535", ":65536", ":08"]),
)


@settings(max_examples=1000, deadline=None)
@given(st.one_of(_NEAR_PLAIN, _LONG))
def test_the_fast_path_decides_as_the_whole_grammar(text):
    """A plain name skips UTS #46 and IDNA: the answer (or the refusal) is the same."""
    assert _outcome(parse_entry, text) == _outcome(_parse, text)
