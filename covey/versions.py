"""What versioned configuration shares (agents, workplaces): writing a version
(:func:`record_version`), differences between two versions, shown in the admin as a table and
in the API as field → [old, new], and the API's ``versions/`` and ``compare/`` actions (the
admin's pages of versions: organisations/readonly.py). Imports no covey app.

A versioned model has a ``versions`` relation to rows with ``number``, ``config`` (the whole
configuration at that version), ``changes`` (field → [old, new] from the one before),
``created_by``, ``reason`` and ``created_at``; its app's services write them with
:func:`record_version`, never the views.
"""

import json
from typing import Any

from django.conf import settings
from django.db import models
from django.shortcuts import get_object_or_404
from django.utils.html import format_html, format_html_join
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import exceptions, serializers
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response


class Version(models.Model):
    """One numbered configuration of something versioned (its model adds the foreign key and
    the constraint that numbers are unique per object); rows are never changed once written."""

    number = models.PositiveIntegerField()
    config = models.JSONField(help_text="The whole configuration at this version.")
    changes = models.JSONField(
        default=dict, help_text="What changed from the previous version: field → [old, new]."
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    reason = models.CharField(
        max_length=500,
        blank=True,
        help_text="Why it was made, when covey made it: the approved request, the grant that"
        " expired. Empty: a person's own change.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True


def record_version(
    owner: Any,
    config: dict[str, Any],
    *,
    before: dict[str, Any] | None = None,
    by: Any = None,
    reason: str = "",
) -> Any:
    """Write ``owner``'s version number ``owner.version`` to its ``versions``: the whole
    ``config``, what changed from ``before`` (None: the first version, nothing before it), who
    made it (``by``, when a signed-in user) and why (``reason``, when covey made it)."""
    return owner.versions.create(
        number=owner.version,
        config=config,
        changes={} if before is None else diff_configs(before, config),
        created_by=by if by is not None and by.is_authenticated else None,
        reason=reason[:500],
    )


def diff_configs(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """Field → [old value, new value] for every field that differs."""
    return {
        key: [old.get(key), new.get(key)]
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    }


def shown(value: Any) -> str:
    """A configuration value as people read it: lists of text as comma-separated items."""
    if value is None or value == [] or value == "" or value == {}:
        return "—"
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return ", ".join(value)
    if isinstance(value, str | int | float | bool):
        return str(value)
    return json.dumps(value, sort_keys=True)


def _differences(field: str, old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """A change as rows: a group of settings (a dict) one row per setting that differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            (f"{field} {key.replace('_', ' ')}", old.get(key), new.get(key))
            for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)
        ]
    return [(field, old, new)]


def changes_table(version: Any) -> str:
    """What a version changed, one row per field: before, after (HTML, escaped)."""
    if not version.changes:
        return "created" if version.number == 1 else "no change"
    rows = format_html_join(
        "",
        "<tr><th>{}</th><td>{}</td><td>{}</td></tr>",
        (
            (field, shown(old), shown(new))
            for name, (old, new) in sorted(version.changes.items())
            for field, old, new in _differences(name.replace("_", " "), old, new)
        ),
    )
    return format_html(
        '<table class="covey-changes"><thead><tr><th>field</th><th>before</th>'
        "<th>after</th></tr></thead><tbody>{}</tbody></table>",
        rows,
    )


def versions_actions(version_serializer: type[serializers.Serializer], name: str) -> type:
    """A viewset mixin with ``versions/`` (every version, newest first, paginated) and
    ``compare/?from=&to=`` (what differs between two), for a model whose versions
    ``version_serializer`` shows; ``name`` prefixes the schema's component names."""

    class Versioned:
        @extend_schema(responses=version_serializer(many=True))
        @action(detail=True, methods=["get"])
        def versions(self: Any, request: Request, pk: str | None = None) -> Response:
            """Every version of its configuration, newest first."""
            versions = self.get_object().versions.select_related("created_by").order_by("-number")
            page = self.paginate_queryset(versions)
            return self.get_paginated_response(version_serializer(page, many=True).data)

        @extend_schema(
            parameters=[
                OpenApiParameter("from", int, required=True, description="Older version number."),
                OpenApiParameter("to", int, required=True, description="Newer version number."),
            ],
            responses=inline_serializer(
                f"{name}VersionComparison",
                {
                    "from": serializers.IntegerField(),
                    "to": serializers.IntegerField(),
                    "changes": serializers.DictField(),
                },
            ),
        )
        @action(detail=True, methods=["get"])
        def compare(self: Any, request: Request, pk: str | None = None) -> Response:
            """What differs between two versions: field → [value in ``from``, value in ``to``]."""
            versions = self.get_object().versions.all()
            numbers = {}
            for param in ("from", "to"):
                raw = request.query_params.get(param, "")
                if not (raw.isascii() and raw.isdigit()):
                    raise exceptions.ValidationError({param: "give a version number"})
                numbers[param] = int(raw)
            old, new = (get_object_or_404(versions, number=numbers[p]) for p in ("from", "to"))
            return Response(
                {
                    "from": old.number,
                    "to": new.number,
                    "changes": diff_configs(old.config, new.config),
                }
            )

    return Versioned
