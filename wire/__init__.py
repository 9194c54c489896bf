"""Messages that cross a process boundary: frozen dataclasses with a strict JSON round-trip.

What the control plane and a data-plane process (a runner host, an egress proxy) send each
other is a :class:`Message`: ``to_json`` makes plain JSON types, ``from_json`` parses them back
and refuses what does not fit (a missing field, a wrong type, a value not of its enum, a value
a message's ``__post_init__`` refuses) with a :class:`ProtocolError` that names the field, so a
receiver never acts on half a body. The control plane's serializers are made from the same
dataclasses (``DataclassSerializer``: runners/messages.py, egress/messages.py), so the OpenAPI
schema describes them. No Django: the data plane uses it (docs/architecture.md, "Process
boundaries").
"""

import dataclasses
import threading
import types
import typing
import uuid
from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, Self


class ProtocolError(ValueError):
    """A message that does not fit its dataclass; the text names the field."""


class Message:
    """JSON round-trip for the protocol's dataclasses (fields of str, int, float, bool, None,
    datetimes as ISO 8601, UUIDs, enums, tuples, lists, mappings with text keys and nested
    messages or other frozen dataclasses).

    A message may check its values in ``__post_init__``: a ValueError there names the field
    (``"port: …"``), and ``from_json`` says where the message was (``"events[3].port: …"``).
    """

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types, ready for the wire."""
        return {f.name: _encode(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """The message in ``data`` (as :meth:`to_json` makes it); ProtocolError when it does
        not fit. Unknown keys are ignored: a newer side may send more."""
        return typing.cast(Self, decode(cls, data, cls.__name__))


def _encode(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple | list):
        return [_encode(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _encode(item) for key, item in value.items()}
    return value


def decode(kind: Any, data: Any, where: str) -> Any:
    """``data`` (JSON types) as a value of ``kind``, a field's type; ``where`` names it in a
    :class:`ProtocolError`."""
    try:
        return _decoder(kind)(data)
    except _Misfit as misfit:
        path = "".join(reversed(misfit.path))
        raise ProtocolError(f"{where}{path}{misfit.joint}{misfit.problem}") from None


class _Misfit(Exception):
    """What does not fit, and where below the value being decoded (innermost first): each
    container adds its step as it passes the misfit up, so a value that fits costs no text."""

    def __init__(self, problem: str, *, joint: str = ": ") -> None:
        self.problem, self.joint = problem, joint
        self.path: list[str] = []


Decoder = typing.Callable[[Any], Any]
_DECODERS: dict[Any, Decoder] = {}
_MAKING = threading.RLock()  # a decoder is published whole (the web process has 32 threads)


def _decoder(kind: Any) -> Decoder:
    """How to decode a value of ``kind``, made once per type (a policy holds 10,000 agents)."""
    found = _DECODERS.get(kind)
    if found is None:
        with _MAKING:
            found = _DECODERS.get(kind)
            if found is None:
                found = _DECODERS[kind] = _make_decoder(kind)
    return found


def _make_decoder(kind: Any) -> Decoder:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        optional = type(None) in options
        (inner,) = [_decoder(option) for option in options if option is not type(None)]

        def union(data: Any) -> Any:
            return None if data is None and optional else inner(data)

        return union
    if origin in (tuple, list):
        return _sequence(typing.get_args(kind)[0])
    if origin in (dict, Mapping):
        key_kind, item_kind = typing.get_args(kind)
        if key_kind is not str:  # JSON's keys are text
            raise TypeError(f"{kind}: a message's mapping has text keys")
        return _mapping(_decoder(item_kind))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _message(kind)
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        allowed = ", ".join(member.value for member in kind)

        def enum(data: Any) -> Any:
            try:
                return kind(data)
            except ValueError:
                raise _Misfit(f"{data!r} is not one of {allowed}") from None

        return enum
    if kind is uuid.UUID:

        def a_uuid(data: Any) -> uuid.UUID:
            try:
                return uuid.UUID(data)
            except (TypeError, ValueError, AttributeError):
                raise _Misfit(f"{data!r} is not a UUID") from None

        return a_uuid
    if kind is datetime:

        def a_time(data: Any) -> datetime:
            if not isinstance(data, str):
                raise _Misfit("expected an ISO 8601 time")
            try:
                return datetime.fromisoformat(data)
            except ValueError:
                raise _Misfit(f"{data!r} is not an ISO 8601 time") from None

        return a_time
    if kind is float:

        def a_float(data: Any) -> float:
            if isinstance(data, int | float) and not isinstance(data, bool):
                return float(data)
            raise _Misfit(f"expected float, got {type(data).__name__}")

        return a_float
    if kind in (str, int, bool):

        def plain(data: Any) -> Any:
            if type(data) is kind:
                return data
            raise _Misfit(f"expected {kind.__name__}, got {type(data).__name__}")

        return plain
    raise TypeError(f"{kind!r}: not a type a message may hold")


def _sequence(item_kind: Any) -> Decoder:
    item = _decoder(item_kind)
    plain = item_kind if item_kind in (str, int) else None

    def sequence(data: Any) -> tuple[Any, ...]:
        if not isinstance(data, list):
            raise _Misfit(f"expected a list, got {type(data).__name__}")
        if plain is not None and set(map(type, data)) <= {plain}:
            return tuple(data)  # a policy holds a million entries: none is decoded apart
        out = []
        for i, value in enumerate(data):
            try:
                out.append(item(value))
            except _Misfit as misfit:
                misfit.path.append(f"[{i}]")
                raise
        return tuple(out)

    return sequence


def _mapping(item: Decoder) -> Decoder:
    def mapping(data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise _Misfit(f"expected an object, got {type(data).__name__}")
        out = {}
        for key, value in data.items():
            try:
                out[key] = item(value)
            except _Misfit as misfit:
                misfit.path.append(f"[{key!r}]")
                raise
        return out

    return mapping


def _message(kind: type[Any]) -> Decoder:
    hints = typing.get_type_hints(kind)
    fields = [
        (
            f.name,
            _decoder(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(kind)
    ]

    def decoder(data: Any) -> Any:
        if not isinstance(data, dict):
            raise _Misfit(f"expected an object, got {type(data).__name__}")
        values = {}
        for name, field, required in fields:
            if name in data:
                try:
                    values[name] = field(data[name])
                except _Misfit as misfit:
                    misfit.path.append(f".{name}")
                    raise
            elif required:
                missing = _Misfit("missing")
                missing.path.append(f".{name}")
                raise missing
        try:
            return kind(**values)
        except ProtocolError:
            raise
        except ValueError as exc:  # the message's own check, naming the field
            raise _Misfit(str(exc), joint=".") from None

    return decoder
