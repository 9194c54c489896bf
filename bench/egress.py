"""x."""


def f() -> int:
    return 1
