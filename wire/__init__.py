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
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if data is None and type(None) in options:
            return None
        (kind,) = [option for option in options if option is not type(None)]
        return decode(kind, data, where)
    if origin in (tuple, list):
        if not isinstance(data, list):
            raise ProtocolError(f"{where}: expected a list, got {type(data).__name__}")
        item = typing.get_args(kind)[0]
        return tuple(decode(item, value, f"{where}[{i}]") for i, value in enumerate(data))
    if origin in (dict, Mapping):
        if not isinstance(data, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(data).__name__}")
        key_kind, item = typing.get_args(kind)
        if key_kind is not str:  # JSON's keys are text
            raise TypeError(f"{where}: a message's mapping has text keys")
        return {key: decode(item, value, f"{where}[{key!r}]") for key, value in data.items()}
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _message(kind, data, where)
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        try:
            return kind(data)
        except ValueError:
            allowed = ", ".join(member.value for member in kind)
            raise ProtocolError(f"{where}: {data!r} is not one of {allowed}") from None
    if kind is uuid.UUID:
        try:
            return uuid.UUID(data)
        except (TypeError, ValueError, AttributeError):
            raise ProtocolError(f"{where}: {data!r} is not a UUID") from None
    if kind is datetime:
        if not isinstance(data, str):
            raise ProtocolError(f"{where}: expected an ISO 8601 time")
        try:
            return datetime.fromisoformat(data)
        except ValueError:
            raise ProtocolError(f"{where}: {data!r} is not an ISO 8601 time") from None
    if kind is float and isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if kind in (str, int, bool) and type(data) is kind:
        return data
    raise ProtocolError(f"{where}: expected {kind.__name__}, got {type(data).__name__}")


_FIELDS: dict[type[Any], tuple[tuple[str, Any, bool], ...]] = {}


def _fields(kind: type[Any]) -> tuple[tuple[str, Any, bool], ...]:
    """A message's fields: name, type and whether it must be given (read once per class: a
    proxy's batch holds thousands of events)."""
    fields = _FIELDS.get(kind)
    if fields is None:
        hints = typing.get_type_hints(kind)
        fields = _FIELDS[kind] = tuple(
            (
                f.name,
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(kind)
        )
    return fields


def _message(kind: type[Any], data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(data).__name__}")
    values = {}
    for name, hint, required in _fields(kind):
        if name in data:
            values[name] = decode(hint, data[name], f"{where}.{name}")
        elif required:
            raise ProtocolError(f"{where}.{name}: missing")
    try:
        return kind(**values)
    except ProtocolError:
        raise
    except ValueError as exc:  # the message's own check, naming the field
        raise ProtocolError(f"{where}.{exc}") from None
