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
  belongs to the home's owner.
- Archives are streamed and skip what they cannot vouch for, and say so in a file of their own.

Memory stays bounded: files and archives are read and written in chunks. No Django.
"""

import contextlib
import errno
import os
import queue
import shutil
import stat
import tarfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 1024 * 1024
NAME_MAX = 255  # bytes, as Linux counts a name
PATH_MAX = 4096
UPLOAD_PREFIX = ".covey-upload-"
SKIPPED_FILE = "covey-skipped.txt"  # in an archive: what it left out, and why
LARGEST = 10  # directories and files in a usage report

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class HomeError(Exception):
    """An operation refused, with what is wrong; ``status`` is the HTTP status it answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
        raise _refused(f"{_shown(path)} is absolute: paths are relative to the home")
    if len(path.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise _refused(f"the path is longer than {PATH_MAX} bytes")
    parts = path.removesuffix("/").split("/")
    for name in parts:
        if name in ("", ".", ".."):
            what = "an empty name" if not name else f"{name!r}"
            raise _refused(f"{_shown(path)} has {what} in it: give each name once, no '..'")
        if any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise _refused(f"{_shown(path)} has a control character in a name")
        if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise _refused(f"a name in {_shown(path)} is longer than {NAME_MAX} bytes")
    return parts


def _shown(text: str) -> str:
    """A name as it can be printed (control characters and undecodable bytes escaped)."""
    return repr(text)[1:-1] if not text.isprintable() else text


@dataclass(frozen=True)
class Entry:
    """One thing in a directory, as listed (never followed: a link is a ``symlink``)."""

    name: str  # printable: control characters and undecodable bytes escaped
    type: str  # file, directory, symlink, fifo, socket, device
    size: int
    modified: float  # seconds since the epoch
    usable: bool = True  # False: its name cannot be given back as a path (see ``names``)
    target: str = ""  # a symlink's target, as text (never followed)


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


@dataclass(frozen=True)
class Changes:
    """What changed in a home between two manifests."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


Manifest = dict[str, tuple[str, int, int]]  # path → (type, size, mtime in ns)


class Home:
    """One agent's home directory on this host (made when first needed)."""

    def __init__(self, root: Path, *, owner: tuple[int, int] | None = None) -> None:
        self.root = root
        # (uid, gid) of what is written: the sandbox's user; None: the home directory's owner.
        self.owner = owner

    # --- reading ---------------------------------------------------------------------------

    def listing(self, path: str = "", *, offset: int = 0, limit: int = 1000) -> Listing:
        """A page of a directory, by name."""
        parts = names(path)
        if not parts and not self.root.exists():
            return Listing("", [], 0)  # no run or upload has made it yet
        with self._directory(parts) as fd:
            found = []
            with os.scandir(fd) as scan:
                for item in scan:
                    found.append(_entry(item.name, item.stat(follow_symlinks=False), fd))
        found.sort(key=lambda e: e.name)
        return Listing("/".join(parts), found[offset : offset + limit], len(found))

    def stat(self, path: str) -> Entry:
        parts = names(path)
        if not parts:
            with self._directory([]) as fd:
                return _entry("", os.fstat(fd), fd)
        with self._directory(parts[:-1]) as parent:
            return _entry(parts[-1], _lstat(parent, parts[-1], path), parent)

    def read(self, path: str, *, chunk: int = CHUNK) -> tuple[int, Iterator[bytes]]:
        """A regular file's size and its bytes, in chunks (the file is open until they end)."""
        parts = names(path)
        if not parts:
            raise HomeError(400, "the home is a directory: download it as an archive")
        with self._directory(parts[:-1]) as parent:
            fd = _open_file(parent, parts[-1], path)
        size = os.fstat(fd).st_size

        def chunks() -> Iterator[bytes]:
            with os.fdopen(fd, "rb", buffering=0) as file:
                while data := file.read(chunk):
                    yield data

        return size, chunks()

    def archive(self, path: str = "", *, chunk: int = CHUNK) -> Iterator[bytes]:
        """A directory (or file) as a tar archive, streamed: made on a thread that waits while
        nobody reads, so memory stays a few chunks whatever the size. What it cannot vouch for
        (symbolic links, FIFOs, devices, hard-linked files, unusable names) is left out and
        listed in ``covey-skipped.txt`` at the archive's root."""
        parts = names(path)
        base = parts[-1] if parts else "home"
        top: int | None = None  # the directory archived
        single: int | None = None  # or the one file
        with self._directory(parts[:-1]) as parent:
            if not parts:
                top = os.dup(parent)
            else:
                st = _lstat(parent, parts[-1], path)
                if stat.S_ISDIR(st.st_mode):
                    try:
                        top = os.open(parts[-1], _DIRECTORY, dir_fd=parent)
                    except OSError as exc:
                        raise _open_error(exc, path) from None
                else:
                    single = _open_file(parent, parts[-1], path)
        pipe: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=4)
        stop = threading.Event()

        class Sink:
            def write(self, data: bytes) -> int:
                for start in range(0, len(data), chunk):
                    while not stop.is_set():
                        try:
                            pipe.put(bytes(data[start : start + chunk]), timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        raise BrokenPipeError("the archive's reader went")
                return len(data)

        def make() -> None:
            try:
                with tarfile.open(fileobj=Sink(), mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                    if single is not None:
                        _add_file(tar, single, base)
                    else:
                        assert top is not None  # noqa: S101
                        skipped = _add_tree(tar, top, base)
                        if skipped:
                            text = "".join(f"{p}: {why}\n" for p, why in skipped).encode()
                            info = tarfile.TarInfo(f"{base}/{SKIPPED_FILE}")
                            info.size, info.mtime = len(text), int(time.time())
                            tar.addfile(info, _Bytes(text))
                pipe.put(None)
            except BaseException as exc:  # the reader hears of it
                if not stop.is_set():
                    pipe.put(exc)
            finally:
                for fd in (top, single):
                    if fd is not None:
                        os.close(fd)

        def chunks() -> Iterator[bytes]:
            maker = threading.Thread(target=make, name="covey-home-archive", daemon=True)
            maker.start()
            try:
                while (item := pipe.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                stop.set()
                maker.join(5)

        return chunks()

    def usage(self) -> Usage:
        """Bytes, files and where the space goes, walking the whole home (never following a
        link); how long it took is part of the answer."""
        started, measured_at = time.monotonic(), time.time()
        files: list[tuple[int, str]] = []
        sizes: dict[str, int] = {}
        count = directories = total = 0
        if not self.root.exists():
            return Usage(0, 0, 0, [], [], measured_at, 0.0)
        with self._directory([]) as fd:
            # fwalk descends into every directory, never through a link.
            for top, _dirs, filenames, dirfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
                directories += 1
                here = top.removeprefix("./").removeprefix(".")
                for name in filenames:
                    try:
                        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # gone meanwhile
                    total += st.st_size
                    count += 1
                    files.append((st.st_size, f"{here}/{name}" if here else name))
                    for ancestor in _ancestors(here):
                        sizes[ancestor] = sizes.get(ancestor, 0) + st.st_size
        files.sort(key=lambda f: (-f[0], f[1]))
        ranked = sorted(((p, s) for p, s in sizes.items() if p), key=lambda d: (-d[1], d[0]))
        return Usage(
            bytes=total,
            files=count,
            directories=max(directories - 1, 0),
            largest_files=[(_shown(p), s) for s, p in files[:LARGEST]],
            largest_directories=[(_shown(p), s) for p, s in ranked[:LARGEST]],
            measured_at=measured_at,
            seconds=time.monotonic() - started,
        )

    def manifest(self) -> Manifest:
        """Every path in the home with its type, size and modification time."""
        found: Manifest = {}
        if not self.root.exists():
            return found
        with self._directory([]) as fd:
            for top, dirs, filenames, dirfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
                here = top.removeprefix("./").removeprefix(".")
                for name in [*dirs, *filenames]:
                    try:
                        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    kind = _kind(st.st_mode)
                    # A directory changes when what is in it does: that is said of its entries.
                    size, mtime = (0, 0) if kind == "directory" else (st.st_size, st.st_mtime_ns)
                    found[_shown(f"{here}/{name}" if here else name)] = (kind, size, mtime)
        return found

    # --- writing ---------------------------------------------------------------------------

    def write(
        self,
        path: str,
        chunks: Iterable[bytes],
        *,
        replace: bool = False,
        limit: int | None = None,
    ) -> Entry:
        """Write a file from ``chunks``: into a new file beside it, renamed over the target
        once whole (a link there is replaced, never written through). ``limit``: the most bytes
        it may have (413 beyond); ``replace``: whether an existing file may be replaced (409
        otherwise; a directory never is)."""
        parts = names(path)
        if not parts:
            raise HomeError(400, "give the file's path, not the home's")
        name = parts[-1]
        with self._directory(parts[:-1], make=True) as parent:
            existing = _lstat_or_none(parent, name)
            if existing is not None and stat.S_ISDIR(existing.st_mode):
                raise HomeError(409, f"{_shown(path)} is a directory")
            if existing is not None and not replace:
                raise HomeError(409, f"{_shown(path)} exists: say replace to write over it")
            draft = f"{UPLOAD_PREFIX}{uuid.uuid4().hex}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(draft, flags, 0o644, dir_fd=parent)
            try:
                written = 0
                with os.fdopen(fd, "wb", closefd=False) as file:
                    for data in chunks:
                        written += len(data)
                        if limit is not None and written > limit:
                            raise HomeError(
                                413, f"{_shown(path)} would pass the home's quota ({limit} bytes)"
                            )
                        file.write(data)
                    file.flush()
                    os.fsync(fd)
                self._own(fd)
                os.rename(draft, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                os.unlink(draft, dir_fd=parent)
                raise
            finally:
                os.close(fd)
            return _entry(name, _lstat(parent, name, path), parent)

    def mkdir(self, path: str) -> Entry:
        """Make a directory (and those above it that are missing)."""
        parts = names(path)
        if not parts:
            raise HomeError(409, "the home exists")
        with self._directory(parts[:-1], make=True) as parent:
            try:
                os.mkdir(parts[-1], 0o755, dir_fd=parent)
            except FileExistsError:
                raise HomeError(409, f"{_shown(path)} exists") from None
            fd = os.open(parts[-1], _DIRECTORY, dir_fd=parent)
            try:
                self._own(fd)
            finally:
                os.close(fd)
            return _entry(parts[-1], _lstat(parent, parts[-1], path), parent)

    def move(self, source: str, target: str) -> Entry:
        """Move or rename; the target must not exist (409), nor lie inside the source."""
        old, new = names(source), names(target)
        if not old or not new:
            raise HomeError(400, "the home itself cannot be moved, nor be a target")
        if new[: len(old)] == old:
            raise HomeError(400, f"{_shown(target)} is inside {_shown(source)}")
        with self._directory(old[:-1]) as src, self._directory(new[:-1], make=True) as dst:
            _lstat(src, old[-1], source)  # 404 when it is not there
            if _lstat_or_none(dst, new[-1]) is not None:
                raise HomeError(409, f"{_shown(target)} exists")
            os.rename(old[-1], new[-1], src_dir_fd=src, dst_dir_fd=dst)
            return _entry(new[-1], _lstat(dst, new[-1], target), dst)

    def delete(self, path: str) -> None:
        """Delete a file, link or whole directory (a link is removed, never followed)."""
        parts = names(path)
        if not parts:
            raise HomeError(400, "the home itself cannot be deleted")
        with self._directory(parts[:-1]) as parent:
            st = _lstat(parent, parts[-1], path)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(parts[-1], dir_fd=parent)  # fd-based: immune to swapped links
            else:
                os.unlink(parts[-1], dir_fd=parent)

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
                    here = _shown("/".join(parts[: depth + 1]))
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


def _owner_of(root: Path) -> tuple[int, int]:
    st = os.stat(root, follow_symlinks=False)
    return st.st_uid, st.st_gid


def _lstat(parent: int, name: str, path: str) -> os.stat_result:
    """What ``name`` is in the directory ``parent`` (a link is a link); 404 when nothing."""
    found = _lstat_or_none(parent, name)
    if found is None:
        raise HomeError(404, f"{_shown(path)} is not there")
    return found


def _lstat_or_none(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


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
        raise HomeError(409, f"{_shown(path)} changed while it was opened; try again")
    return fd


def _readable(st: os.stat_result, path: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise HomeError(400, f"{_shown(path)} is a symbolic link: covey does not follow links")
    if not stat.S_ISREG(st.st_mode):
        raise HomeError(400, f"{_shown(path)} is a {_kind(st.st_mode)}, not a file")
    if st.st_nlink > 1:
        raise HomeError(
            400, f"{_shown(path)} has {st.st_nlink} hard links (one may be outside the home)"
        )


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
        return HomeError(400, f"{_shown(path)} is a symbolic link: covey does not follow links")
    if exc.errno == errno.ENOTDIR:
        return HomeError(400, f"{_shown(path)} is not a directory")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return HomeError(403, f"{_shown(path)}: permission denied")
    return HomeError(500, f"{_shown(path)}: {exc.strerror or exc}")


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
            target = _shown(os.readlink(name, dir_fd=parent))
        except OSError:
            target = "?"
    usable = True
    try:
        names(name) if name else None
        name.encode("utf-8")
    except (HomeError, UnicodeEncodeError):
        usable = False
    return Entry(
        name=_shown(name) if not usable else name,
        type=kind,
        size=st.st_size if kind != "directory" else 0,
        modified=st.st_mtime,
        usable=usable,
        target=target,
    )


def _ancestors(here: str) -> Iterator[str]:
    """'' and every directory from the top down to ``here``."""
    yield ""
    if not here:
        return
    parts = here.split("/")
    for depth in range(1, len(parts) + 1):
        yield "/".join(parts[:depth])


def _add_file(tar: tarfile.TarFile, fd: int, name: str) -> None:
    st = os.fstat(fd)
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), st.st_mode & 0o777
    with os.fdopen(os.dup(fd), "rb") as file:
        tar.addfile(info, file)


def _add_tree(tar: tarfile.TarFile, top: int, base: str) -> list[tuple[str, str]]:
    """Everything under the directory ``top`` as ``base/...``; what was left out, and why."""
    skipped: list[tuple[str, str]] = []
    info = tarfile.TarInfo(base)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(os.fstat(top).st_mtime)
    tar.addfile(info)
    for here, dirs, filenames, dirfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
        rel = here.removeprefix("./").removeprefix(".")
        prefix = f"{base}/{rel}" if rel else base
        for name in list(dirs):
            shown = f"{rel}/{name}" if rel else name
            if not _usable_name(name):
                skipped.append((_shown(shown), "a name that cannot be given back as a path"))
                dirs.remove(name)
                continue
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):  # listed with the directories, never descended into
                skipped.append((shown, "a symbolic link (covey does not follow links)"))
                dirs.remove(name)
                continue
            info = tarfile.TarInfo(f"{prefix}/{name}")
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, st.st_mode & 0o777, int(st.st_mtime)
            tar.addfile(info)
        for name in filenames:
            shown = f"{rel}/{name}" if rel else name
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not _usable_name(name):
                skipped.append((_shown(shown), "a name that cannot be given back as a path"))
                continue
            if stat.S_ISLNK(st.st_mode):
                skipped.append((shown, "a symbolic link (covey does not follow links)"))
                continue
            if not stat.S_ISREG(st.st_mode):
                skipped.append((shown, f"a {_kind(st.st_mode)}, not a file"))
                continue
            if st.st_nlink > 1:
                skipped.append((shown, f"{st.st_nlink} hard links (one may be outside)"))
                continue
            try:
                fd = _open_file(dirfd, name, shown)
            except HomeError as exc:
                skipped.append((shown, str(exc)))
                continue
            try:
                _add_file(tar, fd, f"{prefix}/{name}")
            finally:
                os.close(fd)
    return skipped


def _usable_name(name: str) -> bool:
    try:
        names(name)
        name.encode("utf-8")
    except (HomeError, UnicodeEncodeError):
        return False
    return True


def changes(before: Manifest, after: Manifest) -> Changes:
    """Paths added, changed (type, size or modification time) and removed, in order."""
    return Changes(
        added=sorted(set(after) - set(before)),
        changed=sorted(p for p in set(after) & set(before) if after[p] != before[p]),
        removed=sorted(set(before) - set(after)),
    )
