"""The commits a pushed pack carries, read as the pack streams past (:class:`PackReader`), so
the gateway can tell whether an update is a fast-forward (:meth:`Commits.descends`) without
holding the pack: only commits are kept (they are small); every other object is inflated in
bounded pieces, hashed for the trailer and dropped.

No Django and no I/O. The format is git's (gitformat-pack(5)): ``PACK``, a version (2 or 3), a
count of objects, each object's header and its zlib stream (a delta's base first: an offset
back in the pack, or an object id), and a trailer, the hash of all before it. A pack that does
not keep to it is Malformed, with what is wrong.
"""

import hashlib
import re
import zlib
from collections import deque
from dataclasses import dataclass, field

from connections.smarthttp import Malformed

COMMIT, TREE, BLOB, TAG, OFS_DELTA, REF_DELTA = 1, 2, 3, 4, 6, 7
TYPES = (COMMIT, TREE, BLOB, TAG, OFS_DELTA, REF_DELTA)
MAX_COMMIT_BYTES = 1024 * 1024  # a commit larger than this is no commit an agent made
MAX_HEADER_BYTES = 64  # an object's header, delta base included (10 + 32 bytes at most)
CHUNK = 64 * 1024  # inflated at a time


@dataclass
class Commits:
    """The commits of a pack: each one's parents, by id."""

    parents: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def descends(self, new: str, old: str) -> bool | None:
        """True when ``new`` descends from ``old`` through commits of this pack (a fast-forward);
        None when the pack cannot tell (``new`` is not in it, or its ancestry leaves the pack
        before reaching ``old``): a pack never proves the opposite."""
        seen, todo = {new}, deque([new])
        while todo:
            for parent in self.parents.get(todo.popleft(), ()):
                if parent == old:
                    return True
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        return None


def _commit_parents(body: bytes, id_length: int) -> tuple[str, ...]:
    """The parents a commit names: the ``parent`` lines right after its ``tree`` line."""
    lines = body.split(b"\n\n", 1)[0].split(b"\n")
    if not lines[0].startswith(b"tree "):
        raise Malformed("a commit in the pack does not begin with its tree")
    parents = []
    for line in lines[1:]:
        if not line.startswith(b"parent "):
            break
        if not re.fullmatch(rb"[0-9a-f]{%d}" % id_length, line[7:]):
            raise Malformed("a commit in the pack names a parent that is no object id")
        parents.append(line[7:].decode())
    return tuple(parents)


def apply_delta(base: bytes, delta: bytes) -> bytes:
    """git's delta: the base's and the result's sizes, then copies from the base and inserts."""
    position = 0

    def size() -> int:
        nonlocal position
        value = shift = 0
        while True:
            if position >= len(delta):
                raise Malformed("a delta in the pack ends in its header")
            byte = delta[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    if size() != len(base):
        raise Malformed("a delta in the pack does not fit its base")
    result_size = size()
    if result_size > MAX_COMMIT_BYTES:
        raise Malformed("a commit in the pack is larger than 1 MiB")
    out = bytearray()
    while position < len(delta):
        op = delta[position]
        position += 1
        if op & 0x80:
            offset = length = 0
            for bit in range(4):
                if op & (1 << bit):
                    offset |= delta[position] << (8 * bit)
                    position += 1
            for bit in range(3):
                if op & (1 << (4 + bit)):
                    length |= delta[position] << (8 * bit)
                    position += 1
            length = length or 0x10000
            if offset + length > len(base):
                raise Malformed("a delta in the pack copies past its base")
            out += base[offset : offset + length]
        elif op:
            out += delta[position : position + op]
            position += op
        else:
            raise Malformed("a delta in the pack holds a zero opcode")
        if len(out) > result_size:
            raise Malformed("a delta in the pack makes more than it says")
    if len(out) != result_size:
        raise Malformed("a delta in the pack makes less than it says")
    return bytes(out)


@dataclass
class _Object:
    """The object being read: where it began, what it is, and its inflater."""

    offset: int
    kind: int
    size: int
    base: bytes | None  # a delta's base commit (None: not a commit, or not a delta)
    inflater: "zlib._Decompress"
    inflated: bytearray = field(default_factory=bytearray)
    length: int = 0  # inflated so far

    @property
    def keep(self) -> bool:
        """A commit, or a delta of one: its inflated bytes are kept."""
        return self.kind == COMMIT or self.base is not None


class PackReader:
    """Reads a pack as it streams: :meth:`feed` each chunk, then :meth:`finish` for its
    commits. Memory stays bounded by the commits it carries, whatever the size of the rest."""

    def __init__(self, *, id_length: int = 40, max_bytes: int) -> None:
        self.id_length = id_length
        self.max_bytes = max_bytes
        self._hash_name = "sha256" if id_length == 64 else "sha1"
        self._trailer = hashlib.new(self._hash_name)
        self._buffer = bytearray()
        self._offset = 0  # of the buffer's first byte in the pack
        self._count: int | None = None
        self._read = 0  # objects read whole
        self._current: _Object | None = None
        self._commits_at: dict[int, bytes] = {}  # offset → a commit's bytes (delta bases)
        self._commits_by_id: dict[str, bytes] = {}
        self.commits = Commits()
        self._done = False

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the pack."""
        if self._offset + len(self._buffer) + len(data) > self.max_bytes:
            raise Malformed(f"the pack is larger than covey takes ({self.max_bytes} bytes)")
        self._buffer += data
        while self._step():
            pass

    def finish(self) -> Commits:
        """The commits, once the pack is whole; Malformed when it was cut short or ran on."""
        if not self._done:
            raise Malformed("the pack ended early")
        return self.commits

    def _step(self) -> bool:
        """Read what the buffer allows; True when it made progress and may make more."""
        if self._done:
            if self._buffer:
                raise Malformed("bytes after the pack's trailer")
            return False
        if self._count is None:
            return self._header()
        if self._current is not None:
            return self._inflate(self._current)
        if self._read == self._count:
            return self._end()
        return self._object_header()

    def _take(self, length: int) -> bytes:
        taken = bytes(self._buffer[:length])
        del self._buffer[:length]
        self._offset += length
        self._trailer.update(taken)
        return taken

    def _header(self) -> bool:
        if len(self._buffer) < 12:
            return False
        head = self._take(12)
        if head[:4] != b"PACK" or int.from_bytes(head[4:8]) not in (2, 3):
            raise Malformed("the pack does not begin with PACK and version 2 or 3")
        self._count = int.from_bytes(head[8:12])
        return True

    def _object_header(self) -> bool:
        available = bytes(self._buffer[:MAX_HEADER_BYTES])
        position, byte = 1, available[0] if available else None
        if byte is None:
            return False
        kind, size, shift = (byte >> 4) & 7, byte & 15, 4
        while byte & 0x80:
            if position >= len(available):
                return self._need_more(available)
            byte = available[position]
            position += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if shift > 70:
                raise Malformed("an object's size in the pack runs on")
        base: bytes | None = None
        if kind == OFS_DELTA:
            if position >= len(available):
                return self._need_more(available)
            byte = available[position]
            position += 1
            distance = byte & 0x7F
            while byte & 0x80:
                if position >= len(available):
                    return self._need_more(available)
                byte = available[position]
                position += 1
                distance = ((distance + 1) << 7) | (byte & 0x7F)
            if distance <= 0 or distance > self._offset:
                raise Malformed("a delta in the pack points outside it")
            base = self._commits_at.get(self._offset - distance)
        elif kind == REF_DELTA:
            if position + self.id_length // 2 > len(available):
                return self._need_more(available)
            base_id = available[position : position + self.id_length // 2].hex()
            position += self.id_length // 2
            base = self._commits_by_id.get(base_id)
        elif kind not in TYPES:
            raise Malformed(f"an object of type {kind} in the pack, which git does not make")
        if kind == COMMIT and size > MAX_COMMIT_BYTES:
            raise Malformed("a commit in the pack is larger than 1 MiB")
        offset = self._offset
        self._take(position)
        self._current = _Object(offset, kind, size, base, zlib.decompressobj())
        return True

    def _need_more(self, available: bytes) -> bool:
        if len(available) >= MAX_HEADER_BYTES:
            raise Malformed("an object's header in the pack runs on")
        return False

    def _inflate(self, current: _Object) -> bool:
        if not self._buffer:
            return False
        data = bytes(self._buffer)
        try:
            out = current.inflater.decompress(data, CHUNK)
            while True:
                self._account(current, out)
                if current.inflater.eof or not current.inflater.unconsumed_tail:
                    break
                out = current.inflater.decompress(current.inflater.unconsumed_tail, CHUNK)
        except zlib.error as exc:
            raise Malformed(f"an object in the pack is no zlib stream ({exc})") from None
        used = len(data) - len(current.inflater.unused_data) - len(current.inflater.unconsumed_tail)
        self._take(used)
        if not current.inflater.eof:
            return False
        if current.length != current.size:
            raise Malformed("an object in the pack is not the size its header says")
        self._current = None
        self._read += 1
        self._keep(current)
        return True

    def _account(self, current: _Object, out: bytes) -> None:
        current.length += len(out)
        if current.length > current.size:
            raise Malformed("an object in the pack is larger than its header says")
        if current.keep:
            current.inflated += out

    def _keep(self, current: _Object) -> None:
        if not current.keep:
            return
        body = bytes(current.inflated)
        if current.base is not None:
            body = apply_delta(current.base, body)
        object_id = hashlib.new(self._hash_name, b"commit %d\0" % len(body) + body).hexdigest()
        self._commits_at[current.offset] = body
        self._commits_by_id[object_id] = body
        self.commits.parents[object_id] = _commit_parents(body, self.id_length)

    def _end(self) -> bool:
        length = self.id_length // 2
        if len(self._buffer) < length:
            return False
        expected = self._trailer.digest()
        trailer = bytes(self._buffer[:length])
        del self._buffer[:length]
        self._offset += length
        if trailer != expected:
            raise Malformed("the pack's trailer is not the hash of the pack")
        self._done = True
        return True
