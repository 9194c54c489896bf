"""The JSON round-trip every process boundary's messages share (wire/__init__.py): what it adds
to what runners/protocol.py had, mappings and a message's own checks; the rest is tested with
the runner's messages (tests/runners/test_protocol.py)."""

import dataclasses

import pytest

from wire import Message, ProtocolError


@dataclasses.dataclass(frozen=True)
class Listed(Message):
    entries: dict[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Ported(Message):
    port: int

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not between 0 and 65535")


@dataclasses.dataclass(frozen=True)
class Outer(Message):
    targets: tuple[Ported, ...]


def test_a_mapping_with_text_keys_goes_there_and_back():
    message = Listed({"git.example:443": ("agent", "base")})
    assert message.to_json() == {"entries": {"git.example:443": ["agent", "base"]}}
    assert Listed.from_json(message.to_json()) == message


def test_a_mapping_that_does_not_fit_is_refused_naming_the_key():
    with pytest.raises(ProtocolError, match=r"Listed\.entries\['a'\]: expected a list, got str"):
        Listed.from_json({"entries": {"a": "agent"}})
    with pytest.raises(ProtocolError, match=r"Listed\.entries: expected an object, got list"):
        Listed.from_json({"entries": []})


def test_a_value_the_message_itself_refuses_is_refused_saying_where():
    with pytest.raises(ProtocolError, match=r"^Outer\.targets\[1\]\.port: 70000 is not between"):
        Outer.from_json({"targets": [{"port": 443}, {"port": 70000}]})
