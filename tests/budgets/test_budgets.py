"""Budgets against the real database: periods, prices in effect, reserving the worst case and
settling the actual cost, the organisation's cap, and many requests at once never spending more
than a budget holds."""

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from uuid import uuid4
from zoneinfo import ZoneInfo

import pytest
import time_machine
from django.db import connection
from django.utils import timezone

from budgets import keys, metering, periods, services
from budgets.models import Charge, Outcome, Price, Reservation, Spend
from budgets.usage import Usage
from tests.factories import AgentFactory

BERLIN = ZoneInfo("Europe/Berlin")
SONNET = "claude-sonnet-4-5-20250929"


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


# --- periods -----------------------------------------------------------------------------------


def test_periods_are_calendar_aligned_in_the_time_zone():
    moment = at("2026-03-29T12:00:00+02:00")  # Berlin's spring change was at 02:00 that day
    day = periods.bounds(periods.DAILY, moment, BERLIN)
    assert day == (at("2026-03-28T23:00:00+00:00"), at("2026-03-29T22:00:00+00:00"))  # 23 h
    week = periods.bounds(periods.WEEKLY, moment, BERLIN)
    assert week[0] == at("2026-03-23T00:00:00+01:00")  # Monday
    assert week[1] == at("2026-03-30T00:00:00+02:00")
    month = periods.bounds(periods.MONTHLY, at("2026-12-31T23:30:00+00:00"), BERLIN)
    assert month[0] == at("2027-01-01T00:00:00+01:00")  # already January in Berlin
    assert periods.bounds(periods.NONE, moment, BERLIN) == (periods.BEGINNING, None)
    with pytest.raises(ValueError, match="'hourly' is not a budget period"):
        periods.bounds("hourly", moment, BERLIN)


# --- prices ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_shipped_prices_cover_current_models_and_unknown_ones_are_refused():
    sonnet = metering.price_for(SONNET)
    assert (sonnet.model, sonnet.input, sonnet.output) == ("claude-sonnet-4-5-*", 3, 15)
    assert (sonnet.cache_write_5m, sonnet.cache_write_1h, sonnet.cache_read) == (
        Decimal("3.75"),
        6,
        Decimal("0.3"),
    )
    assert metering.price_for("claude-sonnet-4-5").model == "claude-sonnet-4-5"
    assert metering.price_for("claude-opus-4-5-20251101").input == 5
    assert metering.price_for("claude-opus-4-20250514").input == 15  # a name of its own
    with pytest.raises(metering.Unpriced, match="no price for Anthropic's model 'claude-opus-9'"):
        metering.price_for("claude-opus-9")
    with pytest.raises(metering.Unpriced):
        metering.price_for("claude-sonnet-4-50")  # no pattern takes it


@pytest.mark.django_db
def test_a_price_change_applies_to_requests_that_start_after_it(acme):
    agent = AgentFactory(organisation=acme)
    before = metering.reserve(agent, model=SONNET, input_bound=10, max_tokens=10, request_id="a")
    change = timezone.now()
    Price.objects.filter(model="claude-sonnet-4-5-*").update(effective_until=change)
    Price.objects.create(
        model="claude-sonnet-4-5-*", input=6, cache_write_5m=Decimal("7.5"), cache_write_1h=12,
        cache_read=Decimal("0.6"), output=30, effective_from=change, source="test",
    )  # fmt: skip
    after = metering.reserve(agent, model=SONNET, input_bound=10, max_tokens=10, request_id="b")
    usage = Usage(input=1_000_000)
    assert metering.settle(before, usage).cost == 3  # the price it started under
    assert metering.settle(after, usage).cost == 6
    earlier = metering.price_for(SONNET, change - timedelta(seconds=1))
    assert earlier.input == 3


# --- reserving and settling --------------------------------------------------------------------


@pytest.mark.django_db
def test_a_request_holds_its_worst_case_then_is_charged_what_it_used(acme):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("1.00"))
    # 1000 input tokens at the 1-hour write price ($6) + 1000 output ($15): $0.021.
    held = metering.reserve(
        agent, model=SONNET, input_bound=1000, max_tokens=1000, request_id="r-1", run_id=None
    )
    spend = Spend.objects.get(budget__agent=agent)
    assert (held.amount, spend.reserved, spend.spent) == (Decimal("0.021"), held.amount, 0)
    used = Usage(input=10, cache_write_5m=100, cache_write_1h=200, cache_read=300, output=50)
    charge = metering.settle(held, used, model=SONNET)
    spend.refresh_from_db()
    # 10*3 + 100*3.75 + 200*6 + 300*0.3 + 50*15 = 2445 per million.
    assert charge.cost == Decimal("0.002445") and spend.spent == charge.cost
    assert spend.reserved == 0
    assert (charge.input_tokens, charge.cache_write_5m_tokens, charge.cache_write_1h_tokens) == (
        10,
        100,
        200,
    )
    assert (charge.cache_read_tokens, charge.output_tokens, charge.outcome) == (
        300,
        50,
        Outcome.COMPLETE,
    )
    assert charge.price.model == "claude-sonnet-4-5-*"
    with pytest.raises(Exception, match="is settled already"):
        metering.settle(held, used)
    freed = metering.reserve(agent, model=SONNET, input_bound=1, max_tokens=1, request_id="r-2")
    metering.release(freed)
    spend.refresh_from_db()
    assert spend.reserved == 0 and Charge.objects.count() == 1  # released: no charge


@pytest.mark.django_db
def test_a_request_that_does_not_fit_is_refused_and_holds_nothing(acme):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.02"))
    with pytest.raises(metering.Exhausted) as refused:
        metering.reserve(agent, model=SONNET, input_bound=1000, max_tokens=1000, request_id="x")
    assert str(refused.value) == (
        f"the budget of agent {agent} has $0.02 left this period; this request may cost up to"
        " $0.021: ask for fewer output tokens, or raise the budget"
    )
    assert not refused.value.used_up  # a smaller request fits: not used up
    assert Spend.objects.get().reserved == 0 and not Reservation.objects.exists()
    # Raising the budget lets it work again, at once.
    services.set_budget(agent, Decimal("0.05"))
    metering.reserve(agent, model=SONNET, input_bound=1000, max_tokens=1000, request_id="y")


@pytest.mark.django_db
def test_the_organisation_caps_the_sum_of_its_agents(acme):
    first, second = AgentFactory(organisation=acme), AgentFactory(organisation=acme)
    services.set_budget(acme, Decimal("0.03"))
    services.set_budget(first, Decimal("1"))  # more than the organisation's: the cap decides
    one = metering.reserve(first, model=SONNET, input_bound=1000, max_tokens=1000, request_id="1")
    metering.settle(one, Usage(output=1000))  # $0.015
    with pytest.raises(
        metering.Exhausted, match=r"the budget of the organisation has \$0\.015 left"
    ):
        metering.reserve(second, model=SONNET, input_bound=1000, max_tokens=1000, request_id="2")
    assert Spend.objects.get(budget__agent=first).spent == Decimal("0.015")


@pytest.mark.django_db
def test_settlements_of_many_requests_are_written_at_once_each_exactly(
    acme, django_assert_max_num_queries
):
    """One batch: charged, released, and charged its worst case; two agents under the
    organisation's budget; in a handful of statements, and no reservation ended twice."""
    first, second = AgentFactory(organisation=acme), AgentFactory(organisation=acme)
    services.set_budget(acme, Decimal(10))
    services.set_budget(first, Decimal(1))
    ask = dict(model=SONNET, input_bound=1000, max_tokens=1000)  # $0.021 each
    held = [metering.reserve(first, request_id=f"a-{n}", **ask) for n in range(3)]
    held += [metering.reserve(second, request_id=f"b-{n}", **ask) for n in range(2)]
    ended = timezone.now() - timedelta(seconds=1)
    batch = [
        metering.Settlement(held[0].pk, Usage(output=1000), model="claude-x", at=ended),  # $0.015
        metering.Settlement(held[1].pk, None),  # released
        metering.Settlement(held[2].pk, Usage(), outcome=Outcome.UNSETTLED, worst=True),
        metering.Settlement(held[3].pk, Usage(input=1000)),  # $0.003
        metering.Settlement(held[4].pk, Usage(output=10)),  # $0.00015
    ]
    with django_assert_max_num_queries(12):
        assert metering.settle_all(batch) == sorted(h.pk for h in held)
    charges = {c.request_id: c for c in Charge.objects.all()}
    assert sorted(charges) == ["a-0", "a-2", "b-0", "b-1"]
    assert (charges["a-0"].cost, charges["a-0"].model, charges["a-0"].at) == (
        Decimal("0.015"),
        "claude-x",
        ended,
    )
    assert charges["a-0"].started_at == held[0].created_at
    assert (charges["a-2"].cost, charges["a-2"].outcome) == (Decimal("0.021"), "unsettled")
    assert (charges["b-0"].model, charges["b-1"].cost) == (SONNET, Decimal("0.00015"))
    statuses = dict(Reservation.objects.values_list("request_id", "status"))
    assert statuses == {"a-0": "settled", "a-1": "released", "a-2": "settled",
                        "b-0": "settled", "b-1": "settled"}  # fmt: skip
    mine = Spend.objects.get(budget__agent=first)
    theirs = Spend.objects.get(budget__agent=None)
    assert (mine.spent, mine.reserved) == (Decimal("0.036"), 0)
    assert (theirs.spent, theirs.reserved) == (Decimal("0.03915"), 0)
    assert metering.settle_all(batch) == []  # ended already: nothing happens twice
    assert Charge.objects.count() == 4
    theirs.refresh_from_db()
    assert theirs.spent == Decimal("0.03915")


@pytest.mark.django_db
def test_a_new_period_starts_afresh_and_past_ones_keep_their_spend(acme):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.02"), period=periods.DAILY)
    monday = datetime(2026, 11, 30, 12, tzinfo=UTC)
    held = metering.reserve(
        agent, model=SONNET, input_bound=0, max_tokens=1000, request_id="m", at=monday
    )
    metering.settle(held, Usage(output=1000))
    with pytest.raises(metering.Exhausted, match=r"has \$0\.005 left"):
        metering.reserve(
            agent, model=SONNET, input_bound=0, max_tokens=1000, request_id="m2", at=monday
        )
    tuesday = monday + timedelta(days=1)
    metering.reserve(
        agent, model=SONNET, input_bound=0, max_tokens=1000, request_id="t", at=tuesday
    )
    spends = {s.starts_at.date().isoformat(): s for s in Spend.objects.filter(budget__agent=agent)}
    assert spends["2026-11-30"].spent == Decimal("0.015")  # kept
    assert spends["2026-12-01"].reserved == Decimal("0.015")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_fifty_requests_at_once_never_spend_more_than_the_budget(acme, sonnet_price):
    """Each may cost $0.015; $0.10 holds six of them. Fifty threads, each with a connection of
    its own, reserve and settle at their worst case at the same moment."""
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("0.10"))
    services.set_budget(acme, Decimal("5"))
    start = threading.Barrier(50)
    outcomes: list[str] = []

    def one() -> None:
        try:
            start.wait()
            try:
                held = metering.reserve(
                    agent, model=SONNET, input_bound=0, max_tokens=1000, request_id=str(uuid4())
                )
            except metering.OverBudget:  # busy while others hold it, then used up
                outcomes.append("refused")
                return
            metering.settle(held, Usage(output=1000))
            outcomes.append("charged")
        finally:
            connection.close()

    threads = [threading.Thread(target=one) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == 50
    charged = Charge.objects.filter(agent=agent)
    total = sum((c.cost for c in charged), Decimal(0))
    assert total <= Decimal("0.10")  # never more than the budget
    assert outcomes.count("charged") == charged.count() == 6  # and as much of it as fits
    spend = Spend.objects.get(budget__agent=agent)
    assert (spend.spent, spend.reserved) == (total, 0)
    assert Spend.objects.get(budget__agent=None).spent == total


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_fifty_requests_in_batches_at_once_never_spend_more_than_the_budget(acme, sonnet_price):
    """As the gateways' writers reserve: ten threads at once, each reserving five requests in
    one transaction, of two agents under one organisation's budget; $0.10 holds six."""
    agents = [AgentFactory(organisation=acme), AgentFactory(organisation=acme)]
    services.set_budget(acme, Decimal("0.10"))
    price = metering.price_for(SONNET)
    start = threading.Barrier(10)
    results: list[object] = []

    def batch(n: int) -> None:
        asks = [
            metering.Ask(agent.pk, acme.pk, SONNET, price, Decimal("0.015"), f"{n}-{k}")
            for k, agent in enumerate(agents * 3)
        ][:5]
        try:
            start.wait()
            results.extend(metering.reserve_all(asks, timezone.now()))
        finally:
            connection.close()

    threads = [threading.Thread(target=batch, args=(n,)) for n in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    held = [r for r in results if isinstance(r, metering.Reserved)]
    assert len(results) == 50 and len(held) == 6  # as many as fit, never more
    assert all(isinstance(r, metering.Busy) for r in results if r not in held)
    spend = Spend.objects.get(budget__agent=None)
    assert (spend.spent, spend.reserved) == (0, Decimal("0.09"))
    assert Reservation.objects.count() == 6
    assert sorted(len(r.spends) for r in held) == [1] * 6


@pytest.mark.django_db
def test_changing_the_period_counts_what_the_ledger_holds_for_the_new_one(acme):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("1"), period=periods.MONTHLY)
    held = metering.reserve(agent, model=SONNET, input_bound=0, max_tokens=1000, request_id="a")
    charge = metering.settle(held, Usage(output=1000))  # $0.015, today
    assert charge.started_at == held.created_at
    services.set_budget(agent, Decimal("1"), period=periods.DAILY)
    today = Spend.objects.get(budget__agent=agent, period=periods.DAILY)
    assert today.spent == Decimal("0.015")  # not a fresh start
    assert Spend.objects.get(budget__agent=agent, period=periods.MONTHLY).spent == today.spent


@pytest.mark.django_db
def test_negative_bounds_are_refused_before_anything_is_held(acme):
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal("1"))
    with pytest.raises(ValueError, match="cannot be negative"):
        metering.reserve(agent, model=SONNET, input_bound=-(10**9), max_tokens=1, request_id="n")
    assert Spend.objects.get().reserved == 0


def test_a_time_zone_that_does_not_exist_is_refused_at_start(settings):
    from budgets.checks import budget_settings

    assert budget_settings() == []
    settings.COVEY_BUDGET_TIME_ZONE = "Mars/Olympus"
    (error,) = budget_settings()
    assert error.id == "budgets.E001" and "'Mars/Olympus', which is not a time zone" in error.msg


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("172.17.0.1:8002", "give http://HOST:PORT"),
        ("ftp://gw.corp", "give http://HOST:PORT"),
        ("http://gw.corp:8002/v1", "no user, path or query"),
        ("http://user@gw.corp:8002", "no user, path or query"),
        ("http://gw.corp:99999", "Port out of range"),
    ],
)
def test_a_gateway_url_sandboxes_cannot_use_is_refused_at_start(settings, url, problem):
    from budgets.checks import budget_settings

    settings.COVEY_MODEL_GATEWAY_URL = url
    (error,) = budget_settings()
    assert error.id == "budgets.E002" and problem in error.msg


@pytest.mark.parametrize(
    ("url", "destination"),
    [
        ("", None),
        ("http://172.17.0.1:8002", ("172.17.0.1", 8002)),
        ("https://GW.corp/", ("gw.corp", 443)),
        ("http://[fd00::1]:8002", ("fd00::1", 8002)),
    ],
)
def test_the_gateway_url_names_one_destination(url, destination):
    assert keys.gateway_destination(url) == destination


def test_a_reservation_never_settled_is_charged_its_worst_case_once_it_is_stale(
    acme, sonnet_price, settings
):
    settings.COVEY_GATEWAY_MAX_REQUEST_SECONDS = 600
    agent = AgentFactory(organisation=acme)
    services.set_budget(agent, Decimal(10))
    with time_machine.travel(datetime(2026, 12, 2, 10, 0, tzinfo=UTC)):
        old = metering.reserve(agent, model=SONNET, input_bound=100, max_tokens=100, request_id="o")
    with time_machine.travel(datetime(2026, 12, 2, 10, 14, tzinfo=UTC)):
        metering.reserve(agent, model=SONNET, input_bound=100, max_tokens=100, request_id="new")
        assert metering.settle_stale() == 0  # 14 minutes: within 10 and the 5-minute margin
    with time_machine.travel(datetime(2026, 12, 2, 10, 16, tzinfo=UTC)):
        assert metering.settle_stale() == 1
        assert metering.settle_stale() == 0  # once
    (charge,) = Charge.objects.all()
    assert (charge.request_id, charge.outcome, charge.cost) == ("o", "unsettled", old.amount)
    spend = Spend.objects.get()
    assert (spend.spent, spend.reserved) == (old.amount, old.amount)  # "new" still holds
