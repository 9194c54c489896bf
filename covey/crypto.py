"""Secrets the control plane must read back (a webhook's signing secret, a model API key), kept
encrypted at rest.

Fernet (AES-128-CBC with HMAC-SHA256, from ``cryptography``) with the keys of
COVEY_ENCRYPTION_KEYS: the first encrypts, every one decrypts, so a key is rotated by putting a
new one first and re-encrypting (:func:`rotate`) before the old one is dropped. Without the
setting the key is the one ``python -m covey.var`` made in the var directory (``make run``
does); a production control plane sets it, the same on every process. A value that no key
opens is an error that says so, never an empty secret.
"""

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

PREFIX = "fernet:"  # what an encrypted value starts with, so a plain one is never taken for it


class Undecryptable(Exception):
    """No key of COVEY_ENCRYPTION_KEYS opens the value."""


def _fernet() -> MultiFernet:
    keys = [key for key in settings.COVEY_ENCRYPTION_KEYS if key]
    if not keys:
        raise ImproperlyConfigured(
            "no encryption key: set COVEY_ENCRYPTION_KEYS, or run 'python -m covey.var'"
            f" (make run does) to make one in {settings.VAR_DIR}"
        )
    try:
        return MultiFernet([Fernet(key) for key in keys])
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"COVEY_ENCRYPTION_KEYS: each key must be 32 url-safe base64-encoded bytes ({exc})"
        ) from None


def encrypt(secret: str) -> str:
    """``secret`` encrypted with the first key."""
    return PREFIX + _fernet().encrypt(secret.encode()).decode()


def decrypt(value: str) -> str:
    """The secret in ``value`` (from :func:`encrypt`); Undecryptable when no key opens it."""
    if not value.startswith(PREFIX):
        raise Undecryptable("the value is not encrypted by covey")
    try:
        return _fernet().decrypt(value.removeprefix(PREFIX).encode()).decode()
    except InvalidToken:
        raise Undecryptable(
            "no key of COVEY_ENCRYPTION_KEYS opens it (was the key changed without keeping the"
            " old one after it?)"
        ) from None


def rotate(value: str) -> str:
    """``value`` encrypted again with the first key."""
    return PREFIX + _fernet().rotate(value.removeprefix(PREFIX).encode()).decode()
