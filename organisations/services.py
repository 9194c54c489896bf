"""Creating and changing organisations; the API, the admin and commands all call these."""

from collections.abc import Callable, Iterable
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils.text import slugify

from organisations.models import Membership, Organisation, Role

# What else a new organisation needs, from apps that build on this one (they register here in
# their AppConfig.ready(); this app imports none of them): e.g. its built-in runner.
when_created: list[Callable[[Organisation], object]] = []
# What an organisation about to be deleted takes with it, from those apps: e.g. its built-in
# runner, which nobody made by hand.
when_deleting: list[Callable[[Organisation], object]] = []


def find_one(queryset: Any, reference: str, field: str, noun: str) -> Any:
    """One row of an organisation's by id, ``field`` (when unique across organisations) or
    ``organisation-slug/<field>``; the model's DoesNotExist or MultipleObjectsReturned, saying
    what to give instead."""
    if reference.isdigit():
        found = list(queryset.filter(pk=int(reference)))
    elif "/" in reference:
        org, _, value = reference.partition("/")
        found = list(queryset.filter(organisation__slug=org, **{field: value}))
    else:
        found = list(queryset.filter(**{field: reference})[:2])
    if not found:
        raise queryset.model.DoesNotExist(
            f"no {noun} {reference!r} (give an id, a {field} or org-slug/{field})"
        )
    if len(found) > 1:
        raise queryset.model.MultipleObjectsReturned(
            f"several {noun}s are called {reference!r}; use org-slug/{field}"
        )
    return found[0]


def slug_for(name: str, field: str = "name") -> str:
    """The slug a name gets, or a ValidationError when the name has nothing to make one from."""
    slug = slugify(name)[:100]
    if not slug:
        raise ValidationError({field: ["the name must contain at least one letter or digit"]})
    return slug


@transaction.atomic
def create_organisation(
    name: str,
    *,
    by: Any = None,
    slug: str | None = None,
    base_allowlist: Iterable[str] | None = None,
    request_expiry_minutes: int | None = None,
    own_requests: str | None = None,
) -> Organisation:
    """Create an organisation; the user who creates it becomes its admin, and every hook in
    :data:`when_created` runs in the same transaction."""
    organisation = Organisation(
        name=name, slug=slug or slug_for(name), request_expiry_minutes=request_expiry_minutes
    )
    if Organisation.objects.filter(name=name).exists():
        raise ValidationError({"name": [f"an organisation named {name!r} exists already"]})
    if Organisation.objects.filter(slug=organisation.slug).exists():
        raise ValidationError(
            {"name": [f"an organisation with the slug {organisation.slug!r} exists already"]}
        )
    if base_allowlist is not None:
        organisation.base_allowlist = list(base_allowlist)
    if own_requests is not None:
        organisation.own_requests = own_requests
    organisation.full_clean()
    organisation._history_user = by  # type: ignore[attr-defined]
    organisation.save()
    if by is not None and by.is_authenticated:
        Membership.objects.create(organisation=organisation, user=by, role=Role.ADMIN)
    for hook in when_created:
        hook(organisation)
    return organisation


@transaction.atomic
def update_organisation(
    organisation: Organisation, *, by: Any = None, reason: str = "", **changes: Any
) -> None:
    """Change an organisation's name, base allowlist, request expiry or whether its only
    approver decides their own filings (recorded in its history, with ``reason`` when covey
    changes it, e.g. an approved request)."""
    unknown = set(changes) - {"name", "base_allowlist", "request_expiry_minutes", "own_requests"}
    if unknown:
        raise TypeError(f"cannot change {', '.join(sorted(unknown))} of an organisation")
    for field, value in changes.items():
        setattr(organisation, field, value)
    organisation.full_clean()
    organisation._history_user = by  # type: ignore[attr-defined]
    organisation._change_reason = reason[:100] or None  # type: ignore[attr-defined]
    organisation.save()


@transaction.atomic
def delete_organisation(organisation: Organisation, *, by: Any = None) -> None:
    """Delete an organisation with nothing left in it; ProtectedError (the API answers 409)
    names what still depends on it, and then nothing is deleted."""
    for hook in when_deleting:
        hook(organisation)
    organisation._history_user = by  # type: ignore[attr-defined]
    organisation.delete()


# --- memberships: who belongs to an organisation, in which role -----------------------------

LAST_ADMIN = "an organisation keeps at least one admin: make another member admin first"


@transaction.atomic
def add_member(organisation: Organisation, user: Any, role: str, *, by: Any = None) -> Membership:
    """Make ``user`` a member of ``organisation`` in ``role``; ValidationError if they are one
    already (change their role instead)."""
    if Membership.objects.filter(organisation=organisation, user=user).exists():
        raise ValidationError(
            {"user": [f"{user} is a member of {organisation} already: change their role"]}
        )
    membership = Membership(organisation=organisation, user=user, role=role)
    membership.full_clean()
    membership._history_user = by  # type: ignore[attr-defined]
    membership.save()
    return membership


@transaction.atomic
def change_role(membership: Membership, role: str, *, by: Any = None) -> Membership:
    """Give a member another role; the organisation's last admin stays one."""
    locked = Membership.objects.select_for_update().get(pk=membership.pk)
    if locked.role == Role.ADMIN and role != Role.ADMIN and _admins(locked.organisation_id) == 1:
        raise ValidationError({"role": [LAST_ADMIN]})
    locked.role = role
    locked.full_clean()
    locked._history_user = by  # type: ignore[attr-defined]
    locked.save(update_fields=["role"])
    return locked


@transaction.atomic
def remove_member(membership: Membership, *, by: Any = None) -> None:
    """End a membership; the organisation's last admin stays."""
    locked = Membership.objects.select_for_update().get(pk=membership.pk)
    if locked.role == Role.ADMIN and _admins(locked.organisation_id) == 1:
        raise ValidationError({"user": [LAST_ADMIN]})
    locked._history_user = by  # type: ignore[attr-defined]
    locked.delete()


def _admins(organisation_id: int) -> int:
    # Every admin's row locked: two admins demoting each other at once cannot leave none.
    return len(
        Membership.objects.select_for_update()
        .filter(organisation_id=organisation_id, role=Role.ADMIN)
        .values_list("pk", flat=True)
    )
