"""JSON bodies from outside, read strictly: what every covey process that takes a JSON body
from a client reads it with (the web process's API, the model gateway, the proxy's request
desk). Python's ``json`` takes more than JSON, and more than covey can keep: NaN and Infinity
(no JSON number, and no JSON encoder writes them again), lone surrogates (no Unicode text:
neither UTF-8 nor PostgreSQL holds one), and nesting deep enough to exhaust the stack. Each is
:class:`Malformed`, saying what is wrong and at which field, so a door answers 400 naming it
instead of a server error, or a retry that can never succeed. No Django: the data plane uses
it.
"""

import json
import math
from typing import Any

# Deeper than any body covey takes; far below where the parser, or whatever walks the result,
# could exhaust the stack.
MAX_DEPTH = 64

Path = tuple[str | int, ...]


class Malformed(ValueError):
    """A body that is not JSON covey takes: ``problem`` is what is wrong, ``path`` where (the
    keys and indexes down to it; empty for the body as a whole)."""

    def __init__(self, problem: str, path: Path = ()) -> None:
        self.problem, self.path = problem, path
        super().__init__(f"{shown(path)}: {problem}" if path else problem)

    @property
    def field(self) -> str | None:
        """The top-level field it is in, when the body is an object (shown as text)."""
        return printable(self.path[0]) if self.path and isinstance(self.path[0], str) else None

    @property
    def message(self) -> str:
        """What is wrong, for a message under :attr:`field` (with the rest of the way down)."""
        return f"{shown(self.path)}: {self.problem}" if len(self.path) > 1 else self.problem


def loads(raw: bytes | str, *, max_depth: int = MAX_DEPTH, encoding: str = "utf-8") -> Any:
    """The JSON value in ``raw`` (bytes in ``encoding``), or :class:`Malformed`."""
    if isinstance(raw, bytes | bytearray):
        try:
            text = bytes(raw).decode(encoding)
        except UnicodeDecodeError as exc:
            raise Malformed(f"not {encoding} text (byte {exc.start})") from None
        except LookupError:
            raise Malformed(f"{encoding!r} is no text encoding") from None
    else:
        text = raw
    try:
        value = json.loads(text)
    except RecursionError:
        raise Malformed(f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, and numbers with too many digits
        raise Malformed(f"not JSON: {exc}") from None
    check(value, max_depth=max_depth)
    return value


def check(value: Any, *, max_depth: int = MAX_DEPTH) -> None:
    """:class:`Malformed` unless ``value`` (as ``json.loads`` returns it) is within
    ``max_depth`` levels, its numbers finite and its text (keys too) Unicode."""
    # Iterative, so that checking cannot exhaust the stack either.
    stack: list[tuple[Any, Path]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _text(item, path)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise Malformed("not a finite number (JSON has no NaN or Infinity)", path)
        elif isinstance(item, dict | list):
            if len(path) >= max_depth:  # named by its field alone: the way down is long
                raise Malformed(f"nested deeper than {max_depth} levels", path[:1])
            if isinstance(item, dict):
                for key, child in item.items():
                    _text(key, (*path, key))
                    stack.append((child, (*path, key)))
            else:
                stack.extend((child, (*path, index)) for index, child in enumerate(item))


def _text(text: str, path: Path) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        lone = f"\\u{ord(text[exc.start]):04x}"
        raise Malformed(f"a lone surrogate ({lone}) is not Unicode text", path) from None


def printable(name: str | int) -> str:
    """A key as it can be shown, and written in an answer (lone surrogates escaped)."""
    return str(name).encode("utf-8", "backslashreplace").decode("utf-8")


def shown(path: Path) -> str:
    """``messages[2].content`` for the path ``("messages", 2, "content")``."""
    words: list[str] = []
    for step in path:
        if isinstance(step, int):
            words.append(f"[{step}]")
        else:
            words.append(("." if words else "") + printable(step))
    return "".join(words) or "the body"
