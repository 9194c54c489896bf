"""Anthropic's Messages API at the model gateway (POST /v1/messages): a request's cost is
bounded by its size in bytes (its input tokens) and ``max_tokens`` (set from the configuration
when the request has none); what would cost more than that can bound is refused (server tools,
content the vendor fetches, the 1M-token context), and the standard service tier asked for.
No Django."""

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
from budgets.usage import EventStream, StreamMeter, Usage, from_message

# Tools the client runs itself (their results come back in the next request, in its size);
# every other kind runs at the vendor, at costs the gateway cannot bound, and is refused.
CLIENT_TOOLS = ("custom", "bash_", "text_editor_", "computer_", "memory_")
SERVICE_TIERS = (None, "auto", "standard_only")  # priority capacity is billed otherwise


def check_bounded(body: dict[str, Any], beta: str) -> None:
    """Refuse what would cost more than the request's size and max_tokens can bound."""
    if "context-1m" in beta:
        raise invalid(
            "the 1M-token context (anthropic-beta context-1m) is priced differently and is not"
            " metered by covey's gateway"
        )
    if body.get("service_tier") not in SERVICE_TIERS:
        raise invalid(
            f"service_tier {body.get('service_tier')!r} is billed otherwise than the prices"
            " covey's gateway meters by: use auto or standard_only"
        )
    for name in ("mcp_servers", "container"):
        if body.get(name):
            raise invalid(f"{name!r} runs at the vendor at a cost covey's gateway cannot bound")
    for tool in body.get("tools") or []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and not kind.startswith(CLIENT_TOOLS):
            raise invalid(
                f"the server tool {kind!r} runs at the vendor at a cost covey's gateway cannot"
                " bound: only tools the client runs itself are allowed"
            )
    for item in objects_in(body.get("messages"), body.get("system")):
        source = item.get("source")
        if isinstance(source, dict) and source.get("type") in ("url", "file"):
            raise invalid(
                f"content by {source['type']} is fetched by the vendor, at a size covey's"
                " gateway cannot bound: send it in the request"
            )


class Messages(Api):
    vendor = "anthropic"
    vendor_name = "Anthropic"
    key_variable = "ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN"

    def prepare(self, raw: bytes, headers: Mapping[str, str], default_max: int) -> Prepared:
        body = json_object(raw)
        max_tokens = whole(body, "max_tokens")
        check_bounded(body, headers.get("anthropic-beta", ""))
        # auto would use Priority Tier capacity, billed otherwise, where an organisation has it
        wanted: dict[str, Any] = {"service_tier": "standard_only"}
        if max_tokens is None:
            wanted["max_tokens"] = max_tokens = default_max
        return Prepared(body["model"], max_tokens, with_fields(raw, body, wanted))

    def meter(self) -> EventStream:
        return StreamMeter()

    def from_answer(self, body: bytes) -> tuple[Usage, str]:
        return from_message(body)

    def credentials(self, key: str) -> list[tuple[str, str]]:
        return [("x-api-key", key)]

    def error_body(self, refused: Refused) -> dict[str, Any]:
        return {"type": "error", "error": {"type": refused.kind, "message": refused.message}}
