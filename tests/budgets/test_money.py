"""Money as people read it (budgets.money): one rule for the admin, the dashboard and every
message."""

from decimal import Decimal

import pytest

from budgets.money import dollars, figures


@pytest.mark.parametrize(
    ("amount", "shown", "exact"),
    [
        ("5.000000", "$5.00", "$5.00"),
        ("0.000000", "$0.00", "$0.00"),
        ("3.485000", "$3.49", "$3.485"),  # cents, rounded half up
        ("0.012258", "$0.01", "$0.012258"),
        ("0.0019", "$0.0019", "$0.0019"),  # under a cent: its digits, never $0.00
        ("0.001248", "$0.001248", "$0.001248"),
        ("0.004999", "$0.004999", "$0.004999"),
        ("0.000001", "$0.000001", "$0.000001"),
        ("0.0000001", "$0.000001", "$0.000001"),  # not nothing: never shown as nothing
        ("1234567.891234", "$1,234,567.89", "$1,234,567.891234"),
        ("-0.5", "-$0.50", "-$0.50"),
        (7, "$7.00", "$7.00"),
    ],
)
def test_an_amount_is_shown_in_cents_unless_it_is_under_one(amount, shown, exact):
    value = Decimal(amount) if isinstance(amount, str) else amount
    assert dollars(value) == shown
    assert dollars(value, exact=True) == exact


@pytest.mark.parametrize(
    ("amount", "shown"),
    [("5.000000", "5.00"), ("3.5", "3.50"), ("0.012500", "0.0125"), ("1234.5", "1234.50")],
)
def test_a_forms_field_shows_every_digit_and_no_separator(amount, shown):
    assert figures(Decimal(amount)) == shown
