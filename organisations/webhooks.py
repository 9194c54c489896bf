"""An organisation's webhook: its events POSTed as JSON, signed, by the control plane's worker.

A delivery is one POST of ``{"event", "delivery", "at", "organisation", "data"}`` with

- ``X-Covey-Event``: the event (``request.pending``, ``request.decided``);
- ``X-Covey-Delivery``: the delivery's id (the same on each retry: a receiver can drop repeats);
- ``X-Covey-Signature: t=<unix time>,v1=<hex>``: HMAC-SHA256 with the webhook's secret of
  ``<t>.<body>`` (receivers check it, and that ``t`` is recent).

It is sent after the change that caused it commits, by a Celery task (the web request never
waits for a receiver), with certificate verification, a short timeout and retries with back-off;
an answer outside 2xx counts as a failure. The last outcome is kept on the webhook. The secret
is shown once, when made (:func:`set_webhook`), and never again.
"""

import hashlib
import hmac
import json
import logging
import secrets
import ssl
import time
import uuid
from typing import Any

import httpx
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import transaction
from django.utils import timezone

from covey import crypto
from covey.celery import app
from organisations.models import Organisation, Webhook

logger = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"  # noqa: S105 - how a signing secret starts, not one
SIGNATURE_HEADER = "X-Covey-Signature"
EVENTS = ("request.pending", "request.decided")
TIMEOUT = 10.0  # seconds for one POST
RETRIES = 5  # after the first try; back-off 10 s, 20 s, 40 s, 80 s, 160 s
DELIVER = "organisations.webhook"  # the task (organisations/tasks.py)
USER_AGENT = "covey-webhook/1"


def set_webhook(organisation: Organisation, url: str, *, new_secret: bool = False) -> str | None:
    """Point the organisation's webhook at ``url`` (checked: http or https); returns the new
    signing secret when one was made (a new webhook, or ``new_secret``), else None. The secret
    is returned this once: keep it."""
    url = url.strip()
    try:
        URLValidator(schemes=["http", "https"])(url)
    except ValidationError:
        raise ValidationError({"url": ["give an http or https URL"]}) from None
    with transaction.atomic():
        webhook = Webhook.objects.select_for_update().filter(organisation=organisation).first()
        secret = None
        if webhook is None or new_secret:
            secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        if webhook is None:
            webhook = Webhook(organisation=organisation)
        webhook.url = url
        if secret is not None:
            webhook.secret = crypto.encrypt(secret)
            webhook.secret_made_at = timezone.now()
        webhook.save()
    return secret


def remove_webhook(organisation: Organisation) -> bool:
    """No more deliveries for the organisation; whether it had a webhook."""
    deleted, _ = Webhook.objects.filter(organisation=organisation).delete()
    return bool(deleted)


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The X-Covey-Signature value of ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def send(organisation_id: int, event: str, data: dict[str, Any]) -> None:
    """Post ``event`` to the organisation's webhook, if it has one, once the current
    transaction commits (from a Celery worker)."""
    if event not in EVENTS:
        raise ValueError(f"unknown webhook event {event!r}")
    if not Webhook.objects.filter(organisation_id=organisation_id).exists():
        return
    delivery = str(uuid.uuid4())
    at = timezone.now().isoformat()
    transaction.on_commit(
        lambda: app.send_task(DELIVER, args=[organisation_id, event, delivery, at, data])
    )


def post(organisation_id: int, event: str, delivery: str, at: str, data: dict[str, Any]) -> str:
    """POST the event now; the outcome ("delivered: 204", "failed: …"), also kept on the
    webhook. Never raises for the receiver's failures."""
    webhook = (
        Webhook.objects.select_related("organisation")
        .filter(organisation_id=organisation_id)
        .first()
    )
    if webhook is None:
        return "no webhook"
    organisation = webhook.organisation
    body = json.dumps(
        {
            "event": event,
            "delivery": delivery,
            "at": at,
            "organisation": {"id": organisation.pk, "slug": organisation.slug},
            "data": data,
        },
        sort_keys=True,
    ).encode()
    try:
        secret = crypto.decrypt(webhook.secret)
    except crypto.Undecryptable as exc:
        return _kept(webhook, f"failed: the signing secret cannot be read: {exc}")
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-Covey-Event": event,
        "X-Covey-Delivery": delivery,
        SIGNATURE_HEADER: signature(secret, int(time.time()), body),
    }
    try:
        answer = httpx.post(
            webhook.url,
            content=body,
            headers=headers,
            timeout=TIMEOUT,
            follow_redirects=False,
            verify=_verify(),
        )
    except httpx.HTTPError as exc:
        return _kept(webhook, f"failed: {type(exc).__name__}: {exc}"[:300])
    if not 200 <= answer.status_code < 300:
        return _kept(webhook, f"failed: the receiver answered {answer.status_code}")
    return _kept(webhook, f"delivered: {answer.status_code}")


def _verify() -> ssl.SSLContext:
    """The system's CAs, or COVEY_WEBHOOK_CA_BUNDLE's."""
    return ssl.create_default_context(cafile=settings.COVEY_WEBHOOK_CA_BUNDLE or None)


def _kept(webhook: Webhook, outcome: str) -> str:
    Webhook.objects.filter(pk=webhook.pk).update(
        last_delivery=outcome[:300], last_delivery_at=timezone.now()
    )
    if outcome.startswith("failed"):
        logger.warning("covey: webhook of %s: %s", webhook.organisation, outcome)
    return outcome
