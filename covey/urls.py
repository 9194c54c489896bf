"""URLs: the admin at /admin/, the API at /api/v1/ with its schema and docs, and /healthz,
/readyz and /metrics for whatever watches the process.

The API's schema and docs come in two: the public API (/api/v1/schema/, /api/v1/docs/), what
people and automation call with their token, and the internal one (/api/v1/schema/internal/,
/api/v1/docs/internal/), what runner hosts and their egress proxies call with a runner token
(``internal_api`` below)."""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from agents.views import AgentViewSet
from approvals.views import RequestViewSet, RunnerRequestsView, RunnerRequestView
from budgets.views import AgentUsageView, BudgetViewSet, ChargeViewSet
from connections.views import ConnectionViewSet, CredentialedRequestViewSet
from covey.health import healthz, readyz
from covey.metrics import metrics
from egress.views import DecisionViewSet, EgressTokenViewSet
from homes.runner_views import RunnerHomeAnswerView, RunnerHomeBodyView, RunnerHomeTakeView
from homes.views import HomeViewSet
from organisations.views import MembershipViewSet, OrganisationViewSet
from runners.views import (
    DecisionIngestView,
    EgressPolicyView,
    RegisterRunnerView,
    RunnerPauseView,
    RunnerProbeReportView,
    RunnerProbesView,
    RunnerSelfView,
    RunnerViewSet,
)
from runs.views import (
    RunLogView,
    RunnerRunsView,
    RunOutputView,
    RunReportView,
    RunStartView,
    RunViewSet,
)
from templates.views import AllowlistTemplateViewSet
from workplaces.views import WorkplaceViewSet


def no_favicon(request: HttpRequest) -> HttpResponse:
    """Browsers ask every new session: nothing, said so without a 404 in the log."""
    return HttpResponse(status=204, headers={"Cache-Control": "max-age=86400"})


router = DefaultRouter()
router.register("organisations", OrganisationViewSet)
router.register("memberships", MembershipViewSet)
router.register("agents", AgentViewSet)
router.register("allowlist-templates", AllowlistTemplateViewSet)
router.register("workplaces", WorkplaceViewSet)
router.register("connections", ConnectionViewSet)
router.register("credentialed-requests", CredentialedRequestViewSet)
router.register("egress-tokens", EgressTokenViewSet)
router.register("egress-decisions", DecisionViewSet)
router.register("runners", RunnerViewSet)
router.register("runs", RunViewSet)
router.register("requests", RequestViewSet)
router.register("budgets", BudgetViewSet)
router.register("charges", ChargeViewSet)
# An alias, a public name (docs/architecture.md, "Public names").
router.register("package-requests", RequestViewSet, basename="package-request")


def _home(suffix: str, actions: dict[str, Any], name: str) -> Any:
    # An action must not be named like an HTTP method: the view would answer it on every route.
    return path(
        f"api/v1/agents/<int:agent_id>/home/{suffix}",
        HomeViewSet.as_view(actions),
        name=f"agent-home-{name}",
    )


home_urls = [
    _home("", {"get": "summary"}, "summary"),
    _home("entries/", {"get": "entries"}, "entries"),
    _home("stat/", {"get": "stat"}, "stat"),
    _home("download/", {"get": "download", "head": "download_head"}, "download"),
    _home("file/", {"put": "write"}, "file"),
    _home("upload/", {"post": "upload"}, "upload"),
    _home("mkdir/", {"post": "mkdir"}, "mkdir"),
    _home("move/", {"post": "move"}, "move"),
    _home("delete/", {"post": "remove"}, "delete"),
    _home("usage/", {"get": "usage"}, "usage"),
    _home("changes/", {"get": "changes"}, "changes"),
]

# What runner hosts and their egress proxies call, with a runner token (or, to register, a
# registration token): documented apart from the public API.
internal_api = [
    path("api/v1/egress/policy/", EgressPolicyView.as_view(), name="egress-policy"),
    path("api/v1/egress/decisions/", DecisionIngestView.as_view(), name="egress-decisions-ingest"),
    path("api/v1/runners/register/", RegisterRunnerView.as_view(), name="runner-register"),
    path("api/v1/runner/", RunnerSelfView.as_view(), name="runner-self"),
    path("api/v1/runner/pause/", RunnerPauseView.as_view(), name="runner-pause"),
    path("api/v1/runner/runs/", RunnerRunsView.as_view(), name="runner-runs"),
    path("api/v1/runner/runs/<uuid:run_id>/start/", RunStartView.as_view(), name="runner-start"),
    path("api/v1/runner/runs/<uuid:run_id>/report/", RunReportView.as_view(), name="runner-report"),
    path("api/v1/runner/runs/<uuid:run_id>/log/", RunLogView.as_view(), name="runner-log"),
    path("api/v1/runner/runs/<uuid:run_id>/output/", RunOutputView.as_view(), name="runner-output"),
    path("api/v1/runner/probes/", RunnerProbesView.as_view(), name="runner-probes"),
    path("api/v1/runner/requests/", RunnerRequestsView.as_view(), name="runner-requests"),
    path(
        "api/v1/runner/requests/<int:request_id>/",
        RunnerRequestView.as_view(),
        name="runner-request",
    ),
    path(
        "api/v1/runner/probes/<uuid:probe_id>/report/",
        RunnerProbeReportView.as_view(),
        name="runner-probe-report",
    ),
    path(
        "api/v1/runner/home/<uuid:operation_id>/take/",
        RunnerHomeTakeView.as_view(),
        name="runner-home-take",
    ),
    path(
        "api/v1/runner/home/<uuid:operation_id>/answer/",
        RunnerHomeAnswerView.as_view(),
        name="runner-home-answer",
    ),
    path(
        "api/v1/runner/home/<uuid:operation_id>/body/",
        RunnerHomeBodyView.as_view(),
        name="runner-home-body",
    ),
]

# What people and automation call, with their API token (or the admin's session).
public_api = [
    path("api/v1/auth/", include("rest_framework.urls")),
    path("api/v1/agents/<int:agent_id>/usage/", AgentUsageView.as_view(), name="agent-usage"),
    *home_urls,
    path("api/v1/", include(router.urls)),
]


class InternalSchemaGenerator(SchemaGenerator):
    """The internal schema, titled as such. Not through the view's ``custom_settings``: those
    patch spectacular's settings for the whole process while a schema is made, and the web
    server's threads would make the public one under the internal title meanwhile."""

    def get_schema(self, request: Any = None, public: bool = False) -> Any:
        schema = super().get_schema(request, public)
        schema["info"]["title"] = "covey internal API: runners and egress proxies"
        schema["info"]["description"] = (
            "What runner hosts and their egress proxies call, with a runner token"
            " ('Authorization: Runner <token>'; to register, a registration token): their"
            " runs, reports, output, probes, homes and policy. Not for automation: the public"
            " API is at /api/v1/docs/."
        )
        return schema


urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("favicon.ico", no_favicon),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/v1/schema/", SpectacularAPIView.as_view(urlconf=public_api), name="schema"),
    path(
        "api/v1/schema/internal/",
        SpectacularAPIView.as_view(urlconf=internal_api, generator_class=InternalSchemaGenerator),
        name="schema-internal",
    ),
    path("api/v1/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path(
        "api/v1/docs/internal/",
        SpectacularSwaggerView.as_view(
            url_name="schema-internal", title="covey internal API: runners and egress proxies"
        ),
        name="api-docs-internal",
    ),
    # Before the public API: its router would take "api/v1/runners/register/" for a runner's id.
    *internal_api,
    *public_api,
]
