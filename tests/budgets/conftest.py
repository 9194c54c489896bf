"""Fixtures of the budget tests."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from budgets.models import Price


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
