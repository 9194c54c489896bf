"""What every organisation-owned API resource shares: tenant scoping (another organisation's
objects are simply 404), role checks, and fields that choose among what a user may see."""

from typing import Any

from django.db.models import Model, QuerySet
from rest_framework import mixins, permissions, serializers, viewsets
from rest_framework.request import Request

from organisations.models import Organisation, Role
from organisations.roles import role_of


class OrganisationRolePermission(permissions.BasePermission):
    """Reads for every member; writes only for the roles the view names in ``write_roles``."""

    message = "Your role in this organisation does not allow this change."

    def has_object_permission(self, request: Request, view: Any, obj: Model) -> bool:
        if request.method in permissions.SAFE_METHODS:
            return True
        return role_of(request.user, view.organisation_of(obj)) in view.write_roles


class OrganisationScoped(viewsets.GenericViewSet):
    """A resource owned by an organisation: its queryset is scoped to the user's organisations
    (another organisation's objects are simply 404), members read, ``write_roles`` change.
    Subclasses add the mixins of the actions they offer."""

    permission_classes = [permissions.IsAuthenticated, OrganisationRolePermission]
    write_roles: frozenset[str] = frozenset({Role.ADMIN})

    def get_queryset(self) -> QuerySet[Any]:
        return super().get_queryset().for_user(self.request.user)  # type: ignore[attr-defined]

    def organisation_of(self, obj: Any) -> Organisation:
        """The organisation that owns ``obj`` (override for objects that are not direct)."""
        return obj if isinstance(obj, Organisation) else obj.organisation


class OrganisationScopedViewSet(
    mixins.CreateModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    mixins.ListModelMixin,
    OrganisationScoped,
):
    """An organisation-owned resource with every action of a ModelViewSet."""


class OrganisationField(serializers.PrimaryKeyRelatedField):
    """An organisation the requesting user may create things in (by role)."""

    default_error_messages = {
        "forbidden": "Your role in organisation {name!r} does not allow this; ask an admin.",
    }

    def __init__(self, **kwargs: Any) -> None:
        self.write_roles = kwargs.pop("write_roles", frozenset({Role.ADMIN}))
        super().__init__(**kwargs)

    def get_queryset(self) -> QuerySet[Organisation]:
        return Organisation.objects.for_user(self.context["request"].user)

    def to_internal_value(self, data: Any) -> Organisation:
        organisation: Organisation = super().to_internal_value(data)
        if role_of(self.context["request"].user, organisation) not in self.write_roles:
            self.fail("forbidden", name=organisation.name)
        return organisation


class ScopedRelatedField(serializers.PrimaryKeyRelatedField):
    """A related object chosen by id among those the requesting user may see."""

    def get_queryset(self) -> QuerySet[Any]:
        queryset: Any = super().get_queryset()
        return queryset.for_user(self.context["request"].user)
