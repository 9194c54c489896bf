"""The gateway's database ledger: what it keeps between requests, and for how long; and the
reservation at the exact fit of a budget, on PostgreSQL and on SQLite."""

import json
import os
import subprocess
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import OperationalError
from django.utils import timezone

from budgets import keys, metering, services
from budgets.gateway import ledger as ledger_module
from budgets.gateway.api import Refused
from budgets.gateway.ledger import KEPT_SECONDS, Asked, DjangoLedger, Queued, Writer
from budgets.metering import Settlement
from budgets.models import GatewayToken, ModelKey, Price, Reservation
from budgets.usage import Usage
from tests.budgets import exact_fit
from tests.budgets.conftest import KEY, MODEL
from tests.factories import AgentFactory
from tests.fakes import Clock
from tests.processes import ROOT, VENV_BIN

pytestmark = pytest.mark.django_db


@pytest.fixture
def setup(acme, sonnet_price):
    agent = AgentFactory(organisation=acme)
    keys.set_model_key(acme, KEY)
    services.set_budget(agent, Decimal(10))
    clock = Clock(100.0)
    token = keys.issue_gateway_token(agent, run_id=None, ttl=timedelta(hours=1))
    return DjangoLedger(clock=clock), clock, token


def test_a_token_is_vouched_for_a_moment_then_read_again(setup):
    ledger, clock, token = setup
    assert ledger.known(token) is None  # never read
    caller = ledger.authenticate(token)
    assert caller.keys == {"anthropic": KEY} and ledger.known(token) == caller
    GatewayToken.objects.update(revoked_at=timezone.now())
    clock.now += KEPT_SECONDS * 0.9
    assert ledger.known(token) == caller  # the bound a revocation may take
    clock.now += KEPT_SECONDS * 0.1
    assert ledger.known(token) is None
    with pytest.raises(Refused) as refused:
        ledger.authenticate(token)
    assert refused.value.status == 401


def test_a_refused_token_is_never_kept(setup):
    ledger, _, token = setup
    GatewayToken.objects.update(revoked_at=timezone.now())
    with pytest.raises(Refused):
        ledger.authenticate(token)
    GatewayToken.objects.update(revoked_at=None)
    assert ledger.authenticate(token).keys == {"anthropic": KEY} and ledger.known(token) is not None


@pytest.mark.django_db(transaction=True)  # the ledger's writer reserves in a thread of its own
def test_a_model_priced_after_the_rows_were_read_is_priced_at_once(setup):
    ledger, _, token = setup
    caller = ledger.authenticate(token)
    ask = dict(vendor="anthropic", model="claude-new-1", input_bound=10, max_tokens=10)
    with pytest.raises(Refused) as refused:
        ledger.reserve(caller, request_id="before", **ask).result(10)
    assert refused.value.reason == "unpriced-model"
    Price.objects.create(
        model="claude-new-1",
        input=Decimal(1),
        cache_write_5m=Decimal(1),
        cache_write_1h=Decimal(1),
        cache_read=Decimal(1),
        output=Decimal(1),
        effective_from=timezone.now() - timedelta(seconds=1),
        source="tests",
    )
    hold = ledger.reserve(caller, request_id="after", **ask).result(10)
    ledger.close()
    reservation = Reservation.objects.get(pk=hold.reservation_id)
    assert reservation.price.model == "claude-new-1" and reservation.amount == Decimal("0.00002")
    assert list(reservation.spends.values_list("reserved", flat=True)) == [Decimal("0.00002")]


def test_a_key_that_cannot_be_read_refuses_its_vendor_alone(setup, acme, caplog):
    ledger, _, token = setup
    keys.set_model_key(acme, "sk-openai-sealed-with-a-lost-key", "openai")
    ModelKey.objects.filter(vendor="openai").update(secret="sealed-by-another-key")
    caller = ledger.authenticate(token)
    assert caller.keys == {"anthropic": KEY, "openai": ""}  # the gateway refuses OpenAI (503)
    assert "the openai key of" in caplog.text and "sk-openai" not in caplog.text


# A budget of exactly three worst cases: three are held, a fourth is busy (the three hold it
# all), and once the three are charged their worst case, the budget is used up; a millionth
# short, the third is busy and the last too large, and it is not used up.
EXACT_FIT = {
    "exact": {
        "answers": ["held", "held", "held", "busy", "used up"],
        "spent": str(3 * exact_fit.WORST),
        "reserved": "0.000000",
        "used up": True,
    },
    "short": {
        "answers": ["held", "held", "busy", "busy", "too large"],
        "spent": str(2 * exact_fit.WORST),
        "reserved": "0.000000",
        "used up": False,
    },
}


@pytest.mark.postgres
def test_a_budget_of_exactly_three_worst_cases_holds_three_on_postgresql(acme):
    assert exact_fit.boundary() == {"database": "postgresql", **EXACT_FIT}


def test_a_budget_of_exactly_three_worst_cases_holds_three_on_sqlite(tmp_path):
    """make run's database: its columns hold binary floating point, in which the third's
    comparison was refused (0.012258 - 0.008172 - 0.004086 < 0)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DATABASE_URL", "CELERY_BROKER_URL")
    }
    env |= {
        "DATABASE_URL": f"sqlite:///{tmp_path / 'covey.sqlite3'}",
        "COVEY_VAR_DIR": str(tmp_path / "var"),
        "DJANGO_SETTINGS_MODULE": "covey.settings",
    }
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-m", "tests.budgets.exact_fit"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"database": "sqlite", **EXACT_FIT}


# --- the writer: reservations and settlements in batches --------------------------------------


def nothing_reserved(batch, settling):
    raise AssertionError("nothing was asked")


def test_settlements_queued_at_once_are_written_in_few_batches_in_order():
    written: list[list[int]] = []
    gate = threading.Event()

    def write(batch):
        gate.wait(10)  # the first batch holds the writer while the rest queue up
        written.append([s.reservation_id for s in batch])
        return []

    writer = Writer(nothing_reserved, write)
    for n in range(1, 101):
        writer.settle(Queued(Settlement(n, Usage()), f"r-{n}", pytest.fail))
    gate.set()
    assert writer.idle(10) is True
    assert [n for batch in written for n in batch] == list(range(1, 101))
    assert len(written) <= 2  # what was queued when it began, then the rest at once
    writer.close()


def test_reservations_asked_without_pause_never_hold_settlements_back():
    """A writer busy with reservations all along still writes the settlements, once the
    oldest has waited LINGER_SECONDS."""
    written = threading.Event()
    writer = Writer(lambda batch, settling: [], lambda batch: written.set() or [])

    def reserve(batch, settling):
        time.sleep(0.002)  # a batch's transaction
        for asked in batch:
            asked.future.set_result(None)
        writer.ask(Asked(None, "", "", 0, 0, "next", Future()))  # another has come meanwhile
        return []

    writer.reserve = reserve
    writer.ask(Asked(None, "", "", 0, 0, "first", Future()))
    queued = time.monotonic()
    writer.settle(Queued(Settlement(1, Usage()), "r-1", pytest.fail))
    assert written.wait(5)
    assert time.monotonic() - queued < 10 * ledger_module.LINGER_SECONDS
    writer.close()


def test_a_writer_that_fails_answers_the_batch_and_goes_on(caplog):
    calls = []

    def reserve(batch, settling):
        calls.append(batch[0].request_id)
        if batch[0].request_id == "bad":
            raise RuntimeError("the writer's own bug")
        batch[0].future.set_result("held")
        return []

    writer = Writer(reserve, lambda batch: [])
    bad = Asked(None, "", "", 0, 0, "bad", Future())
    writer.ask(bad)
    with pytest.raises(RuntimeError):
        bad.future.result(5)
    good = Asked(None, "", "", 0, 0, "good", Future())
    writer.ask(good)
    assert good.future.result(5) == "held"  # the writer lives on
    assert "the ledger's writer failed" in caplog.text
    writer.close()


def test_settlements_the_database_refuses_for_a_moment_are_written_when_it_is_back(monkeypatch):
    monkeypatch.setattr(ledger_module, "RETRY_SECONDS", (0.01, 0.01, 0.01))
    calls: list[list[int]] = []

    def write(batch):
        calls.append([s.reservation_id for s in batch])
        if len(calls) <= 2:
            raise OperationalError("the database is restarting")
        return []

    writer = Writer(nothing_reserved, write)
    with held(writer):
        for n in (1, 2, 3):
            writer.settle(Queued(Settlement(n, Usage()), f"r-{n}", pytest.fail))
    writer.close()
    assert calls == [[1, 2, 3]] * 3  # tried again twice, then written


def test_a_settlement_that_cannot_be_written_fails_alone_and_stays_held(caplog):
    calls: list[list[int]] = []

    def write(batch):
        calls.append([s.reservation_id for s in batch])
        if 2 in calls[-1]:
            raise ValueError("a settlement the ledger cannot take")
        return []

    failed: list[str] = []
    writer = Writer(nothing_reserved, write)
    with held(writer):
        for n in (1, 2, 3):
            writer.settle(
                Queued(Settlement(n, Usage()), f"r-{n}", lambda n=n: failed.append(f"r-{n}"))
            )
    writer.close()
    assert calls == [[1, 2, 3], [1], [2], [3]]  # the batch, then one at a time
    assert failed == ["r-2"]
    assert "the reservation of request r-2 stays held" in caplog.text
    writer.settle(Queued(Settlement(4, Usage()), "r-4", lambda: failed.append("r-4")))
    assert failed == ["r-2", "r-4"]  # closed: refused, and told


@contextmanager
def held(writer):
    """The writer busy with a reservation until the block ends (what is queued meanwhile is
    written in its next round, together)."""
    gate = threading.Event()
    writer.reserve = lambda batch, settling: (gate.wait(10), batch[0].future.set_result(None), [])[
        2
    ]
    writer.ask(Asked(None, "", "", 0, 0, "gate", Future()))
    try:
        yield
    finally:
        gate.set()


@pytest.mark.django_db(transaction=True)
def test_a_reservation_busy_only_with_what_queued_settlements_hold_is_asked_again_after_them(
    acme, sonnet_price, monkeypatch
):
    """A budget of one worst case: the first request's settlement is queued while the next
    is being reserved; the next is asked again after it, rather than told to retry."""
    agent = AgentFactory(organisation=acme)
    keys.set_model_key(acme, KEY)
    ask = dict(vendor="anthropic", model=MODEL, input_bound=1000, max_tokens=1000)
    services.set_budget(agent, Decimal("0.02115"))  # one worst case, and the first's cost
    token = keys.issue_gateway_token(agent, run_id=None, ttl=timedelta(hours=1))
    ledger = DjangoLedger()
    caller = ledger.authenticate(token)
    first = ledger.reserve(caller, request_id="first", **ask).result(10)
    reserving, go_on = threading.Event(), threading.Event()
    reserve_all = metering.reserve_all

    def slowly(asks, at):
        results = reserve_all(asks, at)
        reserving.set()
        go_on.wait(10)
        return results

    monkeypatch.setattr(metering, "reserve_all", slowly)
    second = ledger.reserve(caller, request_id="second", **ask)
    assert reserving.wait(10)  # found busy: the first holds its worst case
    ledger.settle(first, Usage(output=10), model=MODEL, outcome="complete", failed=pytest.fail)
    go_on.set()
    hold = second.result(10)  # asked again once the first was settled: it fits
    ledger.release(hold, failed=pytest.fail)
    assert ledger.writer.idle(10)
    assert dict(Reservation.objects.values_list("request_id", "status")) == {
        "first": "settled",
        "second": "released",
    }
    third = ledger.reserve(caller, request_id="third", **ask).result(10)
    with pytest.raises(Refused) as busy:  # nothing queued: told to retry at once
        ledger.reserve(caller, request_id="fourth", **ask).result(10)
    assert busy.value.status == 429
    ledger.release(third, failed=pytest.fail)
    ledger.close()
