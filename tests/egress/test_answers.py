"""How the proxy reads a tunnel's first bytes (egress/proxy/answers.py): covey's ClientHello
reader against mitmproxy's own parser, which it stands in for, on real ClientHellos from
Python's ssl module, on hostile rewritings of them, on every truncation and on seeded random
damage. The two must agree on every input: whole or not, refused or not, and the SNI."""

import random
import ssl

import pytest
from mitmproxy.proxy.layers.tls import parse_client_hello

from egress.proxy.answers import client_hello_sni, read_client_hello


def mitmproxy_reads(data: bytes) -> tuple[bool, str | None] | str:
    try:
        hello = parse_client_hello(data)
    except ValueError:
        return "invalid"
    return (False, None) if hello is None else (True, hello.sni)


def covey_reads(data: bytes) -> tuple[bool, str | None] | str:
    try:
        return client_hello_sni(data)
    except ValueError:
        return "invalid"


def hello_for(name: str | None, *, alpn: list[str] | None = None, tls12: bool = False) -> bytes:
    """The first flight of a real TLS client (one ClientHello record)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(alpn)
    if tls12:
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def message_of(record: bytes) -> bytes:
    return record[9:]  # past the record and handshake headers


def record_of(message: bytes, version: bytes = b"\x03\x01") -> bytes:
    handshake = b"\x01" + len(message).to_bytes(3) + message
    return b"\x16" + version + len(handshake).to_bytes(2) + handshake


def split_at_extensions(message: bytes) -> tuple[bytes, list[bytes]]:
    at = 2 + 32
    at += 1 + message[at]
    at += 2 + int.from_bytes(message[at : at + 2])
    at += 1 + message[at]
    fixed, rest, extensions = message[:at], message[at + 2 :], []
    while rest:
        size = 4 + int.from_bytes(rest[2:4])
        extensions.append(rest[:size])
        rest = rest[size:]
    return fixed, extensions


def with_extensions(record: bytes, extensions: list[bytes]) -> bytes:
    fixed, _ = split_at_extensions(message_of(record))
    joined = b"".join(extensions)
    return record_of(fixed + len(joined).to_bytes(2) + joined)


def server_names(*names: bytes, kind: int = 0, list_length: int | None = None) -> bytes:
    entries = b"".join(bytes([kind]) + len(name).to_bytes(2) + name for name in names)
    data = (len(entries) if list_length is None else list_length).to_bytes(2) + entries
    return b"\x00\x00" + len(data).to_bytes(2) + data


def extension(kind: int, data: bytes) -> bytes:
    return kind.to_bytes(2) + len(data).to_bytes(2) + data


def corpus() -> dict[str, bytes]:
    good = hello_for("good.test", alpn=["h2", "http/1.1"])
    _, extensions = split_at_extensions(message_of(good))
    others = [e for e in extensions if e[:2] != b"\x00\x00"]
    cases = {
        "sni": good,
        "sni, TLS 1.2": hello_for("good.test", tls12=True),
        "no sni": hello_for(None),
        "an IP address, so no sni": hello_for("127.0.0.1"),
        "a trailing dot": hello_for("good.test."),
        "two names in one extension": with_extensions(good, [server_names(b"a.test", b"b.test")]),
        "another name first": with_extensions(
            good, [server_names(b"evil.test"), server_names(b"good.test"), *others]
        ),
        "a bad one, then a good one": with_extensions(
            good, [server_names(b"bad_name!"), server_names(b"good.test"), *others]
        ),
        "a name of another type": with_extensions(good, [server_names(b"good.test", kind=1)]),
        "a name with a NUL": with_extensions(good, [server_names(b"good.test\x00.evil.test")]),
        "a name not ASCII": with_extensions(good, [server_names("café.test".encode())]),
        "an IDNA name": with_extensions(good, [server_names(b"xn--caf-dma.test")]),
        "an empty name": with_extensions(good, [server_names(b"")]),
        "no names": with_extensions(good, [server_names()]),
        "a wrong list length is not checked": with_extensions(
            good, [server_names(b"good.test", list_length=999)]
        ),
        "a name past its extension": with_extensions(
            good, [extension(0, b"\x00\x0c\x00\x00\x20good.test")]
        ),
        "a broken ALPN": with_extensions(
            good, [server_names(b"good.test"), extension(16, b"\x00")]
        ),
        "an ALPN past its end": with_extensions(
            good, [server_names(b"good.test"), extension(16, b"\x00\x05\x09h2")]
        ),
        "an unknown extension, unread": with_extensions(
            good, [extension(0xFE00, b"\xff" * 7), server_names(b"good.test")]
        ),
        "no extensions at all": record_of(split_at_extensions(message_of(good))[0]),
        "one byte where the extensions' length goes": record_of(
            split_at_extensions(message_of(good))[0] + b"\x00"
        ),
        "the message across three records": b"".join(
            b"\x16\x03\x01" + len(part).to_bytes(2) + part
            for part in (good[5:40], good[40:300], good[300:])
        ),
        "an empty record first": b"\x16\x03\x01\x00\x00" + good,
        "a record that is not TLS after a partial message": good[:5]
        + good[5:40]
        + b"\x17\x03\x01\x00\x05hello",
        "bytes after the message": good + b"\x17\x03\x03\x00\x01x",
        "a longer message length than the records hold": good[:6] + b"\xff\xff" + good[8:],
        "a session id past the end": record_of(b"\x03\x03" + b"r" * 32 + b"\x20abc"),
        "cipher suites past the end": record_of(b"\x03\x03" + b"r" * 32 + b"\x00\x00\x10"),
    }
    return cases


CORPUS = corpus()


@pytest.mark.parametrize("name", list(CORPUS))
def test_the_reader_agrees_with_mitmproxys_parser(name):
    data = CORPUS[name]
    assert covey_reads(data) == mitmproxy_reads(data)


def test_real_client_hellos_name_their_server():
    assert client_hello_sni(CORPUS["sni"]) == (True, "good.test")
    assert client_hello_sni(CORPUS["no sni"]) == (True, None)
    assert client_hello_sni(CORPUS["another name first"]) == (True, "evil.test")
    assert client_hello_sni(CORPUS["two names in one extension"]) == (True, None)


@pytest.mark.parametrize("name", ["sni", "the message across three records", "no sni"])
def test_every_truncation_reads_alike(name):
    data = CORPUS[name]
    for end in range(len(data) + 1):
        assert covey_reads(data[:end]) == mitmproxy_reads(data[:end]), end


def test_seeded_random_damage_reads_alike():
    chance = random.Random(37)
    originals = list(CORPUS.values())
    for _ in range(3000):
        data = bytearray(chance.choice(originals))
        for _ in range(chance.randint(1, 4)):
            at = chance.randrange(5, len(data)) if len(data) > 5 else 0
            data[at] = chance.randrange(256)
        damaged = bytes(data)
        assert covey_reads(damaged) == mitmproxy_reads(damaged), damaged.hex()


# A ClientHello that says it is 16 MiB long, in records of 16 KiB: never whole.
HUGE = b"".join(
    b"\x16\x03\x01\x40\x00" + (b"\x01\xff\xff\xff" + b"x" * 16380 if i == 0 else b"x" * 16384)
    for i in range(5)
)


@pytest.mark.parametrize(
    ("data", "read"),
    [
        (b"", None),
        (b"\x16\x03", None),
        (b"GET / HTTP/1.1\r\n", ("", "the tunnel did not start with a TLS ClientHello")),
        (CORPUS["sni"][:50], None),
        (CORPUS["sni"], ("good.test", "")),
        (CORPUS["no sni"], ("", "")),
        (CORPUS["a broken ALPN"], ("", "the tunnel did not start with a valid TLS ClientHello")),
        (HUGE, ("", "the ClientHello is too large")),
    ],
    # ids of their own: a real ClientHello's bytes are random, and so would its id be
    ids=["nothing", "a record's start", "http", "half", "sni", "no sni", "invalid", "too large"],
)
def test_read_client_hello_says_what_the_first_bytes_are(data, read):
    assert read_client_hello(data) == read
