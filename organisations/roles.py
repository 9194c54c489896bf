"""Who may do what in an organisation, and how a person's roles are said to them."""

from typing import Any

from organisations.models import Membership, Organisation, Role, TenantQuerySet

# What each role may do, cumulative: a refusal names the least role that would do.
RANK = {Role.VIEWER: 0, Role.APPROVER: 1, Role.ADMIN: 2}
ARTICLE = {Role.VIEWER: "a viewer", Role.APPROVER: "an approver", Role.ADMIN: "an admin"}


def role_of(user: Any, organisation: Organisation) -> Role | None:
    """The user's role in the organisation; superusers act as admins everywhere."""
    if not user.is_authenticated:
        return None
    if user.is_superuser:
        return Role.ADMIN
    role = (
        Membership.objects.filter(organisation=organisation, user=user)
        .values_list("role", flat=True)
        .first()
    )
    return Role(role) if role else None


def is_member(user: Any) -> bool:
    """Whether the user is an active member of any organisation: all the admin asks of a
    person who is not on the platform team (no staff flag, no per-user permissions)."""
    if not (user.is_authenticated and user.is_active):
        return False
    return Membership.objects.filter(user=user).exists()


def roles_at_least(least: Role) -> list[Role]:
    """``least`` and the roles above it (an admin may do what an approver may)."""
    return [role for role, rank in RANK.items() if rank >= RANK[least]]


def member_now(request: Any) -> bool:
    """:func:`is_member` of the request's user, or on the platform team (a superuser), asked
    once a request: the admin asks it of every page and every app on the index."""
    known = getattr(request, "_covey_member", None)
    if known is None:
        user = request.user
        known = bool(user.is_active and user.is_superuser) or is_member(user)
        request._covey_member = known
    return known


def has_role_somewhere(user: Any, least: Role) -> bool:
    """Whether the user holds ``least`` or a greater role in some organisation."""
    if not (user.is_authenticated and user.is_active):
        return False
    if user.is_superuser:
        return True
    return Membership.objects.filter(user=user, role__in=roles_at_least(least)).exists()


def organisation_of(obj: Any) -> Organisation | None:
    """The organisation that owns a row of a tenant model, found along the same path its
    queryset scopes by (``agent__organisation__memberships__user`` → ``obj.agent.organisation``);
    None for a row of no organisation."""
    if isinstance(obj, Organisation):
        return obj
    manager = type(obj)._default_manager
    queryset = manager.get_queryset()
    if not isinstance(queryset, TenantQuerySet):
        return None
    found: Any = obj
    for step in queryset.membership_lookup.split("__")[:-2]:  # drop memberships__user
        found = getattr(found, step, None)
        if found is None:
            return None
    return found if isinstance(found, Organisation) else None


def roles_said(user: Any) -> str:
    """The user's roles as a sentence's end: 'a viewer of Acme and an approver of Globex'."""
    if user.is_superuser:
        return "on the platform team"
    rows = Membership.objects.filter(user=user).select_related("organisation")
    parts = [f"{ARTICLE[Role(m.role)]} of {m.organisation}" for m in rows]
    if not parts:
        return "a member of no organisation"
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
