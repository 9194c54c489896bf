"""A fake Anthropic Messages API, and a fake OpenAI Chat Completions and Responses API, over
TLS (a test CA's certificate for 127.0.0.x): the model gateway's upstreams in tests and
benchmarks. What it answers is chosen by the first message's text: ``json`` (a plain answer),
``stream`` (server-sent events with realistic usage; also what content in blocks, as the
Claude runtime sends, gets when it asks to stream), ``error`` (a stream that ends in an error
event), ``slow`` (a stream with pauses), ``drop`` (a stream the server cuts off), ``refuse`` (a
400 error). A streamed Chat Completion carries usage only when ``stream_options.include_usage``
asks for it, as OpenAI's does. Every request it saw is kept (headers, body)."""

import asyncio
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# What every answer used: the counts the tests expect in the ledger.
USAGE = {
    "input_tokens": 120,
    "cache_creation_input_tokens": 50,
    "cache_creation": {"ephemeral_5m_input_tokens": 20, "ephemeral_1h_input_tokens": 30},
    "cache_read_input_tokens": 10,
    "output_tokens": 42,
}
TEXT = ["Hello", ", ", "world", "!"]
# OpenAI's counts: 150 tokens of input of which 30 cached, 42 of output (reasoning included).
OPENAI_CHAT_USAGE = {
    "prompt_tokens": 150,
    "completion_tokens": 42,
    "total_tokens": 192,
    "prompt_tokens_details": {"cached_tokens": 30, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 10, "audio_tokens": 0},
}
OPENAI_RESPONSES_USAGE = {
    "input_tokens": 150,
    "input_tokens_details": {"cached_tokens": 30},
    "output_tokens": 42,
    "output_tokens_details": {"reasoning_tokens": 10},
    "total_tokens": 192,
}


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeVendor:
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    pause: float = 0.2  # between the events of a slow stream


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def _message(model: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "usage": usage,
    }


def _app(vendor: FakeVendor) -> web.Application:
    async def messages(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        vendor.seen.append(Seen(request.path, dict(request.headers), body))
        if request.path.endswith("/count_tokens"):
            return web.json_response({"input_tokens": 99})
        first = body["messages"][0]["content"]
        # A real client's content is blocks: it gets what it asked for.
        scenario = first if isinstance(first, str) else "stream" if body.get("stream") else "json"
        model = body["model"]
        if scenario == "refuse":
            return web.json_response(
                {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}},
                status=400,
            )
        if scenario == "json":
            answer = _message(model, USAGE) | {
                "content": [{"type": "text", "text": "".join(TEXT)}],
                "stop_reason": "end_turn",
            }
            return web.json_response(answer, headers={"request-id": "req_fake"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        start = {k: v for k, v in USAGE.items()} | {"output_tokens": 1}
        await response.write(
            _event("message_start", {"type": "message_start", "message": _message(model, start)})
        )
        await response.write(
            _event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
        )
        for n, piece in enumerate(TEXT):
            if scenario == "slow":
                await asyncio.sleep(vendor.pause)
            if scenario == "drop" and n == 2:
                request.transport.close()  # type: ignore[union-attr]
                return response
            if scenario == "error" and n == 2:
                await response.write(
                    _event(
                        "error",
                        {
                            "type": "error",
                            "error": {"type": "overloaded_error", "message": "Overloaded"},
                        },
                    )
                )
                return response
            delta = {"type": "text_delta", "text": piece}
            await response.write(
                _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
            )
        await response.write(
            _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        )
        await response.write(
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn"},
                    "usage": {"output_tokens": USAGE["output_tokens"]},
                },
            )
        )
        await response.write(_event("message_stop", {"type": "message_stop"}))
        return response

    def scenario_of(body: dict[str, Any]) -> str:
        items = body.get("messages") or body.get("input") or []
        first = items[0].get("content") if isinstance(items, list) and items else items
        return first if isinstance(first, str) else "json"

    async def refuse() -> web.Response:
        error = {"message": "no", "type": "invalid_request_error", "param": None, "code": None}
        return web.json_response({"error": error}, status=400)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        vendor.seen.append(Seen(request.path, dict(request.headers), body))
        scenario, model = scenario_of(body), body["model"]
        if scenario == "refuse":
            return await refuse()
        answer = {"id": "chatcmpl-fake", "created": 1, "model": f"{model}-2025-01-01"}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(TEXT)}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            answer |= {"object": "chat.completion", "choices": [choice]}
            return web.json_response(answer | {"usage": OPENAI_CHAT_USAGE})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = answer | {"object": "chat.completion.chunk"}
        with_usage = (body.get("stream_options") or {}).get("include_usage")
        for n, piece in enumerate(TEXT):
            if scenario == "slow":
                await asyncio.sleep(vendor.pause)
            if scenario == "drop" and n == 2:
                request.transport.close()  # type: ignore[union-attr]
                return response
            if scenario == "error" and n == 2:
                error = {"message": "overloaded", "type": "server_error", "code": None}
                await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
                return response
            choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
            data = chunk | {"choices": [choice]} | ({"usage": None} if with_usage else {})
            await response.write(f"data: {json.dumps(data)}\n\n".encode())
        if with_usage:
            data = chunk | {"choices": [], "usage": OPENAI_CHAT_USAGE}
            await response.write(f"data: {json.dumps(data)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def responses(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        vendor.seen.append(Seen(request.path, dict(request.headers), body))
        if request.path.endswith("/input_tokens"):
            return web.json_response({"object": "response.input_tokens", "input_tokens": 99})
        scenario, model = scenario_of(body), body["model"]
        if scenario == "refuse":
            return await refuse()
        text = {"type": "output_text", "text": "".join(TEXT), "annotations": []}
        output = [{"type": "message", "role": "assistant", "content": [text]}]
        done: dict[str, Any] = {"id": "resp_fake", "object": "response"}
        done["model"] = f"{model}-2025-01-01"
        done |= {"status": "completed", "output": output, "usage": OPENAI_RESPONSES_USAGE}
        if not body.get("stream"):
            return web.json_response(done)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        started = done | {"status": "in_progress", "output": [], "usage": None}
        await response.write(
            _event("response.created", {"type": "response.created", "response": started})
        )
        for n, piece in enumerate(TEXT):
            if scenario == "slow":
                await asyncio.sleep(vendor.pause)
            if scenario == "drop" and n == 2:
                request.transport.close()  # type: ignore[union-attr]
                return response
            if scenario == "error" and n == 2:
                error = {"type": "error", "code": "server_error", "message": "overloaded"}
                await response.write(_event("error", error))
                return response
            delta = {"type": "response.output_text.delta", "delta": piece}
            await response.write(_event(delta["type"], delta))
        await response.write(
            _event("response.completed", {"type": "response.completed", "response": done})
        )
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", messages)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/responses/input_tokens", responses)
    return app


@contextmanager
def fake_vendor(host: str, tls: ssl.SSLContext) -> Iterator[FakeVendor]:
    """The fake on ``host`` (a free port), served by a thread of its own until the block ends."""
    vendor = FakeVendor()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner = web.AppRunner(_app(vendor), access_log=None)

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, host, 0, ssl_context=tls)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        vendor.url = f"https://{host}:{port}"
        ready.set()

    thread = threading.Thread(target=loop.run_forever, name="fake-vendor", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield vendor
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
