"""The gateway's database ledger: what it keeps between requests, and for how long; and the
reservation at the exact fit of a budget, on PostgreSQL and on SQLite."""

import json
import os
import subprocess
import threading
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import OperationalError
from django.utils import timezone

from budgets import keys, services
from budgets.gateway import ledger as ledger_module
from budgets.gateway.api import Refused
from budgets.gateway.ledger import KEPT_SECONDS, DjangoLedger, Settler
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


def test_a_model_priced_after_the_rows_were_read_is_priced_at_once(setup):
    ledger, _, token = setup
    caller = ledger.authenticate(token)
    ask = dict(vendor="anthropic", model="claude-new-1", input_bound=10, max_tokens=10)
    with pytest.raises(Refused) as refused:
        ledger.reserve(caller, request_id="before", **ask)
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
    hold = ledger.reserve(caller, request_id="after", **ask)
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


# --- the settler: settlements written after the answer, in batches -------------------------------


def test_settlements_queued_at_once_are_written_in_few_batches_in_order():
    written: list[list[int]] = []
    gate = threading.Event()

    def write(batch):
        gate.wait(10)  # the first batch holds the writer while the rest queue up
        written.append([s.reservation_id for s in batch])
        return []

    settler = Settler(write)
    assert settler.wait(1) is False  # nothing queued: nothing to wait for
    for n in range(1, 101):
        settler.put(Settlement(n, Usage()), f"r-{n}")
    gate.set()
    assert settler.wait(10) is True
    assert [n for batch in written for n in batch] == list(range(1, 101))
    assert len(written) <= 3  # the first alone at most, then what queued meanwhile
    settler.close()


def test_a_settlement_the_database_refuses_is_tried_again_then_left_held(monkeypatch, caplog):
    monkeypatch.setattr(ledger_module, "RETRY_SECONDS", (0.01, 0.01))
    calls: list[list[int]] = []

    def write(batch):
        calls.append([s.reservation_id for s in batch])
        if 2 in calls[-1]:
            raise OperationalError("the database is gone")
        return []

    failed: list[str] = []
    settler = Settler(write)
    gate = threading.Lock()
    with gate:  # the three queue before the writer takes any
        settler.write = lambda batch: (gate.acquire(), gate.release(), write(batch))[2]
        for n in (1, 2, 3):
            settler.put(Settlement(n, Usage()), f"r-{n}", lambda n=n: failed.append(f"r-{n}"))
    settler.close()
    assert calls[:3] == [[1, 2, 3]] * 3  # the batch, tried again twice
    assert calls[3:] == [[1], [2], [2], [2], [3]]  # then one at a time
    assert failed == ["r-2"]
    assert "the reservation of request r-2 stays held" in caplog.text
    settler.put(Settlement(4, Usage()), "r-4", lambda: failed.append("r-4"))
    assert failed == ["r-2", "r-4"]  # closed: refused, and told


@pytest.mark.django_db(transaction=True)
def test_a_reservation_busy_only_with_what_queued_settlements_hold_waits_for_them(
    acme, sonnet_price
):
    """A budget of one worst case: the first request's settlement is queued, not written, when
    the next asks; it waits for the writer rather than being told to retry."""
    agent = AgentFactory(organisation=acme)
    keys.set_model_key(acme, KEY)
    ask = dict(vendor="anthropic", model=MODEL, input_bound=1000, max_tokens=1000)
    services.set_budget(agent, Decimal("0.02115"))  # one worst case, and the first's cost
    token = keys.issue_gateway_token(agent, run_id=None, ttl=timedelta(hours=1))
    ledger = DjangoLedger()
    gate = threading.Event()
    write = ledger.settler.write
    ledger.settler.write = lambda batch: (gate.wait(10), write(batch))[1]
    caller = ledger.authenticate(token)
    first = ledger.reserve(caller, request_id="first", **ask)
    ledger.settle(first, Usage(output=10), model=MODEL, outcome="complete", failed=pytest.fail)
    threading.Timer(0.3, gate.set).start()
    started = time.monotonic()
    second = ledger.reserve(caller, request_id="second", **ask)
    assert time.monotonic() - started >= 0.25  # it waited for the writer
    assert Reservation.objects.get(pk=second.reservation_id).status == "open"
    ledger.release(second, failed=pytest.fail)
    ledger.close()
    assert dict(Reservation.objects.values_list("request_id", "status")) == {
        "first": "settled",
        "second": "released",
    }
    ledger.settler = Settler(write)  # a third, with nothing queued, is told to retry at once
    hold = ledger.reserve(caller, request_id="third", **ask)
    with pytest.raises(Refused) as busy:
        ledger.reserve(caller, request_id="fourth", **ask)
    assert busy.value.status == 429
    ledger.release(hold, failed=pytest.fail)
    ledger.close()
