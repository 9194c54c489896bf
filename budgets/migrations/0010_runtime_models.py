"""Prices for the Anthropic models the default workplace's Claude runtime (2.1.332) knows and
0002 did not ship, so that its default model is priced out of the box. From the runtime's own
baked-in model catalog (its pricing tiers, which it uses to show a session's cost), per
million tokens: input, cache writes of 5 minutes and 1 hour, cache reads, output. Only the
names the API gives these models, no patterns; a model an admin priced already keeps its
prices. Left unpriced (refused until an admin prices
it): claude-haiku-5-5, whose prompts over 100,000 tokens cost five times as much, which one
row per model cannot say."""

from datetime import UTC, datetime
from decimal import Decimal

from django.db import migrations

SOURCE = "@anthropic-ai/claude-code 2.1.332's model catalog (pricing_tiers), as of 2026-12-03"
FROM = datetime(2026, 1, 1, tzinfo=UTC)
# Tier → (input, cache write 5 m, cache write 1 h, cache read, output).
TIERS = {
    "2/10": ("2", "2.5", "4", "0.2", "10"),
    "2/10, reads 0.10": ("2", "2.5", "4", "0.1", "10"),
    "3/15": ("3", "3.75", "6", "0.3", "15"),
    "4/20": ("4", "5", "8", "0.2", "20"),
    "5/25": ("5", "6.25", "10", "0.5", "25"),
    "8/40": ("8", "10", "16", "0.2", "40"),
    "10/50": ("10", "12.5", "20", "1", "50"),
    "10/50, reads 0.25": ("10", "12.5", "20", "0.25", "50"),
}
MODELS = {
    "claude-sonnet-4-6": "3/15",
    "claude-sonnet-5": "2/10",
    "claude-sonnet-5-5": "2/10, reads 0.10",
    "claude-opus-4-6": "5/25",
    "claude-opus-4-7": "5/25",
    "claude-opus-4-8": "5/25",
    "claude-opus-5": "5/25",
    "claude-opus-5-5": "4/20",
    "claude-fable-5": "10/50",
    "claude-fable-5-1": "10/50, reads 0.25",
    "claude-fable-5-2": "8/40",
    "claude-mythos-5": "10/50",
    "claude-mythos-5-1": "10/50, reads 0.25",
    "claude-mythos-5-2": "8/40",
}


def ship(apps, schema_editor):
    Price = apps.get_model("budgets", "Price")
    priced = set(Price.objects.filter(vendor="anthropic").values_list("model", flat=True))
    for model, tier in MODELS.items():
        if model in priced:
            continue  # an admin priced it already: theirs stands
        given_input, write_5m, write_1h, read, output = map(Decimal, TIERS[tier])
        Price.objects.create(
            vendor="anthropic",
            model=model,
            input=given_input,
            cache_write_5m=write_5m,
            cache_write_1h=write_1h,
            cache_read=read,
            output=output,
            effective_from=FROM,
            source=SOURCE,
        )


class Migration(migrations.Migration):
    dependencies = [("budgets", "0009_openai_prices")]

    operations = [migrations.RunPython(ship, migrations.RunPython.noop)]
