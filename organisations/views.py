"""API resources: organisations."""

from typing import Any

from rest_framework import permissions
from rest_framework.request import Request

from organisations import services
from organisations.api import OrganisationScopedViewSet
from organisations.models import Organisation
from organisations.serializers import OrganisationSerializer


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
