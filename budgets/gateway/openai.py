"""OpenAI's Chat Completions (POST /v1/chat/completions) and Responses (POST /v1/responses)
APIs at the model gateway, which sandboxes reach under /openai/v1 (OPENAI_BASE_URL). No Django.

A request's cost is bounded as an Anthropic one's is: its size in bytes bounds its input
tokens, its output bound (``max_completion_tokens`` or ``max_tokens`` times ``n`` choices;
``max_output_tokens``) is set from the configuration when it has none (at most 16384, the least
maximum of the shipped models), and the default service tier is asked for. Refused, because
their cost is not bounded by that or is priced otherwise: tools that run at the vendor (web search,
file search, code interpreter, …), content the vendor fetches (an image or file by URL or file
id, a stored prompt, an earlier response or conversation), audio, predicted outputs, background
responses, a service tier other than the default.

The counts (``usage``): Chat Completions' ``prompt_tokens`` (cached ones included, in
``prompt_tokens_details.cached_tokens``) and ``completion_tokens`` (reasoning included); the
Responses API's ``input_tokens`` (``input_tokens_details.cached_tokens``) and
``output_tokens``. Cached input is charged at the price's cache-read column, the rest at its
input column. A streamed Chat Completion carries usage only when asked, so the gateway asks
(``stream_options.include_usage``): its last chunk before ``[DONE]`` holds it, with no choices.
A streamed response holds it in ``response.completed`` (or ``response.incomplete``). A stream
cut off or ended by an error before its usage is charged its input's worst case (its counts
come only at the end) and its output bound: OpenAI never streams reasoning, which the request
may have spent it all on.
"""

import json
from collections.abc import Mapping
from typing import Any

from budgets.gateway.api import (
    Api,
    Prepared,
    Refused,
    invalid,
    json_object,
    objects_in,
    whole,
    with_fields,
)
from budgets.usage import EventStream, Usage

# Absent or auto, a project's own setting may choose priority: the gateway asks for default.
SERVICE_TIERS = (None, "auto", "default")  # flex and priority are priced otherwise
# The default output bound is at most the least of the shipped models' maximum (gpt-4o's):
# a larger one is refused by the models with a smaller maximum.
DEFAULT_MAX_OUTPUT = 16384
CHAT_TOOLS = ("function", "custom")
# Tools the client runs itself; the rest (web_search, file_search, code_interpreter,
# image_generation, mcp, computer use, …) run at the vendor.
RESPONSES_TOOLS = ("function", "custom", "local_shell", "shell", "apply_patch")
FETCHED = "is fetched by the vendor, at a size covey's gateway cannot bound: send it inline"


def _count(counts: Any, key: str) -> int:
    value = counts.get(key) if isinstance(counts, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return value


def usage_of(counts: Any) -> Usage | None:
    """The usage in an answer's ``usage`` object (either API's); None when there is none."""
    if not isinstance(counts, dict):
        return None
    if "prompt_tokens" in counts or "completion_tokens" in counts:
        total, details = _count(counts, "prompt_tokens"), counts.get("prompt_tokens_details")
        output = _count(counts, "completion_tokens")
    elif "input_tokens" in counts or "output_tokens" in counts:
        total, details = _count(counts, "input_tokens"), counts.get("input_tokens_details")
        output = _count(counts, "output_tokens")
    else:
        return None
    cached = min(_count(details, "cached_tokens"), total)
    return Usage(input=total - cached, cache_read=cached, output=output)


def _check_common(body: dict[str, Any], tools: tuple[str, ...]) -> None:
    """Refuse what cannot be bounded."""
    if body.get("service_tier") not in SERVICE_TIERS:
        raise invalid(
            f"service_tier {body.get('service_tier')!r} is priced otherwise than the prices"
            " covey's gateway meters by: leave it out, or use auto or default"
        )
    for tool in body.get("tools") or []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        environment = tool.get("environment") if isinstance(tool, dict) else None
        if (
            kind == "shell"
            and environment is not None
            and not (isinstance(environment, dict) and environment.get("type") == "local")
        ):
            raise invalid(
                "a shell tool with an environment at the vendor runs there at a cost covey's"
                " gateway cannot bound: only a local one is allowed"
            )
        if kind not in tools:
            raise invalid(
                f"the tool {kind!r} runs at the vendor at a cost covey's gateway cannot bound:"
                f" only tools the client runs itself are allowed ({', '.join(tools)})"
            )
    for item in objects_in(body.get("messages"), body.get("input")):
        _check_part(item)


def _check_part(part: dict[str, Any]) -> None:
    kind = part.get("type")
    if kind in ("input_audio", "audio") or "input_audio" in part:
        raise invalid("audio is priced otherwise than text, and is not metered by covey's gateway")
    if kind == "item_reference":
        raise invalid(f"an item_reference {FETCHED}")
    if kind == "image_url":  # Chat Completions: {"image_url": {"url": …}}
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not (isinstance(url, str) and url.startswith("data:")):
            raise invalid(f"an image by URL {FETCHED} (as a data: URL)")
    if kind == "input_image":  # Responses: {"image_url": …} or {"file_id": …}
        url = part.get("image_url")
        if part.get("file_id") or not (isinstance(url, str) and url.startswith("data:")):
            raise invalid(f"an image by URL or file id {FETCHED} (as a data: URL)")
    if kind in ("file", "input_file"):
        fields = part.get("file")
        if not isinstance(fields, dict):
            fields = part
        if fields.get("file_id") or fields.get("file_url"):
            raise invalid(f"a file by id or URL {FETCHED} (as file_data)")


class _OpenAI(Api):
    vendor = "openai"
    prefix = "/openai"  # OPENAI_BASE_URL is the gateway's /openai/v1
    vendor_name = "OpenAI"
    key_variable = "OPENAI_API_KEY"

    def credentials(self, key: str) -> list[tuple[str, str]]:
        return [("Authorization", f"Bearer {key}")]

    def error_body(self, refused: Refused) -> dict[str, Any]:
        return {
            "error": {
                "message": refused.message,
                "type": refused.kind,
                "param": None,
                "code": refused.reason or None,
            }
        }

    def from_answer(self, body: bytes) -> tuple[Usage, str]:
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"the answer is not JSON: {exc}") from None
        usage = usage_of(answer.get("usage")) if isinstance(answer, dict) else None
        if usage is None:
            raise ValueError("the answer has no usage")
        return usage, str(answer.get("model") or "")


class ChatCompletions(_OpenAI):
    def prepare(self, raw: bytes, headers: Mapping[str, str], default_max: int) -> Prepared:
        body = json_object(raw)
        for name in ("audio", "web_search_options", "prediction"):
            if body.get(name) is not None:
                raise invalid(
                    f"{name!r} is priced otherwise, and is not metered by covey's gateway"
                )
        if "audio" in (body.get("modalities") or []):
            raise invalid(
                "audio is priced otherwise than text, and is not metered by covey's gateway"
            )
        _check_common(body, CHAT_TOOLS)
        wanted: dict[str, Any] = {"service_tier": "default"}
        bounds = [b for b in (whole(body, "max_completion_tokens"), whole(body, "max_tokens")) if b]
        if not bounds:
            wanted["max_completion_tokens"] = min(default_max, DEFAULT_MAX_OUTPUT)
            bounds = [wanted["max_completion_tokens"]]
        choices = whole(body, "n") or 1
        if body.get("stream") is True:
            options = body.get("stream_options")
            if options is not None and not isinstance(options, dict):
                raise invalid("stream_options: a JSON object")
            wanted["stream_options"] = {**(options or {}), "include_usage": True}
        return Prepared(body["model"], max(bounds) * choices, with_fields(raw, body, wanted))

    def meter(self) -> EventStream:
        return ChatStream()


class Responses(_OpenAI):
    def prepare(self, raw: bytes, headers: Mapping[str, str], default_max: int) -> Prepared:
        body = json_object(raw)
        for name, what in (
            ("previous_response_id", "an earlier response"),
            ("conversation", "a conversation"),
            ("prompt", "a stored prompt"),
        ):
            if body.get(name):
                raise invalid(f"{name}: {what} {FETCHED} (send the input itself)")
        if body.get("background"):
            raise invalid("background responses are not metered by covey's gateway")
        _check_common(body, RESPONSES_TOOLS)
        wanted: dict[str, Any] = {"service_tier": "default"}
        bound = whole(body, "max_output_tokens")
        if bound is None:
            wanted["max_output_tokens"] = bound = min(default_max, DEFAULT_MAX_OUTPUT)
        return Prepared(body["model"], bound, with_fields(raw, body, wanted))

    def meter(self) -> EventStream:
        return ResponsesStream()


class _OpenAIStream(EventStream):
    """OpenAI never streams reasoning, which a request may spend its whole output bound on:
    a stream that ends without its usage is charged the worst case of both its input and its
    output."""

    def charged(self, max_tokens: int, input_bound: int) -> Usage:
        if self.exact:
            return super().charged(max_tokens, input_bound)
        return Usage(input=input_bound, output=max_tokens)


class ChatStream(_OpenAIStream):
    """A streamed Chat Completion: chunks, then one with ``usage`` and no choices, then
    ``data: [DONE]``."""

    def _data(self, data: bytes) -> None:
        if data.strip() == b"[DONE]":
            self.finished = True
            return
        super()._data(data)

    def _event(self, data: dict[str, Any]) -> None:
        if "error" in data:
            error = data["error"]
            self.error = str(error.get("type") if isinstance(error, dict) else "error") or "error"
            return
        self.model = str(data.get("model") or self.model)
        usage = usage_of(data.get("usage"))
        if usage is not None:
            self.usage, self.exact, self.input_seen = usage, True, True
        for choice in data.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            for key in ("content", "refusal", "reasoning_content"):
                self._seen(delta.get(key))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    self._seen(function.get("name"))
                    self._seen(function.get("arguments"))

    def _seen(self, text: Any) -> None:
        if isinstance(text, str):
            self.content_bytes += len(text.encode())


class ResponsesStream(_OpenAIStream):
    """A streamed response: typed events; usage in the one that ends it."""

    ENDS = ("response.completed", "response.incomplete", "response.failed")

    def _event(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        response = data.get("response")
        if isinstance(response, dict):
            self.model = str(response.get("model") or self.model)
        if isinstance(kind, str) and kind.endswith(".delta") and isinstance(data.get("delta"), str):
            self.content_bytes += len(data["delta"].encode())
        elif kind in self.ENDS and isinstance(response, dict):
            usage = usage_of(response.get("usage"))
            if usage is not None:
                self.usage, self.exact, self.input_seen = usage, True, True
            self.finished = True
            if kind == "response.failed":
                error = response.get("error")
                self.error = str(error.get("code") if isinstance(error, dict) else "") or "failed"
        elif kind == "error":
            self.error = str(data.get("code") or "error")
