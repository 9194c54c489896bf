"""The admin index's count of pending requests."""

from typing import Any

from django import template
from django.urls import reverse
from django.utils.html import format_html

from approvals.models import Request, Status
from organisations.admin import may_view
from organisations.models import Role
from organisations.roles import has_role_somewhere

register = template.Library()


@register.simple_tag(takes_context=True)
def pending_requests(context: dict[str, Any]) -> str:
    """'3 pending requests', linked to them, for the user's organisations ('' when none, or
    when the user may not view requests)."""
    user = context["request"].user
    if not may_view(context["request"], "approvals.request"):
        return ""
    count = Request.objects.for_user(user).filter(status=Status.PENDING).count()
    if not count:
        return ""
    url = reverse("admin:approvals_request_changelist") + f"?status__exact={Status.PENDING}"
    word = "request" if count == 1 else "requests"
    # "to decide" for who may; a viewer is told they wait, not asked to decide.
    tail = "to decide" if has_role_somewhere(user, Role.APPROVER) else "waiting for a decision"
    return format_html(
        '<p id="pending-requests" class="errornote"><a href="{}">{} pending {}</a> {}</p>',
        url,
        count,
        word,
        tail,
    )
