"""Registering runners and checking their tokens."""

import secrets
from collections.abc import Iterable
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents.models import Organisation
from egress.policy import hash_token
from runners.labels import normalise_labels
from runners.models import RegistrationToken, Runner


def create_registration_token(
    organisation: Organisation, *, by: Any = None, description: str = ""
) -> tuple[RegistrationToken, str]:
    """A new registration token; the secret is returned once and stored only hashed."""
    secret = "covey-reg-" + secrets.token_urlsafe(24)
    token = RegistrationToken.objects.create(
        organisation=organisation,
        description=description,
        sha256=hash_token(secret),
        prefix=secret[10:18],
        created_by=by if by is not None and by.is_authenticated else None,
    )
    return token, secret


@transaction.atomic
def register_runner(
    registration_secret: str, name: str, labels: Iterable[str]
) -> tuple[Runner, str]:
    """Exchange a registration token for a runner and its runner token (returned once)."""
    now = timezone.now()
    registration = (
        RegistrationToken.objects.select_related("organisation")
        .filter(sha256=hash_token(registration_secret), revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .first()
    )
    if registration is None:
        raise ValidationError({"registration_token": ["unknown, revoked or expired"]})
    try:
        clean_labels = normalise_labels(list(labels))
    except ValueError as exc:
        raise ValidationError({"labels": [str(exc)]}) from None
    if Runner.objects.filter(organisation=registration.organisation, name=name).exists():
        raise ValidationError({"name": [f"a runner named {name!r} exists already"]})
    secret = "covey-run-" + secrets.token_urlsafe(32)
    runner = Runner(
        organisation=registration.organisation,
        name=name,
        labels=clean_labels,
        token_sha256=hash_token(secret),
        token_prefix=secret[10:18],
    )
    runner.full_clean()
    runner.save()
    return runner, secret


def runner_for_token(secret: str) -> Runner | None:
    """The runner a runner token belongs to, or None."""
    if not secret:
        return None
    return (
        Runner.objects.select_related("organisation")
        .filter(token_sha256=hash_token(secret))
        .first()
    )
