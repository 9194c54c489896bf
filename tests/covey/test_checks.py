"""System checks stop start-up on egress settings that make no sense."""

import pytest
from django.test import override_settings

from egress.checks import check_egress_settings


def ids(**settings):
    with override_settings(**settings):
        return [message.id for message in check_egress_settings()]


def test_the_defaults_pass():
    assert ids() == []


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"COVEY_EGRESS_BASE_ALLOWLIST": ["*.anthropic.com"]}, "egress.E001"),
        ({"COVEY_EGRESS_BASE_ALLOWLIST": ["10.0.0.1"]}, "egress.E001"),
        ({"COVEY_EGRESS_ISOLATION": "strict"}, "egress.E002"),
        ({"COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": ["10.0.0.1/8"]}, "egress.E003"),
        ({"COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS": ["mirror.corp"]}, "egress.E003"),
        ({"COVEY_EGRESS_NAMESERVERS": ["dns.example"]}, "egress.E004"),
    ],
)
def test_bad_egress_settings_are_errors_with_ids(settings, expected):
    assert ids(**settings) == [expected]


def test_good_egress_settings_pass():
    assert (
        ids(
            COVEY_EGRESS_ISOLATION="network",
            COVEY_EGRESS_ALLOWED_PRIVATE_CIDRS=["10.20.0.0/16", "fd00::/8"],
            COVEY_EGRESS_NAMESERVERS=["127.0.0.53", "::1@5353"],
        )
        == []
    )
