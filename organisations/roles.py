"""Who may do what in an organisation."""

from typing import Any

from organisations.models import Membership, Organisation, Role


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
