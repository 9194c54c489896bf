"""The model gateway as a real process (``manage.py model_gateway``) over the test database, in
front of a fake Messages API over TLS with a test CA: the key it sends, the usage it records,
the budgets it stops at."""

import asyncio
import json
import time
from concurrent.futures import Future
from dataclasses import asdict
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from django.db import connection
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from budgets import keys, services
from budgets.gateway import server as gateway_server
from budgets.models import Charge, GatewayToken, Reservation, Spend
from budgets.usage import Usage
from runs import services as run_services
from runs.models import Run, RunStatus
from tests.budgets.conftest import KEY, METRICS_TOKEN, MODEL, settled, start_gateway
from tests.budgets.fake_vendor import TEXT
from tests.factories import AgentFactory, online_runner
from tests.processes import wait_for

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("settled_at_the_end"),
]


@pytest.fixture(scope="module")
def gateway(vendor, ca, tmp_path_factory, django_db_setup, django_db_blocker):
    with start_gateway(tmp_path_factory.mktemp("gateway"), vendor, ca) as gateway:
        yield gateway


@pytest.fixture
def agent(acme, sonnet_price):
    agent = AgentFactory(organisation=acme)
    keys.set_model_key(acme, KEY)
    services.set_budget(agent, Decimal(10))
    return agent


def token_for(agent) -> str:
    return keys.issue_gateway_token(agent, run_id=None, ttl=timedelta(hours=1))


def ask(gateway, token, scenario="json", *, bearer=False, **fields):
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": scenario}]}
    body.update(fields)
    auth = {"Authorization": f"Bearer {token}"} if bearer else {"x-api-key": token}
    headers = {**auth, "anthropic-version": "2023-06-01"}
    return httpx.post(f"{gateway.url}/v1/messages", json=body, headers=headers, timeout=30)


def expected_cost(price, usage: Usage) -> Decimal:
    return price.prices.cost(usage)


EXACT = Usage(input=120, cache_write_5m=20, cache_write_1h=30, cache_read=10, output=42)


def the_charge() -> Charge:
    settled()
    (charge,) = Charge.objects.all()
    return charge


def assert_nothing_held(agent) -> None:
    settled()
    assert not Reservation.objects.filter(status=Reservation.Status.OPEN).exists()
    assert all(spend.reserved == 0 for spend in Spend.objects.all())


def test_a_plain_answer_is_metered_exactly_and_the_vendor_sees_only_the_key(
    gateway, vendor, agent, sonnet_price
):
    token = token_for(agent)
    answer = ask(gateway, token)
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["text"] == "".join(TEXT)
    assert answer.headers["request-id"] == "req_fake"  # the vendor's headers come back
    seen = vendor.seen[-1]
    assert seen.headers["x-api-key"] == KEY
    assert "Authorization" not in seen.headers
    assert not any(token in value for value in seen.headers.values())
    assert seen.body["service_tier"] == "standard_only"  # auto may be Priority Tier
    charge = the_charge()
    assert (charge.input_tokens, charge.cache_write_5m_tokens, charge.cache_write_1h_tokens) == (
        120,
        20,
        30,
    )
    assert (charge.cache_read_tokens, charge.output_tokens) == (10, 42)
    assert charge.cost == expected_cost(sonnet_price, EXACT) == Decimal("0.001248")
    assert charge.outcome == "complete" and charge.model == MODEL
    assert charge.request_id == answer.headers["X-Covey-Request-Id"]
    assert_nothing_held(agent)
    assert Spend.objects.get(budget__agent=agent).spent == charge.cost
    assert KEY not in answer.text and KEY not in str(answer.headers)


def test_a_stream_passes_unchanged_and_its_usage_is_read_on_the_way(gateway, vendor, agent):
    answer = ask(gateway, token_for(agent), "stream", bearer=True, stream=True)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = [
        json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")
    ]
    assert events[0]["type"] == "message_start"
    assert events[-1]["type"] == "message_stop"
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == (
        "".join(TEXT)
    )
    charge = the_charge()
    assert (charge.input_tokens, charge.output_tokens, charge.outcome) == (120, 42, "complete")
    assert vendor.seen[-1].headers["x-api-key"] == KEY


@pytest.mark.parametrize(("scenario", "outcome"), [("error", "error"), ("drop", "cut-off")])
def test_a_stream_that_fails_is_charged_its_input_and_the_output_it_carried(
    gateway, agent, scenario, outcome
):
    if scenario == "drop":  # cut off at the vendor: cut off for the caller too
        with pytest.raises(httpx.RemoteProtocolError):
            ask(gateway, token_for(agent), scenario, stream=True)
    else:  # an error event ends the stream as the vendor ends it
        assert "event: error" in ask(gateway, token_for(agent), scenario, stream=True).text
    charge = the_charge()
    seen = len("".join(TEXT[:2]).encode())  # the two deltas before it ended
    assert (charge.input_tokens, charge.cache_read_tokens) == (120, 10)
    assert (charge.output_tokens, charge.outcome) == (seen, outcome)
    assert_nothing_held(agent)


def test_a_slow_stream_is_passed_on_as_it_comes(gateway, vendor, agent):
    started = time.monotonic()
    body = {"model": MODEL, "max_tokens": 100, "stream": True}
    body["messages"] = [{"role": "user", "content": "slow"}]
    headers = {"x-api-key": token_for(agent)}
    with httpx.stream(
        "POST", f"{gateway.url}/v1/messages", json=body, headers=headers, timeout=30
    ) as response:
        first = None
        for chunk in response.iter_raw():
            if b"message_start" in chunk and first is None:
                first = time.monotonic() - started
        total = time.monotonic() - started
    # Four pauses follow the first event: buffered, it would come with the rest.
    assert first is not None and total - first > 2 * vendor.pause
    assert the_charge().output_tokens == 42


def test_what_the_vendor_refuses_is_released_uncharged(gateway, agent):
    answer = ask(gateway, token_for(agent), "refuse")
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    settled()
    assert not Charge.objects.exists()
    assert Reservation.objects.get().status == "released"
    assert_nothing_held(agent)


def test_count_tokens_is_free_and_forwarded(gateway, vendor, agent):
    answer = httpx.post(
        f"{gateway.url}/v1/messages/count_tokens",
        json={"model": MODEL, "messages": [{"role": "user", "content": "json"}]},
        headers={"x-api-key": token_for(agent)},
    )
    assert answer.status_code == 200 and answer.json() == {"input_tokens": 99}
    assert not Charge.objects.exists() and not Reservation.objects.exists()


def test_unknown_revoked_and_disabled_are_refused_before_the_vendor(gateway, vendor, agent):
    count = len(vendor.seen)
    assert ask(gateway, "covey-gw-nonsense").status_code == 401
    assert ask(gateway, "").status_code == 401
    run_token = keys.issue_gateway_token(agent, run_id=None, ttl=timedelta(hours=1))
    GatewayToken.objects.update(revoked_at=timezone.now())
    assert ask(gateway, run_token).status_code == 401
    token = token_for(agent)
    agent.enabled = False
    agent.save()
    refused = ask(gateway, token)
    assert refused.status_code == 403 and "disabled" in refused.json()["error"]["message"]
    assert len(vendor.seen) == count


def test_a_token_in_use_is_refused_within_a_second_of_its_revocation(gateway, agent):
    token = token_for(agent)
    assert ask(gateway, token).status_code == 200
    assert ask(gateway, token).status_code == 200  # vouched for from memory now
    GatewayToken.objects.update(revoked_at=timezone.now())
    revoked = time.monotonic()
    wait_for(lambda: ask(gateway, token).status_code == 401, 5, "the revocation seen")
    assert time.monotonic() - revoked < 1


def test_an_organisation_without_a_key_is_told_how_to_get_one(gateway, agent, acme):
    acme.model_keys.all().delete()
    refused = ask(gateway, token_for(agent))
    assert refused.status_code == 403
    assert "no Anthropic API key" in refused.json()["error"]["message"]


def test_an_unpriced_model_is_refused_naming_it(gateway, vendor, agent):
    count = len(vendor.seen)
    refused = ask(gateway, token_for(agent), model="claude-unheard-of-9")
    assert refused.status_code == 400
    assert "claude-unheard-of-9" in refused.json()["error"]["message"]
    assert refused.headers["X-Covey-Deny-Reason"] == "unpriced-model"
    assert len(vendor.seen) == count and not Reservation.objects.exists()


def test_an_unbounded_request_is_refused(gateway, agent):
    token = token_for(agent)
    tools = [{"type": "web_search_20250305", "name": "web_search"}]
    assert ask(gateway, token, tools=tools).status_code == 400
    url = {"type": "document", "source": {"type": "url", "url": "https://example.invalid/a.pdf"}}
    refused = ask(gateway, token, messages=[{"role": "user", "content": [url]}])
    assert refused.status_code == 400 and "fetched by the vendor" in refused.text
    assert "service_tier 'priority'" in ask(gateway, token, service_tier="priority").text
    assert not Reservation.objects.exists()


def test_a_request_larger_than_the_limit_is_refused_unread(gateway, vendor, agent):
    before = len(vendor.seen)
    answer = ask(gateway, token_for(agent), "x" * (32 * 1024 * 1024 + 1))
    assert answer.status_code == 413
    assert answer.json()["error"]["message"] == "the request is larger than 33554432 bytes"
    assert len(vendor.seen) == before and not Reservation.objects.exists()


def test_hostile_json_is_a_400_naming_where_before_anything_is_held_or_sent(gateway, vendor, agent):
    before = len(vendor.seen)
    body = '{"model": "%s", "max_tokens": 100, %s}'
    hello = '"messages": [{"role": "user", "content": "hi"}]'
    table = [
        ("[" * 50_000, "nested deeper than 128 levels"),
        (body % (MODEL, hello + ', "temperature": NaN'), "temperature: not a finite number"),
        (body % (MODEL, hello + ', "top_p": 1e999'), "top_p: not a finite number"),
        (
            body % (MODEL, '"messages": [{"role": "user", "content": "a\\udc80b"}]'),
            r"messages[0].content: a lone surrogate (\udc80) is not Unicode text",
        ),
        (
            body
            % (MODEL, '"messages": [{"role": "user", "content": %s"x"%s}]')
            % ("[" * 200, "]" * 200),
            "messages: nested deeper than 128 levels",
        ),
    ]
    headers = {"x-api-key": token_for(agent), "anthropic-version": "2023-06-01"}
    for raw, said in table:
        answer = httpx.post(f"{gateway.url}/v1/messages", content=raw, headers=headers, timeout=30)
        assert answer.status_code == 400, (raw[:80], answer.text[:300])
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert said in error["message"], error
    assert len(vendor.seen) == before and not Reservation.objects.exists()


def test_a_request_without_max_tokens_gets_the_default_and_is_bounded(gateway, vendor, agent):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "json"}]}
    answer = httpx.post(
        f"{gateway.url}/v1/messages", json=body, headers={"x-api-key": token_for(agent)}
    )
    assert answer.status_code == 200
    assert vendor.seen[-1].body["max_tokens"] == 1000
    reservation = Reservation.objects.get()
    assert reservation.amount >= Decimal(1000) * Decimal(15) / Decimal(1_000_000)


def test_a_used_up_budget_answers_402_until_it_is_raised(gateway, vendor, agent):
    services.set_budget(agent, Decimal("0.001"))  # less than one worst case
    count = len(vendor.seen)
    token = token_for(agent)
    refused = ask(gateway, token)
    assert refused.status_code == 402
    assert refused.headers["X-Covey-Deny-Reason"] == "budget-exhausted"
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "billing_error"
    assert len(vendor.seen) == count
    services.set_budget(agent, Decimal(1))
    assert ask(gateway, token).status_code == 200


def test_fifty_at_once_never_spend_more_than_the_budget(gateway, agent, acme):
    limit = Decimal("0.02")  # about eight worst cases, sixteen actual costs
    services.set_budget(agent, limit)
    token = token_for(agent)

    async def all_at_once() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": MODEL, "max_tokens": 100}
            body["messages"] = [{"role": "user", "content": "stream"}]
            body["stream"] = True

            async def one() -> int:
                response = await client.post(
                    f"{gateway.url}/v1/messages", json=body, headers={"x-api-key": token}
                )
                return response.status_code

            return await asyncio.gather(*(one() for _ in range(50)))

    statuses = asyncio.run(all_at_once())
    # Busy (429) while the others hold it; once spent, what is left may be too little (402).
    assert set(statuses) <= {200, 402, 429} and 429 in statuses and 200 in statuses
    settled()
    spent = sum(charge.cost for charge in Charge.objects.all())
    assert spent <= limit
    assert Charge.objects.count() == statuses.count(200)
    spend = Spend.objects.get(budget__agent=agent)
    assert (spend.spent, spend.reserved) == (spent, 0)


def test_a_burst_that_holds_the_budget_is_told_to_retry_and_uses_nothing_up(
    gateway, agent, acme, orders
):
    """Thirty cheap requests at once against $0.04: their worst cases (about $0.0024 each) fill
    it while the first are under way, so the rest are answered 429 with retry-after, not 402;
    the budget is not used up (it is spent by $0.001248 a request) and the agent's run goes
    on. Retried, every one of them fits."""
    services.set_budget(agent, Decimal("0.04"))
    runner, _ = online_runner(acme)
    run = run_services.queue_run(agent, "work")
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, runner=runner)
    token = keys.issue_gateway_token(agent, run_id=run.pk, ttl=timedelta(hours=1))
    body = {"model": MODEL, "max_tokens": 100, "stream": True}
    body["messages"] = [{"role": "user", "content": "slow"}]  # under way for about a second

    async def burst(count: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{gateway.url}/v1/messages", json=body, headers={"x-api-key": token}
                    )
                    for _ in range(count)
                )
            )

    answers = asyncio.run(burst(30))
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) == {200, 429}, statuses
    for busy in (answer for answer in answers if answer.status_code == 429):
        assert busy.headers["retry-after"] == "2"
        assert busy.headers["X-Covey-Deny-Reason"] == "budget-busy"
        error = busy.json()["error"]
        assert error["type"] == "rate_limit_error" and " is busy: " in error["message"]
    settled()
    spend = Spend.objects.get(budget__agent=agent)
    assert spend.exhausted_at is None and services.used_up(agent) == ""
    assert (spend.spent, spend.reserved) == (Decimal("0.001248") * statuses.count(200), 0)
    assert run_services.stop_over_budget(agent.pk) == 0  # what a used-up budget sends
    run.refresh_from_db()
    assert (run.status, run.cancel_requested_at) == (RunStatus.RUNNING, None)
    assert not [kind for kind, _, _ in orders if kind == "cancel"]
    for _ in range(statuses.count(429)):  # retried one after the other: each fits
        assert asyncio.run(burst(1))[0].status_code == 200
    settled()
    assert Charge.objects.count() == 30


def test_the_ledger_gone_means_nothing_is_forwarded(gateway, vendor, agent):
    """The ledger's table out of the gateway's reach for a moment: 503, never an unmetered
    request; and then it works again by itself."""
    token = token_for(agent)
    count = len(vendor.seen)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE budgets_reservation RENAME TO budgets_reservation_away")
        try:
            refused = ask(gateway, token)
        finally:
            cursor.execute("ALTER TABLE budgets_reservation_away RENAME TO budgets_reservation")
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["type"] == "api_error"
    assert len(vendor.seen) == count
    assert ask(gateway, token).status_code == 200


def scrape(gateway, token=METRICS_TOKEN) -> dict[tuple[str, tuple], float]:
    answer = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.text
    samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_its_metrics_count_requests_outcomes_and_tokens(gateway, vendor, agent):
    assert httpx.get(f"{gateway.url}/metrics").status_code == 401
    wrong = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "covey_" not in wrong.text

    def get(samples, name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    before = scrape(gateway)
    token = token_for(agent)
    assert ask(gateway, token).status_code == 200
    assert ask(gateway, token, "refuse").status_code == 400
    assert ask(gateway, "not-a-token").status_code == 401
    after = scrape(gateway)

    def grew(name, **labels):
        return get(after, name, **labels) - get(before, name, **labels)

    route = "/v1/messages"
    assert grew("covey_gateway_requests_total", route=route, code="200") == 1
    assert grew("covey_gateway_requests_total", route=route, code="400") == 1
    assert grew("covey_gateway_requests_total", route=route, code="401") == 1
    assert grew("covey_gateway_settled_total", vendor="anthropic", outcome="complete") == 1
    assert grew("covey_gateway_settled_total", vendor="anthropic", outcome="released") == 1
    for kind, count in asdict(EXACT).items():  # what the fake vendor's plain answer says it used
        assert grew("covey_gateway_tokens_total", vendor="anthropic", kind=kind) == count
    assert grew("covey_gateway_upstream_seconds_count", vendor="anthropic") == 2
    assert get(after, "covey_gateway_requests_in_flight") == 0


def test_its_metrics_are_refused_to_all_when_no_token_is_set(tmp_path, vendor, ca, agent):
    with start_gateway(tmp_path, vendor, ca, metrics_token="") as bare:
        answer = httpx.get(f"{bare.url}/metrics", headers={"Authorization": "Bearer x"})
    assert answer.status_code == 403
    assert "COVEY_METRICS_TOKEN" in answer.json()["detail"]


def test_its_json_lines_name_the_agent_and_request_they_concern(tmp_path, vendor, ca, agent):
    with start_gateway(tmp_path, vendor, ca, COVEY_LOG_FORMAT="json") as json_gateway:
        refused = ask(json_gateway, token_for(agent), model="claude-unpriced-9")
        assert refused.status_code == 400, refused.text
        wait_for(lambda: "refused request" in json_gateway.output(), 5, "the refusal logged")
        said = [line for line in json_gateway.output().splitlines() if line.strip()]
    # Every line but the one that says where it listens (its output, not a log line) is JSON.
    assert said[0].startswith("covey: model gateway on ")
    written = [json.loads(line) for line in said[1:]]
    (line,) = [line for line in written if "refused request" in line["message"]]
    assert line["agent_id"] == agent.pk
    assert line["request_id"] == refused.headers["X-Covey-Request-Id"]
    assert line["level"] == "INFO" and line["logger"] == "budgets.gateway.server"


def test_it_is_ready_while_its_ledger_answers(gateway):
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok"}
    answer = httpx.get(f"{gateway.url}/readyz")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"status": "ready", "checks": {"ledger": "ok"}}


class SilentLedger:
    """A ledger whose database does not answer, or answers too late."""

    def __init__(self, problem: str = "", wait: float = 0.0) -> None:
        self.said, self.wait = problem, wait

    def problem(self) -> str:
        time.sleep(self.wait)
        return self.said


@pytest.mark.parametrize(
    ("ledger", "says"),
    [(SilentLedger("unreachable"), "unreachable"), (SilentLedger(wait=0.3), "no answer in 0.1 s")],
)
def test_it_is_not_ready_while_its_ledger_does_not_answer(ledger, says, monkeypatch):
    monkeypatch.setattr(gateway_server, "READY_SECONDS", 0.1)
    gateway = gateway_server.Gateway(ledger, gateway_server.GatewayConfig())
    answer = asyncio.run(gateway.readiness(None))
    assert answer.status == 503
    assert json.loads(answer.body) == {"status": "not ready", "checks": {"ledger": says}}


class LateLedger:
    """A ledger whose reservation is made after its request ended."""

    def __init__(self) -> None:
        self.asked: Future = Future()
        self.released: list[gateway_server.Hold] = []

    def release(self, hold, *, failed) -> None:
        self.released.append(hold)


def test_a_reservation_made_after_its_request_ended_is_released():
    ledger = LateLedger()
    gateway = gateway_server.Gateway(ledger, gateway_server.GatewayConfig())

    async def ended() -> None:
        waiting = asyncio.create_task(gateway._reserved(ledger.asked))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the gateway stopping, say
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(ended())
    assert ledger.released == []
    hold = gateway_server.Hold(7, "r-7", (1,))
    ledger.asked.set_result(hold)  # made meanwhile: nothing was sent with it
    assert ledger.released == [hold]
