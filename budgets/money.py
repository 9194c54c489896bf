"""Money as people read it: one rule for the admin, the dashboard and every message. No Django.

Amounts are kept to a millionth of a dollar. They are shown in cents ("$5.00", "$1,234.50"),
except an amount under a cent, which cents would show as "$0.00" or "$0.01": it keeps its
digits ("$0.0019", "$0.000015"). Where two amounts are compared (a refused request's cost
against what is left), each is shown ``exact``: every digit it has, at least cents
("$0.012258"), as cents could show "$0.01 left; this request may cost up to $0.01".
"""

from decimal import ROUND_HALF_UP, ROUND_UP, Decimal

CENT = Decimal("0.01")
MILLIONTH = Decimal("0.000001")


def dollars(amount: Decimal | int, *, exact: bool = False) -> str:
    """'$5.00'; under a cent, its digits ('$0.0019'); ``exact``: every digit ('$0.012258')."""
    size = abs(Decimal(amount))
    if exact or 0 < size < CENT:
        shown = _every_digit(size)
    else:
        shown = size.quantize(CENT, rounding=ROUND_HALF_UP)
    return f"{'-' if amount < 0 else ''}${shown:,f}"


def figures(amount: Decimal) -> str:
    """The amount as a form's field shows it: every digit, at least cents ('5.00', '0.0125');
    not the column's '5.000000'."""
    return f"{'-' if amount < 0 else ''}{_every_digit(abs(amount)):f}"


def _every_digit(size: Decimal) -> Decimal:
    # To a millionth, rounded up (what is not nothing never shows as nothing), its trailing
    # zeros dropped down to cents.
    shown = size.quantize(MILLIONTH, rounding=ROUND_UP)
    exponent = shown.normalize().as_tuple().exponent  # of its last digit that is not 0
    places = max(2, -exponent) if isinstance(exponent, int) else 2
    return shown.quantize(Decimal(1).scaleb(-places))
