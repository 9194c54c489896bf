"""The egress app."""

from django.apps import AppConfig


class EgressConfig(AppConfig):
    """Egress: allowlist grammar, policy, proxy and isolation."""

    name = "egress"

    def ready(self) -> None:
        from egress import checks  # noqa: F401  (registers the system checks)
