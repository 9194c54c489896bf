"""git's smart HTTP as the gateway reads it: routes, ref names and the head of a push, with the
hostile spellings it must refuse before anything goes upstream. Ref names are checked against
git's own check-ref-format."""

import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connections.smarthttp import (
    MAX_HEAD_BYTES,
    MAX_PKT_BYTES,
    Command,
    Malformed,
    PushReader,
    Route,
    Service,
    check_ref_name,
    pkt_line,
    refusal,
    route,
)

OLD, NEW, ZERO = "a" * 40, "b" * 40, "0" * 40

ROUTES = [
    (
        "GET",
        "/git/github.com/acme/app.git/info/refs",
        "service=git-upload-pack",
        Route("github.com", "acme", "app", Service.UPLOAD_PACK, advertisement=True),
    ),
    (
        "POST",
        "/git/git.example:8443/Acme/my_app.v2/git-receive-pack",
        "",
        Route("git.example:8443", "Acme", "my_app.v2", Service.RECEIVE_PACK, advertisement=False),
    ),
    (
        "GET",
        "/git/github.com/acme/app/info/refs",
        "service=git-receive-pack",
        Route("github.com", "acme", "app", Service.RECEIVE_PACK, advertisement=True),
    ),
]


@pytest.mark.parametrize(("method", "path", "query", "expected"), ROUTES)
def test_it_routes_the_smart_protocols_requests(method, path, query, expected):
    assert route(method, path, query) == expected


REFUSED_ROUTES = [
    ("GET", "/git/github.com/acme/ok/../secret/info/refs", "service=git-upload-pack", "'..'"),
    ("GET", "/git/github.com/acme/../secret/info/refs", "service=git-upload-pack", "'..'"),
    ("GET", "/git/github.com/./acme/x/info/refs", "service=git-upload-pack", "'.'"),
    ("GET", "/git/github.com/acme/%2e%2e/info/refs", "service=git-upload-pack", "plain"),
    ("GET", "/git/github.com/acme/ok%2F..%2Fsecret/info/refs", "service=git-upload-pack", "plain"),
    ("GET", "/git/github.com/acme/ok%252e/info/refs", "service=git-upload-pack", "plain"),
    ("GET", "/git/github.com/acme\\ok/x/info/refs", "service=git-upload-pack", "plain"),
    ("GET", "/git/github.com/acme/.hidden/info/refs", "service=git-upload-pack", "repository"),
    ("GET", "/git/github.com/acme/a..b/info/refs", "service=git-upload-pack", "repository"),
    ("GET", "/git/github.com/acme/.git/info/refs", "service=git-upload-pack", "repository"),
    ("GET", "/git/github.com/acme//info/refs", "service=git-upload-pack", "repository"),
    ("GET", "/git/GitHub.com/acme/app/info/refs", "service=git-upload-pack", "host"),
    ("GET", "/git/github.com:0/acme/app/info/refs", "service=git-upload-pack", "host"),
    ("GET", "/git/github.com:65536/acme/app/info/refs", "service=git-upload-pack", "host"),
    ("GET", "/git/user@github.com/acme/app/info/refs", "service=git-upload-pack", "host"),
    ("GET", "/git/-bad.example/acme/app/info/refs", "service=git-upload-pack", "host"),
    ("GET", "/git//acme/app/info/refs", "service=git-upload-pack", "host"),
    ("GET", "/git/github.com/acme/app/info/refs", "", "dumb protocol"),
    ("GET", "/git/github.com/acme/app/info/refs", "service=git-upload-archive", "dumb protocol"),
    ("GET", "/git/github.com/acme/app/HEAD", "", "not a smart HTTP endpoint"),
    ("GET", "/git/github.com/acme/app/objects/info/packs", "", "not a smart HTTP endpoint"),
    ("GET", "/git/github.com/acme/app/git-upload-pack", "", "not a smart HTTP endpoint"),
    ("POST", "/git/github.com/acme/app/info/refs", "service=git-upload-pack", "GET"),
    ("POST", "/git/github.com/acme/app/git-upload-pack", "x=1", "no query"),
    ("POST", "/git/github.com/acme/app/git-upload-pack/", "", "dumb protocol"),
    ("POST", "/git/github.com/acme/app/objects/pack/x.pack", "", "dumb protocol"),
    ("GET", "/git/github.com/acme/info/refs", "service=git-upload-pack", "not a smart HTTP"),
    ("GET", "/gitx/github.com/acme/app/info/refs", "service=git-upload-pack", "/git/<host>"),
]


@pytest.mark.parametrize(("method", "path", "query", "says"), REFUSED_ROUTES)
def test_it_refuses_paths_that_climb_hide_or_leave_the_smart_protocol(method, path, query, says):
    with pytest.raises(Malformed, match=says):
        route(method, path, query)


REF_NAMES = [
    "refs/heads/main",
    "refs/heads/covey/builder/fix-1",
    "refs/tags/v1.0",
    "refs/heads/ünïcode",
    "refs/heads/a..b",
    "refs/heads/a/../b",
    "refs/heads/.hidden",
    "refs/heads/x/.y",
    "refs/heads/x.lock",
    "refs/heads/x.lock/y",
    "refs/heads/x.",
    "refs/heads/x/",
    "refs/heads//x",
    "refs/heads/a b",
    "refs/heads/a\tb",
    "refs/heads/a\x7fb",
    "refs/heads/a\x00b",
    "refs/heads/a~1",
    "refs/heads/a^",
    "refs/heads/a:b",
    "refs/heads/a?",
    "refs/heads/a*",
    "refs/heads/a[1]",
    "refs/heads/a\\b",
    "refs/heads/a@{1}",
    "refs/heads/@",
]


def git_accepts(name: str) -> bool:
    if "\x00" in name:
        return False  # an argument cannot hold one; git's reader stops at it
    result = subprocess.run(["git", "check-ref-format", name], capture_output=True, check=False)
    return result.returncode == 0


def covey_accepts(name: str) -> bool:
    try:
        check_ref_name(name)
    except Malformed:
        return False
    return True


@pytest.mark.parametrize("name", REF_NAMES)
def test_ref_names_are_checked_as_git_checks_them(name):
    assert covey_accepts(name) == git_accepts(name)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("refs/heads/" + "x" * 250, "longer than 255 bytes"),
        ("refs/notes/commits", "only branches"),
        ("refs/pull/1/head", "only branches"),
        ("HEAD", "only branches"),
        ("refs/heads/a\x1bb", r"a\\x1bb"),  # shown escaped, never as a raw control character
    ],
)
def test_covey_takes_branches_and_tags_of_a_sane_length_only(name, says):
    with pytest.raises(Malformed, match=says):
        check_ref_name(name)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30))
def test_no_branch_git_refuses_is_taken(tail):
    name = "refs/heads/" + tail
    if covey_accepts(name):
        assert git_accepts(name), name


def command_line(old, new, ref, capabilities=""):
    line = f"{old} {new} {ref}".encode()
    return line + (b"\0" + capabilities.encode() if capabilities else b"") + b"\n"


def push_head(*lines, options=()):
    return (
        b"".join(pkt_line(line) for line in lines)
        + b"0000"
        + (b"".join(pkt_line(option) for option in options) + b"0000" if options else b"")
    )


def test_it_reads_the_commands_and_leaves_the_pack():
    body = (
        push_head(
            command_line(OLD, NEW, "refs/heads/main", "report-status side-band-64k agent=git/2.39"),
            command_line(ZERO, NEW, "refs/heads/covey/b/new"),
            command_line(OLD, ZERO, "refs/heads/gone"),
        )
        + b"PACK\x00\x00\x00\x02rest"
    )
    reader = PushReader()
    push = reader.feed(body)
    assert push is not None
    assert push.commands == (
        Command(OLD, NEW, "refs/heads/main"),
        Command(ZERO, NEW, "refs/heads/covey/b/new"),
        Command(OLD, ZERO, "refs/heads/gone"),
    )
    assert [(c.creates, c.deletes) for c in push.commands] == [
        (False, False),
        (True, False),
        (False, True),
    ]
    assert push.capabilities == {"report-status", "side-band-64k", "agent=git/2.39"}
    assert reader.rest == b"PACK\x00\x00\x00\x02rest"
    assert reader.finish() == push


def test_it_reads_shallow_lines_push_options_and_sha256():
    old, new = "c" * 64, "d" * 64
    body = push_head(
        b"shallow " + old.encode(),
        command_line(old, new, "refs/heads/x", "push-options object-format=sha256"),
        options=[b"ci.skip\n", b"merge_request.create"],
    )
    push = PushReader().feed(body)
    assert push is not None
    assert push.shallow == (old,)
    assert push.options == ("ci.skip", "merge_request.create")
    assert push.id_length == 64


@given(st.data())
def test_it_reads_the_same_push_however_the_bytes_are_cut(data):
    body = (
        push_head(
            command_line(OLD, NEW, "refs/heads/main", "report-status"),
            command_line(ZERO, NEW, "refs/heads/covey/b/new"),
        )
        + b"PACKdata"
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    reader, push, start = PushReader(), None, 0
    for cut in [*cuts, len(body)]:
        push = reader.feed(body[start:cut])
        start = cut
        if push is not None:
            break
    assert push == PushReader().feed(body)
    assert reader.rest + body[start:] == b"PACKdata"
    with pytest.raises(RuntimeError, match="what follows is the pack"):
        reader.feed(b"more")


HOSTILE_HEADS = [
    (b"zzzz", "four hex digits"),
    (b"0001", "delim-pkt"),
    (b"0002", "delim-pkt"),
    (b"0003", "4 to 65520"),
    (b"0004", "empty pkt-line"),
    (b"fff1" + b"x" * 70000, "4 to 65520"),
    (b"0000", "no ref update"),
    (pkt_line(b"shallow " + OLD.encode()) + b"0000", "no ref update"),
    (push_head(command_line(OLD.upper(), NEW, "refs/heads/x")), "lowercase hex"),
    (push_head(command_line(OLD[:39], NEW, "refs/heads/x")), "40 lowercase hex"),
    (push_head(command_line(OLD, NEW, "refs/heads/x", "object-format=sha256")), "64 lowercase"),
    (push_head(command_line(OLD, OLD, "refs/heads/x")), "same object"),
    (push_head(command_line(OLD, NEW, "refs/heads/a..b")), "not a name git allows"),
    (push_head(command_line(OLD, NEW, "refs/heads/a\x01b")), "not a name git allows"),
    (push_head(command_line(OLD, NEW, "refs/heads/" + "x" * 300)), "longer than 255"),
    (push_head(command_line(OLD, NEW, "refs/meta/config")), "only branches"),
    (push_head(f"{OLD} {NEW} refs/heads/x extra".encode()), "'<old-id> <new-id> <ref>'"),
    (push_head(f"{OLD}  {NEW} refs/heads/x".encode()), "'<old-id> <new-id> <ref>'"),
    (push_head(f"{OLD} {NEW} refs/heads/\xff".encode("latin-1")), "not UTF-8"),
    (
        push_head(command_line(OLD, NEW, "refs/heads/x"), command_line(OLD, NEW, "refs/heads/x")),
        "named twice",
    ),
    (
        push_head(command_line(OLD, NEW, "refs/heads/x"), b"shallow " + OLD.encode()),
        "shallow line after",
    ),
    (push_head(b"push-cert\0report-status\ncertificate version 0.1\n"), "signed pushes"),
    (
        push_head(*[command_line(OLD, NEW, f"refs/heads/b{n}") for n in range(1001)]),
        "more than 1000 ref updates",
    ),
    (
        push_head(
            command_line(OLD, NEW, "refs/heads/x", "push-options"),
            options=[b"o"] * 101,
        ),
        "more than 100 push options",
    ),
]


@pytest.mark.parametrize(("body", "says"), HOSTILE_HEADS)
def test_it_refuses_heads_that_lie_or_overflow(body, says):
    with pytest.raises(Malformed, match=says):
        PushReader().feed(body)


def test_a_length_that_promises_more_than_comes_is_a_cut_push_not_a_hang():
    reader = PushReader()
    assert reader.feed(b"0100" + command_line(OLD, NEW, "refs/heads/x")) is None
    with pytest.raises(Malformed, match="ended before its commands"):
        reader.finish()


def test_a_head_that_never_ends_is_refused_at_its_bound():
    reader = PushReader()
    line = pkt_line(command_line(OLD, NEW, "refs/heads/x") + b" " * 60000)
    assert len(line) <= MAX_PKT_BYTES
    with pytest.raises(Malformed, match="more than 1048576 bytes"):
        for _ in range(MAX_HEAD_BYTES // len(line) + 2):
            reader.feed(line)  # never a flush-pkt: only the bound stops it


def parse_report(body: bytes) -> list[bytes]:
    """The pkt-lines of a body (flushes as b"")."""
    lines = []
    while body:
        length = int(body[:4], 16)
        lines.append(body[4:length] if length else b"")
        body = body[max(length, 4) :]
    return lines


def test_a_refusal_reports_each_ref_in_the_side_band_with_a_message_first():
    push = PushReader().feed(
        push_head(
            command_line(OLD, NEW, "refs/heads/main", "report-status side-band-64k"),
            command_line(OLD, NEW, "refs/heads/covey/b/x"),
        )
    )
    assert push is not None
    body = refusal(push, {"refs/heads/main": "protected\nby covey"}, message="main is protected")
    lines = parse_report(body)
    assert lines[0] == b"\x02covey: main is protected\n"
    assert lines[-1] == b""
    report = parse_report(b"".join(line[1:] for line in lines[1:-1]))
    assert report == [
        b"unpack ok\n",
        b"ng refs/heads/main protected by covey\n",
        b"ng refs/heads/covey/b/x refused: another ref of this push was refused\n",
        b"",
    ]


def test_a_client_that_asked_for_no_report_gets_an_error():
    push = PushReader().feed(push_head(command_line(OLD, NEW, "refs/heads/main")))
    assert push is not None
    assert parse_report(refusal(push, {}, message="no")) == [b"ERR no\n"]
