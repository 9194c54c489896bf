"""The two levels of egress, and the cooperative level's environment, checked by a real client
that honours it."""

import subprocess

import pytest

from egress.environment import Isolation, proxy_environment


@pytest.mark.parametrize(
    ("value", "level"), [("none", Isolation.COOPERATIVE), ("network", Isolation.NETWORK)]
)
def test_the_isolation_setting_names_one_level(value, level):
    assert Isolation.from_setting(value) is level


@pytest.mark.parametrize("value", ["cooperative", "Network", "true", ""])
def test_it_refuses_an_isolation_setting_that_names_no_level(value):
    with pytest.raises(ValueError, match=r"COVEY_EGRESS_ISOLATION is .*: use one of none, network"):
        Isolation.from_setting(value)


def test_both_spellings_carry_the_credentials():
    env = proxy_environment("proxy.internal", 3128, "acme.builder:s3cr/t")
    assert env["HTTPS_PROXY"] == env["https_proxy"] == env["HTTP_PROXY"] == env["http_proxy"]
    assert env["HTTPS_PROXY"] == "http://acme.builder:s3cr%2Ft@proxy.internal:3128"
    assert "127.0.0.1" in env["NO_PROXY"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_curl_obeys_it_and_a_process_that_ignores_it_goes_around(proxy, net, world):
    """Cooperative means bypassable: that is why hard isolation exists."""
    _, credentials = world
    env = {"PATH": "/usr/bin:/bin", **proxy_environment("127.0.0.1", proxy.port, credentials)}
    url = f"https://good.test:{net.tls.port}/"
    resolve = f"good.test:{net.tls.port}:{net.tls.host}"
    common = ["curl", "-sS", "--max-time", "10", "--cacert", str(net.ca.ca_file), url]
    # curl cannot resolve good.test itself: an answer means the proxy carried the request.
    through = subprocess.run(common, env=env, capture_output=True, text=True, check=False)
    assert through.stdout == "hello from good", through.stderr
    # The proxy decides for it...
    blocked = [*common[:-1], "https://other.test/"]
    refused = subprocess.run(blocked, env=env, capture_output=True, text=True, check=False)
    assert refused.returncode != 0
    # ...and a process that ignores the variables reaches the upstream directly.
    around = [*common[:-1], "--noproxy", "*", "--resolve", resolve, url]
    bypass = subprocess.run(around, env=env, capture_output=True, text=True, check=False)
    assert bypass.stdout == "hello from good", bypass.stderr
