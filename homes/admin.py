"""Admin: a file browser per agent's home (list, download, upload, make a directory, rename,
delete with a confirmation, what takes the space), and the audit of changes from outside. It
works through the same services as the API, so the runner holding the home does the work."""

from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
    StreamingHttpResponse,
)
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path as url_path
from django.urls import reverse
from django.utils.http import urlencode

from agents.models import Agent, size_text
from covey.display import seconds
from covey.numbers import whole_number
from homes import services, wire
from homes.models import Home, HomeChange
from homes.services import HomeProblem
from organisations.admin import TenantScoped
from organisations.readonly import ReadOnlyAdmin
from runners.protocol import HomeOp


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


# A change from outside, as people name it (what was asked) and say it went well (what it did).
ASKED = {
    HomeOp.WRITE: "upload",
    HomeOp.MKDIR: "new directory",
    HomeOp.MOVE: "move",
    HomeOp.DELETE: "delete",
}
DONE = {
    HomeOp.WRITE: "uploaded",
    HomeOp.MKDIR: "made",
    HomeOp.MOVE: "moved",
    HomeOp.DELETE: "deleted",
}


def outcome(change: HomeChange) -> str:
    """How a change went, for people: 'uploaded, 3.0 MiB', 'refused: the home holds …',
    'failed: …', or that its answer has not come (yet)."""
    if change.done:
        moved = change.operation in (HomeOp.WRITE, HomeOp.DELETE) and change.bytes > 0
        done = DONE.get(HomeOp(change.operation), "done")
        return f"{done}, {size_text(change.bytes)}" if moved else done
    detail = change.detail or "no reason given"
    if change.status == 0:
        return "waiting for its runner to answer"
    if change.status == 504 and not change.settled:
        return f"no answer yet: {detail}"  # a late answer may still settle it
    if 400 <= change.status < 500:
        return f"refused: {detail}"
    return f"failed: {detail}"


class OutcomeFilter(admin.SimpleListFilter):
    """The audit by how each change went, in words (the HTTP status it keeps is for programs)."""

    title = "how it went"
    parameter_name = "went"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("done", "done"),
            ("refused", "refused"),
            ("failed", "failed"),
            ("open", "no answer yet"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        ranges: dict[str, dict[str, Any]] = {
            "done": {"status__gte": 200, "status__lt": 300},
            "refused": {"status__gte": 400, "status__lt": 500},
            "failed": {"status__gte": 500, "settled": True},
            "open": {"settled": False},
        }
        value = self.value()
        return queryset.filter(**ranges[value]) if value in ranges else queryset


@admin.register(Home)
class HomeAdmin(TenantScoped, admin.ModelAdmin):
    list_display = ["name", "organisation", "home_runner", "usage", "home_measured_at"]
    list_select_related = ["organisation", "home_runner"]
    list_filter = ["organisation"]
    search_fields = ["name", "slug"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="Holds")
    def usage(self, obj: Agent) -> str:
        return obj.home_usage_text()

    def get_urls(self) -> list[Any]:
        wrap = self.admin_site.admin_view
        return [
            url_path("<int:pk>/download/", wrap(self.download_view), name="homes_home_download"),
            url_path("<int:pk>/upload/", wrap(self.upload_view), name="homes_home_upload"),
            url_path("<int:pk>/mkdir/", wrap(self.mkdir_view), name="homes_home_mkdir"),
            url_path("<int:pk>/rename/", wrap(self.rename_view), name="homes_home_rename"),
            url_path("<int:pk>/remove/", wrap(self.remove_view), name="homes_home_remove"),
            url_path("<int:pk>/space/", wrap(self.space_view), name="homes_home_space"),
            *super().get_urls(),
        ]

    # --- who may ---------------------------------------------------------------------------

    def _agent(self, request: HttpRequest, pk: Any) -> Agent:
        agent = get_object_or_404(self.get_queryset(request), pk=pk)
        if not self.has_view_permission(request, agent):
            raise PermissionDenied
        return Agent.objects.select_related("home_runner", "organisation").get(pk=agent.pk)

    def _may_change(self, request: HttpRequest, agent: Agent) -> bool:
        return services.may_change(agent, request.user)  # as the API's

    def _changing(self, request: HttpRequest, pk: Any, kind: HomeOp) -> Agent:
        """The agent whose home the person changes; a change they may not make is refused
        with the role it takes, and a posted one is recorded in the home's audit."""
        agent = self._agent(request, pk)
        if self._may_change(request, agent):
            return agent
        why = self.refusal(request, "change", pk).replace("Changing homes", "Changing a home")
        if request.method == "POST" and kind == HomeOp.WRITE:
            # A refused upload's body is never read: its length is what is known of it.
            size = whole_number(request.META.get("CONTENT_LENGTH")) or 0
            services.refuse_change(agent, request.user, kind, "", size=size)
        elif request.method == "POST":
            path = request.GET.get("path") or request.POST.get("path", "")
            if kind == HomeOp.MKDIR:
                path = "/".join(part for part in (path, request.POST.get("name", "")) if part)
            target = request.POST.get("target", "")
            services.refuse_change(agent, request.user, kind, path, target=target)
        raise PermissionDenied(why)

    def _urls(self, agent: Agent) -> dict[str, str]:
        return {
            f"{name}_url": reverse(f"admin:homes_home_{view}", args=[agent.pk])
            for name, view in [
                ("browse", "change"),
                ("download", "download"),
                ("upload", "upload"),
                ("mkdir", "mkdir"),
                ("rename", "rename"),
                ("remove", "remove"),
                ("space", "space"),
            ]
        }

    def _back(self, agent: Agent, path: str) -> HttpResponseRedirect:
        url = reverse("admin:homes_home_change", args=[agent.pk])
        return HttpResponseRedirect(f"{url}?{urlencode({'path': path})}" if path else url)

    # --- pages -----------------------------------------------------------------------------

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        """The browser: a page of one directory, with what may be done there. A home the
        person cannot see is "doesn't exist", as on every admin page, not a bare 404."""
        if not self.get_queryset(request).filter(pk=whole_number(object_id) or -1).exists():
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)  # type: ignore[attr-defined]
        agent = self._agent(request, object_id)
        path = request.GET.get("path", "")
        offset = whole_number(request.GET.get("offset")) or 0
        listing, total, problem = None, 0, ""
        can_change, active = self._may_change(request, agent), services.active_run(agent)
        try:
            answer = services.ask(agent, HomeOp.LIST, path=path, offset=offset, limit=500)
            total = answer.total
            listing = [
                {
                    **entry.to_json(),
                    "path": f"{path}/{entry.name}" if path else entry.name,
                    "size_text": size_text(entry.size) if entry.type == "file" else "",
                    "modified_at": datetime.fromtimestamp(entry.modified, UTC),
                }
                for entry in answer.entries
            ]
        except HomeProblem as exc:
            problem = exc.detail
        agent.refresh_from_db()
        steps = path.split("/") if path else []
        context = {
            **self.admin_site.each_context(request),
            "title": f"Home of {agent}",
            "agent": agent,
            "opts": self.model._meta,
            "path": path,
            "parent": _parent(path),
            "crumbs": [
                {"name": name, "path": "/".join(steps[: i + 1])} for i, name in enumerate(steps)
            ],
            "listing": listing,
            "total": total,
            "more": offset + 500 < total,
            "offset_from": offset + 1,
            "offset_to": min(offset + 500, total),
            "next_offset": offset + 500,
            "problem": problem,
            "can_change": can_change,
            "active_run": active,
            # The forms only where a change would be taken (the service refuses it anyway).
            "writable": can_change and (active is None or settings.COVEY_HOME_WRITES_DURING_RUNS),
            "runner_name": agent.home_runner.name if agent.home_runner else "",
            "changes": [
                {
                    "at": seconds(change.at),
                    "by": change.by_name,
                    "what": ASKED.get(HomeOp(change.operation), change.operation),
                    "path": change.path,
                    "target": change.target,
                    "outcome": outcome(change),
                }
                for change in HomeChange.objects.filter(agent=agent)[:20]
            ],
            **self._urls(agent),
        }
        return TemplateResponse(request, "admin/homes/browser.html", context)

    def download_view(self, request: HttpRequest, pk: int) -> HttpResponseBase:
        if request.method != "GET":  # a HEAD too would order the whole transfer
            return HttpResponseNotAllowed(["GET"])
        agent = self._agent(request, pk)
        path = request.GET.get("path", "")
        try:
            got = services.download(agent, path, wire=wire.sender(request))
        except HomeProblem as exc:
            messages.error(request, exc.detail)
            return self._back(agent, _parent(path))
        return services.download_headers(
            StreamingHttpResponse(got.chunks), path, archive=got.archive, size=got.size
        )

    def upload_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        agent = self._changing(request, pk, HomeOp.WRITE)
        directory = request.POST.get("path", "")
        replace = bool(request.POST.get("replace"))
        done = []
        for file in request.FILES.getlist("files"):
            name = file.name or "upload"
            path = f"{directory}/{name}" if directory else name
            try:
                services.upload_file(agent, request.user, path, file, replace=replace)
            except HomeProblem as exc:
                messages.error(request, f"Not uploaded, {name}: {exc.detail}")  # not capitalised
            else:
                done.append(name)
        if done:
            messages.success(request, f"Uploaded {', '.join(done)}.")
        return self._back(agent, directory)

    def mkdir_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        agent = self._changing(request, pk, HomeOp.MKDIR)
        directory = request.POST.get("path", "")
        name = request.POST.get("name", "")
        path = f"{directory}/{name}" if directory else name
        try:
            services.change(agent, request.user, HomeOp.MKDIR, path)
        except HomeProblem as exc:
            messages.error(request, exc.detail)
            return self._back(agent, directory)
        messages.success(request, f"Made {path}.")
        return self._back(agent, path)

    def rename_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        agent = self._changing(request, pk, HomeOp.MOVE)
        path = request.GET.get("path", "")
        if request.method == "POST":
            target = request.POST.get("target", "")
            try:
                services.change(agent, request.user, HomeOp.MOVE, path, target=target)
            except HomeProblem as exc:
                return self._form(request, agent, path, "Rename or move", problem=exc.detail)
            messages.success(request, f"Moved {path} to {target}.")
            return self._back(agent, _parent(target))
        return self._form(request, agent, path, "Rename or move")

    def remove_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        agent = self._changing(request, pk, HomeOp.DELETE)
        path = request.GET.get("path", "")
        if request.method == "POST":
            try:
                services.change(agent, request.user, HomeOp.DELETE, path)
            except HomeProblem as exc:
                return self._form(request, agent, path, "Delete", deleting=True, problem=exc.detail)
            messages.success(request, f"Deleted {path}.")
            return self._back(agent, _parent(path))
        directory = False
        try:
            entry = services.ask(agent, HomeOp.STAT, path=path).entry
            directory = entry is not None and entry.type == "directory"
        except HomeProblem as exc:
            return self._form(request, agent, path, "Delete", deleting=True, problem=exc.detail)
        return self._form(request, agent, path, "Delete", deleting=True, is_directory=directory)

    def space_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        """What takes the space (a walk, on request), each directory a link to drill into."""
        agent = self._agent(request, pk)
        path = request.GET.get("path", "")
        context: dict[str, Any] = {
            **self.admin_site.each_context(request),
            "title": f"What takes the space in the home of {agent}",
            "agent": agent,
            "path": path,
            "quota": size_text(agent.home_quota_bytes),
            **self._urls(agent),
        }
        try:
            found = services.space(agent, path)
        except HomeProblem as exc:
            context["problem"] = exc.detail
        else:
            context.update(
                space=found,
                space_bytes=size_text(found.bytes),
                directories=[
                    {"path": d.path, "size": size_text(d.bytes), "usable": d.usable}
                    for d in found.largest_directories
                ],
                files=[{"path": f.path, "size": size_text(f.bytes)} for f in found.largest_files],
            )
        return TemplateResponse(request, "admin/homes/space.html", context)

    def _form(
        self, request: HttpRequest, agent: Agent, path: str, title: str, **extra: Any
    ) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": f"{title}: {path}",
            "agent": agent,
            "path": path,
            "parent": _parent(path),
            **self._urls(agent),
            **extra,
        }
        return TemplateResponse(request, "admin/homes/form.html", context)


@admin.register(HomeChange)
class HomeChangeAdmin(ReadOnlyAdmin, TenantScoped, admin.ModelAdmin):
    """The audit of changes made to homes from outside: a record, never edited."""

    list_display = ["at_shown", "agent", "by_name", "what", "path", "target", "how_it_went"]
    list_filter = ["operation", OutcomeFilter, "agent__organisation"]
    search_fields = ["path", "by_name", "agent__name"]
    list_select_related = ["agent__organisation"]
    fields = readonly_fields = (
        "at_shown", "agent", "by_name", "what", "path", "target", "how_it_went", "runner",
    )  # fmt: skip

    @admin.display(description="At", ordering="at")
    def at_shown(self, obj: HomeChange) -> str:
        return seconds(obj.at)

    @admin.display(description="What", ordering="operation")
    def what(self, obj: HomeChange) -> str:
        return ASKED.get(HomeOp(obj.operation), obj.operation)

    @admin.display(description="How it went")
    def how_it_went(self, obj: HomeChange) -> str:
        return outcome(obj)
