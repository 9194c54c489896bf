"""The web process's lines about a run or an agent carry their ids (logs/): those its URL names
(the runner API's /runs/<run_id>/…, an agent's /agents/<agent_id>/home/…), from the view until
the response is closed, so the request's own warning (a 4xx, a 5xx) and the lines of a streamed
answer carry them too."""

from collections.abc import Callable
from typing import Any

from django.core.signals import request_finished
from django.http import HttpRequest, HttpResponseBase

import logs

URL_IDS = ("run_id", "agent_id")


class LogIds:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        logs.clear()  # nothing of an earlier request on this thread
        return self.get_response(request)

    def process_view(
        self, request: HttpRequest, view: object, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> HttpResponseBase | None:
        ids = {name: str(kwargs[name]) for name in URL_IDS if name in kwargs}
        if ids:
            logs.bind(**ids)
        return None


def _finished(**kwargs: Any) -> None:
    logs.clear()


request_finished.connect(_finished, dispatch_uid="covey.middleware.log_ids")
