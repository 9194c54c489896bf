"""Install the thirteen allowlist templates covey ships (templates/catalogue.py)."""

from django.db import migrations


def install(apps, schema_editor):
    from templates.services import install_shipped

    install_shipped(apps.get_model("templates", "AllowlistTemplate"))


class Migration(migrations.Migration):
    dependencies = [("templates", "0001_initial")]

    operations = [migrations.RunPython(install, migrations.RunPython.noop)]
