"""Model, form and API fields for allowlists: lists of entries kept in normalised form."""

from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.db import models
from rest_framework import serializers

from allowlists.entries import EntryError, normalise_entries


def _clean(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise EntryError("an allowlist must be a list of entries")
    return normalise_entries(value)


class AllowlistFormField(forms.Field):
    """A textarea with one entry per line; blank lines and ``# comments`` are ignored."""

    widget = forms.Textarea(attrs={"rows": 6, "cols": 60})

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return "\n".join(value)
        return value

    def to_python(self, value: Any) -> list[str]:
        if isinstance(value, list | tuple):
            lines = list(value)
        else:
            lines = [line.split("#", 1)[0].strip() for line in (value or "").splitlines()]
        try:
            return _clean([line for line in lines if line])
        except EntryError as exc:
            raise ValidationError(str(exc).splitlines()) from None


class AllowlistField(models.JSONField):
    """A list of allowlist entries, always stored normalised, deduplicated and sorted."""

    description = "Allowlist entries (host or host:port)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", list)
        kwargs.setdefault("blank", True)
        super().__init__(*args, **kwargs)

    def validate(self, value: Any, model_instance: models.Model | None) -> None:
        super().validate(value, model_instance)
        try:
            _clean(value)
        except EntryError as exc:
            raise ValidationError(str(exc).splitlines()) from None

    def pre_save(self, model_instance: models.Model, add: bool) -> Any:
        # Fail closed: nothing that the grammar rejects ever reaches the database.
        value = _clean(getattr(model_instance, self.attname))
        setattr(model_instance, self.attname, value)
        return value

    def formfield(self, **kwargs: Any) -> Any:
        defaults: dict[str, Any] = {
            "required": not self.blank,
            "label": self.verbose_name.capitalize(),
            "help_text": self.help_text or "One entry per line: host or host:port (port 443).",
            # A new object's form shows what it starts with (an organisation's base list).
            "initial": self.get_default if self.has_default() else None,
        }
        defaults.update(kwargs)
        defaults.pop("form_class", None)
        defaults.pop("encoder", None)
        defaults.pop("decoder", None)
        return AllowlistFormField(**defaults)


class AllowlistSerializerField(serializers.ListField):
    """An API list of entries; every bad entry is reported with what is wrong."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.CharField(trim_whitespace=False), **kwargs)

    def to_internal_value(self, data: Any) -> list[str]:
        if isinstance(data, str) or not hasattr(data, "__iter__"):
            raise serializers.ValidationError("expected a list of entries")
        values = super().to_internal_value(data)
        try:
            return _clean(values)
        except EntryError as exc:
            raise serializers.ValidationError(str(exc).splitlines()) from None
