"""covey's admin site: membership of an organisation is what lets a person in (Django's staff
flag is only the platform team's way in), and a refusal is a page that says why."""

from typing import Any

from django.contrib import admin
from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpRequest
from django.template.response import TemplateResponse

from organisations.models import Organisation
from organisations.roles import is_member, member_now


def may_enter(user: Any) -> bool:
    """Whether the person may use the admin: an active member of an organisation, or of the
    platform team (staff, superusers)."""
    return bool(user.is_active and (user.is_staff or user.is_superuser or is_member(user)))


class LoginForm(AdminAuthenticationForm):
    """The admin's sign-in: a member signs in without Django's staff flag."""

    def confirm_login_allowed(self, user: Any) -> None:
        if not user.is_active:
            raise ValidationError(self.error_messages["inactive"], code="inactive")
        if not may_enter(user):
            raise ValidationError(
                "This account belongs to no organisation yet: an admin of one adds it as a"
                " member (viewer, approver or admin).",
                code="invalid_login",
            )


class AdminSite(admin.AdminSite):
    """The admin every member uses: their roles in their organisations say what they read,
    decide and change (organisations/admin.py ``TenantScoped``)."""

    # The index: what waits for a person, then the apps (covey/templates/admin/). The header
    # and every page's title say covey ("Run 1a2b3c4d of acme/builder | covey").
    index_template = "admin/covey_index.html"
    site_header = "covey administration"
    site_title = "covey"
    index_title = "Dashboard"
    login_form = LoginForm

    def has_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return bool(user.is_active and (user.is_staff or member_now(request)))

    def index(self, request: HttpRequest, extra_context: Any = None) -> Any:
        """The start page; on an installation with no organisation it says what to do first."""
        first = not Organisation.objects.for_user(request.user).exists()
        may_add = request.user.has_perm("organisations.add_organisation")
        extra = {"first_step": first, "may_add_organisation": may_add}
        return super().index(request, {**extra, **(extra_context or {})})


def refused_page(request: HttpRequest, reason: str) -> TemplateResponse:
    """The admin's 403: styled as the admin, saying why and which role would do."""
    context = {
        **admin.site.each_context(request),
        "title": "Not allowed",
        "reason": reason or "Your roles do not allow this.",
    }
    response = TemplateResponse(request, "admin/covey_403.html", context, status=403)
    return response
