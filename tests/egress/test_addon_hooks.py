"""The proxy addon's hooks (egress/proxy/addon.py) in mitmproxy's own test harness (taddons,
tflow): a policy held in memory, a resolver that answers from a table. No proxy process, no
database, no network: milliseconds. test_proxy.py runs the same decisions through the real
process and real clients."""

import asyncio
import base64
import ssl
import time

import pytest
from mitmproxy.test import taddons, tflow, tutils

from egress.policy import PROXY_CHECK, hash_token
from egress.protocol import PolicySnapshot
from egress.proxy.addon import CoveyEgress
from egress.proxy.feed import DecisionLog, PolicyFeed
from tests.processes import ROOT

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

    def __call__(self, known: str | None) -> PolicySnapshot | None:
        self.asks += 1
        if known == self.served["generation"]:
            return None
        return PolicySnapshot.from_json(self.served)  # parsed as the control plane's source does


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
    addon = CoveyEgress(feed, DecisionLog(lambda sent: decisions.extend(e.to_json() for e in sent)))
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
    assert [(d["host"], d["allowed"]) for d in decisions(proxy)] == [("good.test", True)]


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


def logged(proxy) -> list[dict]:
    """Every event the addon logged so far (the log writes them in batches: flush it)."""
    proxy.log.flush()
    return proxy.events


def decisions(proxy) -> list[dict]:
    return [e for e in logged(proxy) if e["event"] == "decision"]


def client_hello(server_name: str) -> bytes:
    """The first bytes a TLS client sends for ``server_name``."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_every_decision_is_logged_with_who_where_and_why(proxy):
    run(proxy.http_connect(connect("GOOD.test.")))
    run(proxy.http_connect(connect("evil.test")))
    run(proxy.requestheaders(plain("plain.test", credential=None)))
    allowed, refused, anonymous = decisions(proxy)
    assert {k: allowed[k] for k in ("agent_id", "username", "kind", "host", "port")} == {
        "agent_id": 1, "username": "acme-builder", "kind": "connect", "host": "good.test",
        "port": 443,
    }  # fmt: skip
    assert (allowed["address"], allowed["allowed"], allowed["reason"], allowed["detail"]) == (
        "10.9.0.6", True, "allowed", "agent",
    )  # fmt: skip
    assert (refused["agent_id"], refused["reason"], refused["address"]) == (
        1, "not-on-allowlist", None,
    )  # fmt: skip
    assert (anonymous["agent_id"], anonymous["username"], anonymous["kind"]) == (None, "", "http")
    assert anonymous["reason"] == "proxy-auth-required"


def test_a_runners_proxy_check_is_answered_407_and_not_logged(proxy):
    """Runners check the proxy answers (runners/probe/program.py, with no credential): that is
    covey's own, not an attempt of anyone's; the same with a credential, or another name, is."""
    check = connect("covey-proxy-check.invalid", credential=None)
    run(proxy.http_connect(check))
    assert check.response.status_code == 407
    assert decisions(proxy) == []
    run(
        proxy.http_connect(
            connect("covey-proxy-check.invalid", credential=basic(token="not-a-token"))
        )
    )
    run(proxy.http_connect(connect("other.invalid", credential=None)))
    assert [(d["host"], d["reason"]) for d in decisions(proxy)] == [
        ("covey-proxy-check.invalid", "proxy-auth-required"),
        ("other.invalid", "proxy-auth-required"),
    ]
    # The probe program sends exactly that name (it cannot import egress.policy).
    program = (ROOT / "runners" / "probe" / "program.py").read_text()
    assert f"CONNECT {PROXY_CHECK[0]}:{PROXY_CHECK[1]} HTTP/1.1" in program


def test_tunnels_are_counted_while_open_and_their_close_is_logged(proxy):
    flow = connect("good.test")
    run(proxy.http_connect(flow))
    assert (proxy.open_tunnels, proxy.tunnels_by_agent[1]) == (1, 1)
    proxy.client_disconnected(flow.client_conn)
    assert (proxy.open_tunnels, dict(proxy.tunnels_by_agent)) == (0, {})
    (allowed,) = decisions(proxy)
    close = logged(proxy)[-1]
    assert (close["event"], close["id"]) == ("close", allowed["id"])


def test_a_full_proxy_refuses_tunnels_but_not_plain_requests(proxy):
    with taddons.context(proxy) as tctx:
        tctx.configure(proxy, covey_max_tunnels_per_agent=1)
        run(proxy.http_connect(connect("good.test")))
        second = connect("good.test")
        run(proxy.http_connect(second))
        assert (second.response.status_code, reason(second)) == (429, "capacity")
        assert second.response.headers["Retry-After"] == "1"
        request = plain("plain.test", credential=basic())
        run(proxy.requestheaders(request))
        assert request.response is None


def test_an_open_tunnel_the_new_policy_refuses_is_closed_and_logged_by_its_decided_name(proxy):
    flow = connect("GOOD.test.")
    run(proxy.http_connect(flow))
    proxy.source.served = snapshot("g2", TOKEN, enabled=False)
    proxy.feed.refresh()
    proxy.enforce(proxy.feed.current())  # no mitmproxy handler here: nothing to cancel
    cut = decisions(proxy)[-1]
    assert (cut["reason"], cut["host"], cut["agent_id"], cut["address"]) == (
        "agent-disabled", "good.test", 1, "10.9.0.6",
    )  # fmt: skip
    proxy.source.served = snapshot("g3", TOKEN)
    proxy.feed.refresh()
    before = len(logged(proxy))
    proxy.enforce(proxy.feed.current())  # allowed again: left alone
    assert len(logged(proxy)) == before


def test_the_tunnels_first_bytes_must_be_a_client_hello_naming_the_host(proxy):
    flow = connect("good.test")
    run(proxy.http_connect(flow))
    tunnel = proxy.tunnel_of(flow.client_conn.id)
    assert proxy.check_hello(tunnel, client_hello("good.test")[:20]) is None  # wait for more
    assert proxy.check_hello(tunnel, b"GET / HTTP/1.1\r\n\r\n") is False
    assert proxy.check_hello(tunnel, client_hello("evil.test")) is False
    not_tls, other_name = decisions(proxy)[-2:]
    assert (not_tls["reason"], not_tls["agent_id"], not_tls["address"]) == (
        "bad-request", 1, "10.9.0.6",
    )  # fmt: skip
    assert "did not start with a TLS ClientHello" in not_tls["detail"]
    assert "names 'evil.test', not the CONNECT host 'good.test'" in other_name["detail"]
    assert not tunnel.started
    assert proxy.check_hello(tunnel, client_hello("GOOD.test")) is True and tunnel.started


def test_a_policy_that_changes_while_the_name_resolves_decides_again(proxy):
    table = proxy.resolver.table

    class Slow:
        def cached(self, host):
            return None

        async def resolve(self, host):
            proxy.source.served = snapshot("g2", TOKEN, enabled=False)  # meanwhile
            proxy.feed.refresh()
            return table[host]

    proxy.resolver = Slow()
    flow = connect("GOOD.test.")
    run(proxy.http_connect(flow))
    assert reason(flow) == "agent-disabled"
    refused = decisions(proxy)[-1]
    assert (refused["host"], refused["agent_id"]) == ("good.test", 1)
    assert proxy.open_tunnels == 0
