"""What every API resource shares: the error shape."""

from collections import Counter
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Let services raise Django's ValidationError and still answer 400 with field messages;
    a delete that other rows still depend on answers 409 saying which."""
    if isinstance(exc, ProtectedError | RestrictedError):
        return Response({"detail": still_depends(exc)}, status=status.HTTP_409_CONFLICT)
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else exc.messages
        exc = exceptions.ValidationError(detail=detail)
    return drf_exception_handler(exc, context)


def still_depends(exc: ProtectedError | RestrictedError) -> str:
    """'cannot delete it: 3 runs and 1 agent still depend on it (…)', from Django's error."""
    rows = exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
    counts = Counter((row._meta.verbose_name, row._meta.verbose_name_plural) for row in rows)
    parts = [f"{n} {plural if n > 1 else name}" for (name, plural), n in sorted(counts.items())]
    what = " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)
    return f"cannot delete it: {what} still depend{'s' if sum(counts.values()) == 1 else ''} on it"
