"""Reading OpenAI's usage exactly, plain and streamed in any chunking, and bounding its
requests before they are reserved (budgets/gateway/openai.py)."""

import json

import pytest

from budgets.gateway.api import Refused
from budgets.gateway.openai import ChatCompletions, ChatStream, Responses, ResponsesStream, usage_of
from budgets.usage import Usage

CHAT, RESPONSES = ChatCompletions(), Responses()


def data(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def test_either_apis_usage_is_split_into_uncached_and_cached_input():
    chat = {"prompt_tokens": 1000, "completion_tokens": 50}
    chat["prompt_tokens_details"] = {"cached_tokens": 800}
    assert usage_of(chat) == Usage(input=200, cache_read=800, output=50)
    responses = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}}
    assert usage_of(responses | {"output_tokens": 7}) == Usage(input=10, output=7)
    # A cached count larger than the input is not believed beyond it; nonsense counts are 0.
    odd = {
        "prompt_tokens": 5,
        "completion_tokens": "9",
        "prompt_tokens_details": {"cached_tokens": 9},
    }
    assert usage_of(odd) == Usage(input=0, cache_read=5, output=0)
    assert usage_of(None) is None and usage_of({"total_tokens": 3}) is None


STREAM = b"".join(
    [
        data({"model": "gpt-4.1-x", "choices": [{"delta": {"role": "assistant"}}], "usage": None}),
        data({"choices": [{"delta": {"content": "Hé"}}], "usage": None}),
        data(
            {
                "choices": [
                    {"delta": {"tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}]}}
                ]
            }
        ),
        data({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}),
        data("[DONE]"),
    ]
)


@pytest.mark.parametrize("size", [1, 7, len(STREAM)])
def test_a_chat_stream_is_read_in_any_chunking(size):
    meter = ChatStream()
    for start in range(0, len(STREAM), size):
        meter.feed(STREAM[start : start + size])
    meter.close()
    assert (meter.finished, meter.exact, meter.error, meter.model) == (True, True, "", "gpt-4.1-x")
    assert meter.content_bytes == len("Hé".encode()) + len("ls{}")
    assert meter.charged(100, 5000) == Usage(input=9, output=4)


def test_a_chat_stream_cut_off_before_its_usage_is_charged_its_input_bound():
    meter = ChatStream()
    meter.feed(STREAM[: STREAM.index(b'{"choices": [], "usage"')])
    meter.close()
    assert not meter.finished
    # Reasoning is never streamed: what it spent is not seen, so the whole bound is charged.
    assert meter.charged(100, 5000) == Usage(input=5000, output=100)


def test_a_responses_stream_takes_its_usage_from_the_event_that_ends_it():
    def event(kind, **fields):
        return f"event: {kind}\n".encode() + data({"type": kind, **fields})

    usage = {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 10}, "output_tokens": 8}
    stream = [
        event("response.created", response={"model": "o3", "usage": None}),
        event("response.function_call_arguments.delta", delta='{"a":'),
        event("response.output_text.delta", delta="ok"),
        event("response.completed", response={"model": "o3-2025-04-16", "usage": usage}),
    ]
    meter = ResponsesStream()
    for chunk in stream:
        meter.feed(chunk)
    assert (meter.finished, meter.model, meter.content_bytes) == (True, "o3-2025-04-16", 7)
    assert meter.charged(100, 999) == Usage(input=20, cache_read=10, output=8)
    failed = ResponsesStream()
    failed.feed(stream[0] + event("error", code="server_error", message="x"))
    assert failed.error == "server_error" and failed.charged(100, 999) == Usage(999, output=100)


def prepare(api, body):
    return api.prepare(json.dumps(body).encode(), {}, 500)


def test_a_chat_requests_output_bound_is_its_maximum_times_its_choices():
    asked = prepare(CHAT, {"model": "m", "messages": [], "max_tokens": 40, "n": 3})
    assert (asked.model, asked.max_output) == ("m", 120)
    defaulted = prepare(CHAT, {"model": "m", "messages": [], "stream": True})
    sent = json.loads(defaulted.raw)
    assert defaulted.max_output == 500 and sent["max_completion_tokens"] == 500
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["service_tier"] == "default"  # auto may be a project's priority tier
    # The default bound is never above the least maximum of the shipped models (gpt-4o's).
    assert CHAT.prepare(b'{"model": "gpt-4o"}', {}, 32000).max_output == 16384
    kept = {"model": "m", "max_completion_tokens": 9, "stream": True, "service_tier": "default"}
    kept["stream_options"] = {"include_usage": True, "include_obfuscation": False}
    assert prepare(CHAT, kept).raw == json.dumps(kept).encode()  # nothing to change: as sent
    with pytest.raises(Refused, match="max_completion_tokens: a whole number from 1 to"):
        prepare(CHAT, {"model": "m", "max_completion_tokens": 0})
    # A count no model answers is a 400, not a worst case that overflows the ledger (a 503).
    with pytest.raises(Refused, match="max_tokens: a whole number from 1 to 1000000000"):
        prepare(CHAT, {"model": "m", "max_tokens": 10**30})
    with pytest.raises(Refused, match="n: a whole number"):
        prepare(CHAT, {"model": "m", "n": True})


@pytest.mark.parametrize(
    ("api", "body", "message"),
    [
        (CHAT, {"audio": {"voice": "x"}}, "'audio' is priced otherwise"),
        (CHAT, {"modalities": ["text", "audio"]}, "audio is priced otherwise"),
        (CHAT, {"prediction": {"type": "content", "content": "x"}}, "'prediction'"),
        (CHAT, {"web_search_options": {}}, "'web_search_options'"),
        (CHAT, {"service_tier": "flex"}, "service_tier 'flex'"),
        (CHAT, {"tools": [{"type": "file_search"}]}, "the tool 'file_search' runs at the vendor"),
        (
            CHAT,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}
                ]
            },
            "a file by id or URL",
        ),
        (
            CHAT,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "audio is priced otherwise",
        ),
        (RESPONSES, {"conversation": "conv_1"}, "a conversation is fetched"),
        (RESPONSES, {"prompt": {"id": "pmpt_1"}}, "a stored prompt"),
        (RESPONSES, {"background": True}, "background responses"),
        (RESPONSES, {"tools": [{"type": "web_search"}]}, "the tool 'web_search'"),
        (
            RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "an image by URL or file id",
        ),
        (RESPONSES, {"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
        (
            RESPONSES,
            {"tools": [{"type": "shell", "environment": {"type": "container_auto"}}]},
            "a shell tool with an environment at the vendor",
        ),
    ],
)
def test_what_the_gateway_cannot_bound_is_refused_saying_what(api, body, message):
    with pytest.raises(Refused, match=message) as refused:
        prepare(api, {"model": "m", **body})
    assert refused.value.status == 400


def test_what_the_client_runs_and_inline_content_are_allowed():
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    body = {
        "model": "m",
        "input": [{"role": "user", "content": [image]}],
        "tools": [
            {"type": "function", "name": "f"},
            {"type": "apply_patch"},
            {"type": "shell", "environment": {"type": "local"}},
        ],
        "service_tier": "auto",
    }
    assert prepare(RESPONSES, body).max_output == 500
    chat_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = {"model": "m", "messages": [{"role": "user", "content": [chat_image]}]}
    assert prepare(CHAT, chat | {"tools": [{"type": "function", "function": {}}]}).max_output == 500


def test_fields_a_request_lacks_are_put_in_front_and_one_it_has_is_rewritten():
    from budgets.gateway.api import with_fields

    raw = b' {"model": "m", "messages": []}'
    body = json.loads(raw)
    sent = with_fields(raw, body, {"max_tokens": 5, "service_tier": "standard_only"})
    assert sent.endswith(b'"model": "m", "messages": []}')  # the rest as it came
    assert json.loads(sent) == {"model": "m", "messages": [], "max_tokens": 5} | {
        "service_tier": "standard_only"
    }
    null = b'{"model": "m", "max_tokens": null}'
    rewritten = with_fields(null, json.loads(null), {"max_tokens": 5})
    assert rewritten == b'{"model":"m","max_tokens":5}'  # never two of one name
    assert with_fields(rewritten, json.loads(rewritten), {"max_tokens": 5}) is rewritten
