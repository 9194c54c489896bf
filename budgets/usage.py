"""What a model request used, read exactly from the Anthropic Messages API's answers, and what
it costs. No Django: the model gateway reads usage as the answer streams through it. Streams of
every vendor are read by an :class:`EventStream` (OpenAI's: budgets/gateway/openai.py).

The counts (Messages API ``usage``):

- ``input_tokens``: the input not read from or written to the cache;
- ``cache_creation_input_tokens``: written to the cache, split by lifetime in
  ``cache_creation`` (``ephemeral_5m_input_tokens``, ``ephemeral_1h_input_tokens``; without the
  split, all of it is the 5-minute kind, the default);
- ``cache_read_input_tokens``: read from the cache;
- ``output_tokens``.

A plain answer holds them in ``usage``. A streamed one (server-sent events) holds the input and
cache counts in ``message_start``'s ``message.usage``, whose output count is a placeholder;
each ``message_delta`` carries ``usage`` counts that are cumulative, so the last value of each
field is the one (never the sum). A stream that ends with an ``error`` event, or is cut off,
used its input and the output seen until then; as the output's count only comes at the end,
what was seen is bounded by its size: every output token is at least one byte of the content
deltas (text, thinking, tool input), and never more than the request's ``max_tokens``
(:meth:`StreamMeter.charged`). :class:`StreamMeter` keeps only the event it is reading, never
the answer.
"""

import dataclasses
import json
from decimal import ROUND_CEILING, Decimal
from typing import Any

MILLION = Decimal(1_000_000)
CENT_FRACTION = Decimal("0.000001")  # costs are kept to a millionth of a dollar, rounded up
MAX_EVENT_BYTES = 4 * 1024 * 1024  # an event longer than this is content, not counted
KINDS = ("input", "cache_write_5m", "cache_write_1h", "cache_read", "output")


@dataclasses.dataclass
class Usage:
    """Tokens of each kind one request used."""

    input: int = 0
    cache_write_5m: int = 0
    cache_write_1h: int = 0
    cache_read: int = 0
    output: int = 0

    def update(self, usage: Any, *, output: bool = True) -> None:
        """Take the counts ``usage`` (a Messages API usage object) holds; those it lacks stay.
        ``output``: whether its output count is real (message_start's is a placeholder)."""
        if not isinstance(usage, dict):
            return
        if _count(usage, "input_tokens") is not None:
            self.input = _count(usage, "input_tokens") or 0
        written = _count(usage, "cache_creation_input_tokens")
        split = usage.get("cache_creation")
        if isinstance(split, dict) and (
            _count(split, "ephemeral_5m_input_tokens") is not None
            or _count(split, "ephemeral_1h_input_tokens") is not None
        ):
            self.cache_write_5m = _count(split, "ephemeral_5m_input_tokens") or 0
            self.cache_write_1h = _count(split, "ephemeral_1h_input_tokens") or 0
        elif written is not None and written != self.cache_write_5m + self.cache_write_1h:
            # A total without its split (message_delta never has one): without a split seen
            # before, all of the default kind; else what changed is taken as the dearest kind.
            if self.cache_write_1h == 0:
                self.cache_write_5m = written
            else:
                self.cache_write_5m = min(self.cache_write_5m, written)
                self.cache_write_1h = written - self.cache_write_5m
        if _count(usage, "cache_read_input_tokens") is not None:
            self.cache_read = _count(usage, "cache_read_input_tokens") or 0
        if output and _count(usage, "output_tokens") is not None:
            self.output = _count(usage, "output_tokens") or 0


def _count(usage: dict[str, Any], key: str) -> int | None:
    value = usage.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


@dataclasses.dataclass(frozen=True)
class Prices:
    """Dollars per million tokens of each kind."""

    input: Decimal
    cache_write_5m: Decimal
    cache_write_1h: Decimal
    cache_read: Decimal
    output: Decimal

    def cost(self, usage: Usage) -> Decimal:
        """What ``usage`` costs, in dollars, rounded up to a millionth."""
        total = sum(
            (Decimal(getattr(usage, kind)) * getattr(self, kind) for kind in KINDS), Decimal(0)
        )
        return (total / MILLION).quantize(CENT_FRACTION, rounding=ROUND_CEILING)

    def least(self) -> Decimal:
        """The least any request can cost: one token of the cheapest input and one of output,
        rounded up to a millionth. A budget with less than this left is used up."""
        cheapest = min(self.input, self.cache_write_5m, self.cache_write_1h, self.cache_read)
        return ((cheapest + self.output) / MILLION).quantize(CENT_FRACTION, rounding=ROUND_CEILING)

    def worst_case(self, input_bound: int, max_tokens: int) -> Decimal:
        """The most a request can cost: ``input_bound`` tokens at the dearest input price (a
        1-hour cache write costs the most) and ``max_tokens`` of output. ``input_bound`` must
        bound every input token the model is given (the gateway's business: the request's size
        in bytes does, for text sent in the request itself)."""
        if input_bound < 0 or max_tokens < 0:
            raise ValueError("token bounds cannot be negative")
        dearest = max(self.input, self.cache_write_5m, self.cache_write_1h, self.cache_read)
        total = Decimal(input_bound) * dearest + Decimal(max_tokens) * self.output
        return (total / MILLION).quantize(CENT_FRACTION, rounding=ROUND_CEILING)


def from_message(body: bytes) -> tuple[Usage, str]:
    """The usage and model of a plain (not streamed) answer; ValueError if it has no usage."""
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"the answer is not JSON: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("usage"), dict):
        raise ValueError("the answer has no usage")
    usage = Usage()
    usage.update(message["usage"])
    return usage, str(message.get("model") or "")


class EventStream:
    """Reads a streamed answer (server-sent events: ``data:`` lines up to a blank line) from its
    bytes as they pass (:meth:`feed`), holding only the event being read, and hands each event's
    data to :meth:`_data` (a JSON object to :meth:`_event`). What a vendor's stream tells is set
    by its subclass: ``usage`` what was used so far, ``exact`` whether that is the vendor's final
    count, ``input_seen`` whether its input counts came, ``model`` the model that answered,
    ``finished`` whether the stream ended as it should, ``error`` the type of an error event,
    ``content_bytes`` the bytes of content seen (a bound of the output so far)."""

    def __init__(self) -> None:
        self.usage = Usage()
        self.exact = False
        self.input_seen = False
        self.model = ""
        self.finished = False
        self.error = ""
        self.content_bytes = 0
        self._line = bytearray()  # the line being read
        self._lines: list[bytes] = []  # the event's data lines so far
        self._size = 0
        self._blank = True  # the line being read is empty so far (a blank line ends an event)
        self._skipping = False  # the event is too long to be one that counts

    def charged(self, max_tokens: int, input_bound: int) -> Usage:
        """What to charge: the usage, when the vendor counted it all; else the input counts, or
        without them ``input_bound`` tokens of input (the worst case), and a bound of the output
        seen (the bytes of its content, at most ``max_tokens``)."""
        if self.exact and self.finished and not self.error:
            return dataclasses.replace(self.usage)
        seen = max(self.usage.output, min(self.content_bytes, max_tokens))
        if self.input_seen:
            return dataclasses.replace(self.usage, output=seen)
        return Usage(input=input_bound, output=seen)

    def close(self) -> None:
        """The answer ended: an event it did not end with a blank line is read all the same."""
        self.feed(b"\n\n")

    def feed(self, chunk: bytes) -> None:
        """The next bytes of the answer, as they came."""
        if chunk.endswith(b"\n\n") and self._between_events() and b"\r" not in chunk:
            self._whole_events(chunk)
            return
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._add(chunk[start:end])
            self._end_of_line()
            start = end + 1
        self._add(chunk[start:])

    def _between_events(self) -> bool:
        return self._blank and not (self._line or self._lines or self._skipping)

    def _whole_events(self, chunk: bytes) -> None:
        """Events that end in the chunk, after one that ended (what a vendor's chunk usually
        holds): read as :meth:`feed` reads them line by line, at a fraction of the cost."""
        for event in chunk.split(b"\n\n"):
            if not event or len(event) - event.count(b"\n") > MAX_EVENT_BYTES:
                continue  # a blank line more, or too long to be an event that counts
            lines = [
                value[1:] if value.startswith(b" ") else value
                for line in event.split(b"\n")
                if line.startswith(b"data:")
                for value in (line[5:],)
            ]
            if lines:
                self._data(b"\n".join(lines))

    def _add(self, part: bytes) -> None:
        if part.strip(b"\r"):
            self._blank = False
        if self._skipping or not part:
            return
        self._size += len(part)
        if self._size > MAX_EVENT_BYTES:
            self._line.clear()
            self._lines.clear()
            self._skipping = True
            return
        self._line += part

    def _end_of_line(self) -> None:
        line = bytes(self._line).removesuffix(b"\r")
        self._line.clear()
        blank, self._blank = self._blank, True
        if not blank:
            if not self._skipping and line.startswith(b"data:"):
                value = line[5:]
                self._lines.append(value[1:] if value.startswith(b" ") else value)
            return
        # A blank line ends the event.
        lines, self._lines, self._size = self._lines, [], 0
        skipped, self._skipping = self._skipping, False
        if lines and not skipped:
            self._data(b"\n".join(lines))

    def _data(self, data: bytes) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            return
        if isinstance(event, dict):
            self._event(event)

    def _event(self, data: dict[str, Any]) -> None:
        raise NotImplementedError


class StreamMeter(EventStream):
    """The usage of a streamed Messages API answer (``started``: whether ``message_start``
    came). Its input counts come first, in ``message_start``; a stream cut off before them is
    charged no input (the vendor ended it before it began)."""

    @property
    def started(self) -> bool:
        return self.input_seen

    def charged(self, max_tokens: int, input_bound: int = 0) -> Usage:
        return super().charged(max_tokens, 0)

    def _event(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "message_start" and isinstance(data.get("message"), dict):
            message = data["message"]
            self.usage.update(message.get("usage"), output=False)
            self.model = str(message.get("model") or self.model)
            self.input_seen = True
        elif kind == "message_delta":
            self.usage.update(data.get("usage"))
        elif kind == "content_block_delta" and isinstance(data.get("delta"), dict):
            delta = data["delta"]
            for key in ("text", "partial_json", "thinking"):
                if isinstance(delta.get(key), str):
                    self.content_bytes += len(delta[key].encode())
        elif kind == "message_stop":
            self.finished = self.exact = True
        elif kind == "error":
            error = data.get("error")
            self.error = str(error.get("type") if isinstance(error, dict) else "error")
