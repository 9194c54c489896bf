"""Whole numbers people and processes send as text (a header, a query, an id in a URL): ASCII
digits only, at most :data:`MAX_DIGITS` of them, so ``int()`` never meets a Unicode digit it
cannot read ("²" is a digit to ``str.isdigit``) nor a value past a 64-bit column. Imports no
app."""

MAX_DIGITS = 18


def whole_number(text: str | None) -> int | None:
    """``text`` as a whole number (0 or more), or None when it is not one."""
    if text and text.isascii() and text.isdigit() and len(text) <= MAX_DIGITS:
        return int(text)
    return None
