"""Reading usage exactly from Messages API answers, plain and streamed, and what it costs."""

import json
from decimal import Decimal

import pytest

from budgets.usage import MAX_EVENT_BYTES, Prices, StreamMeter, Usage, from_message

SONNET = Prices(
    input=Decimal("3"),
    cache_write_5m=Decimal("3.75"),
    cache_write_1h=Decimal("6"),
    cache_read=Decimal("0.30"),
    output=Decimal("15"),
)


def event(kind: str, **data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


START = event(
    "message_start",
    message={
        "id": "msg_1",
        "model": "claude-sonnet-4-5-20250929",
        "usage": {
            "input_tokens": 12,
            "cache_creation_input_tokens": 3000,
            "cache_creation": {
                "ephemeral_5m_input_tokens": 1000,
                "ephemeral_1h_input_tokens": 2000,
            },
            "cache_read_input_tokens": 500,
            "output_tokens": 1,  # a placeholder
        },
    },
)
STREAM = b"".join(
    [
        START,
        event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        event("ping"),
        event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hi"}),
        event("message_delta", delta={"stop_reason": None}, usage={"output_tokens": 10}),
        event("content_block_delta", index=0, delta={"type": "text_delta", "text": " there"}),
        event("content_block_stop", index=0),
        event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 25}),
        event("message_stop"),
    ]
)
EXPECTED = Usage(input=12, cache_write_5m=1000, cache_write_1h=2000, cache_read=500, output=25)


def test_a_plain_answer_is_read_with_the_cache_split():
    body = json.dumps(
        {
            "type": "message",
            "model": "claude-sonnet-4-5-20250929",
            "usage": {
                "input_tokens": 12,
                "cache_creation_input_tokens": 3000,
                "cache_creation": {
                    "ephemeral_5m_input_tokens": 1000,
                    "ephemeral_1h_input_tokens": 2000,
                },
                "cache_read_input_tokens": 500,
                "output_tokens": 25,
            },
        }
    ).encode()
    assert from_message(body) == (EXPECTED, "claude-sonnet-4-5-20250929")
    # Without the split, every cache write is the 5-minute kind.
    plain = {"usage": {"input_tokens": 1, "cache_creation_input_tokens": 7, "output_tokens": 2}}
    usage, _ = from_message(json.dumps(plain).encode())
    assert (usage.cache_write_5m, usage.cache_write_1h, usage.output) == (7, 0, 2)
    with pytest.raises(ValueError, match="no usage"):
        from_message(b'{"type": "error"}')
    with pytest.raises(ValueError, match="not JSON"):
        from_message(b"<html>")


@pytest.mark.parametrize("size", [1, 2, 7, 64, len(STREAM)])
def test_a_stream_is_read_in_pieces_of_any_size_taking_the_last_cumulative_counts(size):
    meter = StreamMeter()
    for at in range(0, len(STREAM), size):
        meter.feed(STREAM[at : at + size])
    # 25, the last cumulative count, not 1 + 10 + 25.
    assert meter.usage == EXPECTED
    assert (meter.model, meter.started, meter.finished, meter.error) == (
        "claude-sonnet-4-5-20250929",
        True,
        True,
        "",
    )


def test_crlf_lines_and_data_split_over_lines_are_read():
    body = json.dumps({"type": "message_delta", "usage": {"output_tokens": 9}}, indent=1)
    lines = "".join(f"data: {line}\r\n" for line in body.splitlines())
    meter = StreamMeter()
    meter.feed(START.replace(b"\n", b"\r\n") + f"event: message_delta\r\n{lines}\r\n".encode())
    assert (meter.usage.input, meter.usage.output) == (12, 9)


def test_a_stream_that_fails_or_is_cut_off_counts_what_came():
    meter = StreamMeter()
    meter.feed(START + event("message_delta", usage={"output_tokens": 4}))
    meter.feed(event("error", error={"type": "overloaded_error", "message": "Overloaded"}))
    assert meter.error == "overloaded_error" and not meter.finished
    assert (meter.usage.input, meter.usage.output) == (12, 4)
    cut = StreamMeter()
    cut.feed(START + event("message_delta", usage={"output_tokens": 6}) + b'data: {"type": "mess')
    assert (cut.usage.output, cut.finished) == (6, False)  # the half event is not taken


def test_a_stream_cut_off_before_its_count_is_charged_a_bound_of_what_came():
    """The output's count comes at the end: until then what came is bounded by its bytes (each
    token is at least one), and by max_tokens."""
    meter = StreamMeter()
    meter.feed(START)
    meter.feed(event("content_block_delta", index=0, delta={"type": "text_delta", "text": "héllo"}))
    meter.feed(
        event(
            "content_block_delta",
            index=1,
            delta={"type": "input_json_delta", "partial_json": '{"a": 1'},
        )
    )
    assert meter.content_bytes == len("héllo".encode()) + len('{"a": 1')  # 6 + 7
    charged = meter.charged(max_tokens=1000)
    assert (charged.input, charged.cache_write_1h, charged.output) == (12, 2000, 13)
    assert meter.charged(max_tokens=5).output == 5
    # A finished stream is charged its own count, however many bytes passed.
    meter.feed(event("message_delta", usage={"output_tokens": 4}) + event("message_stop"))
    assert meter.charged(max_tokens=1000).output == 4


def test_a_last_event_without_its_blank_line_is_read_when_the_stream_closes():
    meter = StreamMeter()
    meter.feed(START + event("message_delta", usage={"output_tokens": 7}).rstrip(b"\n"))
    assert meter.usage.output == 0
    meter.close()
    assert meter.usage.output == 7


def test_a_cache_total_without_its_split_keeps_the_split_it_had():
    """message_delta has cache_creation_input_tokens but never the split by lifetime."""
    meter = StreamMeter()
    meter.feed(START)  # 1000 of 5 minutes, 2000 of an hour
    meter.feed(event("message_delta", usage={"cache_creation_input_tokens": 3000}))
    assert (meter.usage.cache_write_5m, meter.usage.cache_write_1h) == (1000, 2000)
    meter.feed(event("message_delta", usage={"cache_creation_input_tokens": 3500}))
    assert (meter.usage.cache_write_5m, meter.usage.cache_write_1h) == (1000, 2500)  # dearest


def test_a_newer_message_delta_with_input_counts_replaces_them():
    meter = StreamMeter()
    meter.feed(START)
    meter.feed(event("message_delta", usage={"input_tokens": 15, "output_tokens": 3}))
    assert (meter.usage.input, meter.usage.cache_write_1h, meter.usage.output) == (15, 2000, 3)


def test_a_long_content_event_is_skipped_and_what_follows_still_counts():
    meter = StreamMeter()
    meter.feed(START)
    huge = "x" * (MAX_EVENT_BYTES + 10)
    meter.feed(event("content_block_delta", delta={"type": "text_delta", "text": huge}))
    meter.feed(event("message_delta", usage={"output_tokens": 8}) + event("message_stop"))
    assert (meter.usage.output, meter.finished) == (8, True)
    assert len(meter._line) == 0 and meter._lines == []  # nothing of it was kept


def test_bad_counts_are_ignored():
    usage = Usage()
    usage.update({"input_tokens": -5, "output_tokens": True, "cache_read_input_tokens": "9"})
    assert usage == Usage()


def test_costs_are_exact_decimals_rounded_up_to_a_millionth():
    # 12*3 + 1000*3.75 + 2000*6 + 500*0.30 + 25*15 = 16311 per million tokens.
    assert SONNET.cost(EXPECTED) == Decimal("0.016311")
    assert SONNET.cost(Usage(input=1)) == Decimal("0.000003")
    assert SONNET.cost(Usage(cache_read=1)) == Decimal("0.000001")  # 0.0000003, rounded up
    assert SONNET.cost(Usage()) == Decimal("0")
    # The worst case prices the whole input at the dearest input kind (the 1-hour write).
    assert SONNET.worst_case(1000, 100) == Decimal("0.007500")
    with pytest.raises(ValueError, match="cannot be negative"):
        SONNET.worst_case(-1000, 10)
