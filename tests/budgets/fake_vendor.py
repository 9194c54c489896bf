"""A fake Anthropic Messages API over TLS (a test CA's certificate for 127.0.0.x), the model
gateway's upstream in tests and benchmarks. What it answers is chosen by the first message's
text: ``json`` (a plain answer), ``stream`` (server-sent events with realistic usage), ``error``
(a stream that ends in an ``error`` event), ``slow`` (a stream with pauses), ``drop`` (a stream
the server cuts off), ``refuse`` (a 400 error). Every request it saw is kept (headers, body)."""

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
        scenario = first if isinstance(first, str) else "json"
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

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", messages)
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
