"""Admin for organisations and their members, written for operators."""

from contextlib import contextmanager
from typing import Any, cast

from django import forms
from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.exceptions import NotRegistered
from django.contrib.admin.utils import NotRelationField, get_fields_from_path, unquote
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.forms import UserChangeForm
from django.core.exceptions import FieldDoesNotExist, PermissionDenied, ValidationError
from django.db.models import Count, QuerySet
from django.forms.fields import InvalidJSONInput
from django.http import Http404, HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from rest_framework.authtoken.admin import TokenAdmin
from rest_framework.authtoken.models import TokenProxy
from simple_history.admin import SimpleHistoryAdmin

import jsonbodies
from organisations import services, webhooks
from organisations.models import (
    ApiToken,
    Membership,
    Organisation,
    Role,
    TenantQuerySet,
    Webhook,
)
from organisations.roles import (
    has_role_somewhere,
    member_now,
    organisation_of,
    role_of,
    roles_at_least,
    roles_said,
)


def _when(moment: Any) -> str:
    return f"{timezone.localtime(moment):%Y-%m-%d %H:%M:%S %Z}"


DOING = {"add": "Adding", "change": "Changing", "delete": "Deleting", "view": "Reading"}


class RoleRefusals:
    """An admin that says why it refuses: a bare PermissionDenied from Django's views becomes
    one that names the role that would do and the roles the person holds (covey's 403 page
    shows it)."""

    # Who changes this model's rows: a role of the row's organisation, or None for the
    # platform team alone (rows of no organisation: templates, prices).
    change_role: Role | None = Role.ADMIN
    record = False  # rows nobody adds, changes or deletes here (versions, logs, audits)

    @contextmanager
    def _saying_why(self, request: HttpRequest, action: str, object_id: Any = None) -> Any:
        try:
            yield
        except PermissionDenied as exc:
            if exc.args:
                raise
            raise PermissionDenied(self.refusal(request, action, object_id)) from None

    def refusal(self, request: HttpRequest, action: str, object_id: Any = None) -> str:
        """Why ``action`` (add, change, delete, view) is refused, in a sentence."""
        opts = self.model._meta  # type: ignore[attr-defined]
        what = f"{DOING[action]} {opts.verbose_name_plural}"
        if action == "view":
            needed = "membership of an organisation"
        elif self.change_role is None:
            needed = "the platform team (a superuser)"
        else:
            found = self.get_object(request, unquote(str(object_id))) if object_id else None  # type: ignore[attr-defined]
            place = organisation_of(found) if found is not None else None
            where = f"in {place}" if place is not None else "in their organisation"
            needed = f"the {self.change_role.label.lower()} role {where}"
        return f"{what} takes {needed}; you are {roles_said(request.user)}."

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: Any = None,
        form_url: str = "",
        extra_context: Any = None,
    ) -> Any:
        action = "add" if object_id is None else "change"
        with self._saying_why(request, action, object_id):
            return super().changeform_view(request, object_id, form_url, extra_context)  # type: ignore[misc]

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> Any:
        with self._saying_why(request, "delete", object_id):
            return super().delete_view(request, object_id, extra_context)  # type: ignore[misc]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        with self._saying_why(request, "view"):
            return super().changelist_view(request, extra_context)  # type: ignore[misc]

    def history_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> Any:
        """A row's history: of a row the person may read (simple_history would also show a
        row of another organisation, found in its history table)."""
        # The platform team also reads the history of deleted rows.
        found = self.get_object(request, unquote(object_id))  # type: ignore[attr-defined]
        if found is None and not request.user.is_superuser:
            raise Http404("no such row")
        with self._saying_why(request, "view", object_id):
            return super().history_view(request, object_id, extra_context)  # type: ignore[misc]

    def has_module_permission(self, request: HttpRequest) -> bool:
        """Every member reads covey's pages: the roles, not Django's staff flag, say so."""
        return member_now(request) or super().has_module_permission(request)  # type: ignore[misc]

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Members read their organisations' rows (and rows of none: templates, prices)."""
        if obj is not None and not request.user.is_superuser:
            place = organisation_of(obj)
            if place is not None and role_of(request.user, place) is None:
                return False
        return member_now(request) or super().has_view_permission(request, obj)  # type: ignore[misc]

    def history_form_view(
        self, request: HttpRequest, object_id: str, version_id: str, extra_context: Any = None
    ) -> Any:
        """A past version (simple_history's page): of a row the person may read, found through
        the scoped queryset; saving it back (a revert) takes changing the row."""
        found = self.get_object(request, unquote(object_id))  # type: ignore[attr-defined]
        if found is None and not request.user.is_superuser:  # who also reads deleted rows'
            raise Http404("no such row")
        changing = request.method != "GET" and found is not None
        if changing and not self.has_change_permission(request, found):  # type: ignore[attr-defined]
            raise PermissionDenied(self.refusal(request, "change", object_id))
        return super().history_form_view(request, object_id, version_id, extra_context)  # type: ignore[misc]


class PlatformOwned(RoleRefusals):
    """Rows of no organisation that every member reads and only the platform team changes
    (allowlist templates, prices)."""

    change_role = None


class TenantScoped(RoleRefusals):
    """An admin whose rows are those of the user's organisations (every row for a superuser),
    as the API's: lists, pages, actions and the views an admin adds all start from it. Every
    member reads them; ``change_role`` (admin) of a row's organisation adds, changes and
    deletes, as in the API. Neither Django's staff flag nor its per-user permissions are
    needed: membership is the permission."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).for_user(request.user)  # type: ignore[misc]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return self._role_allows(request, None)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._role_allows(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._role_allows(request, obj)

    def _role_allows(self, request: HttpRequest, obj: Any) -> bool:
        """The change role in the row's organisation; with no row, in some organisation. A
        record (``record``: versions, decisions, audits) is changed by nobody."""
        if self.record:
            return False
        if self.change_role is None:
            return bool(request.user.is_superuser)
        if obj is None:
            return has_role_somewhere(request.user, self.change_role)
        place = organisation_of(obj)
        role = role_of(request.user, place) if place is not None else None
        return role is not None and role in roles_at_least(self.change_role)

    def save_form(self, request: HttpRequest, form: Any, change: bool) -> Any:
        """The row as the form would save it, refused unless the person may change rows of
        its organisation (a posted choice is checked by the form; this holds whatever the
        admin's own save does)."""
        found = super().save_form(request, form, change)  # type: ignore[misc]
        place = organisation_of(found)
        if place is not None and place.pk is not None and not self._role_allows(request, found):
            raise PermissionDenied(self.refusal(request, "change" if change else "add"))
        return found

    def changeable(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """The rows of ``queryset`` the person may change: those of the organisations where
        they hold ``change_role`` (a list mixes those with others they only read)."""
        if self.record or self.change_role is None:
            return queryset if request.user.is_superuser and not self.record else queryset.none()
        if request.user.is_superuser:
            return queryset
        enough = roles_at_least(self.change_role)
        mine = Membership.objects.filter(user_id=cast(int, request.user.pk), role__in=enough)
        prefix = queryset.membership_lookup.removesuffix("memberships__user")  # type: ignore[attr-defined]
        return queryset.filter(**{f"{prefix}pk__in": mine.values("organisation_id")})

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> Any:
        """An action that changes rows (``change`` or ``delete`` permission) acts on the
        selected rows the person may change; the others are left alone, and they are told."""
        # Every action named counts (Django picks one by an index it parses its own way).
        actions = self.get_actions(request)  # type: ignore[attr-defined]
        needs = set()
        for name in request.POST.getlist("action"):
            if (found := actions.get(name)) is not None:
                needs |= set(getattr(found.func, "allowed_permissions", ()))
        if needs & {"change", "delete"}:
            narrowed = self.changeable(request, queryset)
            chosen = _pks(queryset, request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))
            every = request.POST.get("select_across", "0") == "1"
            picked = queryset if every else queryset.filter(pk__in=chosen)
            left = picked.count() - narrowed.filter(pk__in=picked.values("pk")).count()
            if left:
                self.message_user(  # type: ignore[attr-defined]
                    request,
                    f"{left} selected row(s) left alone: {self.refusal(request, 'change')}",
                    messages.WARNING,
                )
            queryset = narrowed
        return super().response_action(request, queryset, *args, **kwargs)  # type: ignore[misc]

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


class MembersRead:
    """An inline every member reads on the page it belongs to (the page is scoped already)."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return member_now(request) or super().has_view_permission(request, obj)  # type: ignore[misc]


def may_view(request: HttpRequest, model: str) -> bool:
    """Whether the person may read the admin's list of ``model`` ("app.model"): their roles
    say, through the model's admin."""
    try:
        found = admin.site.get_model_admin(apps.get_model(model))
    except (LookupError, NotRegistered):
        return False
    return bool(found.has_view_permission(request))


class StrictJSONField(forms.JSONField):
    """A form's JSON text read as covey reads every client body (jsonbodies): nesting past
    its depth, NaN or a lone surrogate is a form error, not a 500 or a stored oddity."""

    def to_python(self, value: Any) -> Any:
        if isinstance(value, str) and value.strip():
            try:
                jsonbodies.loads(value)
            except jsonbodies.Malformed as exc:  # the field's own words, then where and why
                said = ValidationError(self.error_messages["invalid"], "invalid", {"value": value})
                why = ValidationError(f"Not JSON covey takes: {exc}.")
                raise ValidationError([said, why]) from None
        return super().to_python(value)

    def bound_data(self, data: Any, initial: Any) -> Any:
        """What the form shows again: the text as posted when it is not JSON covey takes."""
        if isinstance(data, str) and data.strip():
            try:
                jsonbodies.loads(data)
            except jsonbodies.Malformed:
                return InvalidJSONInput(data)
        return super().bound_data(data, initial)


def _pks(queryset: QuerySet[Any], values: list[str]) -> list[Any]:
    """The posted ids that are ids of the model (a hostile form posts anything)."""
    field, found = queryset.model._meta.pk, []
    for value in values:
        try:
            found.append(field.to_python(value))
        except ValidationError:
            continue
    return found


def _scope_choices(model_admin: Any, db_field: Any, request: HttpRequest, kwargs: Any) -> None:
    if "queryset" in kwargs:
        return
    related = db_field.remote_field.model
    queryset = model_admin.get_field_queryset(kwargs.get("using"), db_field, request)
    if queryset is None:
        queryset = related._default_manager.all()
    if isinstance(queryset, TenantQuerySet):
        # Rows of the organisations where the person may change things: an admin of one
        # and viewer of another adds nothing to the other.
        kwargs["queryset"] = model_admin.changeable(request, queryset.for_user(request.user))


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
        fields = ["name", "slug", "base_allowlist", "request_expiry_minutes", "own_requests"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "own_requests" in self.fields:  # not on a page its reader may not change
            self.fields["own_requests"].required = False
        found = Webhook.objects.filter(organisation_id=self.instance.pk).first()
        if self.instance.pk and found is not None:
            self.fields["webhook_url"].initial = found.url

    def clean_own_requests(self) -> str:
        """Not posted (a script's form): the organisation's setting stays as it is."""
        return str(self.cleaned_data.get("own_requests") or self.instance.own_requests)

    def clean_webhook_url(self) -> str:
        """Refused on saving, as in the API, where a delivery would be refused (a private
        address the platform team did not allow)."""
        url = str(self.cleaned_data.get("webhook_url") or "")
        if not url:
            return url
        try:
            return webhooks.check_url(url)
        except ValidationError as exc:
            text = "; ".join(exc.messages)
            raise ValidationError(f"{text[:1].upper()}{text[1:]}.") from None


def _administers(request: HttpRequest, organisation: Organisation | None) -> bool:
    """Whether the user is an admin of the organisation (superusers are everywhere): who may
    change it and its memberships, as in the API."""
    return organisation is None or role_of(request.user, organisation) == Role.ADMIN


class MembershipFormSet(forms.BaseInlineFormSet):
    """An organisation's members as its page edits them: one that has an admin keeps one."""

    creator: Any = None  # who is making the organisation (the service makes them its admin)

    def clean(self) -> None:
        super().clean()
        roles: dict[Any, Any] = {}
        if self.instance.pk:
            found = Membership.objects.filter(organisation_id=self.instance.pk)
            roles.update(found.values_list("user_id", "role"))
        elif self.creator is not None:
            roles[self.creator.pk] = Role.ADMIN
        had_one = Role.ADMIN in roles.values()
        for form in self.forms:
            user = form.cleaned_data.get("user") if hasattr(form, "cleaned_data") else None
            if user is None:
                continue
            if form.cleaned_data.get("DELETE"):
                roles.pop(user.pk, None)
            else:
                if form.instance.pk and form.initial.get("user") not in (None, user.pk):
                    roles.pop(form.initial["user"], None)  # the row now names someone else
                roles[user.pk] = form.cleaned_data.get("role")
        if had_one and Role.ADMIN not in roles.values():
            raise ValidationError(services.LAST_ADMIN)


class MemberField(forms.ModelChoiceField):
    """A member named by their user name, as in the API: a list to choose from would show an
    organisation's admin every organisation's people."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            queryset=get_user_model().objects.filter(is_active=True),
            to_field_name="username",
            widget=forms.TextInput(attrs={"autocomplete": "off", "size": 20}),
            help_text="Their user name.",
            error_messages={"invalid_choice": "No active user has this user name."},
            required=kwargs.get("required", True),
            label=kwargs.get("label", "User"),
        )

    def prepare_value(self, value: Any) -> Any:
        """A row's user is shown by name (its initial value is the user's id)."""
        if isinstance(value, int):
            found = get_user_model().objects.filter(pk=value).first()
            return found.get_username() if found is not None else value
        return super().prepare_value(value)


class MembershipInline(admin.TabularInline):
    """Members and their roles, changed by the organisation's admins through the same service
    as the API (an organisation keeps at least one admin); every member sees them."""

    model = Membership
    formset = MembershipFormSet
    extra = 0

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        if db_field.name == "user":
            return MemberField()
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_formset(self, request: HttpRequest, obj: Any = None, **kwargs: Any) -> Any:
        formset: Any = super().get_formset(request, obj, **kwargs)
        formset.creator = request.user if obj is None else None
        return formset

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return member_now(request)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _administers(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _administers(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return _administers(request, obj)


@admin.register(Organisation)
class OrganisationAdmin(TenantScoped, SimpleHistoryAdmin):
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
        return ["slug", "base_allowlist_shown", "webhook_state", "belongings", "created_at"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is not None and not self.has_change_permission(request, obj):
            # What a member who may not change it reads: no form-only boxes (they would read
            # "None"), the allowlist one entry a line, the webhook's state but not its URL.
            return [
                "name", "slug", "base_allowlist_shown", "request_expiry_minutes",
                "own_requests", "webhook_state", "belongings", "created_at",
            ]  # fmt: skip
        fields = [
            "name", "slug", "base_allowlist", "request_expiry_minutes", "own_requests",
            "webhook_url",
        ]  # fmt: skip
        if obj is not None:
            fields += ["new_webhook_secret", "webhook_state", "belongings"]
        return [*fields, "created_at"]

    @admin.display(description="Base allowlist")
    def base_allowlist_shown(self, obj: Organisation) -> str:
        return format_html_join(mark_safe("<br>"), "{}", ((entry,) for entry in obj.base_allowlist))

    @admin.display(description="Its")
    def belongings(self, obj: Organisation) -> str:
        """Links to its agents, runners, runs and connections, and its credential history (the
        apps above name them; the admin's URL names are all this needs of them)."""
        lists = (
            ("agents_agent", "organisation__id__exact", f"{obj.agents.count()} agent(s)"),
            ("runners_runner", "organisation__id__exact", f"{obj.runners.count()} runner(s)"),
            ("runs_run", "agent__organisation__id__exact", "runs"),
        )
        return format_html(
            '{}, <a href="{}?organisation__id__exact={}">connections</a> (<a href="{}">their'
            " history, and grants'</a>)",
            format_html_join(
                ", ",
                '<a href="{}?{}={}">{}</a>',
                (
                    (reverse(f"admin:{name}_changelist"), lookup, obj.pk, text)
                    for name, lookup, text in lists
                ),
            ),
            reverse("admin:connections_connection_changelist"),
            obj.pk,
            reverse("admin:agents_agent_credential_history", args=[obj.pk]),
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
            fields = ("name", "base_allowlist", "request_expiry_minutes", "own_requests")
            changes = {f: data[f] for f in fields if f in form.changed_data}
            services.update_organisation(obj, by=request.user, **changes)
        else:
            created = services.create_organisation(
                data["name"],
                by=request.user,
                slug=data["slug"],
                base_allowlist=data["base_allowlist"],
                request_expiry_minutes=data.get("request_expiry_minutes"),
                own_requests=data.get("own_requests") or None,
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
        if formset.model is not Membership:
            super().save_formset(request, form, formset, change)
            return
        save_members(formset, form.instance, request.user)

    def delete_model(self, request: HttpRequest, obj: Organisation) -> None:
        services.delete_organisation(obj, by=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Organisation]) -> None:
        for organisation in queryset:
            services.delete_organisation(organisation, by=request.user)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Organisation]:
        """The user's organisations (every one for a superuser), as the API's, by name (a
        counting query has no default order: the autocomplete's pages need one)."""
        counted = super().get_queryset(request).annotate(agent_total=Count("agents"))
        return counted.order_by("name", "pk")

    def has_add_permission(self, request: HttpRequest) -> bool:
        """Making organisations is the platform team's (as in the API)."""
        return bool(request.user.has_perm("organisations.add_organisation"))

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.has_perm("organisations.delete_organisation"))

    def refusal(self, request: HttpRequest, action: str, object_id: Any = None) -> str:
        if action in ("add", "delete"):
            return (
                f"{DOING[action]} organisations is for the platform team (a superuser);"
                f" you are {roles_said(request.user)}."
            )
        return super().refusal(request, action, object_id)

    @admin.display(description="Base entries")
    def base_allowlist_size(self, obj: Organisation) -> int:
        return len(obj.base_allowlist)

    @admin.display(description="Agents", ordering="agent_total")
    def agent_count(self, obj: Any) -> int:
        return int(obj.agent_total)


def save_members(formset: Any, organisation: Organisation, by: Any) -> None:
    """An organisation page's member rows, through the services (as the API): a new
    organisation's creator is a member already (its admin), so a row naming them sets their
    role; the admins' count is checked by the form set before, and by the services again, so
    who becomes an admin is saved first."""
    rows = sorted(formset.save(commit=False), key=lambda m: m.role != Role.ADMIN)
    for member in rows:
        existing = Membership.objects.filter(
            organisation_id=organisation.pk, user_id=member.user_id
        ).first()
        if existing is not None:
            if existing.role != member.role:
                services.change_role(existing, member.role, by=by)
            if member.pk and member.pk != existing.pk:  # the row now names someone else
                services.remove_member(Membership.objects.get(pk=member.pk), by=by)
        elif member.pk:
            services.remove_member(Membership.objects.get(pk=member.pk), by=by)
            services.add_member(organisation, member.user, member.role, by=by)
        else:
            services.add_member(organisation, member.user, member.role, by=by)
    for member in formset.deleted_objects:
        if Membership.objects.filter(pk=member.pk).exists():
            services.remove_member(member, by=by)


class MembershipForm(forms.ModelForm):
    """A membership: who, where, in which role; an organisation keeps at least one admin."""

    class Meta:
        model = Membership
        fields = ["organisation", "user", "role"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        before = self.instance
        if before.pk and before.role == Role.ADMIN and data.get("role") != Role.ADMIN:
            others = Membership.objects.filter(
                organisation_id=before.organisation_id, role=Role.ADMIN
            ).exclude(pk=before.pk)
            if not others.exists():
                raise ValidationError({"role": services.LAST_ADMIN})
        return data


@admin.register(Membership)
class MembershipAdmin(TenantScoped, SimpleHistoryAdmin):
    """Who belongs to which of the user's organisations; their admins add, change and remove
    members through the same services as the API."""

    form = MembershipForm
    list_display = ["user", "organisation", "role"]
    list_filter = ["role", "organisation"]
    list_select_related = ["user", "organisation"]
    search_fields = ["user__username", "user__email", "organisation__name"]
    autocomplete_fields = ["organisation"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return ["organisation", "user"] if obj is not None else []

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        if db_field.name == "user":
            return MemberField()
        if db_field.name == "organisation" and not request.user.is_superuser:
            user_id = cast(int, request.user.pk)
            admin_of = Membership.objects.filter(user_id=user_id, role=Role.ADMIN)
            kwargs["queryset"] = Organisation.objects.filter(
                pk__in=admin_of.values("organisation_id")
            )
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        allowed = super().has_change_permission(request, obj)
        return allowed and _administers(request, obj.organisation if obj else None)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Its organisation's admins remove a member, but not the last admin."""
        allowed = super().has_delete_permission(request, obj)
        if not allowed or obj is None:
            return allowed
        if not _administers(request, obj.organisation):
            return False
        last = obj.role == Role.ADMIN and not (
            Membership.objects.filter(organisation_id=obj.organisation_id, role=Role.ADMIN)
            .exclude(pk=obj.pk)
            .exists()
        )
        return not last

    def save_model(self, request: HttpRequest, obj: Membership, form: Any, change: bool) -> None:
        if change:
            services.change_role(obj, obj.role, by=request.user)
        else:
            made = services.add_member(obj.organisation, obj.user, obj.role, by=request.user)
            obj.pk = made.pk
            obj._state.adding = False

    def delete_model(self, request: HttpRequest, obj: Membership) -> None:
        services.remove_member(obj, by=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Membership]) -> None:
        """The members chosen, one at a time; those the user may not remove (another's
        organisation, its last admin) stay, and the user is told which."""
        kept = []
        for membership in queryset.select_related("organisation", "user"):
            if not self.has_delete_permission(request, membership):
                kept.append(str(membership))
                continue
            try:
                services.remove_member(membership, by=request.user)
            except ValidationError:
                kept.append(str(membership))
        if kept:
            self.message_user(
                request,
                f"Not removed (an organisation keeps at least one admin, and only its admins"
                f" remove members): {', '.join(kept)}.",
                messages.ERROR,
            )


admin.site.unregister(TokenProxy)  # DRF's lists every key in full, to whoever may view tokens


@admin.register(ApiToken)
class ApiTokenAdmin(TokenAdmin):
    """Users' API tokens (``Authorization: Token …``): their first characters to recognise
    them, in a list with no page per token (its key is its primary key, which the admin writes
    into every link to it and every row's checkbox); the whole key once, after it is made.
    A token is replaced with ``manage.py drf_create_token -r USER``."""

    list_display = ("shown", "user", "created")
    list_display_links = None

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and super().has_view_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="Key")
    def shown(self, obj: ApiToken) -> str:
        return f"{obj.key[:4]}…"

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        if not change:
            self.message_user(
                request,
                f"API token of {obj.user} (shown once; send it as 'Authorization: Token …'):"
                f" {obj.key}",
                messages.WARNING,
            )


class UserForm(UserChangeForm):
    """Django's user form, saying what the staff flag means in covey."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "is_staff" in self.fields:
            self.fields["is_staff"].help_text = (
                "Not needed to sign in: a member of an organisation signs in to the admin by"
                " being a member, and their roles say what they may do. The platform team are"
                " superusers."
            )


class UserMembershipInline(admin.TabularInline):
    """The user's organisations and roles, as their organisations' pages set them."""

    model = Membership
    fields = readonly_fields = ("organisation", "role")
    extra = 0
    can_delete = False
    verbose_name_plural = "Memberships (changed on each organisation's page)"

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


admin.site.unregister(get_user_model())


@admin.register(get_user_model())
class CoveyUserAdmin(UserAdmin):
    """Users, as the platform team manages them, with the organisations they belong to."""

    form = UserForm
    inlines = [UserMembershipInline]
