"""An organisation's webhook: its events POSTed as JSON, signed, by the control plane's worker.

A delivery is one POST of ``{"event", "delivery", "at", "organisation", "data"}`` with

- ``X-Covey-Event``: the event (``request.pending``, ``request.decided``, ``budget.threshold``);
- ``X-Covey-Delivery``: the delivery's id (the same on each retry: a receiver can drop repeats);
- ``X-Covey-Signature: t=<unix time>,v1=<hex>``: HMAC-SHA256 with the webhook's secret of
  ``<t>.<body>`` (receivers check it, and that ``t`` is recent).

It is sent after the change that caused it commits, by a Celery task (the web request never
waits for a receiver), with certificate verification, a short timeout and retries with back-off;
an answer outside 2xx counts as a failure. The last outcome is kept on the webhook. The secret
is shown once, when made (:func:`set_webhook`), and never again.

An organisation's deliveries go one at a time, and a try of an event that no longer holds (a
``request.pending`` whose request was decided since) is dropped, not sent: a retry never
brings a receiver an older event of a request after a newer one.

A receiver must be at a public address, unless COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS holds its
address: an organisation's admin may not point the control plane at the platform's own
network. A URL is checked when it is saved (:func:`check_url`), as far as it can be without
asking DNS: an address given as such, and the names that are always loopback (``localhost``).
The name is resolved once per delivery, checked, and that address connected to (the
certificate is still checked against the name), so a name cannot change its answer between the
check and the connection.
"""

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import ssl
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.core.validators import URLValidator
from django.db import transaction
from django.utils import timezone

from covey import crypto
from covey.celery import app
from organisations.models import Organisation, Webhook

logger = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"  # noqa: S105 - how a signing secret starts, not one
SIGNATURE_HEADER = "X-Covey-Signature"
EVENTS = ("request.pending", "request.decided", "budget.threshold")
TIMEOUT = 10.0  # seconds for one POST
RETRIES = 5  # after the first try; back-off 10 s, 20 s, 40 s, 80 s, 160 s
DELIVER = "organisations.webhook"  # the task (organisations/tasks.py)
USER_AGENT = "covey-webhook/1"


def set_webhook(organisation: Organisation, url: str, *, new_secret: bool = False) -> str | None:
    """Point the organisation's webhook at ``url`` (checked: http or https); returns the new
    signing secret when one was made (a new webhook, or ``new_secret``), else None. The secret
    is returned this once: keep it."""
    try:
        url = check_url(url)
    except ValidationError as exc:
        raise ValidationError({"url": exc.messages}) from None
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


def check_url(url: str) -> str:
    """``url`` as a webhook takes it (stripped); ValidationError saying what is wrong: not an
    http or https URL, or at an address receivers may not be at (not public, and not in
    COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS). What can be told without asking DNS is checked: an
    address given as such, and the names that are always loopback; any other name is checked
    at each delivery, when it is resolved."""
    url = url.strip()
    try:
        URLValidator(schemes=["http", "https"])(url)
    except ValidationError:
        raise ValidationError("give an http or https URL") from None
    name = urlsplit(url).hostname or ""
    for address in _said_addresses(name):
        if not _allowed(address):
            raise ValidationError(
                f"{name} is at {address}, not a public address; the platform team allows private"
                " receivers with COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS"
            )
    return url


LOOPBACK = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


def _said_addresses(name: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
    """The addresses a host name says without DNS: itself when it is an address (in any form
    the resolver reads as one), loopback for ``localhost`` and its subdomains (RFC 6761), none
    for another name."""
    name = name.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return LOOPBACK
    try:
        found = socket.getaddrinfo(name, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError):
        return ()  # a name: resolved, and checked, when a delivery goes
    return tuple(ipaddress.ip_address(str(entry[4][0]).split("%")[0]) for entry in found)


def _allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a receiver may be at ``address``: a public one, or one the platform allows."""
    allowed = [ipaddress.ip_network(cidr) for cidr in settings.COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS]
    return address.is_global or any(address in network for network in allowed)


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
    # robust: a broker that is down loses the delivery (logged), never the committed change.
    transaction.on_commit(
        lambda: app.send_task(DELIVER, args=[organisation_id, event, delivery, at, data]),
        robust=True,
    )


# Whether an event still holds when a try of its delivery comes, by event: '' when it does,
# else why not. Its delivery is then dropped, as a newer event of its subject went (or goes)
# instead: a retry of request.pending never reaches a receiver after request.decided. The
# apps whose events they are register them (approvals/apps.py).
stale_checks: dict[str, Callable[[dict[str, Any]], str]] = {}


def post(organisation_id: int, event: str, delivery: str, at: str, data: dict[str, Any]) -> str:
    """POST the event now, unless it no longer holds (``stale_checks``); the outcome
    ("delivered: 204", "failed: …", "dropped: …"), kept on the webhook unless dropped. Never
    raises for the receiver's failures.

    An organisation's deliveries go one at a time, in the order their tries come: each holds
    its webhook's row from its check to its answer, so an older event checked before a newer
    one was made is answered before the newer one is sent, and one checked after is dropped."""
    with transaction.atomic():
        webhook = (
            Webhook.objects.select_for_update(of=("self",))
            .select_related("organisation")
            .filter(organisation_id=organisation_id)
            .first()
        )
        if webhook is None:
            return "no webhook"
        check = stale_checks.get(event)
        why = check(data) if check is not None else ""
        if why:
            logger.info("covey: webhook of %s: %s %s dropped: %s", webhook.organisation, event,
                        delivery, why)  # fmt: skip
            return f"dropped: {why}"
        return _post(webhook, event, delivery, at, data)


def _post(webhook: Webhook, event: str, delivery: str, at: str, data: dict[str, Any]) -> str:
    organisation = webhook.organisation
    try:
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
    except (TypeError, ValueError) as exc:  # covey's own mistake: kept, and never retried away
        return _kept(webhook, f"failed: the event could not be written as JSON: {exc}")
    try:
        secret = crypto.decrypt(webhook.secret)
    except (crypto.Undecryptable, ImproperlyConfigured) as exc:
        return _kept(webhook, f"failed: the signing secret cannot be read: {exc}")
    try:
        url, host = _pinned(webhook.url)
        verify = _verify()
    except (OSError, ValueError) as exc:
        return _kept(webhook, f"failed: {exc}")
    headers = {
        "Host": host,
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-Covey-Event": event,
        "X-Covey-Delivery": delivery,
        SIGNATURE_HEADER: signature(secret, int(time.time()), body),
    }
    try:
        with httpx.Client(verify=verify, timeout=TIMEOUT, follow_redirects=False) as client:
            answer = client.request(
                "POST",
                url,
                content=body,
                headers=headers,
                extensions={"sni_hostname": urlsplit(webhook.url).hostname or ""},
            )
    except httpx.HTTPError as exc:
        return _kept(webhook, f"failed: {type(exc).__name__}: {exc}"[:300])
    if not 200 <= answer.status_code < 300:
        return _kept(webhook, f"failed: the receiver answered {answer.status_code}")
    return _kept(webhook, f"delivered: {answer.status_code}")


def _verify() -> ssl.SSLContext:
    """The system's CAs, or COVEY_WEBHOOK_CA_BUNDLE's (OSError when it cannot be read)."""
    bundle = settings.COVEY_WEBHOOK_CA_BUNDLE or None
    try:
        return ssl.create_default_context(cafile=bundle)
    except (OSError, ssl.SSLError) as exc:
        raise OSError(
            f"the CA bundle {bundle} (COVEY_WEBHOOK_CA_BUNDLE) cannot be read: {exc}"
        ) from None


def _pinned(url: str) -> tuple[str, str]:
    """``url`` with its host replaced by the address it resolves to now (checked), and the
    Host header it needs; ValueError saying why when the address is not allowed."""
    parts = urlsplit(url)
    name = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        found = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{name} does not resolve: {exc}") from None
    address = ipaddress.ip_address(str(found[0][4][0]))
    if not _allowed(address):
        raise ValueError(
            f"{name} is at {address}, not a public address; the platform team allows private"
            " receivers with COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS"
        )
    shown = f"[{address}]" if address.version == 6 else str(address)
    netloc = f"{shown}:{parts.port}" if parts.port else shown
    host = f"{name}:{parts.port}" if parts.port else name
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, "")), host


def _kept(webhook: Webhook, outcome: str) -> str:
    Webhook.objects.filter(pk=webhook.pk).update(
        last_delivery=outcome[:300], last_delivery_at=timezone.now()
    )
    if outcome.startswith("failed"):
        logger.warning("covey: webhook of %s: %s", webhook.organisation, outcome)
    return outcome
