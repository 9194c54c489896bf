"""Sealing a renewed runner token for the broker (no Django: both planes use it).

A renewed token travels through the runner's queue sealed with a key only the runner and the
control plane can derive: from the old token's hash, which the control plane stores and the
runner can compute. The broker never sees the token.
"""

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken


def _key(old_token_sha256: str) -> bytes:
    digest = hashlib.sha256(b"covey runner token renewal\0" + old_token_sha256.encode()).digest()
    return base64.urlsafe_b64encode(digest)


def seal(old_token_sha256: str, new_token: str) -> str:
    """The new token, readable only with the old token's hash."""
    return Fernet(_key(old_token_sha256)).encrypt(new_token.encode()).decode()


def unseal(old_token_sha256: str, sealed: str) -> str:
    """The new token; ValueError when it was not sealed for this old token."""
    try:
        return Fernet(_key(old_token_sha256)).decrypt(sealed.encode()).decode()
    except InvalidToken:
        raise ValueError("the renewed token was not sealed for this runner's token") from None
