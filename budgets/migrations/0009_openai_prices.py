"""The OpenAI prices covey ships: the standard tier of current text models, per million tokens
(input, cached input, output). OpenAI caches by itself and charges no cache writes: their
columns hold the input price, which no request is ever charged at (they only bound a worst
case). Only the names OpenAI gives a model and its dated snapshots are priced, no patterns: a
newer snapshot may cost differently (gpt-4o-2024-05-13 did), so it is refused until an admin
prices it."""

from datetime import UTC, datetime
from decimal import Decimal

from django.db import migrations

SOURCE = "https://openai.com/api/pricing/ (standard tier, as of 2026-12-01)"
FROM = datetime(2026, 1, 1, tzinfo=UTC)
# Model → (input, cached input, output), and the snapshots priced as it.
MODELS = {
    "gpt-5.1": (("1.25", "0.125", "10"), ["gpt-5.1-2025-11-13"]),
    "gpt-5.1-codex": (("1.25", "0.125", "10"), []),
    "gpt-5.1-codex-mini": (("0.25", "0.025", "2"), []),
    "gpt-5": (("1.25", "0.125", "10"), ["gpt-5-2025-08-07"]),
    "gpt-5-codex": (("1.25", "0.125", "10"), []),
    "gpt-5-mini": (("0.25", "0.025", "2"), ["gpt-5-mini-2025-08-07"]),
    "gpt-5-nano": (("0.05", "0.005", "0.40"), ["gpt-5-nano-2025-08-07"]),
    "gpt-5-pro": (("15", "15", "120"), ["gpt-5-pro-2025-10-06"]),  # no cache discount
    "gpt-4.1": (("2", "0.50", "8"), ["gpt-4.1-2025-04-14"]),
    "gpt-4.1-mini": (("0.40", "0.10", "1.60"), ["gpt-4.1-mini-2025-04-14"]),
    "gpt-4.1-nano": (("0.10", "0.025", "0.40"), ["gpt-4.1-nano-2025-04-14"]),
    "gpt-4o": (("2.50", "1.25", "10"), ["gpt-4o-2024-08-06", "gpt-4o-2024-11-20"]),
    "gpt-4o-mini": (("0.15", "0.075", "0.60"), ["gpt-4o-mini-2024-07-18"]),
    "o3": (("2", "0.50", "8"), ["o3-2025-04-16"]),
    "o4-mini": (("1.10", "0.275", "4.40"), ["o4-mini-2025-04-16"]),
    "o3-mini": (("1.10", "0.55", "4.40"), ["o3-mini-2025-01-31"]),
}


def ship(apps, schema_editor):
    Price = apps.get_model("budgets", "Price")
    for name, ((given_input, cached, output), snapshots) in MODELS.items():
        for model in [name, *snapshots]:
            Price.objects.create(
                vendor="openai",
                model=model,
                input=Decimal(given_input),
                cache_write_5m=Decimal(given_input),
                cache_write_1h=Decimal(given_input),
                cache_read=Decimal(cached),
                output=Decimal(output),
                effective_from=FROM,
                source=SOURCE,
            )


class Migration(migrations.Migration):
    dependencies = [("budgets", "0008_price_vendor")]

    operations = [migrations.RunPython(ship, migrations.RunPython.noop)]
