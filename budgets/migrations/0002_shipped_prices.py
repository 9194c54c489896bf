"""The prices covey ships: Anthropic's current models, per million tokens (input, cache writes
of 5 minutes (1.25x input) and 1 hour (2x input), cache reads (0.1x input), output). An
installation edits them in the admin (a change is a new row); these stay on the record."""

from datetime import UTC, datetime
from decimal import Decimal

from django.db import migrations

SOURCE = "https://docs.anthropic.com/en/docs/about-claude/pricing (as of 2026-12-01)"
FROM = datetime(2026, 1, 1, tzinfo=UTC)
# Family → (input, output): the cache prices follow from the input price.
FAMILIES = {
    "claude-opus-4-5": ("5", "25"),
    "claude-opus-4-1": ("15", "75"),
    "claude-opus-4-0": ("15", "75"),
    "claude-sonnet-4-5": ("3", "15"),
    "claude-sonnet-4-0": ("3", "15"),
    "claude-haiku-4-5": ("1", "5"),
    "claude-3-7-sonnet": ("3", "15"),
    "claude-3-5-haiku": ("0.80", "4"),
}
# The names the API answers with, besides the family's own and its dated snapshots.
ALIASES = {
    "claude-opus-4-0": ["claude-opus-4-20250514"],
    "claude-sonnet-4-0": ["claude-sonnet-4-20250514"],
    "claude-3-7-sonnet": ["claude-3-7-sonnet-latest"],
    "claude-3-5-haiku": ["claude-3-5-haiku-latest"],
}


def ship(apps, schema_editor):
    Price = apps.get_model("budgets", "Price")
    for family, (given_input, given_output) in FAMILIES.items():
        unit = Decimal(given_input)
        for model in [family, f"{family}-*", *ALIASES.get(family, [])]:
            Price.objects.create(
                model=model,
                input=unit,
                cache_write_5m=unit * Decimal("1.25"),
                cache_write_1h=unit * 2,
                cache_read=unit / 10,
                output=Decimal(given_output),
                effective_from=FROM,
                source=SOURCE,
            )


class Migration(migrations.Migration):
    dependencies = [("budgets", "0001_budgets")]

    operations = [migrations.RunPython(ship, migrations.RunPython.noop)]
