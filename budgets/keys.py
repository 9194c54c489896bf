"""Reaching the model gateway: where sandboxes reach it, the per-run tokens they present to
it, and each organisation's keys at the model vendors (kept encrypted)."""

import hashlib
import secrets
from datetime import timedelta
from urllib.parse import urlsplit
from uuid import UUID

from django.core.exceptions import ValidationError
from django.utils import timezone

from agents.models import Agent
from budgets.models import GatewayToken, ModelKey, Vendor
from covey import crypto
from organisations.models import Organisation


def gateway_destination(url: str) -> tuple[str, int] | None:
    """(host, port) of the model gateway as sandboxes reach it (COVEY_MODEL_GATEWAY_URL); None
    when there is none; ValueError when it is not http(s)://HOST[:PORT]."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("give http://HOST:PORT or https://HOST[:PORT]")
    if parts.username is not None or parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(
            "give the gateway's root, with no user, path or query (the SDKs add /v1/…)"
        )
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80)


GATEWAY_TOKEN_PREFIX = "covey-gw-"  # noqa: S105 - what a gateway token starts with


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_gateway_token(agent: Agent, *, run_id: "UUID | str | None", ttl: timedelta) -> str:
    """A credential at the model gateway for the agent (and its run); returned only now."""
    if ttl <= timedelta(0):
        raise ValueError("a token must live for a positive time")
    secret = GATEWAY_TOKEN_PREFIX + secrets.token_urlsafe(32)
    GatewayToken.objects.create(
        agent=agent,
        run_id=run_id,
        sha256=hash_token(secret),
        prefix=secret[: len(GATEWAY_TOKEN_PREFIX) + 3],
        expires_at=timezone.now() + ttl,
    )
    return secret


def revoke_gateway_tokens(*, run_id: "UUID | str") -> int:
    """Revoke the run's live gateway tokens; returns how many."""
    return GatewayToken.objects.filter(run_id=run_id, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )


def model_vendors(organisation_id: int) -> tuple[str, ...]:
    """Whose APIs an organisation's sandboxes are told of: Anthropic's always (the default
    runtime's; without a key the gateway says so), and each other vendor it has a key at."""
    keyed = set(
        ModelKey.objects.filter(organisation_id=organisation_id).values_list("vendor", flat=True)
    )
    return tuple(v for v in Vendor.values if v == Vendor.ANTHROPIC or v in keyed)


def has_model_key(organisation_id: int, vendor: str) -> bool:
    """Whether the organisation has entered its API key at ``vendor``."""
    return ModelKey.objects.filter(organisation_id=organisation_id, vendor=vendor).exists()


def check_model_key(secret: str) -> str:
    """The key without surrounding spaces; ValueError if it cannot be one."""
    secret = secret.strip()
    if len(secret) < 8 or any(ord(c) < 33 or ord(c) > 126 for c in secret):
        raise ValueError("an API key is at least 8 printable characters, without spaces")
    return secret


def set_model_key(
    organisation: Organisation, secret: str, vendor: str = Vendor.ANTHROPIC
) -> ModelKey:
    """The organisation's key at ``vendor``, made or replaced; kept encrypted."""
    try:
        secret = check_model_key(secret)
    except ValueError as exc:
        raise ValidationError({"secret": [str(exc)]}) from None
    if vendor not in Vendor.values:
        raise ValidationError({"vendor": [f"one of {', '.join(Vendor.values)}"]})
    key, _ = ModelKey.objects.update_or_create(
        organisation=organisation,
        vendor=vendor,
        defaults={"secret": crypto.encrypt(secret), "hint": secret[-4:]},
    )
    return key
