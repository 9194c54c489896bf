"""covey's log lines, for every process (web, worker, runner host, proxy, gateway): text for a
person at a terminal, or one JSON object per line (``COVEY_LOG_FORMAT=json``) for a collector.

A line that concerns a run or an agent carries its ids (``run_id``, ``agent_id``): code that
works for one binds them (:func:`bound`), and every record made inside takes them, whichever
logger makes it (a record factory, :func:`install`; :func:`ids_of` reads them). A JSON line
holds the fields in :data:`FIELDS` and nothing else a record may carry (a request object, a
task's arguments), so no secret reaches it that its message does not name. No Django: the data
plane uses it too.
"""

import logging
import logging.config
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from types import MappingProxyType
from typing import Any

from pythonjsonlogger.json import JsonFormatter

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a JSON line may hold, in this order: the record's own, then the ids bound to it.
IDS = ("run_id", "agent_id", "runner_id", "request_id", "task")
FIELDS = ("time", "level", "logger", "message", *IDS, "exc_info", "stack_info")

_bound: ContextVar[Mapping[str, Any]] = ContextVar("covey_log_ids", default=MappingProxyType({}))


@contextmanager
def bound(**ids: Any) -> Iterator[None]:
    """Every record made inside carries these ids (None: not bound), besides those bound
    already; in this thread or task only."""
    token = bind(**ids)
    try:
        yield
    finally:
        unbind(token)


def bind(**ids: Any) -> Token[Mapping[str, Any]]:
    """:func:`bound` where no block fits (a task's start and end are two signals): give the
    token back to :func:`unbind`."""
    return _bound.set({**_bound.get(), **{k: v for k, v in ids.items() if v is not None}})


def unbind(token: Token[Mapping[str, Any]]) -> None:
    _bound.reset(token)


def clear() -> None:
    """Bind nothing here from now on (the end of a request on a server's thread)."""
    _bound.set(MappingProxyType({}))


def current() -> Mapping[str, Any]:
    """The ids bound here now."""
    return _bound.get()


def install() -> None:
    """Have every record take the ids bound where it is made (idempotent)."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "covey", False):
        return

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = factory(*args, **kwargs)
        # Kept apart: a call's extra= may name the same ids (and wins, ids_of).
        made.covey_ids = _bound.get()
        return made

    record.covey = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(record)


class Json(JsonFormatter):
    """One JSON object per line: :data:`FIELDS` that the record has, nothing else."""

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            datefmt="%Y-%m-%dT%H:%M:%S%z",
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        super().add_fields(log_data, record, message_dict)
        log_data.update(ids_of(record))
        for name in list(log_data):
            if name not in FIELDS:
                del log_data[name]


def ids_of(record: logging.LogRecord) -> dict[str, Any]:
    """The ids a record carries: bound where it was made, or given with it (extra=)."""
    ids = dict(getattr(record, "covey_ids", {}))
    ids.update((name, record.__dict__[name]) for name in IDS if name in record.__dict__)
    return ids


def check_format(value: str) -> str:
    """``value`` if it is a format covey writes; ValueError naming the choices otherwise."""
    if value not in FORMATS:
        raise ValueError(f"COVEY_LOG_FORMAT={value!r}: choose text or json")
    return value


def formatter_config(value: str) -> dict[str, Any]:
    """The ``formatters`` entry of a logging dictConfig for format ``value``."""
    if check_format(value) == "json":
        return {"()": Json}
    return {"format": TEXT}


def configure(value: str, level: str = "INFO") -> None:
    """Set up the root logger of a process without Django settings (the proxy's image)."""
    install()
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"covey": formatter_config(value)},
            "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "covey"}},
            "root": {"handlers": ["console"], "level": level},
        }
    )
