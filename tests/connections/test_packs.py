"""Reading the commits of a pack as it streams, against packs the real git makes: whole,
deltified, thin, SHA-256, and large; and packs that lie."""

import hashlib
import random
import subprocess
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connections.packs import Commits, PackReader, apply_delta
from connections.smarthttp import Malformed
from tests.connections.gitenv import git_env

MAX = 1 << 30


def git(*args: str, cwd: Path, data: bytes | None = None) -> bytes:
    env = git_env(cwd)
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, input=data, capture_output=True, check=True
    ).stdout


def repository(tmp_path: Path, *, object_format: str = "sha1", commits: int = 12) -> Path:
    """A repository whose commits are alike (long messages that differ a little), so that git
    stores some of them as deltas of others, with a merge among them."""
    work = tmp_path / f"repo-{object_format}"
    git(
        "init", f"--object-format={object_format}", "--initial-branch=main", str(work), cwd=tmp_path
    )
    message = "covey agent work\n\n" + "the same long explanation of the change\n" * 40
    for n in range(commits):
        (work / "file.txt").write_text("line\n" * 200 + f"change {n}\n")
        git("add", "file.txt", cwd=work)
        git("commit", "-q", "-m", f"{message}number {n}", cwd=work)
        if n == commits // 2 and n >= 2:
            git("checkout", "-q", "-b", "side", "HEAD~2", cwd=work)
            (work / "side.txt").write_text("side\n")
            git("add", "side.txt", cwd=work)
            git("commit", "-q", "-m", f"{message}side", cwd=work)
            git("checkout", "-q", "main", cwd=work)
            git("merge", "-q", "--no-ff", "-m", f"{message}merge", "side", cwd=work)
    return work


def pack(work: Path, *revisions: str, thin: bool = False) -> bytes:
    args = ["pack-objects", "--stdout", "--revs", "--delta-base-offset"]
    return git(
        *args, *(["--thin"] if thin else []), cwd=work, data="\n".join(revisions).encode() + b"\n"
    )


def rev_list(work: Path, *revisions: str) -> dict[str, tuple[str, ...]]:
    lines = git("rev-list", "--parents", *revisions, cwd=work).decode().split("\n")
    return {line.split()[0]: tuple(line.split()[1:]) for line in lines if line}


def read(data: bytes, *, id_length: int = 40, piece: int = 65536, max_bytes: int = MAX) -> Commits:
    reader = PackReader(id_length=id_length, max_bytes=max_bytes)
    for start in range(0, len(data), piece):
        reader.feed(data[start : start + piece])
    return reader.finish()


def deltified_commits(work: Path, data: bytes) -> int:
    index = work / "check.pack"
    index.write_bytes(data)
    git("index-pack", str(index), cwd=work)
    verified = git("verify-pack", "-v", str(index), cwd=work).decode()
    return sum(1 for line in verified.split("\n") if " commit " in line and len(line.split()) > 5)


@pytest.mark.parametrize("object_format", ["sha1", "sha256"])
def test_it_finds_every_commit_of_a_pack_and_their_parents(tmp_path, object_format):
    work = repository(tmp_path, object_format=object_format)
    data = pack(work, "main")
    commits = read(data, id_length=64 if object_format == "sha256" else 40, piece=997)
    assert commits.parents == rev_list(work, "main")
    if object_format == "sha1":
        assert deltified_commits(work, data) > 0  # the deltas of commits were read too


def test_it_tells_a_fast_forward_from_what_it_cannot_see(tmp_path):
    work = repository(tmp_path)
    main = git("rev-parse", "main", cwd=work).decode().strip()
    old = git("rev-parse", "main~4", cwd=work).decode().strip()
    side = git("rev-parse", "side", cwd=work).decode().strip()
    # What a push of main sends when the upstream has main~4: the commits since.
    commits = read(pack(work, "main", f"^{old}", thin=True))
    assert set(commits.parents) == set(rev_list(work, "main", f"^{old}"))
    assert commits.descends(main, old) is True
    assert commits.descends(main, "f" * 40) is None  # a commit it has never seen
    assert commits.descends(old, main) is None  # a rewind: nothing in the pack shows it
    assert commits.descends(side, old) is None  # side forked before old


def test_an_empty_pack_has_no_commit(tmp_path):
    work = repository(tmp_path, commits=2)
    commits = read(pack(work, "main", "^main"))
    assert commits.parents == {}
    assert commits.descends("a" * 40, "b" * 40) is None


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_the_same_commits_however_the_pack_is_cut(tmp_path_factory, data):
    work = repository_once(tmp_path_factory)
    whole = pack(work, "main")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=20)))
    reader, start = PackReader(max_bytes=MAX), 0
    for cut in [*cuts, len(whole)]:
        reader.feed(whole[start:cut])
        start = cut
    assert reader.finish().parents == rev_list(work, "main")


_REPOSITORIES: dict[str, Path] = {}


def repository_once(tmp_path_factory) -> Path:
    if "small" not in _REPOSITORIES:
        _REPOSITORIES["small"] = repository(tmp_path_factory.mktemp("small"), commits=4)
    return _REPOSITORIES["small"]


def test_a_large_pack_streams_through_in_bounded_memory(tmp_path):
    work = tmp_path / "large"
    git("init", "--initial-branch=main", str(work), cwd=tmp_path)
    (work / "big.bin").write_bytes(random.Random(7).randbytes(12 * 1024 * 1024))
    git("add", "big.bin", cwd=work)
    git("commit", "-q", "-m", "big", cwd=work)
    data = pack(work, "main")
    tracemalloc.start()
    try:
        commits = read(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert list(commits.parents) == [git("rev-parse", "main", cwd=work).decode().strip()]
    assert peak < 4 * 1024 * 1024, peak  # the blob is 12 MiB


def small_pack(tmp_path) -> bytes:
    return pack(repository(tmp_path, commits=3), "main")


def with_trailer(body: bytes) -> bytes:
    return body + hashlib.sha1(body, usedforsecurity=False).digest()


def test_a_pack_cut_short_or_running_on_is_refused(tmp_path):
    data = small_pack(tmp_path)
    with pytest.raises(Malformed, match="ended early"):
        read(data[:-1])
    with pytest.raises(Malformed, match="after the pack's trailer"):
        read(data + b"x")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: b"KCAP" + d[4:], "begin with PACK"),
        (lambda d: d[:4] + (4).to_bytes(4) + d[8:], "version 2 or 3"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "trailer is not the hash"),
        # One more object, a blob of 5 bytes whose data is not deflated.
        (
            lambda d: with_trailer(
                d[:8] + (int.from_bytes(d[8:12]) + 1).to_bytes(4) + d[12:-20] + b"\x35hello"
            ),
            "no zlib stream",
        ),
        # One more object promised than the pack holds: the trailer is taken for it.
        (lambda d: d[:8] + (int.from_bytes(d[8:12]) + 1).to_bytes(4) + d[12:], "."),
        # An object of type 5, which git never makes.
        (lambda d: with_trailer(d[:12] + bytes([(d[12] & 0x8F) | 0x50]) + d[13:-20]), "type 5"),
        # A commit whose header says it is one byte shorter than it is.
        (lambda d: with_trailer(d[:12] + bytes([d[12] - 1]) + d[13:-20]), "than its header says"),
    ],
)
def test_a_pack_that_lies_is_refused(tmp_path, change, says):
    data = small_pack(tmp_path)
    assert data[12] & 0x70 == 0x10 and data[12] & 0x0F  # the first object is a commit
    with pytest.raises(Malformed, match=says):
        read(change(data))


def test_a_pack_larger_than_the_limit_is_refused_as_it_grows(tmp_path):
    data = small_pack(tmp_path)
    reader = PackReader(max_bytes=len(data) - 1)
    with pytest.raises(Malformed, match="larger than covey takes"):
        for start in range(0, len(data), 100):
            reader.feed(data[start : start + 100])


def test_an_offset_delta_that_points_before_the_pack_is_refused():
    header = b"PACK" + (2).to_bytes(4) + (1).to_bytes(4)
    delta = bytes([0x60 | 3, 0x7F])  # an offset delta of 3 bytes, based 127 bytes back
    with pytest.raises(Malformed, match="points outside it"):
        read(with_trailer(header + delta))


@pytest.mark.parametrize(
    ("delta", "says"),
    [
        (bytes([3, 5]), "does not fit its base"),
        (bytes([4, 5, 0]), "zero opcode"),
        (bytes([4, 2, 0x91, 2, 9]), "copies past its base"),
        (bytes([4, 2, 3, 1, 2, 3]), "more than it says"),
        (bytes([4, 9, 1, 7]), "less than it says"),
        (bytes([4]), "ends in its header"),
    ],
)
def test_a_delta_that_lies_is_refused(delta, says):
    with pytest.raises(Malformed, match=says):
        apply_delta(b"base", delta)


def test_a_delta_copies_and_inserts():
    # base "tree x\n" (7 bytes) → "tree x\nparent y\n": copy 7 from 0, insert 9 bytes.
    assert apply_delta(b"tree x\n", bytes([7, 16, 0x90, 7, 9]) + b"parent y\n") == (
        b"tree x\nparent y\n"
    )
