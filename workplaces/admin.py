"""Admin for workplaces and their versions."""

import json
from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.http import urlencode

from organisations.admin import StrictJSONField, TenantScoped
from organisations.readonly import VersionAdmin, VersionInline
from workplaces import config, services
from workplaces.models import WORKPLACE_FIELDS, Workplace, WorkplaceVersion


class PackagesField(forms.CharField):
    """One ecosystem's packages, one per line (``name`` or ``name=version``)."""

    widget = forms.Textarea(attrs={"rows": 4, "cols": 60})

    def prepare_value(self, value: Any) -> Any:
        return "\n".join(value) if isinstance(value, list | tuple) else value

    def to_python(self, value: Any) -> list[str]:  # type: ignore[override]
        if isinstance(value, list | tuple):
            return list(value)
        return [line.strip() for line in (value or "").splitlines() if line.strip()]


class JSONListField(StrictJSONField):
    """A JSON list, empty when left blank."""

    def __init__(self, example: str, **kwargs: Any) -> None:
        super().__init__(widget=forms.Textarea(attrs={"rows": 8, "cols": 80}), **kwargs)
        self.example = example

    def to_python(self, value: Any) -> Any:
        found = super().to_python(value)
        if found in (None, ""):
            return []
        if not isinstance(found, list):
            raise ValidationError(f"Give a JSON list, e.g. {self.example}")
        return found

    def prepare_value(self, value: Any) -> Any:
        if value is None or (isinstance(value, list) and not value):
            return ""
        if isinstance(value, list):
            return json.dumps(value, indent=2)
        return super().prepare_value(value)


def packages_field(ecosystem: str) -> PackagesField:
    return PackagesField(
        label=config.ECOSYSTEM_NAMES[ecosystem],
        required=False,
        help_text=f"One per line: {config.ECOSYSTEM_FORMS[ecosystem]}. Installed in an image"
        " built once for each version of the workplace.",
    )


class WorkplaceForm(forms.ModelForm):
    # One field per ecosystem covey installs (config.ECOSYSTEMS; checked below).
    packages_apt = packages_field("apt")
    packages_pip = packages_field("pip")
    packages_npm = packages_field("npm")
    services = JSONListField(
        config.SERVICES_EXAMPLE,
        required=False,
        help_text="A JSON list of companion services, each reachable from the sandbox by its"
        " name: name, image, environment, command, ready (command, start_period, interval,"
        f" timeout, in seconds), cpus, memory_mb. E.g. {config.SERVICES_EXAMPLE}",
    )
    runtime_command = JSONListField(
        '["sh", "-c", "make test"]',
        required=False,
        help_text='A JSON list of arguments, e.g. ["sh", "-c", "make test"], used by agents'
        " without a command of their own; empty: the Claude runtime on the task.",
    )

    class Meta:
        model = Workplace
        fields = ["organisation", "name", "description", "image", "services", "runtime_command"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        packages = self.instance.packages or {}
        for ecosystem in config.ECOSYSTEMS:
            self.fields[f"packages_{ecosystem}"].initial = packages.get(ecosystem, [])

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        organisation = data.get("organisation")
        if self.instance.pk and organisation and organisation.pk != self.instance.organisation_id:
            self.add_error("organisation", "A workplace cannot move to another organisation.")
        packages: dict[str, list[str]] = {}
        for ecosystem in config.ECOSYSTEMS:
            given = data.pop(f"packages_{ecosystem}", [])
            try:
                packages.update(config.check_packages({ecosystem: given} if given else {}))
            except ValueError as exc:
                self.add_error(f"packages_{ecosystem}", str(exc))
        data["packages"] = packages
        if "services" in data:
            try:
                data["services"] = config.check_services(data["services"])
            except ValueError as exc:
                self.add_error("services", str(exc))
        if "runtime_command" in data:
            try:
                data["runtime_command"] = config.check_command(
                    data["runtime_command"], "the runtime command", empty=True
                )
            except ValueError as exc:
                self.add_error("runtime_command", str(exc))
        return data


if not {f"packages_{e}" for e in config.ECOSYSTEMS} <= set(WorkplaceForm.base_fields):
    raise ImportError("WorkplaceForm lacks a packages field of an ecosystem in config.ECOSYSTEMS")


class WorkplaceVersionInline(VersionInline):
    model = WorkplaceVersion


@admin.register(Workplace)
class WorkplaceAdmin(TenantScoped, admin.ModelAdmin):
    form = WorkplaceForm
    list_display = ["name", "organisation", "image", "version", "service_names", "updated_at"]
    list_filter = ["organisation"]
    list_select_related = ["organisation"]
    search_fields = ["name", "image", "organisation__name"]
    readonly_fields = ["version", "created_at", "updated_at"]
    inlines = [WorkplaceVersionInline]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = ["organisation", "name", "description", "image"]
        fields += [f"packages_{e}" for e in config.ECOSYSTEMS]
        return [*fields, "services", "runtime_command", *self.readonly_fields]

    @admin.display(description="Services")
    def service_names(self, obj: Workplace) -> str:
        return ", ".join(service["name"] for service in obj.services) or "—"

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: Any = None
    ) -> HttpResponse:
        """A workplace's history is its versions: who changed what, when."""
        url = reverse("admin:workplaces_workplaceversion_changelist")
        return HttpResponseRedirect(f"{url}?{urlencode({'workplace__id__exact': object_id})}")

    def save_model(self, request: HttpRequest, obj: Workplace, form: Any, change: bool) -> None:
        # Through the service, so the change is versioned like one made in the API.
        data = {field: form.cleaned_data[field] for field in WORKPLACE_FIELDS}
        if change:
            saved = services.update_workplace(obj, by=request.user, **data)
        else:
            organisation = form.cleaned_data["organisation"]
            saved = services.create_workplace(
                organisation, data.pop("name"), data.pop("image"), by=request.user, **data
            )
        obj.pk, obj.version = saved.pk, saved.version


@admin.register(WorkplaceVersion)
class WorkplaceVersionAdmin(VersionAdmin):
    parent = "workplace"
    list_display = ["workplace", "number", "created_by", "created_at", "changes_shown"]
    list_filter = ["workplace__organisation", "workplace"]
    list_select_related = ["workplace__organisation", "created_by"]
    search_fields = ["workplace__name"]
