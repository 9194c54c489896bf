"""Each environment variable has one parser: the data-plane processes read theirs in their own
config modules, and covey/settings.py takes the values it shares with them from there."""

import json
import os
import re
import subprocess
import sys

import pytest

from budgets.gateway.config import GatewayConfig
from egress.proxy.config import ProxyConfig
from runners.host.config import HostSettings
from tests.covey.test_docs import READ
from tests.processes import ROOT

PARSERS = (
    "egress/proxy/config.py",
    "runners/host/config.py",
    "budgets/gateway/config.py",
    "runners/probe/checks.py",
)


def read_in(name: str) -> set[str]:
    text = (ROOT / name).read_text()
    return {next(g for g in match.groups() if g) for match in READ.finditer(text)}


def test_the_settings_parse_no_variable_a_process_config_parses():
    parsed = set().union(*(read_in(name) for name in PARSERS))
    assert {"COVEY_EGRESS_POLICY_GRACE", "COVEY_RUNNER_HOMES", "COVEY_MODEL_UPSTREAM"} <= parsed
    assert sorted(read_in("covey/settings.py") & parsed) == []


ENVIRONMENT = {
    "COVEY_EGRESS_MAX_TUNNELS": "7",
    "COVEY_EGRESS_POLICY_GRACE": "3.5",
    "COVEY_EGRESS_NAMESERVERS": "10.0.0.53",
    "COVEY_METRICS_TOKEN": "scrape-token",
    "COVEY_CONTROL_PLANE_URL": "https://covey.example.internal",
    "COVEY_MODEL_UPSTREAM": "https://vendor.example.internal",
    "COVEY_GATEWAY_MAX_REQUEST_SECONDS": "600",
    "COVEY_RUNNER_HEARTBEAT_SECONDS": "2",
    "COVEY_EGRESS_PROBE_INTERNET": "192.0.2.1:443",
    "COVEY_DEFAULT_IMAGE": "covey-workplace:other",
}
SHOWN = (
    "COVEY_EGRESS_MAX_TUNNELS", "COVEY_EGRESS_POLICY_GRACE", "COVEY_EGRESS_NAMESERVERS",
    "COVEY_METRICS_TOKEN", "COVEY_CONTROL_PLANE_URL", "COVEY_MODEL_UPSTREAM",
    "COVEY_GATEWAY_MAX_REQUEST_SECONDS", "COVEY_RUNNER_HEARTBEAT_SECONDS",
    "COVEY_EGRESS_PROBE_INTERNET", "COVEY_DEFAULT_IMAGE",
)  # fmt: skip


def test_the_settings_hold_what_the_processes_parsers_read(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COVEY_", "CELERY_"))}
    env |= ENVIRONMENT | {"COVEY_VAR_DIR": str(tmp_path)}
    shown = subprocess.run(
        [sys.executable, "-c", f"import json, covey.settings as s; print(json.dumps("
         f"{{name: getattr(s, name) for name in {SHOWN!r}}}))"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    settings = json.loads(shown.stdout)
    proxy = ProxyConfig.from_environment(ENVIRONMENT)
    gateway = GatewayConfig.from_environment(ENVIRONMENT)
    host = HostSettings.from_environment(ENVIRONMENT)
    assert settings == {
        "COVEY_EGRESS_MAX_TUNNELS": proxy.max_tunnels == 7 and 7,
        "COVEY_EGRESS_POLICY_GRACE": proxy.grace,
        "COVEY_EGRESS_NAMESERVERS": list(proxy.nameservers),
        "COVEY_METRICS_TOKEN": proxy.metrics_token,
        "COVEY_CONTROL_PLANE_URL": host.control_plane_url,
        "COVEY_MODEL_UPSTREAM": gateway.upstream,
        "COVEY_GATEWAY_MAX_REQUEST_SECONDS": gateway.total_timeout,
        "COVEY_RUNNER_HEARTBEAT_SECONDS": host.heartbeat,
        "COVEY_EGRESS_PROBE_INTERNET": ["192.0.2.1:443"],
        "COVEY_DEFAULT_IMAGE": host.default_image,
    }
    assert gateway.total_timeout == 600 and host.heartbeat == 2.0


def test_the_gateway_reads_its_settings_from_the_environment():
    config = GatewayConfig.from_environment(
        {
            "COVEY_MODEL_UPSTREAM": "https://vendor.example.internal",
            "COVEY_MODEL_CA_BUNDLE": "/etc/ca.pem",
            "COVEY_GATEWAY_DEFAULT_MAX_TOKENS": "1000",
            "COVEY_GATEWAY_LEDGER_THREADS": "3",
            "COVEY_MODEL_GATEWAY_LISTEN": "127.0.0.1:9",
        }
    )
    assert config == GatewayConfig(
        upstream="https://vendor.example.internal",
        ca_bundle="/etc/ca.pem",
        default_max_tokens=1000,
        threads=3,
        listen="127.0.0.1:9",
    )
    assert GatewayConfig.from_environment({}) == GatewayConfig()


@pytest.mark.parametrize(
    ("upstream", "problem"),
    [
        ("http://vendor.example.internal", "https only"),
        ("https://vendor.example.internal/v1", "without a path"),
    ],
)
def test_the_gateway_refuses_an_upstream_it_must_not_send_keys_to(upstream, problem):
    config = GatewayConfig.from_environment({"COVEY_OPENAI_UPSTREAM": upstream})
    with pytest.raises(ValueError, match=re.escape(problem)) as refused:
        config.check()
    assert "COVEY_OPENAI_UPSTREAM" in str(refused.value)
