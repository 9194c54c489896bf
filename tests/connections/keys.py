"""Private keys as a GitHub App's come: PEM, unencrypted (the tests make their own)."""

from typing import Any

from cryptography.hazmat.primitives import serialization


def pem(key: Any) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    ).decode()
