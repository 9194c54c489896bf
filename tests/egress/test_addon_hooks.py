"""The proxy addon's hooks (egress/proxy/addon.py) in mitmproxy's own test harness (taddons,
tflow): a policy held in memory, a resolver that answers from a table. No proxy process, no
database, no network: milliseconds. test_proxy.py runs the same decisions through the real
process and real clients."""

import asyncio
import base64
import time

import pytest
from mitmproxy.test import taddons, tflow, tutils

from egress.policy import hash_token
from egress.proxy.addon import CoveyEgress
from egress.proxy.feed import DecisionLog, PolicyFeed

TOKEN, LATE_TOKEN = "a" * 43, "b" * 43  # the shape of tokens covey issues


def snapshot(generation: str, *tokens: str, enabled: bool = True) -> dict:
    return {
        "generation": generation,
        "agents": [
            {
                "id": 1,
                "username": "acme-builder",
                "organisation": "acme",
                "enabled": enabled,
                "budget_exhausted": False,
                "entries": {
                    "plain.test:80": ["agent"],
                    "good.test:443": ["agent"],
                    "inside.test:443": ["agent"],  # resolves to a private address
                },
                "tokens": [
                    {"sha256": hash_token(token), "expires_at": time.time() + 3600}
                    for token in tokens
                ],
            }
        ],
    }


class Source:
    """The policy source: what it serves can change between asks."""

    def __init__(self, served: dict) -> None:
        self.served, self.asks = served, 0

    def __call__(self, known: str | None) -> dict | None:
        self.asks += 1
        return None if known == self.served["generation"] else self.served


class Resolver:
    """Names from a table, as the proxy's resolver gives them."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table

    def cached(self, host: str) -> list[str] | None:
        return self.table.get(host)

    async def resolve(self, host: str) -> list[str]:
        return self.table.get(host, [])


@pytest.fixture
def proxy():
    source = Source(snapshot("g1", TOKEN))
    feed = PolicyFeed(source, poll=60, grace=60)
    feed.refresh()
    decisions: list[dict] = []
    addon = CoveyEgress(feed, DecisionLog(decisions.extend))
    with taddons.context(addon) as tctx:
        tctx.configure(addon, covey_allowed_private_cidrs=["10.9.0.0/16"])
        addon.resolver = Resolver(
            {"plain.test": ["10.9.0.5"], "good.test": ["10.9.0.6"], "inside.test": ["10.1.2.3"]}
        )
        addon.source, addon.events = source, decisions
        yield addon


def basic(token: str = TOKEN, user: str = "acme-builder") -> str:
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def plain(host: str, port: int = 80, credential: str | None = None):
    headers = [(b"Host", host.encode())]
    if credential is not None:
        headers.append((b"Proxy-Authorization", credential.encode()))
    request = tutils.treq(
        host=host, port=port, scheme=b"http", authority=b"", path=b"/", headers=headers
    )
    return tflow.tflow(req=request)


def connect(host: str, port: int = 443, credential: str | None = basic()):
    flow = tflow.tflow(
        req=tutils.treq(
            method=b"CONNECT",
            host=host,
            port=port,
            authority=f"{host}:{port}".encode(),
            path=b"",
            scheme=b"",
            headers=[],
        )
    )
    if credential is not None:
        flow.request.headers["Proxy-Authorization"] = credential
    return flow


def run(hook) -> None:
    """A hook, as mitmproxy awaits it."""
    asyncio.run(hook)


def reason(flow) -> str:
    return flow.response.headers.get("X-Covey-Deny-Reason", "") if flow.response else ""


def test_plain_http_to_a_port_80_entry_goes_on_without_the_credential(proxy):
    flow = plain("PLAIN.test", credential=basic())
    run(proxy.requestheaders(flow))
    assert flow.response is None
    assert "Proxy-Authorization" not in flow.request.headers
    assert (flow.request.host, flow.request.headers["Host"]) == ("plain.test", "plain.test")


def test_no_credential_is_407_and_a_wrong_one_too(proxy):
    for credential in (None, basic("c" * 43), basic(user="someone-else")):
        flow = plain("plain.test", credential=credential)
        run(proxy.requestheaders(flow))
        assert flow.response.status_code == 407, credential


@pytest.mark.parametrize(
    ("host", "port", "code"),
    [
        ("evil.test", 443, "not-on-allowlist"),
        ("good.test", 8443, "port-not-allowed"),
        ("10.9.0.6", 443, "ip-literal"),
        ("inside.test", 443, "non-public-address"),
    ],
)
def test_a_connect_off_the_list_is_refused_with_its_code(proxy, host, port, code):
    flow = connect(host, port)
    run(proxy.http_connect(flow))
    assert flow.response.status_code == 403
    assert reason(flow) == code


def test_an_allowed_connect_goes_on_and_is_logged(proxy):
    flow = connect("good.test")
    run(proxy.http_connect(flow))
    assert flow.response is None
    assert "Proxy-Authorization" not in flow.request.headers


def test_a_disabled_agent_is_refused(proxy):
    proxy.source.served = snapshot("g2", TOKEN, enabled=False)
    proxy.feed.refresh()
    flow = connect("good.test")
    run(proxy.http_connect(flow))
    assert reason(flow) == "agent-disabled"


def test_a_token_issued_after_the_last_poll_is_looked_up_once(proxy):
    proxy.source.served = snapshot("g2", TOKEN, LATE_TOKEN)  # issued since the proxy polled
    asks = proxy.source.asks
    flow = connect("good.test", credential=basic(LATE_TOKEN))
    run(proxy.http_connect(flow))
    assert flow.response is None
    assert proxy.source.asks == asks + 1


def test_without_a_policy_everything_is_refused(proxy):
    proxy.feed._confirmed_at = float("-inf")  # the source has not answered for the grace
    flow = connect("good.test")
    run(proxy.http_connect(flow))
    assert (flow.response.status_code, reason(flow)) == (503, "policy-unavailable")
