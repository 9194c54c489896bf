"""Admin for connections: made and changed by an organisation's admins, read by its members;
the credential is typed once (when made, and to rotate it) and never shown. And the record of
the requests agents made with them (read by every member, written by the gateway only)."""

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from connections import services
from connections.models import CONNECTION_FIELDS, Connection, CredentialedRequest
from covey.display import moment
from organisations.admin import TenantScoped
from organisations.readonly import ReadOnlyAdmin


class WriteOnlyTextarea(forms.Textarea):
    """A box for a secret (a key is several lines): what was typed is never sent back, not
    even when the form returns with an error, and is not shown while it is typed."""

    def format_value(self, value: Any) -> None:
        return None


class ConnectionForm(forms.ModelForm):
    credential = forms.CharField(
        required=False,
        strip=False,
        widget=WriteOnlyTextarea(
            attrs={"rows": 3, "autocomplete": "off", "style": "-webkit-text-security: disc"}
        ),
        help_text="A GitHub App's private key (PEM), a token or a password. Kept encrypted and"
        " never shown again; on a connection that exists, typing one here rotates it.",
    )

    class Meta:
        model = Connection
        fields = list(CONNECTION_FIELDS)

    def clean(self) -> dict[str, Any]:
        """The service's own checks, so that what it would refuse is said on the form."""
        data = super().clean() or {}
        secret = data.get("credential") or None
        if self.instance.pk is None and secret is None:
            self.add_error("credential", "Give the credential.")
        if self.instance.pk is not None:
            if data.get("kind") and data["kind"] != self.instance.kind:
                self.add_error("kind", "A connection keeps its kind: make another.")
            organisation = data.get("organisation")
            if organisation and organisation.pk != self.instance.organisation_id:
                self.add_error("organisation", "A connection cannot move to another organisation.")
        if self.errors or "organisation" not in data:
            return data
        given = {name: data.get(name) for name in CONNECTION_FIELDS}
        candidate = Connection(pk=self.instance.pk, **given)
        if self.instance.pk is None:
            services.with_defaults(candidate)
        for field, told in services.problems(candidate, secret).items():
            field = "credential" if field == "secret" else field
            for text in told:
                self.add_error(field if field in self.fields else None, text)
        return data


@admin.register(Connection)
class ConnectionAdmin(TenantScoped, admin.ModelAdmin):
    form = ConnectionForm
    list_display = ["name", "organisation", "kind", "host_shown", "secret_set_at", "status_shown"]
    list_filter = ["kind", "organisation"]
    list_select_related = ["organisation"]
    search_fields = ["name", "git_url", "api_url", "index_url"]
    readonly_fields = ["host_shown", "secret_set_at", "status_shown", "created_at", "updated_at"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        typed = ["credential"] if self.has_change_permission(request, obj) else []
        return [*CONNECTION_FIELDS, *typed, *self.readonly_fields]

    @admin.display(description="Host")
    def host_shown(self, obj: Connection) -> str:
        return obj.host or "—"

    @admin.display(description="Status")
    def status_shown(self, obj: Connection) -> str:
        if not obj.status:
            return "no refusal seen"
        return f"{obj.status} ({obj.status_at:%Y-%m-%d %H:%M} UTC)" if obj.status_at else obj.status

    def save_model(self, request: HttpRequest, obj: Connection, form: Any, change: bool) -> None:
        data = form.cleaned_data
        fields = {name: data[name] for name in services.CHANGEABLE}
        try:
            if not change:
                made = services.create_connection(
                    data["organisation"],
                    fields.pop("name"),
                    data["kind"],
                    data["credential"],
                    by=request.user,
                    **fields,
                )
                obj.pk = made.pk
                return
            services.update_connection(obj, by=request.user, **fields)
            if data.get("credential"):
                services.rotate_secret(obj, data["credential"], by=request.user)
                messages.success(request, f"The credential of {obj.name} was rotated.")
        except ValidationError as exc:  # changed meanwhile: the form checked what it could
            messages.error(request, "; ".join(exc.messages))

    def get_actions(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        actions = super().get_actions(request, *args, **kwargs)
        actions.pop("delete_selected", None)  # one at a time: grants may name it
        return actions

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> Any:
        """Refused, saying which agents' grants name it, while any does."""
        found = self.get_object(request, object_id)
        if found is not None and (users := services.granted_to(found)):
            messages.error(
                request,
                f"{found.name} is named by the grants of {', '.join(users)}: remove those first.",
            )
            return HttpResponseRedirect(
                reverse("admin:connections_connection_change", args=[found.pk])
            )
        return super().delete_view(request, object_id, extra_context)

    def delete_model(self, request: HttpRequest, obj: Connection) -> None:
        services.delete_connection(obj, by=request.user)


SERVICES = {"git-upload-pack": "fetch", "git-receive-pack": "push"}  # as people say them


class OutcomeFilter(admin.SimpleListFilter):
    title = "outcome"
    parameter_name = "outcome"

    def lookups(self, request: HttpRequest, model_admin: Any) -> Any:
        return [("refused", "Refused or failed"), ("passed", "Passed")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "refused":
            return queryset.exclude(refused="")
        if self.value() == "passed":
            return queryset.filter(refused="")
        return queryset


@admin.register(CredentialedRequest)
class CredentialedRequestAdmin(ReadOnlyAdmin, TenantScoped, admin.ModelAdmin):
    """The record of what agents did with connections' credentials: every request the gateway
    took for them, refused ones standing out."""

    list_display = [
        "at_shown", "agent", "run_shown", "connection", "method", "request_shown", "status",
        "outcome_shown",
    ]  # fmt: skip
    list_filter = [OutcomeFilter, "organisation", "service", "connection"]
    list_select_related = ["agent", "connection", "run"]
    search_fields = ["repository", "host", "agent__name", "refused"]
    date_hierarchy = "at"
    fields = [
        "at_shown", "organisation", "agent", "run_shown", "connection", "method", "host",
        "repository", "service", "path", "status", "outcome_shown", "refs_shown",
    ]  # fmt: skip
    readonly_fields = ["at_shown", "run_shown", "outcome_shown", "refs_shown"]

    at_shown = moment("at", "At", ordered=True)

    @admin.display(description="Run")
    def run_shown(self, obj: CredentialedRequest) -> str:
        if obj.run_id is None:
            return "-"
        url = reverse("admin:runs_run_change", args=[obj.run_id])
        return format_html('<a href="{}">{}</a>', url, str(obj.run_id)[:8])

    @admin.display(description="Request")
    def request_shown(self, obj: CredentialedRequest) -> str:
        if obj.path:  # an API call
            return f"{obj.method} {obj.host}{obj.path}"
        return f"{SERVICES.get(obj.service, obj.service)} {obj.host}/{obj.repository}"

    @admin.display(description="Outcome")
    def outcome_shown(self, obj: CredentialedRequest) -> str:
        if not obj.refused:
            return "passed"
        return format_html(
            '<span style="color: #ba2121; font-weight: bold">refused</span>: {}', obj.refused
        )

    @admin.display(description="Refs")
    def refs_shown(self, obj: CredentialedRequest) -> str:
        if not obj.refs:
            return "-"
        return format_html(
            "<table><tr><th>Ref</th><th>Old</th><th>New</th><th>Outcome</th></tr>{}</table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td><code>{}</code></td><td><code>{}</code></td><td>{}</td></tr>",
                (
                    (r["ref"], r["old"][:12], r["new"][:12], r["refused"] or "passed")
                    for r in obj.refs
                ),
            ),
        )


def requests_link(queryset: QuerySet[CredentialedRequest], **query: Any) -> str:
    """'N request(s), M refused' linking to the record filtered by ``query``."""
    counted = queryset.aggregate(n=Count("pk"), refused=Count("pk", filter=~Q(refused="")))
    if not counted["n"]:
        return "none"
    url = reverse("admin:connections_credentialedrequest_changelist") + "?" + urlencode(query)
    return format_html(
        '<a href="{}">{} request(s), {} refused</a>', url, counted["n"], counted["refused"]
    )
