"""Admin for organisations and their members, written for operators."""

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import NotRelationField, get_fields_from_path
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db.models import Count, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html_join
from simple_history.admin import SimpleHistoryAdmin

from organisations import services, webhooks
from organisations.models import Membership, Organisation, TenantQuerySet, Webhook


def _when(moment: Any) -> str:
    return f"{timezone.localtime(moment):%Y-%m-%d %H:%M:%S %Z}"


class TenantScoped:
    """An admin whose rows are those of the user's organisations (every row for a superuser),
    as the API's: lists, pages, actions and the views an admin adds all start from it."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).for_user(request.user)  # type: ignore[misc]

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        """A choice of an organisation's row (its organisation, agent, runner, workplace)
        offers the user's organisations' rows only: a plain one names every organisation's,
        and a posted id of another's is not a valid choice."""
        _scope_choices(self, db_field, request, kwargs)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)  # type: ignore[misc]

    def formfield_for_manytomany(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        _scope_choices(self, db_field, request, kwargs)
        return super().formfield_for_manytomany(db_field, request, **kwargs)  # type: ignore[misc]

    def get_list_filter(self, request: HttpRequest) -> Any:
        """A filter by a related row offers only the rows the user's list refers to (a plain
        one would name every organisation's runners and agents)."""
        filters = super().get_list_filter(request)  # type: ignore[misc]
        return [_related_only(self.model, item) for item in filters]  # type: ignore[attr-defined]


def _scope_choices(model_admin: Any, db_field: Any, request: HttpRequest, kwargs: Any) -> None:
    if "queryset" in kwargs:
        return
    related = db_field.remote_field.model
    queryset = model_admin.get_field_queryset(kwargs.get("using"), db_field, request)
    if queryset is None:
        queryset = related._default_manager.all()
    if isinstance(queryset, TenantQuerySet):
        kwargs["queryset"] = queryset.for_user(request.user)


def _related_only(model: Any, item: Any) -> Any:
    """A filter by a related row, directly or across relations (``agent__organisation``),
    offers only the rows the list refers to."""
    if not isinstance(item, str):
        return item
    try:
        field = get_fields_from_path(model, item)[-1]
    except (FieldDoesNotExist, NotRelationField):
        return item
    return (item, admin.RelatedOnlyFieldListFilter) if field.is_relation else item


class OrganisationForm(forms.ModelForm):
    """The organisation, and where its events go (its webhook: not a field of the model)."""

    webhook_url = forms.URLField(
        label="Webhook URL",
        required=False,
        assume_scheme="https",
        max_length=500,
        help_text="Requests waiting for a decision, decisions, and budgets reaching their alert"
        " thresholds are POSTed here as JSON signed with a secret shown once when it is made"
        " (X-Covey-Signature). Empty: none.",
    )
    new_webhook_secret = forms.BooleanField(
        label="Make a new signing secret",
        required=False,
        help_text="The old one stops signing at once; the new one is shown once, after saving.",
    )

    class Meta:
        model = Organisation
        fields = ["name", "slug", "base_allowlist", "request_expiry_minutes"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        found = Webhook.objects.filter(organisation_id=self.instance.pk).first()
        if self.instance.pk and found is not None:
            self.fields["webhook_url"].initial = found.url

    def clean_webhook_url(self) -> str:
        url = str(self.cleaned_data.get("webhook_url") or "")
        if url and not url.startswith(("http://", "https://")):
            raise ValidationError("Give an http or https URL.")
        return url


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Organisation)
class OrganisationAdmin(SimpleHistoryAdmin):
    """Organisations are made and changed through the same service as in the API: a new one
    starts with the base allowlist (COVEY_EGRESS_BASE_ALLOWLIST, shown filled in), gets its
    built-in runner, and its creator becomes its admin."""

    form = OrganisationForm
    list_display = ["name", "slug", "base_allowlist_size", "agent_count", "created_at"]
    search_fields = ["name", "slug"]
    inlines = [MembershipInline]
    history_list_display = ["base_allowlist"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is None:
            return ["created_at"]
        return ["slug", "webhook_state", "belongings", "created_at"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = ["name", "slug", "base_allowlist", "request_expiry_minutes", "webhook_url"]
        if obj is not None:
            fields += ["new_webhook_secret", "webhook_state", "belongings"]
        return [*fields, "created_at"]

    @admin.display(description="Its")
    def belongings(self, obj: Organisation) -> str:
        """Links to its agents, runners and runs (the apps above name them; the admin's URL
        names are all this needs of them)."""
        lists = (
            ("agents_agent", "organisation__id__exact", f"{obj.agents.count()} agent(s)"),
            ("runners_runner", "organisation__id__exact", f"{obj.runners.count()} runner(s)"),
            ("runs_run", "agent__organisation__id__exact", "runs"),
        )
        return format_html_join(
            ", ",
            '<a href="{}?{}={}">{}</a>',
            (
                (reverse(f"admin:{name}_changelist"), lookup, obj.pk, text)
                for name, lookup, text in lists
            ),
        )

    @admin.display(description="Webhook")
    def webhook_state(self, obj: Organisation) -> str:
        found = Webhook.objects.filter(organisation=obj).first()
        if found is None:
            return "none"
        made = f"signing secret made {_when(found.secret_made_at)}"
        if not found.last_delivery_at:
            return f"{made}; nothing sent yet"
        return f"{made}; last delivery {_when(found.last_delivery_at)}: {found.last_delivery}"

    def get_prepopulated_fields(self, request: HttpRequest, obj: Any = None) -> dict[str, Any]:
        return {"slug": ["name"]} if obj is None else {}

    def save_model(self, request: HttpRequest, obj: Organisation, form: Any, change: bool) -> None:
        data = form.cleaned_data
        if change:
            fields = ("name", "base_allowlist", "request_expiry_minutes")
            changes = {f: data[f] for f in fields if f in form.changed_data}
            services.update_organisation(obj, by=request.user, **changes)
        else:
            created = services.create_organisation(
                data["name"],
                by=request.user,
                slug=data["slug"],
                base_allowlist=data["base_allowlist"],
                request_expiry_minutes=data.get("request_expiry_minutes"),
            )
            obj.pk, obj.created_at = created.pk, created.created_at
            obj.updated_at = created.updated_at
            obj._state.adding = False
        self._save_webhook(request, obj, data)

    def _save_webhook(self, request: HttpRequest, obj: Organisation, data: dict[str, Any]) -> None:
        url = data.get("webhook_url") or ""
        if not url:
            if webhooks.remove_webhook(obj):
                self.message_user(request, "The webhook was removed.", messages.INFO)
            return
        secret = webhooks.set_webhook(obj, url, new_secret=bool(data.get("new_webhook_secret")))
        if secret is not None:
            self.message_user(
                request,
                f"Webhook signing secret (shown once; the receiver checks X-Covey-Signature"
                f" with it): {secret}",
                messages.WARNING,
            )

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        if formset.model is not Membership or change:
            super().save_formset(request, form, formset, change)
            return
        # A new organisation's creator is a member already (the service made them admin): a
        # row for them in the inline sets their role instead of adding them twice.
        for member in formset.save(commit=False):
            existing = Membership.objects.filter(
                organisation_id=member.organisation_id, user_id=member.user_id
            ).first()
            if existing is not None and existing.pk != member.pk:
                existing.role = member.role
                existing.save(update_fields=["role"])
            else:
                member.save()
        for member in formset.deleted_objects:
            member.delete()

    def delete_model(self, request: HttpRequest, obj: Organisation) -> None:
        services.delete_organisation(obj, by=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Organisation]) -> None:
        for organisation in queryset:
            services.delete_organisation(organisation, by=request.user)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Organisation]:
        return super().get_queryset(request).annotate(agent_total=Count("agents"))

    @admin.display(description="Base entries")
    def base_allowlist_size(self, obj: Organisation) -> int:
        return len(obj.base_allowlist)

    @admin.display(description="Agents", ordering="agent_total")
    def agent_count(self, obj: Any) -> int:
        return int(obj.agent_total)


@admin.register(Membership)
class MembershipAdmin(SimpleHistoryAdmin):
    list_display = ["user", "organisation", "role"]
    list_filter = ["role", "organisation"]
    list_select_related = ["user", "organisation"]
    search_fields = ["user__username", "user__email", "organisation__name"]
    autocomplete_fields = ["user", "organisation"]
