"""The people's API of an agent's home (``/api/v1/agents/{id}/home/…``; paths are relative to
the home and given as ``?path=``): list, stat, download, upload, change, usage and the audit.
The runner holding the home answers through homes/runner_views.py."""

from typing import Any

from django.http import HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, permissions, serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from agents.models import Agent, size_text
from covey.api import RefusesUnknownFields
from covey.numbers import whole_number
from covey.pagination import BoundedPagination
from homes import services, wire
from homes.models import HomeChange
from homes.services import HomeProblem
from runners.messages import HomeEntrySerializer, HomeSpaceSerializer, Refusal
from runners.protocol import HOME_LISTING_MAX, HomeOp


def _refusal(exc: HomeProblem) -> Response:
    return Response({"detail": exc.detail}, status=exc.status)


# --- people --------------------------------------------------------------------------------


class PathSerializer(RefusesUnknownFields, serializers.Serializer):
    # Names are taken as given: a name may start or end with a space, and means that name.
    path = serializers.CharField(
        trim_whitespace=False, help_text="Relative to the home: names separated by '/'."
    )


class MoveSerializer(PathSerializer):
    target = serializers.CharField(
        trim_whitespace=False,
        help_text="Where it goes: it must not exist yet; the directory it goes into must.",
    )


class ListingSerializer(serializers.Serializer):
    path = serializers.CharField()
    total = serializers.IntegerField(help_text="Entries in the directory; a page of them below.")
    offset = serializers.IntegerField()
    entries = HomeEntrySerializer(many=True)


class HomeChangeSerializer(serializers.ModelSerializer):
    runner: serializers.Field = serializers.StringRelatedField()

    class Meta:
        model = HomeChange
        fields = [
            "id",
            "agent",
            "by_name",
            "operation",
            "path",
            "target",
            "bytes",
            "status",
            "detail",
            "settled",
            "runner",
            "at",
        ]
        read_only_fields = fields


class HomeChangePageSerializer(serializers.Serializer):
    """A page of the audit (BoundedPagination's shape)."""

    count = serializers.IntegerField()
    next = serializers.URLField(allow_null=True)
    previous = serializers.URLField(allow_null=True)
    results = HomeChangeSerializer(many=True)


class HomeSummarySerializer(serializers.Serializer):
    agent = serializers.IntegerField()
    runner = serializers.CharField(allow_null=True, help_text="Where the home is.")
    runner_online = serializers.BooleanField(allow_null=True)
    bytes = serializers.IntegerField(allow_null=True, help_text="Kept, not measured per request.")
    files = serializers.IntegerField(allow_null=True)
    measured_at = serializers.DateTimeField(allow_null=True)
    quota_bytes = serializers.IntegerField(help_text="0: no quota.")
    usage = serializers.CharField()
    active_run = serializers.UUIDField(allow_null=True)


PATH = OpenApiParameter("path", str, description="Relative to the home ('' or absent: the home).")
PROBLEMS = {
    403: Refusal,
    404: Refusal,
    409: Refusal,
    413: Refusal,
    503: OpenApiResponse(Refusal, description="The runner holding the home is offline."),
}


class HomeViewSet(viewsets.ViewSet):
    """An agent's home: list, stat, download (a directory as a tar archive), upload, make a
    directory, move, delete, usage, and the audit of changes made from outside. Members read;
    admins of the agent's organisation change. Works whether or not a sandbox runs; changes
    are refused (409) while a run of the agent is active."""

    permission_classes = [permissions.IsAuthenticated]

    def agent(self, request: Request, agent_id: int) -> Agent:
        return get_object_or_404(
            Agent.objects.for_user(request.user).select_related("home_runner", "organisation"),
            pk=agent_id,
        )

    def changing(
        self, request: Request, agent_id: int, kind: HomeOp, path: str | None = None, size: int = 0
    ) -> Agent:
        """The agent whose home the request changes; 403 unless the user may change it, the
        refusal in the home's audit with what was asked, as far as it can be told (``path``,
        else the body's; only a refused request's body is read here)."""
        agent = self.agent(request, agent_id)
        if not services.may_change(agent, request.user):
            raise services.refuse_change(
                agent,
                request.user,
                kind,
                _said(request, "path") if path is None else path,
                target=_said(request, "target") if kind == HomeOp.MOVE else "",
                size=size,
            )
        return agent

    def handle_exception(self, exc: Exception) -> Response:
        wire.drain(self.request._request)
        if isinstance(exc, HomeProblem):
            return _refusal(exc)
        return super().handle_exception(exc)

    @extend_schema(responses=HomeSummarySerializer)
    def summary(self, request: Request, agent_id: int) -> Response:
        """Where the home is and what it holds (as last measured, with when)."""
        agent = self.agent(request, agent_id)
        runner = agent.home_runner
        run = services.active_run(agent)
        return Response(
            {
                "agent": agent.pk,
                "runner": runner.name if runner else None,
                "runner_online": runner.online if runner else None,
                "bytes": agent.home_bytes,
                "files": agent.home_files,
                "measured_at": agent.home_measured_at,
                "quota_bytes": agent.home_quota_bytes,
                "usage": agent.home_usage_text(),
                "active_run": run.pk if run else None,
            }
        )

    @extend_schema(
        parameters=[
            PATH,
            OpenApiParameter("offset", int, description="Entries to skip (by name)."),
            OpenApiParameter("limit", int, description=f"At most {HOME_LISTING_MAX}."),
        ],
        responses={200: ListingSerializer, **PROBLEMS},
    )
    def entries(self, request: Request, agent_id: int) -> Response:
        """A page of a directory, by name (a link is listed, never followed)."""
        agent = self.agent(request, agent_id)
        offset, limit = _number(request, "offset", 0), _number(request, "limit", 1000)
        path = request.query_params.get("path", "")
        answer = services.ask(
            agent, HomeOp.LIST, path=path, offset=offset, limit=min(limit, HOME_LISTING_MAX)
        )
        entries = HomeEntrySerializer([*answer.entries], many=True).data
        return Response({"path": path, "total": answer.total, "offset": offset, "entries": entries})

    @extend_schema(parameters=[PATH], responses={200: HomeEntrySerializer, **PROBLEMS})
    def stat(self, request: Request, agent_id: int) -> Response:
        agent = self.agent(request, agent_id)
        answer = services.ask(agent, HomeOp.STAT, path=request.query_params.get("path", ""))
        return Response(HomeEntrySerializer(answer.entry).data)

    @extend_schema(exclude=True)
    def download_head(self, request: Request, agent_id: int) -> HttpResponseBase:
        """What a download would be (its type, name and a file's length), without its bytes:
        a look, not a transfer. What a download refuses (a link, a FIFO, a socket, a device, a
        hard-linked file) it refuses the same."""
        agent = self.agent(request, agent_id)
        path = request.query_params.get("path", "")
        entry = services.ask(agent, HomeOp.STAT, path=path).entry
        archive = entry is None or entry.type == "directory"
        if entry is not None and not archive:
            services.check_download(entry, path)
        size = None if archive or entry is None else entry.size
        return services.download_headers(HttpResponse(), path, archive=archive, size=size)

    @extend_schema(
        parameters=[PATH],
        responses={
            (200, "application/octet-stream"): OpenApiTypes.BINARY,
            (200, "application/x-tar"): OpenApiTypes.BINARY,
            **PROBLEMS,
        },
    )
    def download(self, request: Request, agent_id: int) -> HttpResponseBase:
        """A file's bytes, or a directory (or the whole home) as a tar archive, streamed. An
        archive leaves out what it cannot vouch for (links, FIFOs, devices, hard-linked files)
        and lists it in covey-skipped.txt."""
        agent = self.agent(request, agent_id)
        path = request.query_params.get("path", "")
        got = services.download(agent, path, wire=wire.sender(request._request))
        return services.download_headers(
            StreamingHttpResponse(got.chunks), path, archive=got.archive, size=got.size
        )

    @extend_schema(
        parameters=[
            PATH,
            OpenApiParameter("replace", bool, description="Write over a file that exists."),
        ],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={200: HomeEntrySerializer, 201: HomeEntrySerializer, **PROBLEMS},
    )
    def write(self, request: Request, agent_id: int) -> Response:
        """Upload one file, the request's body, to ``path`` (streamed; it appears whole or not
        at all, so a broken upload is simply sent again). 413 when it would pass the quota."""
        path = request.query_params.get("path", "")
        agent = self.changing(request, agent_id, HomeOp.WRITE, path, _length(request))
        chunks, size = wire.body(request._request)
        if size is None:
            raise exceptions.ParseError("give the file's length (Content-Length)")
        replace = _flag(request, "replace")
        answer = services.upload(agent, request.user, path, chunks, size, replace=replace)
        return Response(HomeEntrySerializer(answer.entry).data, status=answer.status)

    @extend_schema(
        parameters=[
            OpenApiParameter("path", str, description="The directory the files go into."),
            OpenApiParameter("replace", bool, description="Write over files that exist."),
        ],
        request={"multipart/form-data": {"type": "object", "properties": {"files": {}}}},
        responses={201: HomeEntrySerializer(many=True), **PROBLEMS},
    )
    def upload(self, request: Request, agent_id: int) -> Response:
        """Upload files (multipart, field ``files``, one or more) into a directory: 201 with
        each one made; when one is refused, its status, with what was made and what was not
        (each refusal is in the audit too)."""
        directory = request.query_params.get("path", "")
        agent = self.changing(request, agent_id, HomeOp.WRITE, directory)  # no form is read
        _, size = wire.body(request._request, consume=False)
        if size is None:
            raise exceptions.ParseError("give the form's length (Content-Length)")
        if size > services.upload_cap():
            raise HomeProblem(
                413,
                f"the form is {size_text(size)}, more than one upload may carry"
                f" ({size_text(services.upload_cap())})",
            )
        files = request.FILES.getlist("files")
        if not files:
            raise exceptions.ValidationError({"files": "send one or more files"})
        made, refused = [], []
        replace = _flag(request, "replace")
        for file in files:
            name = file.name or "upload"
            path = f"{directory}/{name}" if directory else name
            try:
                answer = services.upload_file(agent, request.user, path, file, replace=replace)
            except HomeProblem as exc:
                refused.append((path, exc))
            else:
                made.append(answer.entry)
        entries = HomeEntrySerializer(made, many=True).data
        if refused:
            path, first = refused[0]
            said = [{"path": p, "status": e.status, "detail": e.detail} for p, e in refused]
            return Response(
                {"detail": f"{path}: {first.detail}", "made": entries, "refused": said},
                status=first.status,
            )
        return Response(entries, status=201)

    @extend_schema(request=PathSerializer, responses={201: HomeEntrySerializer, **PROBLEMS})
    def mkdir(self, request: Request, agent_id: int) -> Response:
        """Make a directory (and those above it that are missing)."""
        agent = self.changing(request, agent_id, HomeOp.MKDIR)
        given = _valid(PathSerializer, request)
        answer = services.change(agent, request.user, HomeOp.MKDIR, given["path"])
        return Response(HomeEntrySerializer(answer.entry).data, status=201)

    @extend_schema(request=MoveSerializer, responses={200: HomeEntrySerializer, **PROBLEMS})
    def move(self, request: Request, agent_id: int) -> Response:
        """Move or rename (the target must not exist)."""
        agent = self.changing(request, agent_id, HomeOp.MOVE)
        given = _valid(MoveSerializer, request)
        answer = services.change(
            agent, request.user, HomeOp.MOVE, given["path"], target=given["target"]
        )
        return Response(HomeEntrySerializer(answer.entry).data)

    @extend_schema(request=PathSerializer, responses={204: None, **PROBLEMS})
    def remove(self, request: Request, agent_id: int) -> Response:
        """Delete a file, a link (never what it points to) or a whole directory."""
        agent = self.changing(request, agent_id, HomeOp.DELETE)
        given = _valid(PathSerializer, request)
        services.change(agent, request.user, HomeOp.DELETE, given["path"])
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(parameters=[PATH], responses={200: HomeSpaceSerializer, **PROBLEMS})
    def usage(self, request: Request, agent_id: int) -> Response:
        """Where the space goes: the largest directories and files in the home or in one of
        its directories (a walk, on request; for the whole home it renews the kept figure)."""
        agent = self.agent(request, agent_id)
        found = services.space(agent, request.query_params.get("path", ""))
        return Response(HomeSpaceSerializer(found).data)

    @extend_schema(
        parameters=[
            OpenApiParameter("page", int, description="Which page (from 1)."),
            OpenApiParameter("page_size", int, description="At most 500 a page (50 unless said)."),
        ],
        responses=HomeChangePageSerializer,
    )
    def changes(self, request: Request, agent_id: int) -> Response:
        """Every change made to the home from outside, or refused: who, what, how much, when."""
        agent = self.agent(request, agent_id)
        rows = HomeChange.objects.filter(agent=agent).select_related("runner")
        paginator = BoundedPagination()
        page = paginator.paginate_queryset(rows, request, view=self)
        return paginator.get_paginated_response(HomeChangeSerializer(page, many=True).data)


def _valid(kind: type[serializers.Serializer], request: Request) -> dict[str, Any]:
    serializer = kind(data=request.data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def _said(request: Request, name: str) -> str:
    """What the request's body says ``name`` is, as text ('' when it says nothing readable);
    validated later, where it is used."""
    try:
        data = request.data
    except exceptions.APIException:  # unreadable, or read and refused (a NaN, a surrogate)
        return ""
    value = data.get(name) if hasattr(data, "get") else None
    return value if isinstance(value, str) else ""


def _length(request: Request) -> int:
    """The body's length as it says it (0 when it does not, or not as a number)."""
    return whole_number(request.META.get("CONTENT_LENGTH")) or 0


def _number(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not (raw.isascii() and raw.isdigit()):
        raise exceptions.ValidationError({name: "a whole number, 0 or more"})
    return int(raw)


def _flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "").lower() in ("1", "true", "yes", "on")
