"""An agent's home from outside (runners/host/homes.py), on real directories, with what a hostile
agent could plant in it: links out of the home (at every place in a path, swapped in while it is
read), hard links, FIFOs, devices, names no path can give. Nothing outside the home is ever read
or written, nothing hangs, and each refusal says what is wrong."""

import contextlib
import io
import os
import stat
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from runners.host import homes, quotas
from runners.host.homes import SKIPPED_FILE, UPLOAD_PREFIX, Home, HomeError, changes, names
from tests.processes import wait_for
from tests.runners.test_runner_logic import RUN, Host, spec

SECRET = b"outside the home"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory beside the home, with a file the agent must never reach through covey."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "secret").write_bytes(SECRET)
    return directory


@pytest.fixture
def home(tmp_path) -> Home:
    root = tmp_path / "homes" / "1" / "7"
    root.mkdir(parents=True)
    (root / "src").mkdir()
    (root / "src" / "main.py").write_text("print('hi')\n")
    (root / "notes.md").write_text("# notes\n")
    return Home(root)


def read(home: Home, path: str) -> bytes:
    return b"".join(home.read(path))


CHURN = """
import os, shutil, sys
build, count = sys.argv[1], 0
while True:
    for n in range(50):
        target = os.path.join(build, f"obj{n}")
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(os.path.join(target, "deps"))
        with open(os.path.join(target, "main.o"), "wb") as file:
            file.write(b"x" * 100)
        count += 1
        if count % 100 == 0:
            with open(os.path.join(build, "..", "made"), "w") as file:
                file.write(str(count))
"""


@contextlib.contextmanager
def churning(build: Path):
    """A build that removes and makes its directories again as fast as it can, in a process of
    its own (it races the walk on another core); yields how many directories it has made."""
    made = build.parent / "made"
    process = subprocess.Popen([sys.executable, "-c", CHURN, str(build)])
    try:
        yield lambda: int(made.read_text() or 0) if made.exists() else 0
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def flipping(real: Path, outside: Path) -> Iterator[None]:
    """While inside: a hostile agent swaps the directory ``real`` for a link to ``outside``
    and back, as fast as it can (a thread of this process)."""
    parked, link = real.parent / "parked", real.parent / f"{real.name}.link"
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            link.symlink_to(outside)
            os.rename(real, parked)
            os.rename(link, real)  # now real -> outside
            os.unlink(real)
            os.rename(parked, real)  # and back

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        yield
    finally:
        stop.set()
        flipper.join()


class TestPaths:
    @pytest.mark.parametrize(
        ("path", "message"),
        [
            ("../outside/secret", "'..'"),
            ("src/../../outside", "'..'"),
            ("/etc/passwd", "is absolute"),
            ("src//main.py", "an empty name"),
            ("./src", "'.'"),
            ("src/\x1b[31mred", "control character"),
            ("new\nline", "control character"),
            ("nul\0byte", "NUL"),
            ("x" * 256, "longer than 255 bytes"),
            ("a/" * 2100 + "b", "longer than 4096 bytes"),
        ],
    )
    def test_a_path_that_could_leave_the_home_or_mislead_is_refused_saying_why(self, path, message):
        with pytest.raises(HomeError, match=message) as error:
            names(path)
        assert error.value.status == 400

    @pytest.mark.parametrize(
        ("path", "parts"), [("", []), (".", []), ("/", []), ("a/b/", ["a", "b"])]
    )
    def test_the_home_and_ordinary_paths(self, path, parts):
        assert names(path) == parts


class TestReading:
    def test_list_stat_and_read(self, home):
        listing = home.listing("")
        assert [(e.name, e.type) for e in listing.entries] == [
            ("notes.md", "file"),
            ("src", "directory"),
        ]
        assert listing.total == 2
        assert home.stat("src/main.py").size == len("print('hi')\n")
        assert read(home, "src/main.py") == b"print('hi')\n"

    def test_a_large_directory_is_listed_in_pages(self, home):
        for n in range(25):
            (home.root / "src" / f"f{n:02}").write_text("")
        page = home.listing("src", offset=10, limit=5)
        assert (page.total, [e.name for e in page.entries]) == (
            26,
            ["f10", "f11", "f12", "f13", "f14"],
        )

    def test_a_missing_home_is_empty_and_a_missing_path_is_404(self, tmp_path):
        nowhere = Home(tmp_path / "never-ran")
        assert nowhere.listing("").total == 0
        assert nowhere.usage().files == 0
        with pytest.raises(HomeError, match="no home yet") as error:
            nowhere.listing("src")
        assert error.value.status == 404
        assert not nowhere.root.exists()  # looking makes nothing

    @pytest.mark.parametrize("where", ["link", "src/link", "linkdir/secret", "src/linkdir/secret"])
    def test_a_planted_link_is_never_followed_wherever_it_is_in_the_path(
        self, home, outside, where
    ):
        (home.root / "link").symlink_to(outside / "secret")
        (home.root / "src" / "link").symlink_to(outside / "secret")
        (home.root / "linkdir").symlink_to(outside)
        (home.root / "src" / "linkdir").symlink_to(outside)
        with pytest.raises(HomeError, match="symbolic link: covey does not follow links"):
            read(home, where)

    def test_a_link_is_listed_as_a_link_with_its_target(self, home, outside):
        (home.root / "link").symlink_to(outside / "secret")
        (entry,) = [e for e in home.listing("").entries if e.name == "link"]
        assert (entry.type, entry.target) == ("symlink", str(outside / "secret"))
        with pytest.raises(HomeError, match="symbolic link"):
            home.listing("link")

    def test_a_link_swapped_in_while_reading_never_reads_outside(self, home, outside):
        """The agent flips a directory of the path between itself and a link out of the home
        as fast as it can while covey reads through it."""
        real = home.root / "flip"
        real.mkdir()
        (real / "secret").write_bytes(b"inside")
        seen = set()
        with flipping(real, outside):
            # 1.5 s of reads, and on a busy machine more, until one landed while the real
            # directory was in place (else the test would not have read through it at all).
            began = time.monotonic()
            while time.monotonic() - began < 1.5 or (
                b"inside" not in seen and time.monotonic() - began < 15
            ):
                try:
                    seen.add(read(home, "flip/secret"))
                except HomeError as exc:
                    seen.add(exc.status)
        assert SECRET not in seen
        assert b"inside" in seen

    def test_a_fifo_is_refused_at_once_and_nothing_hangs(self, home):
        os.mkfifo(home.root / "pipe")
        started = time.monotonic()
        with pytest.raises(HomeError, match="is a fifo, not a file"):
            read(home, "pipe")
        assert time.monotonic() - started < 1

    @pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
    def test_a_device_is_refused(self, home):
        os.mknod(home.root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        with pytest.raises(HomeError, match="is a device, not a file"):
            read(home, "null")

    def test_a_hard_linked_file_is_refused(self, home, tmp_path):
        other = tmp_path / "homes" / "elsewhere"
        other.write_bytes(SECRET)
        os.link(other, home.root / "linked")
        with pytest.raises(HomeError, match="2 hard links"):
            read(home, "linked")

    def test_a_name_no_path_can_give_is_listed_escaped_and_unusable(self, home):
        os.close(os.open(os.fsencode(home.root) + b"/bad\x1bname\xff", os.O_CREAT | os.O_WRONLY))
        (entry,) = [e for e in home.listing("").entries if "bad" in e.name]
        assert not entry.usable and "\\x1b" in entry.name


class TestArchives:
    def test_a_directory_streams_as_a_tar_without_what_it_cannot_vouch_for(self, home, outside):
        (home.root / "src" / "link").symlink_to(outside / "secret")
        (home.root / "src" / "outdir").symlink_to(outside)
        os.mkfifo(home.root / "src" / "pipe")
        data = b"".join(home.archive("src"))
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = {m.name: m for m in tar.getmembers()}
            assert set(members) == {"src", "src/main.py", f"src/{SKIPPED_FILE}"}
            assert tar.extractfile("src/main.py").read() == b"print('hi')\n"
            skipped = tar.extractfile(f"src/{SKIPPED_FILE}").read().decode()
        assert "link: a symbolic link" in skipped and "pipe: a fifo" in skipped
        assert "outdir: a symbolic link" in skipped
        assert SECRET not in data

    def test_a_large_file_streams_in_bounded_chunks(self, home):
        (home.root / "big").write_bytes(os.urandom(3 * 1024 * 1024 + 5))
        sizes = [len(c) for c in home.archive("", chunk=64 * 1024)]
        assert max(sizes) <= 64 * 1024 and sum(sizes) > 3 * 1024 * 1024

    def test_a_reader_that_stops_ends_the_archive(self, home):
        (home.root / "big").write_bytes(b"\0" * (8 * 1024 * 1024))
        before = threading.active_count()
        archive = home.archive("", chunk=64 * 1024)
        chunks = iter(archive)
        next(chunks)
        archive.close()  # the client went
        time.sleep(0.5)
        assert threading.active_count() <= before


def unseen(late: str):
    """_lstat_or_none as it was before ``late`` appeared."""
    real = homes._lstat_or_none
    return lambda parent, name: None if name == late else real(parent, name)


class TestNothingAppearingIsReplaced:
    """A name that appears between a move's or a write's check and its rename (the agent, when
    changes during runs are allowed) is never replaced."""

    def test_a_move_onto_a_name_that_appeared_after_the_check(self, home, monkeypatch):
        home.write("mine", [b"moved"])
        home.write("theirs", [b"appeared"])
        monkeypatch.setattr(homes, "_lstat_or_none", unseen("theirs"))  # checked too early
        with pytest.raises(HomeError, match="theirs exists") as error:
            home.move("mine", "theirs")
        assert error.value.status == 409
        assert (home.root / "theirs").read_bytes() == b"appeared"
        assert (home.root / "mine").read_bytes() == b"moved"

    def test_a_write_onto_a_name_that_appeared_after_the_check(self, home, monkeypatch):
        home.write("theirs", [b"appeared"])
        monkeypatch.setattr(homes, "_lstat_or_none", unseen("theirs"))
        with pytest.raises(HomeError, match="theirs exists"):
            home.write("theirs", [b"mine"])
        assert (home.root / "theirs").read_bytes() == b"appeared"
        assert not [n for n in os.listdir(home.root) if n.startswith(UPLOAD_PREFIX)]  # no draft


class TestRoomAndRemoval:
    def test_room_counts_what_a_write_replaces(self, home):
        home.write("a", [b"x" * 600])
        home.write("a", [b"y" * 700], replace=True, room=100)  # 600 of it are freed
        with pytest.raises(HomeError, match="room for 700 bytes") as error:
            home.write("a", [b"z" * 701], replace=True, room=0)
        assert error.value.status == 413 and read(home, "a") == b"y" * 700

    def test_delete_says_what_went(self, home):
        home.write("d/one", [b"x" * 10])
        home.write("d/e/two", [b"x" * 5])
        home.mkdir("d/empty")
        removed = home.delete("d")
        assert (removed.bytes, removed.files) == (15, 2)
        home.write("f", [b"abc"])
        removed = home.delete("f")
        assert (removed.bytes, removed.files) == (3, 1)

    def test_usage_of_a_directory_ranks_below_it_with_paths_from_the_home(self, home):
        home.write("top/a/big", [b"x" * 100])
        home.write("top/b/small", [b"x" * 10])
        home.write("other", [b"x" * 1000])
        usage = home.usage("top")
        assert (usage.bytes, usage.files) == (110, 2)
        assert usage.largest_directories == [("top/a", 100), ("top/b", 10)]
        assert usage.largest_files[0] == ("top/a/big", 100)
        with pytest.raises(HomeError) as error:
            home.usage("nowhere")
        assert error.value.status == 404


class TestWriting:
    def test_write_makes_directories_and_replaces_only_when_asked(self, home):
        written = home.write("new/deep/file.txt", [b"one ", b"two"])
        assert (written.entry.type, written.entry.size, written.replaced) == ("file", 7, None)
        assert read(home, "new/deep/file.txt") == b"one two"
        with pytest.raises(HomeError, match="exists: say replace") as error:
            home.write("new/deep/file.txt", [b"x"])
        assert error.value.status == 409
        assert home.write("new/deep/file.txt", [b"three"], replace=True).replaced == 7
        assert read(home, "new/deep/file.txt") == b"three"
        with pytest.raises(HomeError, match="is a directory"):
            home.write("new", [b"x"], replace=True)

    def test_a_link_at_the_destination_is_replaced_never_written_through(self, home, outside):
        (home.root / "trap").symlink_to(outside / "secret")
        home.write("trap", [b"mine"], replace=True)
        assert (outside / "secret").read_bytes() == SECRET
        assert not (home.root / "trap").is_symlink() and read(home, "trap") == b"mine"

    def test_a_link_in_the_destination_directory_is_never_followed(self, home, outside):
        (home.root / "out").symlink_to(outside)
        with pytest.raises(HomeError, match="symbolic link"):
            home.write("out/planted", [b"x"])
        assert sorted(p.name for p in outside.iterdir()) == ["secret"]

    def test_an_upload_over_the_limit_is_refused_and_leaves_nothing(self, home):
        with pytest.raises(HomeError, match="quota") as error:
            home.write("big", iter([b"x" * 600, b"x" * 600]), limit=1000)
        assert error.value.status == 413
        assert not [p for p in home.root.iterdir() if p.name.startswith(UPLOAD_PREFIX)]
        assert not (home.root / "big").exists()

    def test_a_failed_upload_leaves_the_old_file(self, home):
        def broken():
            yield b"half"
            raise ConnectionResetError("the client went")

        with pytest.raises(ConnectionResetError):
            home.write("notes.md", broken(), replace=True)
        assert read(home, "notes.md") == b"# notes\n"
        assert not [p for p in home.root.iterdir() if p.name.startswith(UPLOAD_PREFIX)]

    @pytest.mark.skipif(os.geteuid() != 0, reason="giving files away needs root")
    def test_what_is_written_belongs_to_the_sandboxs_user(self, tmp_path):
        owned = Home(tmp_path / "fresh", owner=(1000, 1000))
        owned.write("dir/file", [b"x"])
        for path in (owned.root, owned.root / "dir", owned.root / "dir" / "file"):
            assert (path.stat().st_uid, path.stat().st_gid) == (1000, 1000), path
        assert stat.S_IMODE(owned.root.stat().st_mode) == 0o700

    def test_mkdir_move_and_delete(self, home, outside):
        home.mkdir("a/b")
        with pytest.raises(HomeError, match="exists"):
            home.mkdir("a/b")
        home.move("notes.md", "a/b/notes.md")
        assert read(home, "a/b/notes.md") == b"# notes\n"
        with pytest.raises(HomeError, match="is inside"):
            home.move("a", "a/b/c")
        home.write("x", [b"x"])
        with pytest.raises(HomeError, match="exists") as error:
            home.move("x", "a/b/notes.md")
        assert error.value.status == 409
        (home.root / "a" / "out").symlink_to(outside)
        home.delete("a")  # the link goes, not what it points to
        assert not (home.root / "a").exists()
        assert (outside / "secret").read_bytes() == SECRET
        with pytest.raises(HomeError, match="cannot be deleted"):
            home.delete("")
        with pytest.raises(HomeError, match="is not there") as error:
            home.delete("a")
        assert error.value.status == 404


class TestUsage:
    def test_usage_ranks_where_the_space_goes(self, home):
        (home.root / "src" / "big.bin").write_bytes(b"x" * 5000)
        (home.root / "data").mkdir()
        (home.root / "data" / "huge.bin").write_bytes(b"x" * 9000)
        usage = home.usage()
        assert usage.files == 4 and usage.directories == 2
        assert usage.bytes == 5000 + 9000 + len("print('hi')\n") + len("# notes\n")
        assert usage.largest_files[:2] == [("data/huge.bin", 9000), ("src/big.bin", 5000)]
        assert usage.largest_directories[0] == ("data", 9000)

    def test_the_changes_of_a_run_from_two_manifests(self, home):
        before = home.manifest()
        (home.root / "notes.md").write_text("# notes\nmore\n")
        (home.root / "src" / "main.py").unlink()
        (home.root / "src" / "new.py").write_text("x")
        found = changes(before, home.manifest())
        assert found.added == ["src/new.py"]
        assert found.changed == ["notes.md"]
        assert found.removed == ["src/main.py"]


class TestWalks:
    """usage, manifest, archive and delete walk the whole home: nothing swapped in is opened."""

    def test_no_walk_opens_a_fifo_swapped_in_for_a_directory(self, home, outside):
        fifo = outside / "fifo"
        os.mkfifo(fifo)
        (home.root / "flip").mkdir()
        (home.root / "flip" / "f").write_text("x")
        stop, opened = threading.Event(), []

        def flip() -> None:  # the agent: a directory, then a link to the FIFO, and back
            while not stop.is_set():
                os.rename(home.root / "flip", home.root / "parked")
                (home.root / "flip").symlink_to(fifo)
                os.unlink(home.root / "flip")
                os.rename(home.root / "parked", home.root / "flip")

        def writer() -> None:  # opening for writing succeeds only while a reader has it open
            while not stop.is_set():
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                    opened.append(1)
                except OSError:
                    pass

        threads = [threading.Thread(target=flip), threading.Thread(target=writer)]
        for thread in threads:
            thread.start()
        try:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                home.usage()
                home.manifest()
                b"".join(home.archive(""))
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert opened == []

    def test_a_tree_deeper_than_a_walk_goes_is_said_not_followed_nor_fatal(self, home):
        deep = home.root.joinpath(*["d"] * 140)
        deep.mkdir(parents=True)
        (deep / "hidden.bin").write_bytes(b"x" * 1000)
        usage = home.usage()
        assert not usage.whole and usage.unmeasured == 1
        assert "more than 128 directories deep" in usage.problems[0][1]
        assert not home.manifest().whole
        with tarfile.open(fileobj=io.BytesIO(b"".join(home.archive("d")))) as tar:
            skipped = tar.extractfile(f"d/{SKIPPED_FILE}").read().decode()
        assert "more than 128 directories deep" in skipped
        with pytest.raises(HomeError, match="more than 128 directories deep"):
            home.delete("d")

    def test_a_build_remaking_its_directories_is_measured_whole_and_never_stopped(
        self, home, tmp_path
    ):
        """A compiler's build/ removed and made again, hundreds of directories a second, while
        the runner watches the home's quota: what vanished between its listing and its opening
        is simply not there, so every walk is whole and the run goes on. It churns for
        COVEY_TEST_CHURN_SECONDS (3 here; 60 to watch it for the minute the issue asked)."""
        seconds = float(os.environ.get("COVEY_TEST_CHURN_SECONDS", "3"))
        build = home.root / "build"
        build.mkdir()
        now = [0.0]
        watched = Host(tmp_path, clock=lambda: now[0])
        watched.order(replace(spec(), home_quota_bytes=1024 * 1024 * 1024))
        assert watched.control.states(RUN) == ["running"]
        walks, unwhole = 0, []
        with churning(build) as rounds:
            wait_for(lambda: rounds() > 0, 30, "the build's first directories")
            # The time asked for, and longer on a busy machine until the build has churned as
            # much as it would on an idle one (up to ten times as long).
            started = time.monotonic()

            def churning_on() -> bool:
                elapsed = time.monotonic() - started
                return elapsed < seconds or (rounds() <= 100 * seconds and elapsed < 10 * seconds)

            while churning_on():
                usage = home.usage()
                manifest = home.manifest()
                walks += 1
                if not usage.whole or not manifest.whole:
                    unwhole.append(usage.problems[:1] or manifest.problems[:1])
                now[0] += quotas.HOME_CHECK_SECONDS
                watched.host.quotas.check()  # the runner's own check, on the same home
                assert watched.engine.stopped == [], unwhole
            made = rounds()
        assert made > 100 * seconds, f"the build made only {made} directories"
        assert walks > 10 and unwhole == []

    def test_a_directory_swapped_for_a_link_out_is_never_counted_nor_read(self, home, outside):
        """The hostile swap: between a walk's listing and its opening of a directory, the agent
        puts a link out of the home in its place. Whatever the timing, nothing outside is
        counted, listed or read (the link is not there as a directory: it is not walked)."""
        huge = outside / "huge.bin"
        with open(huge, "wb") as file:
            file.truncate(1 << 40)  # a terabyte (sparse) that would show in any count
        real = home.root / "flip"
        real.mkdir()
        (real / "inside").write_bytes(b"inside")
        walks = 0
        with flipping(real, outside):
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                usage = home.usage()
                assert usage.bytes < 1 << 30 and usage.whole
                manifest = home.manifest()
                assert not [p for p in manifest.entries if "huge" in p or "secret" in p]
                archive = b"".join(home.archive(""))
                assert SECRET not in archive and b"huge.bin" not in archive
                walks += 1
        assert walks > 10

    def test_names_that_print_alike_are_never_one_in_a_manifest(self, home):
        (home.root / "a\x01").write_text("control")
        (home.root / "a\\x01").write_text("backslash")
        before = home.manifest()
        (home.root / "a\x01").unlink()
        assert len(changes(before, home.manifest()).removed) == 1

    def test_downloads_that_never_start_leak_no_descriptor(self, home):
        def open_descriptors() -> int:
            """Descriptors of this process open on something in the home."""
            found = 0
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    found += os.readlink(f"/proc/self/fd/{fd}").startswith(str(home.root))
            return found

        before = open_descriptors()
        assert before == 0
        for _ in range(20):
            home.read("notes.md").close()
            home.archive("src").close()
            home.read("src/main.py")  # dropped without a word
            home.archive("")
        import gc

        gc.collect()
        assert open_descriptors() == before

    def test_an_archive_whose_reader_leaves_with_its_queue_full_ends_its_thread(self, home):
        (home.root / "big").write_bytes(b"\0" * (2 * 1024 * 1024))
        archive = home.archive("", chunk=64 * 1024)
        chunks = iter(archive)
        next(chunks)
        time.sleep(0.3)  # the maker fills the queue and waits
        archive.close()
        names = [t.name for t in threading.enumerate()]
        assert "covey-home-archive" not in names

    def test_a_name_with_a_bidi_override_or_a_lone_surrogate_is_refused(self):
        for name in ("evil\u202etxt.exe", "a\ud800b", "nbsp\u0085"):
            with pytest.raises(HomeError) as error:
                names(name)
            assert error.value.status == 400
