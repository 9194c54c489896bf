"""The model gateway's OpenAI side (/openai/v1: Chat Completions and Responses) as a real process
over the test database, in front of a fake OpenAI API over TLS with a test CA: the key it sends,
the usage it records, what it refuses."""

import json
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest

from budgets import keys, services
from budgets.models import Charge, Price, Reservation, Spend, Vendor
from budgets.usage import Usage
from tests.budgets.conftest import MODEL, OPENAI_KEY, OPENAI_MODEL, settled, start_gateway
from tests.budgets.fake_vendor import TEXT
from tests.factories import AgentFactory
from tests.processes import wait_for

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("settled_at_the_end"),
]

EXACT = Usage(input=120, cache_read=30, output=42)  # the fake's counts


@pytest.fixture(scope="module")
def gateway(vendor, ca, tmp_path_factory, django_db_setup, django_db_blocker):
    with start_gateway(tmp_path_factory.mktemp("gateway"), vendor, ca) as gateway:
        yield gateway
    assert OPENAI_KEY not in gateway.output(), "the key was logged"


@pytest.fixture
def price(openai_price) -> Price:
    return openai_price


@pytest.fixture
def agent(acme, price):
    agent = AgentFactory(organisation=acme)
    keys.set_model_key(acme, OPENAI_KEY, Vendor.OPENAI)
    services.set_budget(agent, Decimal(10))
    return agent


def token_for(agent) -> str:
    return keys.issue_gateway_token(agent, run_id=None, ttl=timedelta(hours=1))


def chat(gateway, token, scenario="json", **fields):
    body = {"model": OPENAI_MODEL, "max_completion_tokens": 100}
    body["messages"] = [{"role": "user", "content": scenario}]
    body.update(fields)
    return httpx.post(
        f"{gateway.url}/openai/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def respond(gateway, token, scenario="json", **fields):
    body = {"model": OPENAI_MODEL, "max_output_tokens": 100, "input": scenario} | fields
    return httpx.post(
        f"{gateway.url}/openai/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def the_charge() -> Charge:
    settled()
    (charge,) = Charge.objects.all()
    return charge


def counts(charge: Charge) -> tuple[int, int, int, int, int]:
    return (
        charge.input_tokens,
        charge.cache_write_5m_tokens,
        charge.cache_write_1h_tokens,
        charge.cache_read_tokens,
        charge.output_tokens,
    )


def assert_nothing_held() -> None:
    settled()
    assert not Reservation.objects.filter(status=Reservation.Status.OPEN).exists()
    assert all(spend.reserved == 0 for spend in Spend.objects.all())


def test_a_plain_chat_completion_is_metered_exactly_and_the_vendor_sees_only_the_key(
    gateway, vendor, agent, price
):
    token = token_for(agent)
    answer = httpx.post(
        f"{gateway.url}/openai/v1/chat/completions",
        json={"model": OPENAI_MODEL, "messages": [{"role": "user", "content": "json"}]},
        headers={
            "Authorization": f"Bearer {token}",
            "OpenAI-Organization": "org-the-agent-chose",
            "OpenAI-Project": "proj-the-agent-chose",
        },
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "".join(TEXT)
    seen = vendor.seen[-1]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["Authorization"] == f"Bearer {OPENAI_KEY}"
    assert "x-api-key" not in seen.headers  # the token went nowhere
    assert "OpenAI-Organization" not in seen.headers and "OpenAI-Project" not in seen.headers
    assert not any(token in value for value in seen.headers.values())
    assert seen.body["max_completion_tokens"] == 1000  # bounded by the default
    assert seen.body["service_tier"] == "default"
    charge = the_charge()
    assert counts(charge) == (120, 0, 0, 30, 42)
    assert charge.cost == price.prices.cost(EXACT) == Decimal("0.000591")
    assert (charge.outcome, charge.model, charge.price_id) == (
        "complete",
        "gpt-4.1-2025-01-01",
        price.pk,
    )
    assert Spend.objects.get(budget__agent=agent).spent == charge.cost
    assert_nothing_held()
    assert OPENAI_KEY not in answer.text and OPENAI_KEY not in str(answer.headers)


def test_a_streamed_chat_completion_is_asked_for_its_usage_and_metered(gateway, vendor, agent):
    answer = chat(gateway, token_for(agent), "stream", stream=True)
    assert answer.status_code == 200
    data = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == (
        "".join(TEXT)
    )
    assert vendor.seen[-1].body["stream_options"] == {"include_usage": True}
    charge = the_charge()
    assert (counts(charge), charge.outcome) == ((120, 0, 0, 30, 42), "complete")


@pytest.mark.parametrize(("scenario", "outcome"), [("error", "error"), ("drop", "cut-off")])
def test_a_chat_stream_that_fails_is_charged_its_worst_input_and_the_output_it_carried(
    gateway, agent, scenario, outcome
):
    if scenario == "drop":
        with pytest.raises(httpx.RemoteProtocolError):
            chat(gateway, token_for(agent), scenario, stream=True)
    else:
        assert '"error"' in chat(gateway, token_for(agent), scenario, stream=True).text
    charge = the_charge()
    reservation = Reservation.objects.get()
    # The counts come only at the end, and reasoning is never streamed: the worst case.
    assert charge.input_tokens > 0 and charge.cache_read_tokens == 0
    assert charge.cost == reservation.amount
    assert (charge.output_tokens, charge.outcome) == (100, outcome)
    assert_nothing_held()


def test_a_response_plain_and_streamed_is_metered_exactly(gateway, vendor, agent):
    token = token_for(agent)
    plain = respond(gateway, token)
    assert plain.status_code == 200, plain.text
    assert vendor.seen[-1].path == "/v1/responses"
    streamed = respond(gateway, token, "stream", stream=True)
    assert streamed.status_code == 200
    assert "response.completed" in streamed.text
    wait_for(lambda: Charge.objects.count() == 2, 10, "both charges")
    assert [counts(c) for c in Charge.objects.all()] == [(120, 0, 0, 30, 42)] * 2
    body = {"model": OPENAI_MODEL, "input": "json"}
    answer = httpx.post(
        f"{gateway.url}/openai/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
    )
    assert answer.status_code == 200 and vendor.seen[-1].body["max_output_tokens"] == 1000
    assert_nothing_held()


def test_a_response_stream_cut_off_is_charged_what_it_carried(gateway, agent):
    with pytest.raises(httpx.RemoteProtocolError):
        respond(gateway, token_for(agent), "drop", stream=True)
    charge = the_charge()
    assert (charge.output_tokens, charge.outcome) == (100, "cut-off")  # its bound
    assert_nothing_held()


def test_counting_input_tokens_is_free(gateway, agent):
    answer = httpx.post(
        f"{gateway.url}/openai/v1/responses/input_tokens",
        json={"model": OPENAI_MODEL, "input": "json"},
        headers={"Authorization": f"Bearer {token_for(agent)}"},
    )
    assert answer.status_code == 200 and answer.json()["input_tokens"] == 99
    assert not Charge.objects.exists() and not Reservation.objects.exists()


def test_refusals_are_in_openais_shape_and_reach_no_vendor(
    gateway, vendor, agent, acme, sonnet_price
):
    token = token_for(agent)
    count = len(vendor.seen)
    web = chat(gateway, token, tools=[{"type": "web_search_preview"}])
    assert web.status_code == 400
    assert web.json()["error"]["type"] == "invalid_request_error"
    assert "runs at the vendor" in web.json()["error"]["message"]
    image = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}
    by_url = chat(gateway, token, messages=[{"role": "user", "content": [image]}])
    assert by_url.status_code == 400 and "fetched by the vendor" in by_url.text
    earlier = respond(gateway, token, previous_response_id="resp_1")
    assert earlier.status_code == 400 and "earlier response" in earlier.text
    assert chat(gateway, token, service_tier="priority").status_code == 400
    assert respond(gateway, token, tools=[{"type": "file_search"}]).status_code == 400
    unpriced = chat(gateway, token, model="gpt-4o-2024-05-13")  # priced otherwise: not shipped
    assert unpriced.status_code == 400
    assert unpriced.json()["error"]["code"] == "unpriced-model"
    assert "OpenAI's model 'gpt-4o-2024-05-13'" in unpriced.json()["error"]["message"]
    claude = chat(gateway, token, model=MODEL)  # priced at Anthropic, not at OpenAI
    assert claude.status_code == 400 and claude.json()["error"]["code"] == "unpriced-model"
    assert len(vendor.seen) == count and not Reservation.objects.exists()
    services.set_budget(agent, Decimal("0.0001"))
    used_up = chat(gateway, token)
    assert used_up.status_code == 402
    assert used_up.headers["X-Covey-Deny-Reason"] == "budget-exhausted"
    assert used_up.json()["error"]["code"] == "budget-exhausted"
    acme.model_keys.filter(vendor=Vendor.OPENAI).delete()
    services.set_budget(agent, Decimal(10))
    refused = chat(gateway, token_for(agent))  # a new token: its caller is read now
    assert refused.status_code == 403
    assert "no OpenAI API key" in refused.json()["error"]["message"]
    assert len(vendor.seen) == count
