"""egress_explain says what the proxy would decide, and why, with the proxy's own engine."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from agents import services
from templates.models import AllowlistTemplate
from tests.factories import AgentFactory

pytestmark = pytest.mark.django_db


def explain(*args):
    out = StringIO()
    call_command("egress_explain", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def builder(acme):
    AllowlistTemplate.objects.filter(slug="npm").update(entries=["registry.example"])
    return AgentFactory(
        organisation=acme,
        name="builder",
        templates=AllowlistTemplate.objects.filter(slug="npm"),
        allowlist=["git.example:8443", "mirror.example:80"],
    )


@pytest.mark.parametrize(
    ("target", "extra", "expected"),
    [
        ("registry.example", [], "from template:npm"),
        ("api.anthropic.com", [], "from base"),
        ("git.example:8443", [], "from agent"),
        ("mirror.example", ["--plain-http"], "mirror.example:80 from agent"),
        ("other.example", [], "decision: deny not-on-allowlist"),
        ("git.example", [], "decision: deny port-not-allowed"),
        ("git.example:8443", ["--plain-http"], "decision: deny port-not-allowed"),
        ("127.0.0.1", [], "decision: deny ip-literal"),
        ("[::1]:443", [], "decision: deny ip-literal"),
        ("2130706433", [], "decision: deny ip-literal"),
    ],
)
def test_it_names_the_list_that_allows_or_the_code_that_denies(builder, target, extra, expected):
    assert expected in explain("acme/builder", target, "--no-resolve", *extra)


def test_a_disabled_agent_is_explained(builder):
    services.update_agent(builder, enabled=False)
    assert "deny agent-disabled" in explain("acme/builder", "registry.example", "--no-resolve")


def test_it_resolves_and_vets_addresses_through_the_configured_resolver(builder, net):
    net.dns.set("registry.example", "10.9.8.7")
    with override_settings(COVEY_EGRESS_NAMESERVERS=[net.dns.nameserver]):
        output = explain("acme/builder", "registry.example")
        assert "resolves to: 10.9.8.7" in output
        assert "decision: deny non-public-address" in output
        with override_settings(COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS=["10.9.0.0/16"]):
            output = explain("acme/builder", "registry.example")
        assert "decision: allow, connecting to 10.9.8.7 port 443" in output
    net.dns.remove("registry.example")


def test_an_unknown_agent_is_a_clear_error(db):
    with pytest.raises(CommandError, match="no agent"):
        explain("nobody", "x.example")


def test_the_model_gateway_is_a_built_in_destination_of_every_agent(builder):
    with override_settings(COVEY_MODEL_GATEWAY_URL="http://172.17.0.1:8002"):
        output = explain("acme/builder", "172.17.0.1:8002", "--plain-http")
    assert "172.17.0.1:8002 from built-in: model gateway" in output
    assert "decision: allow, connecting to 172.17.0.1 port 8002" in output
    assert "deny ip-literal" in explain("acme/builder", "172.17.0.1:8002", "--plain-http")
