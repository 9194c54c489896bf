"""What every API resource shares: the error shape, a strict JSON parser, and serializers that
refuse fields they do not have."""

from collections import Counter
from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from django.http import QueryDict
from rest_framework import exceptions, parsers, serializers, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

import jsonbodies


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


class StrictJSONParser(parsers.JSONParser):
    """JSON bodies as :mod:`jsonbodies` reads them: NaN, Infinity, lone surrogates and deep
    nesting are a 400 naming the field they are in (a body nested past the stack was a server
    error; a lone surrogate failed only when PostgreSQL refused it)."""

    def parse(
        self,
        stream: IO[Any] | None,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        # A charset that is no text encoding (bz2_codec: a tiny body decompressed past the size
        # limit) is refused by jsonbodies, as by DRF's own parser.
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        raw = stream.read() if stream is not None else b""
        try:
            return jsonbodies.loads(raw, encoding=encoding)
        except jsonbodies.Malformed as exc:
            if exc.field is not None:
                raise exceptions.ValidationError({exc.field: [exc.message]}) from None
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None


# A form posted from the browsable API carries Django's CSRF token among its fields.
FORM_ONLY = frozenset({"csrfmiddlewaretoken"})


class RefusesUnknownFields(serializers.Serializer):
    """Put first among a serializer's bases: a field it does not have is a 400 naming it and
    the fields it takes, not silently dropped (``command`` for ``runtime_command`` was a
    change that did nothing). Read-only fields are known (a GET's answer may be sent back)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            ignored = FORM_ONLY if isinstance(data, QueryDict) else frozenset()
            unknown = [name for name in data if name not in self.fields and name not in ignored]
            if unknown:
                takes = [name for name, field in self.fields.items() if not field.read_only]
                told = f"Unknown field; the fields are: {', '.join(takes) or 'none'}"
                raise serializers.ValidationError(
                    {jsonbodies.printable(name): [told] for name in unknown}
                )
        return super().to_internal_value(data)
