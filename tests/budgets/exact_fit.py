"""A budget of exactly three worst cases, on whatever database Django is given: the ledger's
tests run :func:`boundary` in their own process on PostgreSQL, and this module as a program
(``python -m tests.budgets.exact_fit``, which migrates a new database first) on SQLite, make
run's database, whose columns hold binary floating point. It prints what it saw as JSON."""

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

# The amount: one token of input at $6 a million (a 1-hour cache write, the dearest
# kind) and 272 of output at $15: $0.004086, whose three times 0.012258 less two of it is below
# 0.004086 in floating point.
INPUT, OUTPUT = 1, 272
WORST = Decimal("0.004086")
MODEL = "exact-fit-1"


def boundary() -> dict[str, Any]:
    """Reserve against a budget of exactly three worst cases until refused, settle those held at
    their worst case, and ask once more; the same against a budget a millionth short."""
    from django.db import connection

    from budgets import metering, services
    from budgets.models import Price
    from budgets.usage import Usage
    from tests.factories import AgentFactory

    Price.objects.create(
        model=MODEL,
        input=Decimal(3),
        cache_write_5m=Decimal("3.75"),
        cache_write_1h=Decimal(6),
        cache_read=Decimal("0.3"),
        output=Decimal(15),
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        source="tests",
    )

    def ask(agent: Any, request_id: str) -> tuple[str, Any]:
        try:
            held = metering.reserve(
                agent, model=MODEL, input_bound=INPUT, max_tokens=OUTPUT, request_id=request_id
            )
        except metering.Busy:
            return "busy", None
        except metering.Exhausted as exc:
            return ("used up" if exc.used_up else "too large"), None
        return "held", held

    seen: dict[str, Any] = {"database": connection.vendor}
    for name, limit in (("exact", 3 * WORST), ("short", 3 * WORST - Decimal("0.000001"))):
        agent: Any = AgentFactory()
        services.set_budget(agent, limit)
        answers = [ask(agent, f"{name}-{n}") for n in range(4)]
        for _, held in answers:
            if held is not None:
                metering.settle(held, Usage(cache_write_1h=INPUT, output=OUTPUT))
        last, _ = ask(agent, f"{name}-last")
        spend = metering.current_spend(agent.budget)
        seen[name] = {
            "answers": [answer for answer, _ in answers] + [last],
            "spent": str(spend.spent),
            "reserved": str(spend.reserved),
            "used up": services.used_up(agent) != "",
        }
    return seen


if __name__ == "__main__":
    import os

    import django
    from django.core.management import call_command

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "covey.settings")
    django.setup()
    call_command("migrate", verbosity=0)
    print(json.dumps(boundary()))
