"""git's smart HTTP protocol as the gateway reads it: which repository and service a request is
for (:func:`route`), the ref commands at the head of a push (:class:`PushReader`), read strictly
and whole before a byte goes upstream, and the answer to a refused push (:func:`refusal`), which
``git push`` prints per ref.

No Django and no I/O: the gateway feeds it bytes. The formats are git's own
(gitprotocol-http(5), gitprotocol-pack(5), gitprotocol-common(5)); what git allows and covey
does not (signed pushes, refs outside branches and tags, names longer than
:data:`MAX_REF_BYTES`) is refused with a reason that says so.
"""

import re
from dataclasses import dataclass, field
from enum import StrEnum

MAX_PKT_BYTES = 65520  # a pkt-line, its four-digit length included (gitprotocol-common(5))
MAX_COMMANDS = 1000  # ref updates in one push
MAX_PUSH_OPTIONS = 100
MAX_HEAD_BYTES = 1024 * 1024  # the commands and options before the pack, all told
MAX_REF_BYTES = 255  # what the big git hosts take
ZERO_IDS = {40: "0" * 40, 64: "0" * 64}  # SHA-1, SHA-256

_HOST = re.compile(
    r"(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
)
_PORT = re.compile(r"[1-9][0-9]{0,4}")
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_FORBIDDEN_IN_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


class Service(StrEnum):
    """The two things a smart HTTP client does: fetch (clone, pull) and push."""

    UPLOAD_PACK = "git-upload-pack"
    RECEIVE_PACK = "git-receive-pack"


class Malformed(ValueError):
    """A request the protocol does not allow, or covey does not take; the text says which."""


@dataclass(frozen=True)
class Route:
    """A request under ``/git/``: ``/git/<host>/<owner>/<name>[.git]/info/refs?service=…`` (the
    advertisement) or ``…/git-upload-pack`` and ``…/git-receive-pack`` (the exchange)."""

    host: str  # the upstream's host name, with ``:port`` when not 443
    owner: str
    name: str  # without ``.git``
    service: Service
    advertisement: bool  # GET info/refs, not POST to the service

    @property
    def repository(self) -> str:
        """``owner/name`` as the request spelled it (grants match it ignoring case)."""
        return f"{self.owner}/{self.name}"


def route(method: str, path: str, query: str) -> Route:
    """The route of a request for ``path`` (raw, as sent: nothing is percent-decoded, and a
    ``%`` anywhere is refused, so no encoded ``..`` or ``/`` can hide) with ``query``.

    Malformed for anything else: a path that is not ``/git/<host>/<owner>/<name>/<endpoint>``,
    a segment that could climb (``.``, ``..``) or is not a host or repository name, an endpoint
    of the dumb protocol, a method the endpoint does not take."""
    if "%" in path or "\\" in path:
        raise Malformed("a git path is plain: no percent-encoding and no backslash")
    parts = path.split("/")
    if any(part in (".", "..") for part in parts):
        raise Malformed("a git path has no '.' or '..' segment")
    if len(parts) < 6 or parts[:2] != ["", "git"]:
        raise Malformed("a git path is /git/<host>/<owner>/<name>/<endpoint>")
    host, owner, name, endpoint = parts[2], parts[3], parts[4], "/".join(parts[5:])
    check_host(host)
    check_segment("owner", owner)
    check_segment("repository name", name)
    name = name.removesuffix(".git")
    if not name:
        raise Malformed("the repository name is empty")
    if endpoint == "info/refs":
        if method != "GET":
            raise Malformed("info/refs is read with GET")
        service = _service(query.removeprefix("service=") if query.startswith("service=") else "")
        return Route(host, owner, name, service, advertisement=True)
    if method != "POST":
        raise Malformed(f"{endpoint[:100]!r} is not a smart HTTP endpoint for {method}")
    if query:
        raise Malformed("a git request's exchange has no query")
    return Route(host, owner, name, _service(endpoint), advertisement=False)


def check_host(host: str) -> None:
    """Malformed unless ``host`` is a lowercase host name, with ``:port`` if not 443."""
    name, _, port = host.partition(":")
    if (
        len(name) > 253
        or not _HOST.fullmatch(name)
        or (port and (not _PORT.fullmatch(port) or int(port) > 65535))
    ):
        raise Malformed(f"host {host[:100]!r}: a lowercase host name, with a port if not 443")


def check_segment(what: str, segment: str) -> None:
    """Malformed unless ``segment`` is an owner's or a repository's name."""
    if not _SEGMENT.fullmatch(segment) or ".." in segment:
        raise Malformed(f"{what} {segment[:100]!r}: letters, digits, '_', '-' and '.' only")


def _service(name: str) -> Service:
    try:
        return Service(name)
    except ValueError:
        raise Malformed(
            "the service is git-upload-pack or git-receive-pack (the dumb protocol is not served)"
        ) from None


def check_ref_name(name: str) -> None:
    """Malformed unless ``name`` is a branch or tag git accepts (git-check-ref-format(1)) and
    covey takes: under ``refs/heads/`` or ``refs/tags/``, at most :data:`MAX_REF_BYTES`."""
    if len(name.encode()) > MAX_REF_BYTES:
        raise Malformed(f"ref {name[:60]!r}…: longer than {MAX_REF_BYTES} bytes")
    if not name.startswith(("refs/heads/", "refs/tags/")):
        raise Malformed(f"ref {name!r}: only branches (refs/heads/) and tags (refs/tags/)")
    if (
        _FORBIDDEN_IN_REF.search(name)
        or ".." in name
        or "@{" in name
        or "//" in name
        or name.endswith(("/", "."))
        or any(part.startswith(".") or part.endswith(".lock") for part in name.split("/"))
    ):
        raise Malformed(f"ref {name!r}: not a name git allows (git-check-ref-format(1))")


@dataclass(frozen=True)
class Command:
    """One ref update of a push: ``old`` is what the client believes the ref is (zeros: it
    creates it), ``new`` what it asks for (zeros: it deletes it)."""

    old: str
    new: str
    ref: str

    @property
    def creates(self) -> bool:
        return set(self.old) == {"0"}

    @property
    def deletes(self) -> bool:
        return set(self.new) == {"0"}


@dataclass(frozen=True)
class Push:
    """The head of a ``git-receive-pack`` request: the commands and what came with them. The
    pack follows (none when every command deletes)."""

    commands: tuple[Command, ...]
    capabilities: frozenset[str]
    shallow: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    @property
    def id_length(self) -> int:
        return _id_length(self.capabilities)


@dataclass
class PushReader:
    """Reads the head of a push from the bytes of its body as they come: :meth:`feed` each
    chunk until it returns the :class:`Push`; :attr:`rest` then holds what followed it (the
    start of the pack). Malformed, with what is wrong, the moment the bytes say so."""

    _buffer: bytearray = field(default_factory=bytearray)
    _consumed: int = 0
    _lines: list[bytes] = field(default_factory=list)
    _options: list[bytes] | None = None  # after the commands' flush, when options were sent
    _push: Push | None = None
    rest: bytes = b""

    def feed(self, data: bytes) -> Push | None:
        """The push once its head is whole; after that the body's bytes are the caller's."""
        if self._push is not None:
            raise RuntimeError("the head of this push is read: what follows is the pack")
        self._buffer += data
        while (packet := self._next()) is not None:
            if self._take(packet):
                self.rest = bytes(self._buffer)
                self._buffer.clear()
                return self._push
        if self._consumed + len(self._buffer) > MAX_HEAD_BYTES:
            raise Malformed(f"the commands of a push take more than {MAX_HEAD_BYTES} bytes")
        return None

    def finish(self) -> Push:
        """The push, at the end of the body: Malformed when its head was cut short."""
        if self._push is None:
            raise Malformed("the push ended before its commands did (no flush-pkt)")
        return self._push

    def _next(self) -> bytes | None:
        """The next pkt-line's payload (b"" for a flush-pkt), or None until it is all here."""
        if len(self._buffer) < 4:
            return None
        digits = bytes(self._buffer[:4])
        if not re.fullmatch(rb"[0-9a-fA-F]{4}", digits):
            raise Malformed(f"a pkt-line length is four hex digits, not {digits!r}")
        length = int(digits, 16)
        if length in (1, 2):
            raise Malformed("a delim-pkt or response-end-pkt has no place in a push")
        if length == 3 or length > MAX_PKT_BYTES:
            raise Malformed(f"a pkt-line of {length} bytes: git's are 4 to {MAX_PKT_BYTES}")
        length = max(length, 4)
        if len(self._buffer) < length:
            return None
        payload = bytes(self._buffer[4:length])
        del self._buffer[:length]
        self._consumed += length
        if length == 4 and digits != b"0000":
            raise Malformed("an empty pkt-line (0004) has no place in a push")
        return payload

    def _take(self, packet: bytes) -> bool:
        """Take one pkt-line; True when the head is complete."""
        if self._options is not None:
            if packet:
                if len(self._options) == MAX_PUSH_OPTIONS:
                    raise Malformed(f"more than {MAX_PUSH_OPTIONS} push options")
                self._options.append(packet.removesuffix(b"\n"))
                return False
            self._push = self._push_of(self._options)
            return True
        if packet:
            if len(self._lines) == MAX_COMMANDS:
                raise Malformed(f"more than {MAX_COMMANDS} ref updates in one push")
            self._lines.append(packet.removesuffix(b"\n"))
            return False
        if all(line.startswith(b"shallow ") for line in self._lines):
            raise Malformed("a push with no ref update")
        if "push-options" in _capabilities(self._first_command()):
            self._options = []
            return False
        self._push = self._push_of([])
        return True

    def _first_command(self) -> bytes:
        return next(line for line in self._lines if not line.startswith(b"shallow "))

    def _push_of(self, options: list[bytes]) -> Push:
        capabilities = _capabilities(self._first_command())
        id_length = _id_length(capabilities)
        shallow: list[str] = []
        commands: list[Command] = []
        for line in self._lines:
            if line.startswith(b"shallow "):
                if commands:
                    raise Malformed("a shallow line after the ref updates")
                shallow.append(_object_id(line[8:], id_length))
                continue
            commands.append(_command(line.partition(b"\0")[0], id_length))
        if len({command.ref for command in commands}) != len(commands):
            raise Malformed("a ref named twice in one push")
        return Push(
            tuple(commands),
            capabilities,
            tuple(shallow),
            tuple(_text(option, "a push option") for option in options),
        )


def _id_length(capabilities: frozenset[str]) -> int:
    """40 hex digits (SHA-1) unless the client said ``object-format=sha256``."""
    return 64 if "object-format=sha256" in capabilities else 40


def _capabilities(line: bytes) -> frozenset[str]:
    if line.startswith(b"push-cert\0"):
        raise Malformed("signed pushes (push-cert) are not brokered: push without --signed")
    _, _, listed = line.partition(b"\0")
    return frozenset(_text(listed, "the capabilities").split())


def _command(line: bytes, id_length: int) -> Command:
    parts = line.split(b" ")
    if len(parts) != 3:
        raise Malformed("a ref update is '<old-id> <new-id> <ref>'")
    old, new = (_object_id(part, id_length) for part in parts[:2])
    ref = _text(parts[2], "a ref name")
    check_ref_name(ref)
    if old == new:
        raise Malformed(f"ref {ref!r}: old and new are the same object")
    return Command(old, new, ref)


def _object_id(raw: bytes, id_length: int) -> str:
    if len(raw) != id_length or not re.fullmatch(rb"[0-9a-f]+", raw):
        raise Malformed(f"an object id is {id_length} lowercase hex digits")
    return raw.decode()


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise Malformed(f"{what} is not UTF-8") from None


def pkt_line(payload: bytes) -> bytes:
    """``payload`` as one pkt-line (b"" makes a flush-pkt)."""
    if not payload:
        return b"0000"
    if len(payload) + 4 > MAX_PKT_BYTES:
        raise ValueError(f"a pkt-line holds at most {MAX_PKT_BYTES - 4} bytes")
    return b"%04x" % (len(payload) + 4) + payload


def refusal(push: Push, reasons: dict[str, str], *, message: str) -> bytes:
    """The body answering ``push`` when covey refuses it whole (nothing went upstream):
    ``ng <ref> <reason>`` for each ref in ``reasons`` and, for the others, that the push was
    refused for another ref; ``message`` goes to the client's terminal first (``remote: …``)
    when it takes a side band. A client that asked for no report gets ``message`` as an error.
    The content type is ``application/x-git-receive-pack-result``."""
    report = []
    if "report-status" in push.capabilities or "report-status-v2" in push.capabilities:
        report.append(pkt_line(b"unpack ok\n"))
        for command in push.commands:
            reason = reasons.get(command.ref, "refused: another ref of this push was refused")
            report.append(pkt_line(f"ng {command.ref} {_one_line(reason)}\n".encode()))
        report.append(pkt_line(b""))
    sideband = {"side-band-64k", "side-band"} & push.capabilities
    if not sideband:
        if report:
            return b"".join(report)
        return pkt_line(f"ERR {_one_line(message)}\n".encode())
    chunk = 65515 if "side-band-64k" in sideband else 995
    body = [pkt_line(b"\x02" + f"covey: {_one_line(message)}\n".encode())]
    data = b"".join(report)
    if not data:
        body.append(pkt_line(b"\x03" + f"covey: {_one_line(message)}\n".encode()))
    for start in range(0, len(data), chunk):
        body.append(pkt_line(b"\x01" + data[start : start + chunk]))
    body.append(pkt_line(b""))
    return b"".join(body)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]


def default_branch(advertisement: bytes) -> str | None:
    """The default branch an upload-pack advertisement names (``symref=HEAD:refs/heads/…`` among
    the first ref's capabilities), or None when it names none or cannot be read: the caller
    then protects every branch."""
    position, lines = 0, 0
    while position + 4 <= len(advertisement) and lines < 3:
        digits = advertisement[position : position + 4]
        if not re.fullmatch(rb"[0-9a-f]{4}", digits):
            return None
        length = int(digits, 16)
        if length == 0:
            position += 4
            continue
        if length < 4 or position + length > len(advertisement):
            return None
        payload = advertisement[position + 4 : position + length]
        position += length
        lines += 1
        if payload.startswith(b"# service="):
            continue
        _, _, listed = payload.rstrip(b"\n").partition(b"\0")
        for capability in listed.split():
            if capability.startswith(b"symref=HEAD:"):
                branch = capability.removeprefix(b"symref=HEAD:").decode(errors="replace")
                try:
                    check_ref_name(branch)
                except Malformed:
                    return None
                return branch if branch.startswith("refs/heads/") else None
        return None
    return None
