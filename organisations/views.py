"""API resources: organisations and their memberships."""

from typing import Any

from django.core.exceptions import ValidationError
from rest_framework import permissions, status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.exceptions import ValidationError as BadRequest
from rest_framework.request import Request
from rest_framework.response import Response

from organisations import services, webhooks
from organisations.api import OrganisationScopedViewSet
from organisations.models import Membership, Organisation, Role, Webhook
from organisations.roles import role_of
from organisations.serializers import (
    MembershipSerializer,
    OrganisationSerializer,
    WebhookSerializer,
)


class PlatformTeamOnly(permissions.BasePermission):
    """Creating and deleting organisations is for the platform team (the ``add_organisation``
    and ``delete_organisation`` permissions; superusers have both)."""

    NEEDS = {"create": "add_organisation", "destroy": "delete_organisation"}

    def has_permission(self, request: Request, view: Any) -> bool:
        needed = self.NEEDS.get(view.action)
        if needed is None:
            return True
        self.message = f"This needs the 'organisations.{needed}' permission."
        return bool(request.user.has_perm(f"organisations.{needed}"))


class OrganisationViewSet(OrganisationScopedViewSet):
    """Organisations you belong to. Admins change the name and the base allowlist; the
    platform team creates them, and deletes one that no longer has agents or workplaces."""

    queryset = Organisation.objects.all()
    serializer_class = OrganisationSerializer
    permission_classes = [*OrganisationScopedViewSet.permission_classes, PlatformTeamOnly]
    filterset_fields = ["slug"]
    ordering_fields = ["name", "created_at"]

    def perform_destroy(self, instance: Organisation) -> None:
        services.delete_organisation(instance, by=self.request.user)

    @action(detail=True, methods=["get", "put", "delete"], serializer_class=WebhookSerializer)
    def webhook(self, request: Request, pk: str | None = None) -> Response:
        """Where the organisation's events go (organisations/webhooks.py), for its admins alone
        (a receiver's URL may hold a credential of its own): read it, set it (PUT ``url``,
        ``new_secret``; the answer holds ``secret`` when one was made, this once) and remove
        it (DELETE)."""
        organisation = self.get_object()
        if role_of(request.user, organisation) != Role.ADMIN:
            raise PermissionDenied("Only the organisation's admins see and change its webhook.")
        if request.method == "DELETE":
            if not webhooks.remove_webhook(organisation):
                raise NotFound("this organisation has no webhook")
            return Response(status=status.HTTP_204_NO_CONTENT)
        if request.method == "PUT":
            given = WebhookSerializer(data=request.data)
            given.is_valid(raise_exception=True)
            try:
                secret = webhooks.set_webhook(
                    organisation,
                    given.validated_data["url"],
                    new_secret=given.validated_data["new_secret"],
                )
            except ValidationError as exc:
                raise BadRequest(exc.message_dict) from None
            answer = dict(WebhookSerializer(Webhook.objects.get(organisation=organisation)).data)
            if secret is not None:
                answer["secret"] = secret
            return Response(answer)
        found = Webhook.objects.filter(organisation=organisation).first()
        if found is None:
            raise NotFound("this organisation has no webhook")
        return Response(WebhookSerializer(found).data)


class MembershipViewSet(OrganisationScopedViewSet):
    """Who belongs to your organisations, in which role (admin, approver, viewer). Members
    read; the organisation's admins add members, change their role and remove them, and an
    organisation keeps at least one admin."""

    queryset = Membership.objects.select_related("organisation", "user")
    serializer_class = MembershipSerializer
    filterset_fields = ["organisation", "role"]
    ordering_fields = ["organisation", "role"]
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self) -> Any:
        visible = Organisation.objects.for_user(self.request.user)
        return self.queryset.filter(organisation__in=visible)

    def perform_destroy(self, instance: Membership) -> None:
        services.remove_member(instance, by=self.request.user)
