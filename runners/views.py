"""API: runners of your organisations, and registration for new runner hosts."""

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from runners import services
from runners.models import Runner


class RunnerSerializer(serializers.ModelSerializer):
    """A runner (its token is never shown again after registration)."""

    class Meta:
        model = Runner
        fields = ["id", "organisation", "name", "labels", "paused", "created_at", "last_seen_at"]
        read_only_fields = fields


class RunnerViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Runners of your organisations."""

    queryset = Runner.objects.all()
    serializer_class = RunnerSerializer
    filterset_fields = ["organisation", "paused"]

    def get_queryset(self) -> Any:
        return Runner.objects.for_user(self.request.user)


class RegistrationSerializer(serializers.Serializer):
    """What a new runner host sends to register."""

    registration_token = serializers.CharField()
    name = serializers.CharField(max_length=100)
    labels = serializers.ListField(child=serializers.CharField(), required=False, default=list)


class RegisterRunnerView(APIView):
    """Exchange a registration token for a runner token (shown once)."""

    authentication_classes: list[Any] = []
    permission_classes = [permissions.AllowAny]

    @extend_schema(request=RegistrationSerializer, responses={201: dict})
    def post(self, request: Request) -> Response:
        serializer = RegistrationSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        runner, token = services.register_runner(
            data["registration_token"], data["name"], data["labels"]
        )
        body = {**RunnerSerializer(runner).data, "token": token}
        return Response(body, status=status.HTTP_201_CREATED)
