"""Whole numbers read from text: what int() would take only when it is plain ASCII digits."""

import pytest

from covey.numbers import whole_number


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("0", 0),
        ("42", 42),
        ("007", 7),
        ("9" * 18, int("9" * 18)),
        ("9" * 19, None),  # past a 64-bit column
        ("", None),
        (None, None),
        ("-1", None),
        (" 1", None),
        ("1.5", None),
        ("²", None),  # a digit to str.isdigit, which int() refuses
        ("١٢", None),  # Arabic-Indic digits, which int() would take
    ],
)
def test_only_plain_ascii_digits_are_a_whole_number(text, number):
    assert whole_number(text) == number
