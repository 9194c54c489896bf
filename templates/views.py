"""API resource: allowlist templates (read by everyone, changed by the platform team)."""

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from allowlists.fields import AllowlistSerializerField
from covey.api import RefusesUnknownFields
from templates import services
from templates.models import AllowlistTemplate


class AllowlistTemplateSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    """A template; ``modified`` tells whether this installation changed what covey ships."""

    entries = AllowlistSerializerField()
    modified = serializers.BooleanField(source="is_modified", read_only=True)

    class Meta:
        model = AllowlistTemplate
        fields = [
            "slug",
            "name",
            "description",
            "docs_url",
            "entries",
            "shipped_entries",
            "modified",
            "updated_at",
        ]
        read_only_fields = ["slug", "shipped_entries", "updated_at"]


class TemplatePermission(permissions.DjangoModelPermissions):
    """Anyone signed in reads; changing needs the model's change permission."""

    perms_map = {
        **permissions.DjangoModelPermissions.perms_map,
        "GET": [],
        "HEAD": [],
        "OPTIONS": [],
        # Templates are never created through the API; POST only restores one.
        "POST": ["%(app_label)s.change_%(model_name)s"],
    }


class AllowlistTemplateViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet,
):
    """The allowlist templates agents can attach, looked up by slug."""

    queryset = AllowlistTemplate.objects.all()
    serializer_class = AllowlistTemplateSerializer
    permission_classes = [permissions.IsAuthenticated, TemplatePermission]
    lookup_field = "slug"

    @extend_schema(request=None)
    @action(detail=True, methods=["post"])
    def restore(self, request: Request, slug: str | None = None) -> Response:
        """Put back the entries covey ships for this template."""
        template = self.get_object()
        services.restore_shipped(template)
        return Response(self.get_serializer(template).data)
