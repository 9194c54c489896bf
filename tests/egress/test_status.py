"""The proxy's status listener (egress/proxy/status.py): /healthz, /readyz and /metrics on an
address apart from the agents' port, in the real proxy process with real clients, and its
answers before a policy, once the policy is stale, and without a token."""

import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from egress.proxy.addon import CoveyEgress
from egress.proxy.feed import DecisionLog, PolicyFeed
from egress.proxy.status import ProxyStatus
from tests.egress.conftest import connect, start_proxy
from tests.egress.test_addon_hooks import TOKEN, Source, snapshot
from tests.fakes import Clock
from tests.processes import free_port

TOKEN_FOR_METRICS = "proxy-metrics-" + "p" * 24


def samples(text: str) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_running_proxy_answers_health_readiness_and_metrics(net, tmp_path, world):
    _, credentials = world
    port = free_port()
    env = {
        "COVEY_EGRESS_STATUS_LISTEN": f"127.0.0.1:{port}",
        "COVEY_METRICS_TOKEN": TOKEN_FOR_METRICS,
    }
    with start_proxy(tmp_path, net, **env) as proxy:
        status = f"http://127.0.0.1:{port}"
        assert f"status at {status}/" in proxy.output()
        assert httpx.get(f"{status}/healthz").json() == {"status": "ok"}
        proxy.sync()
        ready = httpx.get(f"{status}/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"] == {"listening": "ok", "policy": "ok"}
        assert ready.json()["policy_age_seconds"] < 5
        assert httpx.head(f"{status}/readyz").status_code == 200

        assert httpx.get(f"{status}/metrics").status_code == 401
        held = connect(proxy, f"good.test:{net.tls.port}", credentials)
        assert held.status == 200
        refused = connect(proxy, "evil.test:443", credentials)
        assert refused.status == 403
        scraped = httpx.get(
            f"{status}/metrics", headers={"Authorization": f"Bearer {TOKEN_FOR_METRICS}"}
        )
        held.sock.close()
    assert scraped.status_code == 200 and scraped.headers["Content-Type"].startswith("text/plain")
    got = samples(scraped.text)
    decided = "covey_egress_decisions_total"
    assert got[(decided, (("kind", "connect"), ("reason", "allowed")))] == 1
    assert got[(decided, (("kind", "connect"), ("reason", "not-on-allowlist")))] == 1
    assert got[("covey_egress_open_tunnels", ())] == 1
    assert got[("covey_egress_policy_age_seconds", ())] < 5
    assert got[("covey_egress_policy_agents", ())] >= 1
    assert got[("covey_egress_policy_failures", ())] == 0
    assert got[("covey_egress_policy_streaming", ())] == 0  # the database's proxy polls it
    assert got[("covey_egress_decisions_dropped_total", ())] == 0
    assert TOKEN_FOR_METRICS not in proxy.output()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_status_address_it_cannot_use_stops_the_proxy_saying_which(net, tmp_path, world):
    bad = start_proxy(tmp_path, net, COVEY_EGRESS_STATUS_LISTEN="no-port-here")
    with pytest.raises(AssertionError, match="COVEY_EGRESS_STATUS_LISTEN must be HOST:PORT"), bad:
        pass


@pytest.fixture
def hand_fed():
    """A proxy's addon over a feed driven by hand, and its status server on a free port."""
    clock = Clock(1000.0)
    feed = PolicyFeed(Source(snapshot("g1", TOKEN)), poll=60, grace=15, clock=clock)
    log = DecisionLog(lambda events: None)
    addon = CoveyEgress(feed, log)
    status = ProxyStatus(("127.0.0.1", 0), addon, log, token="", grace=15)
    status.start()
    host, port = status.address
    yield feed, clock, status, f"http://{host}:{port}"
    status.stop()


def test_it_is_not_ready_until_it_listens_with_a_policy_and_once_the_policy_is_stale(hand_fed):
    feed, clock, status, url = hand_fed
    before = httpx.get(f"{url}/readyz")
    assert before.status_code == 503
    assert before.json()["checks"] == {"listening": "not yet", "policy": "none yet"}

    status.listening = True
    feed.refresh()
    assert httpx.get(f"{url}/readyz").status_code == 200

    clock.now += 16  # its source silent past the grace period: it refuses everything
    stale = httpx.get(f"{url}/readyz")
    assert stale.status_code == 503
    assert stale.json()["checks"]["policy"] == (
        "stale: its source last answered 16 s ago (grace 15 s)"
    )
    assert stale.json()["policy_age_seconds"] == 16


def test_metrics_are_refused_to_all_without_a_token_and_nothing_else_is_served(hand_fed):
    _, _, status, url = hand_fed
    answer = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer anything"})
    assert answer.status_code == 403
    assert "COVEY_METRICS_TOKEN" in answer.json()["detail"]
    assert httpx.get(f"{url}/admin/").status_code == 404

    status.token = TOKEN_FOR_METRICS
    scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN_FOR_METRICS}"})
    got = samples(scraped.text)
    assert math.isnan(got[("covey_egress_policy_age_seconds", ())])  # never answered
    assert got[("covey_egress_policy_agents", ())] == 0
