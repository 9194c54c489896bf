"""What the model gateway knows of a vendor's API (:class:`Api`): how a request is bounded
before it is reserved, how its answer's usage is read, how the key is sent, and how a refusal
is written so that the vendor's own SDKs show it. No Django."""

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

import jsonbodies
from budgets.usage import EventStream, Usage


class Refused(Exception):
    """A request the gateway answers itself, in the API's error shape; ``retry_after``: the
    seconds after which the same request may succeed (sent as ``retry-after``, which the
    vendors' SDKs wait for before they retry)."""

    def __init__(
        self, status: int, kind: str, message: str, reason: str = "", retry_after: int = 0
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.reason = status, kind, message, reason
        self.retry_after = retry_after


def invalid(message: str) -> Refused:
    return Refused(400, "invalid_request_error", message)


@dataclass(frozen=True)
class Prepared:
    """A request to reserve and send: its model, the most output it can produce (the sum over
    every choice it asks for), and the bytes to send (changed when the gateway set a bound)."""

    model: str
    max_output: int
    raw: bytes


# Tool schemas nest deeper than covey's own bodies; the vendor has limits of its own.
MAX_DEPTH = 128


def json_object(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, read strictly: NaN, a lone surrogate or nesting deeper than
    :data:`MAX_DEPTH` is a 400 naming where (no vendor takes them, and deep nesting was a
    server error here)."""
    try:
        body = jsonbodies.loads(raw, max_depth=MAX_DEPTH)
    except jsonbodies.Malformed as exc:
        raise invalid(f"the request is not JSON the gateway takes: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the request is not a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: the request names no model")
    return body


def whole(body: dict[str, Any], name: str, least: int = 1, most: int = 10**9) -> int | None:
    """``body[name]``, a whole number from ``least`` to ``most`` (a count of tokens: a
    larger one is no request any model answers, and the ledger's worst case of it overflows
    its columns); None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise invalid(f"{name}: a whole number from {least} to {most}")
    return value


def objects_in(*roots: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in ``roots`` and in what they hold, at any depth."""
    stack = list(roots)
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            yield item
            stack.extend(v for v in item.values() if isinstance(v, list | dict))


def dumped(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def with_fields(raw: bytes, body: dict[str, Any], wanted: dict[str, Any]) -> bytes:
    """The request ``raw`` (the JSON object ``body`` was read from) with the fields of
    ``wanted`` set, in ``body`` too. When it has none of them they are put in front, without
    writing the rest again (a request may be megabytes); when it has one with another value it
    is written anew."""
    changed = {name: value for name, value in wanted.items() if body.get(name, ...) != value}
    if not changed:
        return raw
    lacking = all(name not in body for name in changed)
    body.update(changed)
    if not lacking:
        return dumped(body)
    front = json.dumps(changed, separators=(",", ":")).encode()
    return front[:-1] + b"," + raw.lstrip()[1:]


class Api:
    """One of a vendor's APIs: subclasses say what it is."""

    vendor = ""  # budgets.models.Vendor
    prefix = ""  # where its paths are at the gateway (with it removed, at the vendor)
    vendor_name = ""  # for people
    key_variable = ""  # the sandbox variable its SDKs read the token from

    def prepare(self, raw: bytes, headers: Mapping[str, str], default_max: int) -> Prepared:
        """The request bounded (Refused when its cost cannot be)."""
        raise NotImplementedError

    def meter(self) -> EventStream:
        """A reader of a streamed answer's usage."""
        raise NotImplementedError

    def from_answer(self, body: bytes) -> tuple[Usage, str]:
        """The usage and model of a plain answer; ValueError when it has none."""
        raise NotImplementedError

    def credentials(self, key: str) -> list[tuple[str, str]]:
        """The headers that carry the organisation's key to the vendor."""
        raise NotImplementedError

    def error_body(self, refused: Refused) -> dict[str, Any]:
        raise NotImplementedError

    def error(self, refused: Refused, request_id: str) -> web.Response:
        response = web.json_response(self.error_body(refused), status=refused.status)
        response.headers["X-Covey-Request-Id"] = request_id
        if refused.reason:
            response.headers["X-Covey-Deny-Reason"] = refused.reason
        if refused.retry_after:
            response.headers["Retry-After"] = str(refused.retry_after)
        return response
