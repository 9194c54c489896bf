"""The web process's own middleware. LogIds: the lines about a run or an agent carry their
ids (logs/), those its URL names (the runner API's /runs/<run_id>/…, an agent's
/agents/<agent_id>/home/…), from the view until the response is closed, so the request's own
warning (a 4xx, a 5xx) and the lines of a streamed answer carry them too. DatabaseUnavailable:
a 503 that says so when the database does not answer. ValueRefused: a 400 that says which
value the database would not take (a NUL character, a time zone offset past what PostgreSQL
knows), where a validator let it through. AdminRefusals: the admin's 403 is a page in the
admin's style that says which role would do."""

import logging
from collections.abc import Callable
from typing import Any

from django.core.exceptions import PermissionDenied
from django.core.signals import request_finished
from django.db import DataError, InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse

import logs
from covey.admin_site import refused_page

logger = logging.getLogger(__name__)

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


class DatabaseUnavailable:
    """A request the database could not answer (it is down, restarting, or out of connections)
    is answered 503 with Retry-After and a body that says so, not a 500: the client may try
    again, and nothing was half-written (each write is one transaction). The next request
    checks its connection before using it (CONN_HEALTH_CHECKS), so none of this needs a
    restart once the database is back."""

    RETRY_AFTER_SECONDS = 5

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        try:
            return self.get_response(request)
        except (OperationalError, InterfaceError) as exc:  # raised before any view ran
            return self.process_exception(request, exc)

    def process_exception(self, request: HttpRequest, exception: Exception) -> Any:
        if not isinstance(exception, OperationalError | InterfaceError):
            return None
        logger.warning(
            "covey: the database did not answer %s %s: %s",
            request.method,
            request.path,
            str(exception).splitlines()[0] if str(exception) else "",
        )
        detail = "the database does not answer; try again in a few seconds"
        return _said(request, 503, detail, {"Retry-After": str(self.RETRY_AFTER_SECONDS)})


class ValueRefused:
    """A value the database refused to store or compare (``DataError``: a NUL character in
    text, a time zone offset beyond ±15:59, a number out of its column's range) came from the
    request, past a validator that let it through: 400 with the database's reason, not a 500.
    The request's transaction was rolled back, so nothing was half-written."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> Any:
        if not isinstance(exception, DataError):
            return None
        reason = str(exception).splitlines()[0] if str(exception) else "a value out of range"
        logger.warning(
            "covey: the database refused a value of %s %s: %s", request.method, request.path, reason
        )
        return _said(request, 400, f"the database cannot take a value of this request: {reason}")


class AdminRefusals:
    """A refusal in the admin (PermissionDenied) is covey's styled 403 page saying why, and
    one warning line in the log, not Django's bare page and a traceback."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> Any:
        if not isinstance(exception, PermissionDenied) or not request.path.startswith("/admin/"):
            return None
        return refused_page(request, str(exception)).render()


def _said(
    request: HttpRequest, status: int, detail: str, headers: dict[str, str] | None = None
) -> HttpResponse:
    """An answer that says why: JSON like the API's own errors under /api/, plain text else."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": detail}, status=status, headers=headers)
    return HttpResponse(
        f"covey: {detail}.\n",
        status=status,
        headers=headers,
        content_type="text/plain; charset=utf-8",
    )
