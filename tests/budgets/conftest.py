"""Fixtures of the budget tests, and the model gateway as a real process before a fake vendor."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from budgets.models import Price, Reservation, Vendor
from tests.budgets.fake_vendor import FakeVendor, fake_vendor
from tests.egress.conftest import subprocess_database_url
from tests.netfixtures import TestCA, loopback_alias
from tests.processes import free_port, running, wait_for

VENDOR_HOST = loopback_alias(40)
KEY = "sk-ant-api03-organisations-own-key-0123456789"
MODEL = "claude-sonnet-4-5-20250929"
OPENAI_KEY = "sk-proj-organisations-own-openai-key-0123456789"
OPENAI_MODEL = "gpt-4.1"
METRICS_TOKEN = "gateway-metrics-" + "m" * 24


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("vendor-ca"))


@pytest.fixture(scope="module")
def vendor(ca) -> Iterator[FakeVendor]:
    with fake_vendor(VENDOR_HOST, ca.issue(VENDOR_HOST)) as vendor:
        yield vendor


class Gateway:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def start_gateway(
    tmp_path: Path,
    vendor: FakeVendor,
    ca: TestCA,
    host: str = "127.0.0.1",
    metrics_token: str = METRICS_TOKEN,
    **env_overrides: str,
) -> Iterator[Gateway]:
    """``manage.py model_gateway`` on ``host`` over the test database, to the fake vendor; the
    organisation's key must never be in its output."""
    port = free_port()
    log = tmp_path / f"gateway-{port}.log"
    env = {
        **os.environ,
        "DATABASE_URL": subprocess_database_url(),
        "COVEY_VAR_DIR": str(settings.VAR_DIR),
        "COVEY_ENCRYPTION_KEYS": ",".join(settings.COVEY_ENCRYPTION_KEYS),
        "COVEY_MODEL_UPSTREAM": vendor.url,
        "COVEY_OPENAI_UPSTREAM": vendor.url,
        "COVEY_MODEL_CA_BUNDLE": str(ca.ca_file),
        "COVEY_CONNECTIONS_CA_BUNDLE": str(ca.ca_file),  # stand-ins of git hosts, too
        "COVEY_GATEWAY_DEFAULT_MAX_TOKENS": "1000",
        "COVEY_METRICS_TOKEN": metrics_token,
        "PYTHONUNBUFFERED": "1",
        **env_overrides,
    }
    args = [sys.executable, "manage.py", "model_gateway", "--listen", f"{host}:{port}"]
    with running(args, env, log) as process:
        url = f"http://{host}:{port}"

        def up() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, "the gateway answering", log)
        yield Gateway(url, log)
    assert KEY not in log.read_text(), "the key was logged"
    assert not metrics_token or metrics_token not in log.read_text(), "its token was logged"


@pytest.fixture
def sonnet_price(db) -> Price:
    """Sonnet 4.5's price row: the shipped one, or (after a transactional test emptied the
    tables the migrations filled) the same made again."""
    price, _ = Price.objects.get_or_create(
        model="claude-sonnet-4-5-*",
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        defaults={
            "input": Decimal(3),
            "cache_write_5m": Decimal("3.75"),
            "cache_write_1h": Decimal(6),
            "cache_read": Decimal("0.3"),
            "output": Decimal(15),
            "source": "tests",
        },
    )
    return price


@pytest.fixture
def openai_price(db) -> Price:
    """gpt-4.1's price row: the shipped one, or the same made again."""
    price, _ = Price.objects.get_or_create(
        vendor=Vendor.OPENAI,
        model=OPENAI_MODEL,
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        defaults={
            "input": Decimal(2),
            "cache_write_5m": Decimal(2),
            "cache_write_1h": Decimal(2),
            "cache_read": Decimal("0.5"),
            "output": Decimal(8),
            "source": "tests",
        },
    )
    return price


def settled() -> None:
    """Wait until every reservation is settled: the gateway writes settlements once the answer
    has ended (budgets/gateway/ledger.py), moments after the caller has it."""
    wait_for(
        lambda: not Reservation.objects.filter(status=Reservation.Status.OPEN).exists(),
        10,
        "every reservation settled",
    )


@pytest.fixture
def settled_at_the_end(transactional_db):
    """Every reservation settled before the test's tables are emptied: the gateway writes a
    settlement moments after its answer, and a flush meanwhile would wait for it, or deadlock
    with it (set up after the database, so torn down before its flush)."""
    yield
    settled()
