"""A running sandbox's output on its way to the control plane (runners/host/output.py): chunks
in order, at their byte offsets, never cutting a character, resent or skipped by what the
control plane says it has."""

import pytest

from runners.host.output import LiveOutput
from tests.fakes import Clock


@pytest.fixture
def clock():
    return Clock()


def test_output_waits_a_second_then_goes_with_its_offset(clock):
    live = LiveOutput(clock=clock)
    live.feed(b"first line\n")
    assert not live.due()
    clock.now = 1.0
    assert live.due()
    assert live.take() == (0, "first line\n")
    live.confirm(11)
    assert not live.due()
    live.feed(b"second\n")
    clock.now = 2.5
    assert live.take() == (11, "second\n")


def test_much_output_goes_at_once_in_chunks_that_never_cut_a_character(clock):
    live = LiveOutput(max_chunk=10, clock=clock)
    text = "ééééééé"  # 14 bytes
    live.feed(text.encode())
    assert live.due()  # more than a chunk waits
    offset, first = live.take()
    assert (offset, first) == (0, "ééééé")  # 10 bytes, five whole characters
    live.confirm(10)
    assert live.take() == (10, "éé")


def test_a_character_split_across_reads_arrives_whole(clock):
    live = LiveOutput(clock=clock)
    data = "née ✓\n".encode()
    live.feed(data[:2])
    live.feed(data[2:6])
    live.feed(data[6:])
    clock.now = 5
    assert live.take() == (0, "née ✓\n")


def test_a_resent_chunk_the_control_plane_has_already_is_skipped(clock):
    live = LiveOutput(clock=clock)
    live.feed(b"abcdef")
    clock.now = 1
    assert live.take() == (0, "abcdef")
    live.confirm(4)  # it had four bytes of it (an answer lost, say): go on from there
    assert live.take() == (4, "ef")


def test_a_follower_that_restarted_skips_what_was_sent(clock):
    live = LiveOutput(skip=6, clock=clock)
    live.feed(b"abc")
    live.feed(b"defghi")
    live.feed(b"", final=True)
    assert live.due()  # the stream ended: what is left goes now
    assert live.take() == (6, "ghi")
    live.confirm(9)
    assert live.done


def test_a_control_plane_with_another_story_stops_live_output(clock):
    live = LiveOutput(clock=clock)
    live.feed(b"abc")
    live.confirm(100)
    assert live.given_up and live.take() is None
    live.feed(b"more", final=True)
    assert live.done and not live.due()


def test_pending_output_is_bounded(clock):
    live = LiveOutput(max_pending=100, clock=clock)
    live.feed(b"x" * 101)
    assert "not taking it" in live.given_up
    assert live.take() is None


def test_invalid_utf8_is_replaced_like_the_whole_log_replaces_it(clock):
    data = b"ok \xff\xfe then \xe2\x9c"
    live = LiveOutput(clock=clock)
    live.feed(data[:5])
    live.feed(data[5:], final=True)
    _, text = live.take()
    assert text == data.decode("utf-8", errors="replace")


def test_an_answer_that_took_nothing_stops_live_output_instead_of_resending(clock):
    """A control plane that answers with the size it had would have the chunk sent forever."""
    live = LiveOutput(clock=clock)
    live.feed(b"abc")
    clock.now = 1
    assert live.take() == (0, "abc")
    live.confirm(0)
    assert live.given_up and not live.due()


def test_a_chunk_that_did_not_get_there_waits_a_second_before_it_is_sent_again(clock):
    live = LiveOutput(clock=clock)
    live.feed(b"abc")
    clock.now = 1
    assert live.take() == (0, "abc")
    live.failed()
    assert not live.due()
    clock.now = 2
    assert live.due() and live.take() == (0, "abc")


def test_the_total_is_known_only_when_followed_from_the_first_byte_to_the_end(clock):
    live = LiveOutput(clock=clock)
    live.feed("a\x00é".encode())
    assert live.total is None  # not ended
    live.give_up("closed")  # sent no more, still counted
    live.feed(b"xyz", final=True)
    assert live.total == 1 + 3 + 2 + 3  # NUL counts as U+FFFD, as the control plane keeps it
    restarted = LiveOutput(skip=3, clock=clock)
    restarted.feed(b"abcdef", final=True)
    assert restarted.total is None  # what Docker kept may lack the start


def test_nul_goes_as_the_replacement_character(clock):
    live = LiveOutput(clock=clock)
    live.feed(b"a\x00b", final=True)
    assert live.take() == (0, "a\ufffdb")
