"""Whether the control plane's web process lives (/healthz) and can serve (/readyz).

Both answer anyone (GET or HEAD) without a session or a token, as load balancers and
orchestrators ask: so they say which dependency is wrong and never its address or
credentials, which go to the log (with the password masked) for the people who run it. As
every path, they answer only the host names DJANGO_ALLOWED_HOSTS lists: a probe that asks by
another name (a pod's address) must be given one, or be listed.
"""

import logging
import time

from django.db import Error, connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe

from covey.celery import app

logger = logging.getLogger(__name__)

BROKER_TIMEOUT = 2.0  # seconds: a readiness answer must come quickly, whatever is down


@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    """The process answers; nothing else is asked."""
    return JsonResponse({"status": "ok"})


@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    """200 when the database and the broker both answer, else 503 naming what does not."""
    checks = {"database": _database(), "broker": _broker()}
    ready = all(answer == "ok" for answer in checks.values())
    return JsonResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status=200 if ready else 503,
    )


def database_problem() -> str:
    """'' when the database answers, else why not, naming its address (never its password):
    for /readyz and for the image's roles waiting for it (covey/entrypoint.py)."""
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Error as exc:  # InterfaceError (a closed connection) too
        connections["default"].close()  # the next question opens a new one
        settings = connections["default"].settings_dict
        where = f"{settings.get('HOST') or settings.get('NAME')}:{settings.get('PORT') or ''}"
        return f"the database at {where.rstrip(':')} does not answer ({_first_line(exc)})"
    return ""


def broker_problem() -> str:
    """'' when the broker answers, else why not, naming its URL with the password masked."""
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(
                max_retries=1, interval_start=0, interval_step=0, timeout=BROKER_TIMEOUT
            )
    except Exception as exc:  # kombu raises its transports' own errors
        where = app.connection_for_write().as_uri()  # the password masked
        return f"the broker at {where} does not answer ({_first_line(exc)})"
    return ""


def _first_line(exc: Exception) -> str:
    return str(exc).strip().split("\n", 1)[0] or type(exc).__name__


def _database() -> str:
    started = time.monotonic()
    if problem := database_problem():
        logger.warning("readyz: %s", problem)
        return "unreachable"
    return "ok" if time.monotonic() - started < 10 else "slow"


def _broker() -> str:
    if problem := broker_problem():
        logger.warning("readyz: %s", problem)
        return "unreachable"
    return "ok"
