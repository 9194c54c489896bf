"""API resource: requests (alias ``package-requests``), filed on an agent's behalf by a person
here, decided by approvers and admins."""

from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import exceptions, mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request as HttpRequest
from rest_framework.response import Response
from rest_framework.settings import api_settings

from agents.models import Agent
from approvals import services
from approvals.models import Grant, Kind, Request, Requester, Scope, Status
from covey.api import RefusesUnknownFields
from egress.environment import DESK_TOKEN_HEADER as TOKEN_HEADER
from organisations.api import OrganisationScoped, ScopedRelatedField
from organisations.models import Role
from organisations.roles import role_of
from runners.auth import RunnerEndpoint


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"


class RequesterSerializer(serializers.ModelSerializer):
    filed_by: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )

    class Meta:
        model = Requester
        fields = ["agent", "run", "reason", "refusal", "filed_by", "at"]
        read_only_fields = fields


class GrantSerializer(serializers.ModelSerializer):
    class Meta:
        model = Grant
        fields = ["entry", "agent", "expires_at", "added_version", "removed_at", "removed_version"]
        read_only_fields = fields


class RequestSerializer(serializers.ModelSerializer):
    """A request: what is asked for, who asked (every requester merged into it), and what was
    decided, by whom, and what it changed."""

    requesters = RequesterSerializer(many=True, read_only=True)
    grants = GrantSerializer(many=True, read_only=True)
    decided_by: "serializers.SlugRelatedField[Any]" = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )

    class Meta:
        model = Request
        fields = [
            "id", "organisation", "agent", "workplace", "workplace_version", "kind", "ecosystem",
            "package", "target", "status", "decided_by", "decided_by_filer", "decided_at", "note",
            "scope", "grant_expires_at", "produced", "expired", "created_at", "requesters",
            "grants",
        ]  # fmt: skip
        read_only_fields = fields


class FilingSerializer(RefusesUnknownFields, serializers.Serializer):
    """What is asked for: ``egress`` with ``target`` (host[:port]), or ``package`` with
    ``ecosystem`` and ``package`` (name[=version]); always a ``reason``. What a sandbox files at
    the desk (its agent is the one its credential proves), and, with the agent, what a person
    files here: one validation for both."""

    kind = serializers.ChoiceField(choices=Kind.choices)
    target = serializers.CharField(required=False, allow_blank=True, max_length=300)
    ecosystem = serializers.CharField(required=False, allow_blank=True, max_length=16)
    package = serializers.CharField(required=False, allow_blank=True, max_length=255)
    reason = serializers.CharField(max_length=services.MAX_REASON)


class FileSerializer(FilingSerializer):
    """Filing on an agent's behalf: the ``agent``, and what is asked for."""

    agent = ScopedRelatedField(queryset=Agent.objects.select_related("organisation"))


class RequestDecisionSerializer(RefusesUnknownFields, serializers.Serializer):
    note = serializers.CharField(help_text="Why: kept on the record.")
    scope = serializers.ChoiceField(
        choices=Scope.choices,
        required=False,
        help_text="Egress only: where the entry goes (default: this agent).",
    )
    expires_at = serializers.DateTimeField(
        required=False, allow_null=True, help_text="Egress only: when the entry goes again."
    )


class RejectionSerializer(RefusesUnknownFields, serializers.Serializer):
    note = serializers.CharField(help_text="Why: kept on the record, and told to the agent.")


class RequestViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, OrganisationScoped):
    """Requests of your organisations' agents: members read; admins file on an agent's
    behalf; approvers and admins decide (never one they filed)."""

    queryset = Request.objects.select_related("organisation", "decided_by").prefetch_related(
        "requesters__filed_by", "grants"
    )
    serializer_class = RequestSerializer
    write_roles = services.DECIDERS  # deciding; filing checks for an admin itself
    filterset_fields = ["organisation", "agent", "workplace", "kind", "status"]
    ordering_fields = ["created_at", "decided_at"]

    @extend_schema(request=FileSerializer, responses={201: RequestSerializer})
    def create(self, request: HttpRequest) -> Response:
        """File a request for an agent (it merges into a pending one for the same thing, and
        something already allowed is answered at once)."""
        filing = FileSerializer(data=request.data, context={"request": request})
        filing.is_valid(raise_exception=True)
        data = filing.validated_data
        agent = data["agent"]
        if role_of(request.user, agent.organisation) != Role.ADMIN:
            raise exceptions.PermissionDenied(
                f"Your role in {agent.organisation.name!r} does not allow filing requests."
            )
        if data["kind"] == Kind.EGRESS:
            filed = services.file_egress(
                agent, data.get("target", ""), reason=data["reason"], by=request.user
            )
        else:
            filed = services.file_package(
                agent,
                data.get("ecosystem", ""),
                data.get("package", ""),
                reason=data["reason"],
                by=request.user,
            )
        return Response(self._shown(filed), status=status.HTTP_201_CREATED)

    @extend_schema(request=RequestDecisionSerializer, responses=RequestSerializer)
    @action(detail=True, methods=["post"])
    def approve(self, request: HttpRequest, pk: str | None = None) -> Response:
        """Approve, with a note; for egress, where the entry goes and until when."""
        decision = RequestDecisionSerializer(data=request.data)
        decision.is_valid(raise_exception=True)
        data = decision.validated_data
        found = self.get_object()
        self._pending(found)
        try:
            decided = services.approve(
                found,
                by=request.user,
                note=data["note"],
                scope=data.get("scope") or (Scope.AGENT if found.kind == Kind.EGRESS else ""),
                expires_at=data.get("expires_at"),
            )
        except DjangoPermissionDenied as exc:
            raise exceptions.PermissionDenied(str(exc)) from None
        return Response(self._shown(decided))

    @extend_schema(request=RejectionSerializer, responses=RequestSerializer)
    @action(detail=True, methods=["post"])
    def reject(self, request: HttpRequest, pk: str | None = None) -> Response:
        """Reject, with a note."""
        rejection = RejectionSerializer(data=request.data)
        rejection.is_valid(raise_exception=True)
        found = self.get_object()
        self._pending(found)
        try:
            decided = services.reject(found, by=request.user, note=rejection.validated_data["note"])
        except DjangoPermissionDenied as exc:
            raise exceptions.PermissionDenied(str(exc)) from None
        return Response(self._shown(decided))

    def _pending(self, found: Request) -> None:
        if found.status != Status.PENDING:
            raise Conflict(f"it was {found.status} already")

    def _shown(self, found: Request) -> dict[str, Any]:
        return dict(RequestSerializer(self.get_queryset().get(pk=found.pk)).data)


# --- what the egress proxy forwards from sandboxes, with its runner's token ---------------------


DeskAnswer = inline_serializer(
    "DeskAnswer",
    {
        "id": serializers.IntegerField(),
        "kind": serializers.CharField(),
        "what": serializers.CharField(),
        "status": serializers.CharField(),
        "decision": serializers.CharField(required=False),
        "note": serializers.CharField(required=False),
        "changed": serializers.DictField(required=False),
        "expired": serializers.BooleanField(required=False),
        "until": serializers.DateTimeField(required=False),
    },
)


def desk_file(
    token_sha256: str, filing: Any, organisation: Any = None, runner: Any = None
) -> tuple[int, dict[str, Any]]:
    """The desk's filing (egress/proxy/desk.py) as an HTTP status and JSON answer, whichever
    way it came (a runner's proxy, through :class:`RunnerRequestsView`; the control-plane
    host's, through ``egress.sources``): validated as the API validates a filing, so what the
    API refuses is refused here too, naming its fields."""
    given = FilingSerializer(data=filing)
    if not given.is_valid():
        return 400, refusal(given.errors)
    return services.desk_file(token_sha256, given.validated_data, organisation, runner)


def refusal(errors: Any) -> dict[str, Any]:
    """A serializer's errors as the desk answers them: each field's messages, and all of them
    in ``detail``, the line ``covey-request`` prints."""
    fields = {str(name): [str(said) for said in told] for name, told in errors.items()}
    lines = [
        " ".join(told) if name == api_settings.NON_FIELD_ERRORS_KEY else f"{name}: {' '.join(told)}"
        for name, told in fields.items()
    ]
    return {**fields, "detail": "; ".join(lines)}


class RunnerRequestsView(RunnerEndpoint):
    """File a request for the agent whose egress credential the proxy saw (its runner's
    organisation and runs only; the credential's SHA-256 in ``X-Covey-Token-SHA256``, the
    filing as the body: egress/proxy/desk.py); answers what the agent is told."""

    seen_as = "proxy"

    @extend_schema(request=FilingSerializer, responses={201: DeskAnswer})
    def post(self, request: HttpRequest) -> Response:
        token = request.headers.get(TOKEN_HEADER, "")
        runner = self.runner(request)
        code, body = desk_file(token, request.data, runner.organisation, runner)
        return Response(body, status=code)


class RunnerRequestView(RunnerEndpoint):
    """A request's state, for the agent that asked (or one merged into it)."""

    seen_as = "proxy"

    @extend_schema(responses={200: DeskAnswer})
    def get(self, request: HttpRequest, request_id: int) -> Response:
        token = request.headers.get(TOKEN_HEADER, "")
        runner = self.runner(request)
        code, body = services.desk_status(token, request_id, runner.organisation, runner)
        return Response(body, status=code)
