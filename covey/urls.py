"""URLs: the admin at /admin/, the API at /api/v1/ with its schema and docs."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from agents.views import AgentViewSet, OrganisationViewSet
from egress.views import (
    DecisionIngestView,
    DecisionViewSet,
    EgressPolicyView,
    EgressTokenViewSet,
)
from runners.views import RegisterRunnerView, RunnerViewSet
from templates.views import AllowlistTemplateViewSet
from workplaces.views import WorkplaceViewSet

router = DefaultRouter()
router.register("organisations", OrganisationViewSet)
router.register("agents", AgentViewSet)
router.register("allowlist-templates", AllowlistTemplateViewSet)
router.register("workplaces", WorkplaceViewSet)
router.register("egress-tokens", EgressTokenViewSet)
router.register("egress-decisions", DecisionViewSet)
router.register("runners", RunnerViewSet)

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/v1/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/v1/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/v1/auth/", include("rest_framework.urls")),
    path("api/v1/egress/policy/", EgressPolicyView.as_view(), name="egress-policy"),
    path("api/v1/egress/decisions/", DecisionIngestView.as_view(), name="egress-decisions-ingest"),
    path("api/v1/runners/register/", RegisterRunnerView.as_view(), name="runner-register"),
    path("api/v1/", include(router.urls)),
]
