"""Admin for runs, written for operators: what waits and what happened, read-only; a run
is started from its agent's page and cancelled from its own.

Runs sit above agents, egress and budgets, so the pages of those that lead to runs are
extended here: the agent's (start a run, its recent runs and denials), and the egress
decisions' and tokens' (the run each belongs to)."""

from decimal import Decimal
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, Q, QuerySet, Sum
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseBase,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
    JsonResponse,
)
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils.html import escape, format_html, format_html_join
from django.utils.http import urlencode

from agents.admin import DEFAULT_WORKPLACE
from agents.models import Agent
from budgets.admin import AgentWithSpendAdmin
from budgets.models import Charge
from budgets.money import dollars
from connections.admin import requests_link
from covey.display import linked, moment, seconds
from covey.numbers import whole_number
from egress.admin import DecisionAdmin, EgressTokenAdmin
from egress.models import Decision, EgressToken
from organisations.admin import MembersRead, TenantScoped
from organisations.models import Role
from organisations.roles import role_of, roles_said
from runs import output, services
from runs.models import FINISHED, Run, RunEvent

RECENT = 10  # runs and denials listed on an agent's page
# What the run page's follower updates together with its status, every time it asks (the
# page's own fields, shown by the same methods).
LIVE_FIELDS = ("detail_shown", "started_shown", "finished_shown", "egress_shown")


def _decisions_url(run: Run) -> str:
    """The decision log, filtered to the run: its agent's decisions while it went."""
    query: dict[str, Any] = {"agent__id__exact": run.agent_id}
    if run.started_at is not None:
        query["decided_at__gte"] = run.started_at.isoformat()
    if run.finished_at is not None:
        query["decided_at__lte"] = run.finished_at.isoformat()
    return f"{reverse('admin:egress_decision_changelist')}?{urlencode(query)}"


def _run_link(run: Run | None) -> str:
    if run is None:
        return "-"
    url = reverse("admin:runs_run_change", args=[run.pk])
    return format_html('<a href="{}">{}</a>', url, run.short_id)


OFFSET_RULE = "offset: give a number of bytes (0 or more)\n"


class RunEventInline(MembersRead, admin.TabularInline):
    model = RunEvent
    extra = 0
    can_delete = False
    fields = ("at_shown", "status", "detail")
    readonly_fields = ("at_shown", "status", "detail")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="At")
    def at_shown(self, obj: RunEvent) -> str:
        return seconds(obj.at)


@admin.register(Run)
class RunAdmin(TenantScoped, admin.ModelAdmin):
    """What waits and what happened; runs are queued through the API, cancelled here."""

    list_display = [
        "short_id", "agent", "status", "status_detail", "runner", "created_shown", "finished_shown",
    ]  # fmt: skip
    list_display_links = ["short_id"]
    list_filter = ["status", "agent__organisation", "runner", "agent"]
    list_select_related = ["agent__organisation", "runner"]
    search_fields = ["id", "agent__name", "task"]
    date_hierarchy = "created_at"
    inlines = [RunEventInline]
    actions = ["cancel_runs"]
    readonly_fields = [
        "id",
        "agent",
        "agent_version",
        "workplace_shown",
        "image_id",
        "services_shown",
        "task",
        "command",
        "status",
        "detail_shown",
        "runner",
        "timeout",
        "exit_code",
        "live_output",
        "log_link",
        "egress_shown",
        "model_usage",
        "credentialed_shown",
        "changes_in_home",
        "output_size",
        "log_start",
        "created_by",
        "created_shown",
        "placed_shown",
        "started_shown",
        "finished_shown",
        "cancel_requested_shown",
    ]
    fields = tuple(readonly_fields)  # a run is a record: nothing on its page is edited
    change_form_template = "admin/runs/run_change_form.html"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a run is a record (its organisation's deletion takes its runs along)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        # A run is a record: nothing to save, and not deleted from its page.
        no_saving = {"show_save": False, "show_save_and_continue": False, "show_delete": False}
        return super().change_view(
            request, object_id, form_url, {**(extra_context or {}), **no_saving}
        )

    def get_actions(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        """The actions, without deleting runs (they are the record of what ran)."""
        actions = super().get_actions(request, *args, **kwargs)
        actions.pop("delete_selected", None)
        return actions

    def render_change_form(
        self,
        request: HttpRequest,
        context: Any,
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Run | None = None,
    ) -> HttpResponse:
        """The Cancel button is for who may cancel (the run the page already read); the title
        names the run (not "Change run": nothing on it is changed here)."""
        context["may_cancel"] = obj is not None and _may_run(request, obj.agent)
        if obj is not None:
            # The status is a field the page keeps current; a subtitle with it would go stale.
            context.update(title=f"Run {obj.short_id} of {obj.agent}", subtitle=None)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self) -> list[Any]:
        log = self.admin_site.admin_view(self.log_view)
        live = self.admin_site.admin_view(self.live_view)
        cancel = self.admin_site.admin_view(self.cancel_view)
        return [
            path("<uuid:object_id>/log/", log, name="runs_run_log"),
            path("<uuid:object_id>/live/", live, name="runs_run_live"),
            path("<uuid:object_id>/cancel/", cancel, name="runs_run_cancel"),
            *super().get_urls(),
        ]

    @admin.display(description="Run")
    def short_id(self, obj: Run) -> str:
        return obj.short_id

    @admin.display(description="Command")
    def command(self, obj: Run) -> str:
        return format_html("<code>{}</code>", services.command_shown(obj)) if obj.pk else "-"

    @admin.display(description="Output")
    def live_output(self, obj: Run) -> str:
        """The end of the output; while the run goes, the page follows it with its status,
        times and egress counts (``live_view``), and reloads when all has come."""
        return format_html(
            '<pre id="run-output" data-offset="{}" data-live="{}" data-follow="{}"'
            # The newline after <pre> is the page's: HTML drops one there, not the output's.
            ' style="max-height: 40em; overflow: auto; white-space: pre-wrap">\n{}</pre>',
            obj.output_size,
            "false" if obj.status in FINISHED else "true",
            reverse("admin:runs_run_live", args=[obj.pk]),
            obj.log_tail,
        )

    @admin.display(description="Status detail")
    def detail_shown(self, obj: Run) -> str:
        # Whole, with the admin page it names a link (a refused run says where to mend it).
        return linked(obj.status_detail) if obj.status_detail else "-"

    created_shown = moment("created_at", "Created at", ordered=True)
    placed_shown = moment("placed_at", "Placed at")
    started_shown = moment("started_at", "Started at")
    finished_shown = moment("finished_at", "Finished at", ordered=True)
    cancel_requested_shown = moment("cancel_requested_at", "Cancel requested at")

    @admin.display(description="Egress")
    def egress_shown(self, obj: Run) -> str:
        if obj.started_at is None:
            return "- (its sandbox has not started)"
        decisions = Decision.objects.filter(agent_id=obj.agent_id, decided_at__gte=obj.started_at)
        if obj.finished_at is not None:
            decisions = decisions.filter(decided_at__lte=obj.finished_at)
        counts = decisions.aggregate(
            n_allowed=Count("pk", filter=Q(allowed=True)),
            n_denied=Count("pk", filter=Q(allowed=False)),
        )
        return format_html(
            '<a href="{}" id="run-decisions">{} allowed, {} denied</a>',
            _decisions_url(obj),
            counts["n_allowed"],
            counts["n_denied"],
        )

    @admin.display(description="Model usage")
    def model_usage(self, obj: Run) -> str:
        charged = Charge.objects.filter(run_id=obj.pk).aggregate(n=Count("pk"), cost=Sum("cost"))
        if not charged["n"]:
            return "no model request"
        url = (
            reverse("admin:budgets_charge_changelist")
            + f"?{urlencode({'run__id__exact': str(obj.pk)})}"
        )
        return format_html(
            '<a href="{}">{} request(s), {}</a>',
            url,
            charged["n"],
            dollars(charged["cost"] or Decimal(0)),
        )

    @admin.display(description="Credentialed requests")
    def credentialed_shown(self, obj: Run) -> str:
        """What it did with its organisation's connections (git through the gateway)."""
        return requests_link(obj.credentialed_requests.all(), run__id__exact=str(obj.pk))

    def cancel_view(self, request: HttpRequest, object_id: Any) -> HttpResponseBase:
        """The run page's Cancel button."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        run = self.get_object(request, str(object_id))
        if run is None:
            raise Http404("no such run")
        if not self.has_change_permission(request, run) or not _may_run(request, run.agent):
            raise PermissionDenied(_needs_admin(request, "Cancelling a run", run.agent))
        try:
            services.cancel(run, by=request.user)
        except services.RunError as exc:
            self.message_user(request, f"Not cancelled: {exc}.", messages.ERROR)
        else:
            self.message_user(request, "The run is cancelled or cancelling.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:runs_run_change", args=[run.pk]))

    @admin.display(description="Changes in the home")
    def changes_in_home(self, obj: Run) -> str:
        changed = obj.home_changes
        if not changed:
            browse = reverse("admin:homes_home_change", args=[obj.agent_id])
            said = "not recorded" if obj.finished_at else "-"
            return format_html('{} (<a href="{}">browse the home</a>)', said, browse)
        parts = []
        for kind in ("added", "changed", "removed"):
            listed, total = changed.get(kind, []), changed.get(f"{kind}_total", 0)
            if not total:
                continue
            more = f" and {total - len(listed)} more" if total > len(listed) else ""
            parts.append(
                format_html(
                    "<p><strong>{} {}</strong>{}</p><pre>{}</pre>",
                    total,
                    kind,
                    more,
                    "\n".join(listed),
                )
            )
        browse = format_html(
            '<p><a href="{}">Browse the home</a></p>',
            reverse("admin:homes_home_change", args=[obj.agent_id]),  # the homes app's browser
        )
        listed = format_html_join("", "{}", ((p,) for p in parts)) if parts else "nothing"
        return format_html("{}{}", listed, browse)

    @admin.display(description="Workplace")
    def workplace_shown(self, obj: Run) -> str:
        version = obj.workplace_version
        if version is None:
            return DEFAULT_WORKPLACE
        url = reverse("admin:workplaces_workplaceversion_change", args=[version.pk])
        return format_html(
            '<a href="{}">{} v{}</a>', url, version.config.get("name"), version.number
        )

    @admin.display(description="Services")
    def services_shown(self, obj: Run) -> str:
        if not obj.services:
            return "-"
        return format_html_join(
            "",
            "<p><strong>{}</strong> image {}, ready after {}</p><pre>{}</pre>",
            (
                (
                    service.get("name"),
                    (service.get("image_id") or "?")[:19],
                    "-"
                    if service.get("ready_seconds") is None
                    else f"{service['ready_seconds']:.1f} s",
                    service.get("log") or "(no log yet)",
                )
                for service in obj.services
            ),
        )

    @admin.display(description="Output as text")
    def log_link(self, obj: Run) -> str:
        if obj.pk is None:
            return "-"
        url = reverse("admin:runs_run_log", args=[obj.pk])
        what = "the whole output" if obj.log else "the output so far"
        return format_html('<a href="{}">{}</a>', url, what)

    def _followed(self, request: HttpRequest, object_id: Any) -> tuple[Run, int | None]:
        """The run the person may read (else 404) and ``?offset=`` as a number of bytes
        (None when it is not one): what the log and the live view both follow from."""
        run = self.get_object(request, str(object_id))
        if run is None or not self.has_view_permission(request, run):
            raise Http404("no such run")
        return run, whole_number(request.GET.get("offset", "0"))

    def log_view(self, request: HttpRequest, object_id: Any) -> HttpResponseBase:
        """The run's output as text: the whole log once kept, else what arrived so far; from
        ``?offset=`` bytes on (as the API's), which the run page follows it with."""
        run, offset = self._followed(request, object_id)
        if offset is None:
            return HttpResponseBadRequest(OFFSET_RULE)
        return output.log_response(run, offset)

    def live_view(self, request: HttpRequest, object_id: Any) -> HttpResponseBase:
        """What the run page follows while the run goes, in one answer so they agree: its
        fields as the page shows them (status, times, egress counts), the output from
        ``?offset=`` bytes on, where to ask from next, and whether all has come (the run
        ended and its output is whole: the page reloads then)."""
        run, offset = self._followed(request, object_id)
        if offset is None:
            return HttpResponseBadRequest(OFFSET_RULE)
        data, size, complete = output.output_since(run, offset)
        text = data.decode(errors="replace")
        fields = {name: str(getattr(self, name)(run)) for name in LIVE_FIELDS}
        fields["status"] = str(escape(run.get_status_display()))
        return JsonResponse(
            {
                "fields": fields,
                "finished": run.status in FINISHED,
                "text": text,
                "size": size,
                "complete": complete,
            }
        )

    @admin.action(description="Cancel selected runs", permissions=["change"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        cancelled = refused = 0
        for run in queryset.exclude(status__in=FINISHED).select_related("agent__organisation"):
            if not _may_run(request, run.agent):
                refused += 1
                continue
            services.cancel(run, by=request.user)
            cancelled += 1
        self.message_user(request, f"{cancelled} run(s) cancelled or cancelling.", messages.SUCCESS)
        if refused:
            self.message_user(
                request,
                f"{refused} run(s) not cancelled: that takes the admin role in their organisation.",
                messages.ERROR,
            )


def _needs_admin(request: HttpRequest, doing: str, agent: Agent) -> str:
    """Why starting or cancelling a run is refused, for the admin's 403 page."""
    return (
        f"{doing} takes the admin role in {agent.organisation}; you are {roles_said(request.user)}."
    )


def _may_run(request: HttpRequest, agent: Agent) -> bool:
    """Starting and cancelling runs takes the organisation's admin role, as in the API."""
    return role_of(request.user, agent.organisation) == Role.ADMIN


class AgentWithRunsAdmin(AgentWithSpendAdmin):
    """The agents' admin (agents, then budgets) with its runs: a task box that starts one, the
    recent runs and egress denials, and where its versions are."""

    change_form_template = "admin/runs/agent_change_form.html"
    readonly_fields = [
        *AgentWithSpendAdmin.readonly_fields[:-2],
        "recent_runs",
        "recent_denials",
        "versions",
        *AgentWithSpendAdmin.readonly_fields[-2:],
    ]

    def get_urls(self) -> list[Any]:
        start = self.admin_site.admin_view(self.start_run_view)
        return [
            path("<int:object_id>/start-run/", start, name="agents_agent_start_run"),
            *super().get_urls(),
        ]

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        agent = self.get_object(request, object_id)
        may_run = agent is not None and agent.enabled and _may_run(request, agent)
        return super().change_view(
            request, object_id, form_url, {**(extra_context or {}), "may_start_run": may_run}
        )

    def start_run_view(self, request: HttpRequest, object_id: Any) -> HttpResponseBase:
        """The agent page's task box: queue a run and show it."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        agent = get_object_or_404(
            self.get_queryset(request).select_related("organisation"), pk=object_id
        )
        if not self.has_view_permission(request, agent) or not _may_run(request, agent):
            raise PermissionDenied(_needs_admin(request, "Starting a run", agent))
        page = reverse("admin:agents_agent_change", args=[agent.pk])
        try:
            run = services.queue_run(agent, request.POST.get("task", ""), by=request.user)
        except ValidationError as exc:
            said = "; ".join(m for messages_ in exc.message_dict.values() for m in messages_)
            self.message_user(request, f"No run started: {said}.", messages.ERROR)
            return HttpResponseRedirect(page)
        self.message_user(request, f"Run {run.short_id} queued.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:runs_run_change", args=[run.pk]))

    @admin.display(description="Recent runs")
    def recent_runs(self, obj: Agent) -> str:
        if obj.pk is None:
            return "-"
        runs = list(obj.runs.order_by("-created_at")[:RECENT])
        if not runs:
            return "none yet"
        everything = reverse("admin:runs_run_changelist") + f"?agent__id__exact={obj.pk}"
        return format_html(
            '<table id="agent-runs">{}</table><p><a href="{}">all its runs</a></p>',
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                (
                    (_run_link(run), run.status, seconds(run.created_at), run.status_detail[:120])
                    for run in runs
                ),
            ),
            everything,
        )

    @admin.display(description="Recent egress denials")
    def recent_denials(self, obj: Agent) -> str:
        if obj.pk is None:
            return "-"
        denied = list(obj.egress_decisions.filter(allowed=False)[:RECENT])
        if not denied:
            return "none"
        everything = (
            reverse("admin:egress_decision_changelist")
            + "?"
            + urlencode({"agent__id__exact": obj.pk, "allowed__exact": 0})
        )
        return format_html(
            '<table id="agent-denials">{}</table><p><a href="{}">all its denials</a></p>',
            format_html_join(
                "",
                '<tr><td><a href="{}">{}:{}</a></td><td>{}</td><td>{}</td></tr>',
                (
                    (
                        reverse("admin:egress_decision_change", args=[d.pk]),
                        d.host,
                        d.port,
                        d.reason,
                        seconds(d.decided_at),
                    )
                    for d in denied
                ),
            ),
            everything,
        )

    @admin.display(description="Versions")
    def versions(self, obj: Agent) -> str:
        if obj.pk is None:
            return "-"
        url = reverse("admin:agents_agentversion_changelist") + f"?agent__id__exact={obj.pk}"
        return format_html('<a href="{}">{} version(s): who changed what</a>', url, obj.version)


class DecisionWithRunAdmin(DecisionAdmin):
    """The decision log (egress) with the run each decision was made in: the run of its agent
    going at that moment (an agent's runs never overlap). A decision made with a token issued
    by hand while a run went is shown with that run too."""

    _after = DecisionAdmin.list_display.index("agent") + 1  # the run beside its agent
    list_display = [
        *DecisionAdmin.list_display[:_after],
        "run",
        *DecisionAdmin.list_display[_after:],
    ]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [*super().get_readonly_fields(request, obj), "run"]

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """The page's runs in one query."""
        changelist = super().get_changelist_instance(request)
        found = services.runs_at(
            (d.agent_id, d.decided_at) for d in changelist.result_list if d.agent_id
        )
        for decision in changelist.result_list:
            decision.run_then = found.get((decision.agent_id, decision.decided_at))
        return changelist

    @admin.display(description="Run")
    def run(self, obj: Decision) -> str:
        if hasattr(obj, "run_then"):  # the list's, found at once
            return _run_link(obj.run_then)
        if obj.agent_id is None:
            return "-"
        found = services.runs_at([(obj.agent_id, obj.decided_at)])
        return _run_link(found.get((obj.agent_id, obj.decided_at)))


class EgressTokenWithRunAdmin(EgressTokenAdmin):
    """The egress tokens (egress) with the run each was issued to."""

    list_display = [*EgressTokenAdmin.list_display[:3], "run", *EgressTokenAdmin.list_display[3:]]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [*super().get_readonly_fields(request, obj), "run"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [*super().get_fields(request, obj), "run"]

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        changelist = super().get_changelist_instance(request)
        tokens = [token.pk for token in changelist.result_list]
        runs = {run.egress_token_id: run for run in Run.objects.filter(egress_token_id__in=tokens)}
        for token in changelist.result_list:
            token.run_of = runs.get(token.pk)
        return changelist

    @admin.display(description="Run")
    def run(self, obj: EgressToken) -> str:
        if hasattr(obj, "run_of"):  # the list's, found at once
            return _run_link(obj.run_of)
        return _run_link(Run.objects.filter(egress_token_id=obj.pk).first() if obj.pk else None)


for model, extended in (
    (Agent, AgentWithRunsAdmin),
    (Decision, DecisionWithRunAdmin),
    (EgressToken, EgressTokenWithRunAdmin),
):
    admin.site.unregister(model)
    admin.site.register(model, extended)
