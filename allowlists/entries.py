"""The allowlist entry grammar: ``host`` or ``host:port``, exact DNS names only.

Pure Python, no Django or mitmproxy import: the models, the admin, the API and the proxy all
call :func:`parse_entry`, so an entry means the same thing everywhere.
"""

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

import idna

DEFAULT_PORT = 443
MAX_HOST_LENGTH = 253
MAX_LABEL_LENGTH = 63

_LDH_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
# WHATWG URL parsing treats a host whose last label is a number (decimal, or 0x hex) as an
# IPv4 address in some notation: 2130706433, 0177.1, 0x7f.1 and 127.1 all mean 127.0.0.1.
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
_PORT = re.compile(r"^[1-9][0-9]{0,4}$")
# A name already in the form the grammar gives (lower-case letters, digits and inner hyphens;
# no label with hyphens 3rd and 4th, as IDNA's ``xn--`` has), with or without a port: what
# nearly every entry and proxy target is. For these, UTS #46 and IDNA 2008 change nothing, so
# :func:`parse_entry` skips them (tests/allowlists/test_entries.py holds both ways equal).
_LABEL = r"(?![a-z0-9-]{2}--)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_PLAIN = re.compile(rf"((?:{_LABEL}\.)*{_LABEL})(?::([1-9][0-9]{{0,4}}))?")


class EntryError(ValueError):
    """An allowlist entry that the grammar rejects; the message says what is wrong."""


class IPLiteralError(EntryError):
    """The entry (or a proxy target) is an IP address in some notation, not a name."""


@dataclass(frozen=True, order=True)
class Entry:
    """One normalised allowlist entry."""

    host: str
    port: int = DEFAULT_PORT

    def __str__(self) -> str:
        return self.host if self.port == DEFAULT_PORT else f"{self.host}:{self.port}"

    @property
    def host_port(self) -> str:
        """The entry with its port always spelled out, as the effective allowlist shows it."""
        return f"{self.host}:{self.port}"


def parse_entry(text: str) -> Entry:
    """Parse and normalise one entry, or raise :class:`EntryError` saying what is wrong."""
    plain = _PLAIN.fullmatch(text) if type(text) is str else None
    if plain is not None:
        host, port = plain.group(1), int(plain.group(2) or DEFAULT_PORT)
        # An IP address in any notation has a numeric last label; a plain name has no colon.
        numeric = _NUMERIC_LABEL.match(host.rpartition(".")[2])
        if len(host) <= MAX_HOST_LENGTH and port <= 65535 and not numeric:
            return Entry(host, port)
    return _parse(text)


def _parse(text: str) -> Entry:
    """:func:`parse_entry`'s every step, for any text."""
    if not isinstance(text, str):
        raise EntryError(f"an entry must be a string, not {type(text).__name__}")
    shown = repr(text) if text else "''"
    if not text:
        raise EntryError("an entry must not be empty")
    bad = next((c for c in text if c.isspace() or not c.isprintable()), None)
    if bad is not None:
        raise EntryError(
            f"{shown}: whitespace and control characters are not allowed (found {bad!r})"
        )
    if "*" in text:
        raise EntryError(f"{shown}: wildcards are not allowed; list each host name exactly")
    if "/" in text and "://" not in text and _is_network(text):
        raise EntryError(f"{shown}: IP ranges are not allowed; list each host's DNS name")
    if "://" in text or "/" in text or "?" in text or "#" in text:
        raise EntryError(f"{shown}: give a host name or host:port, not a URL or path")
    if "@" in text:
        raise EntryError(f"{shown}: user names and passwords are not allowed in an entry")

    host_text, port = _split_port(text, shown)
    host = _normalise_host(host_text, shown)
    return Entry(host, port)


def parse_entries(texts: Iterable[str]) -> list[Entry]:
    """Parse a list of entries, reporting every bad one at once; duplicates are merged.

    Raises :class:`EntryError` whose message lists each bad entry on its own line.
    """
    if isinstance(texts, str):
        raise EntryError("entries must be a list of strings, not one string")
    entries: list[Entry] = []
    errors: list[str] = []
    for text in texts:
        try:
            entry = parse_entry(text)
        except EntryError as exc:
            errors.append(str(exc))
        else:
            if entry not in entries:
                entries.append(entry)
    if errors:
        raise EntryError("\n".join(errors))
    return entries


def format_entries(entries: Iterable[Entry]) -> list[str]:
    """Entries as stored and shown: normalised, deduplicated, sorted."""
    return [str(e) for e in sorted(set(entries))]


def normalise_entries(texts: Iterable[str]) -> list[str]:
    """Parse, normalise, deduplicate and sort a list of entry strings."""
    return format_entries(parse_entries(texts))


def split_host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` → (host, port), the brackets gone; a
    bare IPv6 address is all host. Every covey ``host:port`` (entries, settings, flags, probe
    targets) is split here. ValueError saying what is wrong: no port and no default, or a port
    outside 1-65535."""
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: give [address] or [address]:port")
        port_text = rest[1:]
        if rest and not port_text:
            raise ValueError(f"{text!r}: the port is missing after ':'")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text and not text.endswith(":"):
        if default_port is None:
            raise ValueError(f"{text!r} has no port")
        return host, default_port
    if not _PORT.match(port_text) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    return host, int(port_text)


def _split_port(text: str, shown: str) -> tuple[str, int]:
    if text.startswith("[") or text.count(":") > 1:
        # Bracketed or bare IPv6, possibly with a port: an IP literal either way.
        raise IPLiteralError(f"{shown}: IP addresses are not allowed; use the host's DNS name")
    try:
        return split_host_port(text, DEFAULT_PORT)
    except ValueError:
        raise EntryError(f"{shown}: the port must be a number from 1 to 65535") from None


def _normalise_host(text: str, shown: str) -> str:
    if text.endswith("."):
        text = text[:-1]
    if not text:
        raise EntryError(f"{shown}: the host name is empty")
    if any(label == "" for label in text.split(".")):
        raise EntryError(f"{shown}: the host name has an empty label (two dots in a row?)")
    if _looks_like_ip(text):
        raise IPLiteralError(f"{shown}: IP addresses are not allowed; use the host's DNS name")
    try:
        # UTS #46 maps case, full-width forms and other look-alike spellings to one form,
        # then IDNA 2008 turns non-ASCII labels into punycode.
        host = idna.encode(text, uts46=True, std3_rules=True).decode("ascii")
    except idna.IDNAError as exc:
        reason = str(exc)
        if reason == "Domain too long":
            reason = f"the host name is longer than {MAX_HOST_LENGTH} characters"
        elif reason == "Label too long":
            reason = f"a label is longer than {MAX_LABEL_LENGTH} characters"
        else:
            reason = f"not a valid host name ({reason})"
        raise EntryError(f"{shown}: {reason}") from None
    except UnicodeError as exc:
        raise EntryError(f"{shown}: not a valid host name ({exc})") from None
    host = host.rstrip(".")
    if _looks_like_ip(host):
        raise IPLiteralError(f"{shown}: IP addresses are not allowed; use the host's DNS name")
    if len(host) > MAX_HOST_LENGTH:
        raise EntryError(f"{shown}: the host name is longer than {MAX_HOST_LENGTH} characters")
    for label in host.split("."):
        if not label:
            raise EntryError(f"{shown}: the host name has an empty label (two dots in a row?)")
        if len(label) > MAX_LABEL_LENGTH:
            raise EntryError(
                f"{shown}: the label {label[:20]!r}... is longer than {MAX_LABEL_LENGTH} characters"
            )
        if not _LDH_LABEL.match(label):
            raise EntryError(
                f"{shown}: the label {label!r} may hold only letters, digits and inner hyphens"
            )
    return host


def _looks_like_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return True
    last = host.lower().rsplit(".", 1)[-1]
    return bool(_NUMERIC_LABEL.match(last))


def _is_network(text: str) -> bool:
    """``text`` is an IP network in CIDR notation (``10.0.0.0/8``, ``fd00::/8``)."""
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True
