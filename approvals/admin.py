"""Admin for requests: the pending list, a page per request with its history, and the decision
(approve or reject, with a note; for egress, the scope and an expiry). A request is a record:
nothing on it is edited or deleted."""

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from agents.models import Agent
from approvals import services
from approvals.models import Grant, Kind, Request, Requester, Scope, Status
from covey.display import seconds
from organisations.admin import TenantScoped
from organisations.readonly import ReadOnlyAdmin, ReadOnlyInline


class RequesterInline(ReadOnlyInline):
    model = Requester
    verbose_name = "requester"
    fields = ("at", "agent", "run", "reason", "refusal_shown", "filed_by")
    readonly_fields = fields

    @admin.display(description="The refusal that prompted it")
    def refusal_shown(self, obj: Requester) -> str:
        refusal = obj.refusal
        if refusal is None:
            return "-"
        return f"{refusal.host}:{refusal.port} refused ({refusal.reason}) at {refusal.decided_at}"


class GrantInline(ReadOnlyInline):
    model = Grant
    fields = ("entry", "agent", "expires_at", "added_version", "removed_at", "removed_version")
    readonly_fields = fields


class DecisionForm(forms.Form):
    decision = forms.ChoiceField(
        choices=[("approve", "Approve"), ("reject", "Reject")], widget=forms.RadioSelect
    )
    note = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 70}),
        help_text="Why: kept on the record, and told to the agent.",
    )
    scope = forms.ChoiceField(
        choices=Scope.choices,
        initial=Scope.AGENT,
        required=False,
        help_text="Where an approved route goes.",
    )
    expires_at = forms.DateTimeField(
        required=False,
        help_text="Optional: when an approved route is removed again (YYYY-MM-DD HH:MM, UTC).",
    )


@admin.register(Request)
class RequestAdmin(ReadOnlyAdmin, TenantScoped, admin.ModelAdmin):
    # A request is a record: it is decided (decide_view), never edited.
    # The decision (a button for who may decide) right after what is asked, so it is in view
    # in a 1280-pixel window beside the filters.
    list_display = ["what", "decide_link", "agent", "kind", "created_shown", "reason"]
    list_filter = ["status", "kind", "organisation", "expired"]
    list_select_related = ["agent__organisation", "organisation"]
    search_fields = ["target", "package", "agent__name", "requesters__reason"]
    inlines = [RequesterInline, GrantInline]
    readonly_fields = [
        "organisation", "agent", "workplace_filed", "kind", "ecosystem", "package", "target",
        "status", "decide_link", "decided_by_shown", "decided_at", "note", "scope",
        "grant_expires_at", "produced_shown", "expired", "created_at",
    ]  # fmt: skip
    fields = tuple(readonly_fields)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        record = {"show_save": False, "show_save_and_continue": False, "title": "Request"}
        found = self.get_object(request, object_id)
        # The Decide button (object tools) is for who may decide it, while it is pending.
        record["may_decide"] = found is not None and not services.can_decide(request.user, found)
        return super().change_view(
            request, object_id, form_url, {**(extra_context or {}), **record}
        )

    @admin.display(description="Decided by")
    def decided_by_shown(self, obj: Request) -> str:
        if obj.decided_by is None:
            return "-"
        if obj.decided_by_filer:
            return (
                f"{obj.decided_by}, who filed it: the only approver {obj.organisation} had"
                " (four eyes were not possible)"
            )
        return str(obj.decided_by)

    @admin.display(description="Workplace")
    def workplace_filed(self, obj: Request) -> str:
        return workplace_filed(obj)

    @admin.display(description="What it changed")
    def produced_shown(self, obj: Request) -> str:
        return _produced(obj)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Request]:
        return super().get_queryset(request).prefetch_related("requesters")

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not request.GET and request.method == "GET":  # the pending ones first
            return HttpResponseRedirect(f"{request.path}?status__exact={Status.PENDING}")
        return super().changelist_view(request, extra_context)

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """Whether the user may decide each pending request of the page: only they see its
        Decide button (a viewer sees that it waits)."""
        changelist = super().get_changelist_instance(request)
        allowed = services.decidable(request.user, changelist.result_list)
        for found in changelist.result_list:
            found.may_decide = found.pk in allowed
        return changelist

    @admin.display(description="Filed", ordering="created_at")
    def created_shown(self, obj: Request) -> str:
        return seconds(obj.created_at)

    @admin.display(description="What")
    def what(self, obj: Request) -> str:
        return obj.thing

    @admin.display(description="Reason")
    def reason(self, obj: Request) -> str:
        first = next(iter(obj.requesters.all()), None)
        more = obj.requesters.count() - 1
        text = first.reason if first else ""
        return f"{text[:120]}{' (+' + str(more) + ' more)' if more > 0 else ''}"

    @admin.display(description="Decision")
    def decide_link(self, obj: Request) -> str:
        if obj.pk is None:
            return "-"
        if obj.status != Status.PENDING:
            return f"{obj.status}" + (f" by {obj.decided_by}" if obj.decided_by else "")
        if not getattr(obj, "may_decide", False):  # the list's, for who may decide it
            return "pending"
        url = reverse("admin:approvals_request_decide", args=[obj.pk])
        return format_html('<a class="button" href="{}">Decide</a>', url)

    def get_urls(self) -> list[Any]:
        decide = self.admin_site.admin_view(self.decide_view)
        return [
            path("<int:object_id>/decide/", decide, name="approvals_request_decide"),
            *super().get_urls(),
        ]

    def decide_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        found = get_object_or_404(self.get_queryset(request), pk=object_id)
        why_not = services.can_decide(request.user, found)
        form = DecisionForm(request.POST or None)
        if found.workplace_id is None:  # its agent had none: every agent of it is no place
            scope = form.fields["scope"]
            scope.choices = [c for c in Scope.choices if c[0] != Scope.WORKPLACE]  # type: ignore[attr-defined]
        if request.method == "POST" and not why_not and form.is_valid():
            data = form.cleaned_data
            try:
                if data["decision"] == "approve":
                    services.approve(
                        found,
                        by=request.user,
                        note=data["note"],
                        scope=data["scope"] or Scope.AGENT,
                        expires_at=data["expires_at"],
                    )
                else:
                    services.reject(found, by=request.user, note=data["note"])
            except (ValidationError, PermissionDenied) as exc:
                form.add_error(None, "; ".join(getattr(exc, "messages", [str(exc)])))
            else:
                self.message_user(request, _decided(found), messages.SUCCESS)
                return HttpResponseRedirect(reverse("admin:approvals_request_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": f"Decide: {found.thing} for {found.agent}",
            "errors": form.errors,
            "opts": self.model._meta,
            "original": found,
            "request_shown": found,
            "requesters": found.requesters.select_related("run", "refusal", "filed_by"),
            "form": form,
            "why_not": why_not,
            "egress": found.kind == Kind.EGRESS,
            "workplace_filed": workplace_filed(found),
            "alone": not why_not and services.filed_by(request.user, found),
        }
        return TemplateResponse(request, "admin/approvals/decide.html", context)


def _decided(found: Request) -> str:
    """The confirmation of a decision just made: what, for whom, what it changed, and the
    request's page (its record)."""
    found.refresh_from_db()
    word = "Approved" if found.status == Status.APPROVED else "Rejected"
    page = reverse("admin:approvals_request_change", args=[found.pk])
    said = f"{word}: {found.thing} for {found.agent}."
    if found.status == Status.APPROVED:
        said += f" What it changed: {_produced(found)}."
    if found.decided_by_filer:
        said += " You filed it and decided it yourself, as the only approver: its record says so."
    return format_html('{} <a href="{}">The request\'s record</a>.', said, page)


def _produced(obj: Request) -> str:
    """What a decided request changed, in words: 'agent acme/builder v2; workplace v3'."""
    produced = obj.produced or {}
    versions = produced.get("agent_versions") or {}  # by agent id
    agents = Agent.objects.filter(pk__in=[int(pk) for pk in versions if str(pk).isdigit()])
    names = {str(agent.pk): str(agent) for agent in agents.select_related("organisation")}
    parts = [f"agent {names.get(str(pk), pk)} v{version}" for pk, version in versions.items()]
    if "workplace_version" in produced:
        parts.append(f"workplace v{produced['workplace_version']}")
    if produced.get("base_allowlist"):
        parts.append("the organisation's base list")
    if produced.get("replaced"):
        parts.append(f"replacing {', '.join(produced['replaced'])}")
    return "; ".join(parts) or "nothing"


def workplace_filed(request: Request) -> str:
    """The workplace as the request was filed against it ('python v3'), and its version now
    when it has changed since ('python v3 (now v5)')."""
    workplace = request.workplace
    if workplace is None:
        return "the default workplace"
    if request.workplace_version is None:  # filed before covey recorded the version
        return f"{workplace.name} (now v{workplace.version})"
    shown = f"{workplace.name} v{request.workplace_version}"
    if workplace.version != request.workplace_version:
        shown += f" (now v{workplace.version})"
    return shown
