"""An agent's home on its runner host, as people see it from outside: list, stat, read, archive,
write, make a directory, move, delete; its usage; and the manifest that tells what a run changed.
Homes are directories on the runner host, so all of it works whether or not a sandbox runs.

The agent owns what is inside and may have planted anything there, so nothing is trusted:

- A path is relative to the home and given as names separated by ``/``: no ``..``, ``.``, empty
  name, absolute path, control character or over-long name (:func:`names`).
- It is resolved one name at a time from a descriptor of the directory above (``openat`` with
  ``O_NOFOLLOW``), starting from the home's own directory: a symbolic link is never followed,
  wherever it is, and one swapped in between a check and a use is not followed either, as
  nothing is looked up by its path twice.
- Only regular files are read, and only ones with a single link (another link may be outside
  the home); FIFOs, sockets and devices are refused before they are opened for reading, so
  none can hang the runner or have side effects.
- A write goes to a new file beside its target and is renamed over it (``renameat``), which
  replaces a symbolic link at the destination instead of writing through it; what is written
  belongs to the home's owner. A write that may not replace, and every move, renames with
  ``RENAME_NOREPLACE``: a name that appears after the check is never replaced.
- Archives are streamed and skip what they cannot vouch for, and say so in a file of their own.

Memory stays bounded: files and archives are read and written in chunks. No Django.
"""

import contextlib
import ctypes
import errno
import heapq
import os
import queue
import stat
import tarfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 1024 * 1024
NAME_MAX = 255  # bytes, as Linux counts a name
PATH_MAX = 4096
UPLOAD_PREFIX = ".covey-upload-"
SKIPPED_FILE = "covey-skipped.txt"  # in an archive: what it left out, and why
LARGEST = 10  # directories and files in a usage report
MAX_SKIPPED = 10_000  # lines in an archive's covey-skipped.txt

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class HomeError(Exception):
    """An operation refused, with what is wrong; ``status`` is the HTTP status it answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.removed: Removed | None = None  # a delete that stopped part-way: what went


def _refused(message: str) -> HomeError:
    return HomeError(400, message)


def names(path: str) -> list[str]:
    """The names of a path inside a home ('' or '.' is the home itself); HomeError (400) saying
    what is wrong with anything else."""
    if path in ("", ".", "/"):
        return []
    if "\0" in path:
        raise _refused("a path cannot contain a NUL character")
    if path.startswith("/"):
        raise _refused(f"{shown(path)} is absolute: paths are relative to the home")
    if len(path.encode("utf-8", "surrogatepass")) > PATH_MAX:
        raise _refused(f"the path is longer than {PATH_MAX} bytes")
    parts = path.removesuffix("/").split("/")
    for name in parts:
        if name in ("", ".", ".."):
            what = "an empty name" if not name else f"{name!r}"
            raise _refused(f"{shown(path)} has {what} in it: give each name once, no '..'")
        if not name.isprintable():  # control, format (bidi) and separator characters
            raise _refused(f"{shown(path)} has a control character in a name")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise _refused(f"{shown(path)} is not valid UTF-8") from None
        if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX:
            raise _refused(f"a name in {shown(path)} is longer than {NAME_MAX} bytes")
    return parts


def shown(text: str) -> str:
    """A name as it can be printed (control characters and undecodable bytes escaped)."""
    return text if text.isprintable() and _encodes(text) else repr(text)[1:-1]


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Entry:
    """One thing in a directory, as listed (never followed: a link is a ``symlink``)."""

    name: str  # printable: control characters and undecodable bytes escaped
    type: str  # file, directory, symlink, fifo, socket, device
    size: int
    modified: float  # seconds since the epoch
    usable: bool = True  # False: its name cannot be given back as a path (see ``names``)
    target: str = ""  # a symlink's target, as text (never followed)
    links: int = 1  # a file's hard links (see ``unreadable``); 1 for anything else


@dataclass(frozen=True)
class Listing:
    path: str
    entries: list[Entry]
    total: int  # entries in the directory, of which ``entries`` is a page


@dataclass(frozen=True)
class Usage:
    """What a home holds: bytes and files in all, and where the space goes."""

    bytes: int
    files: int
    directories: int
    largest_files: list[tuple[str, int]]
    largest_directories: list[tuple[str, int]]  # with everything below them
    measured_at: float
    seconds: float  # how long measuring took
    problems: list[tuple[str, str]] = field(default_factory=list)  # the first not measured
    unmeasured: int = 0  # how many places could not be measured (0: the figures are whole)
    # Ranked paths (as shown) that cannot be given back as paths (see ``names``).
    unusable: frozenset[str] = frozenset()

    @property
    def whole(self) -> bool:
        return not self.unmeasured


@dataclass(frozen=True)
class Changes:
    """What changed in a home between two manifests."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Written:
    """A file written: what it is now, and the size of what it replaced (None: nothing), which
    was a regular file or not (a link)."""

    entry: Entry
    replaced: int | None
    replaced_file: bool = False


@dataclass
class Removed:
    """What a delete took away, as usage counts it (bytes of all but directories; regular
    files)."""

    bytes: int = 0
    files: int = 0

    def count(self, st: os.stat_result) -> None:
        self.bytes += st.st_size
        self.files += stat.S_ISREG(st.st_mode)


@dataclass
class Manifest:
    """Every path in a home (as on disk: names are kept whole, escaped only to be shown) with
    its type, size and modification time in ns; and what could not be walked."""

    entries: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return not self.problems


class Home:
    """One agent's home directory on this host (made when first needed)."""

    def __init__(self, root: Path, *, owner: tuple[int, int] | None = None) -> None:
        self.root = root
        # (uid, gid) of what is written: the sandbox's user; None: the home directory's owner.
        self.owner = owner

    # --- reading ---------------------------------------------------------------------------

    def listing(self, path: str = "", *, offset: int = 0, limit: int = 1000) -> Listing:
        """A page of a directory, by name (only the page's entries are looked at: a large
        directory costs its names, not a stat of each)."""
        parts = names(path)
        if not parts and not self.root.exists():
            return Listing("", [], 0)  # no run or upload has made it yet
        with self._directory(parts) as fd:
            listed = sorted(os.listdir(fd))
            page = []
            for name in listed[offset : offset + limit]:
                st = _lstat_or_none(fd, name)
                if st is not None:  # gone since it was listed
                    page.append(_entry(name, st, fd))
        return Listing("/".join(parts), page, len(listed))

    def stat(self, path: str) -> Entry:
        parts = names(path)
        if not parts:
            with self._directory([]) as fd:
                return _entry("", os.fstat(fd), fd)
        with self._directory(parts[:-1]) as parent:
            return _entry(parts[-1], _lstat(parent, parts[-1], path), parent)

    def read(self, path: str, *, chunk: int = CHUNK) -> "Stream":
        """A regular file's bytes in chunks, as many as it had when opened (the file is open
        until they end or the stream is closed)."""
        parts = names(path)
        if not parts:
            raise HomeError(400, "the home is a directory: download it as an archive")
        with self._directory(parts[:-1]) as parent:
            fd = _open_file(parent, parts[-1], path)
        stream = Stream(fd, os.fstat(fd).st_size, chunk)  # closes it, whatever comes next
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # read whole: a larger read-ahead
        return stream

    def archive(self, path: str = "", *, chunk: int = CHUNK) -> "Archive":
        """A directory (or file) as a tar archive, streamed: made on a thread that waits while
        nobody reads, so memory stays a few chunks whatever the size. What it cannot vouch for
        (symbolic links, FIFOs, devices, hard-linked files, unusable names, what could not be
        walked) is left out and listed in ``covey-skipped.txt`` at the archive's root."""
        parts = names(path)
        base = parts[-1] if parts else "home"
        with self._directory(parts[:-1] if parts else []) as parent:
            if not parts:
                return Archive(os.dup(parent), None, base, chunk)
            st = _lstat(parent, parts[-1], path)
            if not stat.S_ISDIR(st.st_mode):
                return Archive(None, _open_file(parent, parts[-1], path), base, chunk)
            try:
                return Archive(os.open(parts[-1], _DIRECTORY, dir_fd=parent), None, base, chunk)
            except OSError as exc:
                raise _open_error(exc, path, parent, parts[-1]) from None

    def usage(self, path: str = "") -> Usage:
        """Bytes, files and where the space goes, walking the whole home or the directory at
        ``path`` (never following a link); how long it took, and what could not be measured,
        are part of the answer. Paths in it are relative to the home."""
        started, measured_at = time.monotonic(), time.time()
        parts = names(path)
        if not parts and not self.root.exists():
            return Usage(0, 0, 0, [], [], measured_at, 0.0)
        count = directories = total = 0
        largest: list[tuple[int, str]] = []  # a heap of the LARGEST biggest files
        direct: dict[str, int] = {}  # directory → bytes of the files right in it
        problems: list[tuple[str, str]] = []
        top = "/".join(parts)

        def problem(where: str, why: str) -> None:
            problems.append((f"{top}/{where}" if top and where != "." else top or where, why))

        with self._directory(parts) as fd:
            for _, below, name, st in _walk(fd, problem):
                here = f"{top}/{below}" if top and below else top or below
                if stat.S_ISDIR(st.st_mode):
                    directories += 1
                    continue
                total += st.st_size
                count += stat.S_ISREG(st.st_mode)
                direct[here] = direct.get(here, 0) + st.st_size
                entry = (st.st_size, f"{here}/{name}" if here else name)
                if len(largest) < LARGEST:
                    heapq.heappush(largest, entry)
                elif entry > largest[0]:
                    heapq.heapreplace(largest, entry)
        within: dict[str, int] = {}  # directory → bytes in it and everything below it
        for directory, size in direct.items():
            steps = directory.split("/") if directory else []
            for depth in range(len(parts) + 1, len(steps) + 1):
                key = "/".join(steps[:depth])
                within[key] = within.get(key, 0) + size
        ranked = sorted(within.items(), key=lambda d: (-d[1], d[0]))[:LARGEST]
        raw = [p for _, p in largest] + [p for p, _ in ranked]
        return Usage(
            bytes=total,
            files=count,
            directories=directories,
            largest_files=[(shown(p), n) for n, p in sorted(largest, key=lambda f: (-f[0], f[1]))],
            largest_directories=[(shown(p), n) for p, n in ranked],
            measured_at=measured_at,
            seconds=time.monotonic() - started,
            problems=[(shown(p), why) for p, why in problems[:LARGEST]],
            unmeasured=len(problems),
            unusable=frozenset(shown(p) for p in raw if not _usable_path(p)),
        )

    def manifest(self) -> Manifest:
        """Every path in the home (as it is on disk) with its type, size and modification
        time; and what could not be walked."""
        found = Manifest()
        if not self.root.exists():
            return found
        with self._directory([]) as fd:
            for _, here, name, st in _walk(fd, lambda p, why: found.problems.append((p, why))):
                kind = _kind(st.st_mode)
                # A directory changes when what is in it does: that is said of its entries.
                size, mtime = (0, 0) if kind == "directory" else (st.st_size, st.st_mtime_ns)
                found.entries[f"{here}/{name}" if here else name] = (kind, size, mtime)
        return found

    # --- writing ---------------------------------------------------------------------------

    def write(
        self,
        path: str,
        chunks: Iterable[bytes],
        *,
        replace: bool = False,
        limit: int | None = None,
        room: int | None = None,
    ) -> "Written":
        """Write a file from ``chunks``: into a new file beside it, renamed over the target
        once whole (a link there is replaced, never written through). ``limit``: the most bytes
        it may have; ``room``: how many more bytes the home may hold (what it replaces counts
        as room); 413 beyond either. ``replace``: whether an existing file may be replaced (409
        otherwise; a directory never is)."""
        parts = names(path)
        if not parts:
            raise HomeError(400, "give the file's path, not the home's")
        name = parts[-1]
        with self._directory(parts[:-1], make=True) as parent:
            existing = _lstat_or_none(parent, name)
            if existing is not None and stat.S_ISDIR(existing.st_mode):
                raise HomeError(409, f"{shown(path)} is a directory")
            if existing is not None and not replace:
                raise HomeError(409, f"{shown(path)} exists: say replace to write over it")
            replaced = existing.st_size if existing is not None else None
            replaced_file = existing is not None and stat.S_ISREG(existing.st_mode)
            if room is not None:
                most = max(0, room + (replaced or 0))
                if limit is None or most < limit:
                    limit = most
            draft = f"{UPLOAD_PREFIX}{uuid.uuid4().hex}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(draft, flags, 0o644, dir_fd=parent)
            try:
                written = flushed = 0
                with os.fdopen(fd, "wb", closefd=False) as file:
                    for data in chunks:
                        written += len(data)
                        if limit is not None and written > limit:
                            raise HomeError(
                                413,
                                f"{shown(path)} would pass the home's quota: it has room for"
                                f" {limit:,} bytes there",
                            )
                        file.write(data)
                        if written - flushed >= WRITE_BEHIND:
                            file.flush()
                            _write_behind(fd, flushed, written)
                            flushed = written
                    file.flush()
                    os.fsync(fd)
                self._own(fd)
                if replace:
                    os.rename(draft, name, src_dir_fd=parent, dst_dir_fd=parent)
                else:
                    _rename_new(parent, draft, parent, name, path)
            except BaseException:
                os.unlink(draft, dir_fd=parent)
                raise
            finally:
                os.close(fd)
            entry = _entry(name, _lstat(parent, name, path), parent)
            return Written(entry, replaced, replaced_file)

    def mkdir(self, path: str) -> Entry:
        """Make a directory (and those above it that are missing)."""
        parts = names(path)
        if not parts:
            raise HomeError(409, "the home exists")
        with self._directory(parts[:-1], make=True) as parent:
            try:
                os.mkdir(parts[-1], 0o755, dir_fd=parent)
            except FileExistsError:
                raise HomeError(409, f"{shown(path)} exists") from None
            fd = os.open(parts[-1], _DIRECTORY, dir_fd=parent)
            try:
                self._own(fd)
            finally:
                os.close(fd)
            return _entry(parts[-1], _lstat(parent, parts[-1], path), parent)

    def move(self, source: str, target: str) -> Entry:
        """Move or rename; the target must not exist (409), nor lie inside the source, and its
        directory must (404): a move that fails changes nothing."""
        old, new = names(source), names(target)
        if not old or not new:
            raise HomeError(400, "the home itself cannot be moved, nor be a target")
        if new[: len(old)] == old:
            raise HomeError(400, f"{shown(target)} is inside {shown(source)}")
        with self._directory(old[:-1]) as src, self._directory(new[:-1]) as dst:
            _lstat(src, old[-1], source)  # 404 when it is not there
            _rename_new(src, old[-1], dst, new[-1], target)  # 409 when the target is
            return _entry(new[-1], _lstat(dst, new[-1], target), dst)

    def delete(self, path: str) -> "Removed":
        """Delete a file, link or whole directory (a link is removed, never followed); what
        went, as usage counts it."""
        parts = names(path)
        if not parts:
            raise HomeError(400, "the home itself cannot be deleted")
        removed = Removed()
        with self._directory(parts[:-1]) as parent:
            st = _lstat(parent, parts[-1], path)
            if stat.S_ISDIR(st.st_mode):
                try:
                    _remove_tree(parent, parts[-1], "/".join(parts), removed)
                except (HomeError, OSError) as exc:
                    if isinstance(exc, OSError):
                        exc = HomeError(500, f"{shown(path)}: {exc.strerror or exc}")
                    exc.removed = removed  # what went before it stopped
                    raise exc from None
            else:
                os.unlink(parts[-1], dir_fd=parent)
                removed.count(st)
        return removed

    # --- inside ----------------------------------------------------------------------------

    def _directory(self, parts: list[str], *, make: bool = False) -> "_Descriptor":
        """The directory at ``parts``, opened one name at a time without following links
        (``make``: directories that are missing are made, as the home's owner's)."""
        if make and not self.root.exists():
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # as the engine makes it
            if os.geteuid() == 0 and self.owner is not None:
                os.chown(self.root, *self.owner, follow_symlinks=False)
        try:
            fd = os.open(self.root, _DIRECTORY)
        except FileNotFoundError:
            raise HomeError(
                404, "this agent has no home yet: its first run or upload makes it"
            ) from None
        try:
            for depth, name in enumerate(parts):
                try:
                    below = os.open(name, _DIRECTORY, dir_fd=fd)
                except FileNotFoundError:
                    here = shown("/".join(parts[: depth + 1]))
                    if not make:
                        raise HomeError(404, f"{here} is not there") from None
                    with contextlib.suppress(FileExistsError):  # made meanwhile: opened below
                        os.mkdir(name, 0o755, dir_fd=fd)
                    below = os.open(name, _DIRECTORY, dir_fd=fd)
                    self._own(below)
                except OSError as exc:
                    raise _open_error(exc, "/".join(parts[: depth + 1]), fd, name) from None
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
        return _Descriptor(fd)

    def _own(self, fd: int) -> None:
        """What covey writes belongs to the home's owner (when this process may say so)."""
        if os.geteuid() != 0:
            return
        uid, gid = self.owner or _owner_of(self.root)
        os.fchown(fd, uid, gid)


class Stream:
    """A file's bytes in chunks, as many as it had when it was opened. Iterating to the end or
    ``close()`` closes the file (so does dropping it): a download that never starts leaks
    nothing."""

    def __init__(self, fd: int, size: int, chunk: int) -> None:
        self._fd: int | None = fd
        self.size = size
        self._chunk = chunk
        self._finalizer = weakref.finalize(self, os.close, fd)

    def __iter__(self) -> Iterator[bytes]:
        left = self.size
        try:
            while left > 0 and self._fd is not None:
                data = os.read(self._fd, min(self._chunk, left))
                if not data:
                    break
                left -= len(data)
                yield data
        finally:
            self.close()

    def fileno(self) -> int:
        """The open file, for sending its bytes without reading them (``sendfile``)."""
        if self._fd is None:
            raise ValueError("the stream is closed")
        return self._fd

    def close(self) -> None:
        self._fd = None
        self._finalizer()


class Archive:
    """A tar archive of a directory (or of one file), streamed (see :meth:`Home.archive`).
    Iterating makes it on a thread that waits for its reader; ``close()`` ends it, whether it
    started or not."""

    def __init__(self, top: int | None, single: int | None, base: str, chunk: int) -> None:
        self._fds = [fd for fd in (top, single) if fd is not None]
        self._top, self._single, self._base, self._chunk = top, single, base, chunk
        self._stop = threading.Event()
        self._pipe: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=4)
        self._maker: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _close_all, list(self._fds))

    def __iter__(self) -> Iterator[bytes]:
        if self._maker is not None or self._stop.is_set():
            raise RuntimeError("an archive is read once")
        self._maker = threading.Thread(target=self._make, name="covey-home-archive", daemon=True)
        self._maker.start()
        try:
            while (item := self._pipe.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        if self._maker is not None and self._maker is not threading.current_thread():
            self._maker.join(5)
        self._finalizer()

    def _put(self, item: bytes | BaseException | None) -> None:
        """Hand the reader an item, unless it has gone (then raise, to end the thread)."""
        while not self._stop.is_set():
            try:
                self._pipe.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise BrokenPipeError("the archive's reader went")

    def _make(self) -> None:
        archive = self

        class Sink:
            def write(self, data: bytes) -> int:
                for start in range(0, len(data), archive._chunk):
                    archive._put(bytes(data[start : start + archive._chunk]))
                return len(data)

        try:
            with tarfile.open(fileobj=Sink(), mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                if self._single is not None:
                    _add_file(tar, self._single, self._base)
                else:
                    assert self._top is not None  # noqa: S101 - one of the two is given
                    skipped = _add_tree(tar, self._top, self._base)
                    if skipped:
                        text = "".join(f"{p}: {why}\n" for p, why in skipped).encode()
                        info = tarfile.TarInfo(f"{self._base}/{SKIPPED_FILE}")
                        info.size, info.mtime = len(text), int(time.time())
                        tar.addfile(info, _Bytes(text))
            self._put(None)
        except BrokenPipeError:
            pass  # the reader went: nobody to tell
        except BaseException as exc:  # the reader hears of it
            with contextlib.suppress(BrokenPipeError):
                self._put(exc)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Descriptor:
    """An open directory descriptor, closed on leaving ``with``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size < 0 else self.at + size
        chunk, self.at = self.data[self.at : end], min(end, len(self.data))
        return chunk


RENAME_NOREPLACE = 1  # renameat2(2): fail with EEXIST rather than replace the target
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # glibc 2.28 on; musl 1.2.4 on
if _renameat2 is not None:
    _renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    _renameat2.restype = ctypes.c_int


def _rename_new(src: int, old: str, dst: int, new: str, target: str) -> None:
    """Rename ``old`` (in ``src``) to ``new`` (in ``dst``) only if nothing is there: atomic
    with renameat2's RENAME_NOREPLACE, so a name that appears after it was checked is never
    replaced (409); where the kernel or file system lacks it, checked just before instead."""
    if _renameat2 is not None:
        if _renameat2(src, os.fsencode(old), dst, os.fsencode(new), RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise HomeError(409, f"{shown(target)} exists")
        if code not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(code, os.strerror(code), target)
    if _lstat_or_none(dst, new) is not None:
        raise HomeError(409, f"{shown(target)} exists")
    os.rename(old, new, src_dir_fd=src, dst_dir_fd=dst)


def _owner_of(root: Path) -> tuple[int, int]:
    st = os.stat(root, follow_symlinks=False)
    return st.st_uid, st.st_gid


def _lstat(parent: int, name: str, path: str) -> os.stat_result:
    """What ``name`` is in the directory ``parent`` (a link is a link); 404 when nothing."""
    found = _lstat_or_none(parent, name)
    if found is None:
        raise HomeError(404, f"{shown(path)} is not there")
    return found


def _lstat_or_none(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


WRITE_BEHIND = 8 * CHUNK


def _write_behind(fd: int, start: int, end: int) -> None:
    """Start writing a range of a file to disk now, without waiting for it (the kernel's
    ``posix_fadvise(DONTNEED)`` starts the writeback of dirty pages, then drops those already
    clean): the fsync at a large upload's end then waits for the last few MiB, not all of
    them, and the host holds few dirty pages of it meanwhile."""
    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


def _open_file(parent: int, name: str, path: str) -> int:
    """A regular file with one link, open for reading; refused before opening otherwise, and
    checked again once open (it may have been swapped meanwhile)."""
    before = _lstat(parent, name, path)
    _readable(before, path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO cannot hang it
    try:
        fd = os.open(name, flags, dir_fd=parent)
    except OSError as exc:
        raise _open_error(exc, path) from None
    after = os.fstat(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not _is_plain(after):
        os.close(fd)
        raise HomeError(409, f"{shown(path)} changed while it was opened; try again")
    return fd


def unreadable(path: str, kind: str, links: int) -> str:
    """Why the bytes of ``path``, a ``kind`` (as :class:`Entry` says it) with ``links`` hard
    links, are never read ('' when they may be): only a regular file with one link is. The
    runner holds every read to it, and the control plane answers a download's HEAD by it from
    the entry alone, so both say the same."""
    if kind == "symlink":
        return f"{shown(path)} is a symbolic link: covey does not follow links"
    if kind != "file":
        return f"{shown(path)} is a {kind}, not a file"
    if links > 1:
        return f"{shown(path)} has {links} hard links (one may be outside the home)"
    return ""


def _readable(st: os.stat_result, path: str) -> None:
    if why := unreadable(path, _kind(st.st_mode), st.st_nlink):
        raise HomeError(400, why)


def _is_plain(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _open_error(exc: OSError, path: str, parent: int | None = None, name: str = "") -> HomeError:
    """What an ``openat`` that refused says, in words (a link opened with O_NOFOLLOW fails
    with ELOOP, or ENOTDIR when a directory was asked for)."""
    link = exc.errno == errno.ELOOP
    if exc.errno == errno.ENOTDIR and parent is not None:
        found = _lstat_or_none(parent, name)
        link = found is not None and stat.S_ISLNK(found.st_mode)
    if link:
        return HomeError(400, f"{shown(path)} is a symbolic link: covey does not follow links")
    if exc.errno == errno.ENOTDIR:
        return HomeError(400, f"{shown(path)} is not a directory")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return HomeError(403, f"{shown(path)}: permission denied")
    return HomeError(500, f"{shown(path)}: {exc.strerror or exc}")


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def _entry(name: str, st: os.stat_result, parent: int) -> Entry:
    kind = _kind(st.st_mode)
    target = ""
    if kind == "symlink":
        try:
            target = shown(os.readlink(name, dir_fd=parent))
        except OSError:
            target = "?"
    usable = not name or _usable_name(name)
    return Entry(
        name=shown(name) if not usable else name,
        type=kind,
        size=st.st_size if kind != "directory" else 0,
        modified=st.st_mtime,
        usable=usable,
        target=target,
        links=st.st_nlink if kind == "file" else 1,
    )


def _add_file(tar: tarfile.TarFile, fd: int, name: str) -> None:
    st = os.fstat(fd)
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), st.st_mode & 0o777
    with os.fdopen(os.dup(fd), "rb") as file:
        tar.addfile(info, file)


def _add_tree(tar: tarfile.TarFile, top: int, base: str) -> list[tuple[str, str]]:
    """Everything under the directory ``top`` as ``base/...``; what was left out, and why."""
    skipped: list[tuple[str, str]] = []

    def left_out(where: str, why: str) -> None:
        if len(skipped) < MAX_SKIPPED:
            skipped.append((shown(where), why))

    info = tarfile.TarInfo(base)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(os.fstat(top).st_mtime)
    tar.addfile(info)
    for dirfd, here, name, st in _walk(top, left_out, descend=_usable_path, went=left_out):
        path = f"{here}/{name}" if here else name
        if not _usable_name(name):
            left_out(path, "a name that cannot be given back as a path")
            continue
        if stat.S_ISDIR(st.st_mode):
            info = tarfile.TarInfo(f"{base}/{path}")
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, st.st_mode & 0o777, int(st.st_mtime)
            tar.addfile(info)
            continue
        if stat.S_ISLNK(st.st_mode):
            left_out(path, "a symbolic link (covey does not follow links)")
            continue
        if not stat.S_ISREG(st.st_mode):
            left_out(path, f"a {_kind(st.st_mode)}, not a file")
            continue
        if st.st_nlink > 1:
            left_out(path, f"{st.st_nlink} hard links (one may be outside)")
            continue
        if here == "" and name == SKIPPED_FILE:
            left_out(path, "its name is the one this list takes")
            continue
        try:
            fd = _open_file(dirfd, name, path)
        except HomeError as exc:
            left_out(path, str(exc))
            continue
        try:
            _add_file(tar, fd, f"{base}/{path}")
        finally:
            os.close(fd)
    return skipped


def _usable_path(path: str) -> bool:
    return all(_usable_name(name) for name in path.split("/"))


def _usable_name(name: str) -> bool:
    """Whether a name on disk can be given back as a path (names() checks UTF-8 too)."""
    try:
        names(name)
    except HomeError:
        return False
    return True


def changes(before: Manifest, after: Manifest) -> Changes:
    """Paths added, changed (type, size or modification time) and removed, in order, shown
    escaped (the manifests keep them whole, so two names never meet under one spelling)."""
    old, new = before.entries, after.entries
    return Changes(
        added=[shown(p) for p in sorted(set(new) - set(old))],
        changed=[shown(p) for p in sorted(p for p in set(new) & set(old) if new[p] != old[p])],
        removed=[shown(p) for p in sorted(set(old) - set(new))],
    )


# --- walking a tree ------------------------------------------------------------------------

MAX_DEPTH = 128  # directories below the top a walk goes into; deeper ones are a problem
_WALK_DIRECTORY = _DIRECTORY | os.O_NONBLOCK | os.O_NOCTTY  # nothing swapped in is opened


def _walk(
    top: int,
    problem: Callable[[str, str], None],
    descend: Callable[[str], bool] = lambda path: True,
    went: Callable[[str, str], None] | None = None,
) -> Iterator[tuple[int, str, str, os.stat_result]]:
    """Everything below the directory ``top``, depth first in name order: (descriptor of its
    directory, that directory's path, its name, what it is, not following a link).

    Each directory is opened from the one above with O_NOFOLLOW, O_DIRECTORY, O_NONBLOCK and
    O_NOCTTY: a link, a FIFO or a device swapped in is never opened, let alone followed, and
    what is opened is a directory in the home (the one there now, when it was made again). At
    most MAX_DEPTH descriptors are open at once. A tree that changes while it is walked is
    walked as it is found: a directory that went (or became something else) between its
    listing and its opening is not there, and is told to ``went(path, why)`` (an archive says
    so), not to ``problem``. What cannot be walked for another reason (too deep, out of
    descriptors, unreadable) is told to ``problem(path, why)``; ``descend(path)`` says
    whether to go into a directory at all."""
    stack: list[tuple[int, str, list[str] | None]] = [(os.dup(top), "", None)]
    try:
        while stack:
            fd, here, pending = stack[-1]
            if pending is None:
                pending = []
                stack[-1] = (fd, here, pending)
                try:
                    listed = sorted(os.listdir(fd))
                except FileNotFoundError:  # removed since it was opened: nothing is in it
                    listed = []
                except OSError as exc:
                    problem(here or ".", exc.strerror or str(exc))
                    listed = []
                for name in listed:
                    path = f"{here}/{name}" if here else name
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # gone meanwhile
                    except OSError as exc:
                        problem(path, exc.strerror or str(exc))
                        continue
                    yield fd, here, name, st
                    if stat.S_ISDIR(st.st_mode) and descend(path):
                        pending.append(name)
                pending.reverse()  # taken from the end, in name order
            if not pending:
                stack.pop()
                os.close(fd)
                continue
            name = pending.pop()
            path = f"{here}/{name}" if here else name
            if len(stack) > MAX_DEPTH:
                problem(path, f"more than {MAX_DEPTH} directories deep: not walked")
                continue
            try:
                child = os.open(name, _WALK_DIRECTORY, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    if went is not None:
                        went(path, "it went while it was walked")
                elif exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    if went is not None:
                        went(path, "it is no longer a directory (not followed)")
                else:  # out of descriptors, unreadable: it is there and cannot be measured
                    problem(path, exc.strerror or str(exc))
                continue
            stack.append((child, path, None))
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _remove_tree(parent: int, name: str, path: str, removed: "Removed", depth: int = 0) -> None:
    """Delete the directory ``name`` and everything in it, entering each directory with
    O_NOFOLLOW (a link swapped in is removed as a link, or refused, never entered)."""
    try:
        fd = os.open(name, _WALK_DIRECTORY, dir_fd=parent)
    except OSError as exc:
        raise _open_error(exc, path, parent, name) from None
    try:
        if depth >= MAX_DEPTH:
            raise HomeError(400, f"{shown(path)} is more than {MAX_DEPTH} directories deep")
        for child in os.listdir(fd):
            below = f"{path}/{child}"
            found = _lstat_or_none(fd, child)
            if found is None:
                continue
            if stat.S_ISDIR(found.st_mode):
                _remove_tree(fd, child, below, removed, depth + 1)
            else:
                os.unlink(child, dir_fd=fd)
                removed.count(found)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)
