"""The model gateway's settings (``GatewayConfig.from_environment()``), with no Django and
nothing heavy to import: covey/settings.py takes the values it shares with the gateway from
here, so each variable has one parser."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import environ


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway runs; the defaults are covey's."""

    upstream: str = "https://api.anthropic.com"  # COVEY_MODEL_UPSTREAM
    openai_upstream: str = "https://api.openai.com"  # COVEY_OPENAI_UPSTREAM
    ca_bundle: str = ""  # COVEY_MODEL_CA_BUNDLE: the CAs to trust for it (empty: the system's)
    # COVEY_CONNECTIONS_CA_BUNDLE: CAs to trust for connections' hosts besides the system's
    connections_ca_bundle: str = ""
    default_max_tokens: int = 32000  # COVEY_GATEWAY_DEFAULT_MAX_TOKENS: when a request has none
    max_request_bytes: int = 32 * 1024 * 1024  # the Messages API's own limit
    threads: int = 8  # COVEY_GATEWAY_LEDGER_THREADS: ledger calls at once
    connect_timeout: float = 10.0
    read_timeout: float = 600.0  # between two chunks of an answer
    total_timeout: float = 3600.0  # COVEY_GATEWAY_MAX_REQUEST_SECONDS: answer included
    metrics_token: str = field(default="", repr=False)  # COVEY_METRICS_TOKEN: /metrics for it
    listen: str = "127.0.0.1:8002"  # COVEY_MODEL_GATEWAY_LISTEN: HOST:PORT it accepts sandboxes on

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] | None = None) -> "GatewayConfig":
        """The settings in ``environment`` (the process's by default); the metrics token is the
        proxy's variable, and is given by whoever reads that (the settings)."""
        env = environ.Env()
        if environment is not None:
            env.ENVIRON = dict(environment)
        default = cls()
        return cls(
            upstream=env.str("COVEY_MODEL_UPSTREAM", default=default.upstream),
            openai_upstream=env.str("COVEY_OPENAI_UPSTREAM", default=default.openai_upstream),
            ca_bundle=env.str("COVEY_MODEL_CA_BUNDLE", default=""),
            connections_ca_bundle=env.str("COVEY_CONNECTIONS_CA_BUNDLE", default=""),
            default_max_tokens=env.int(
                "COVEY_GATEWAY_DEFAULT_MAX_TOKENS", default=default.default_max_tokens
            ),
            threads=env.int("COVEY_GATEWAY_LEDGER_THREADS", default=default.threads),
            total_timeout=env.int(
                "COVEY_GATEWAY_MAX_REQUEST_SECONDS", default=int(default.total_timeout)
            ),
            listen=env.str("COVEY_MODEL_GATEWAY_LISTEN", default=default.listen),
        )

    def check(self) -> None:
        """ValueError naming the setting that cannot work: vendors are called over https only
        (their key travels with every request), at their root."""
        for name, url in (
            ("COVEY_MODEL_UPSTREAM", self.upstream),
            ("COVEY_OPENAI_UPSTREAM", self.openai_upstream),
        ):
            parts = urlsplit(url)
            if parts.scheme != "https" or not parts.hostname:
                raise ValueError(
                    f"{name} {url!r}: the vendor is called over https only"
                    " (its key travels with every request)"
                )
            if parts.path.strip("/") or parts.query:
                raise ValueError(
                    f"{name} {url!r}: give the vendor's root, without a path"
                    " (the gateway adds /v1/…)"
                )
