"""For migrations that move models from one app to another (their tables kept): the content
types go with them, and so do the permissions granted on them and the admin's history."""

from typing import Any

from django.db import migrations


def move_content_types(source: str, target: str, models: list[str]) -> migrations.RunPython:
    """A migration step that moves these models' content types from ``source`` to ``target``
    (and back when unapplied)."""

    def forwards(apps: Any, schema_editor: Any) -> None:
        _move(apps, source, target, models)

    def backwards(apps: Any, schema_editor: Any) -> None:
        _move(apps, target, source, models)

    return migrations.RunPython(forwards, backwards)


def _move(apps: Any, source: str, target: str, models: list[str]) -> None:
    content_types = apps.get_model("contenttypes", "ContentType")
    permissions = apps.get_model("auth", "Permission")
    log_entries = apps.get_model("admin", "LogEntry")
    for model in models:
        old = content_types.objects.filter(app_label=source, model=model).first()
        if old is None:
            continue  # a new install: post_migrate makes them in the right app
        new = content_types.objects.filter(app_label=target, model=model).first()
        if new is None:
            old.app_label = target
            old.save(update_fields=["app_label"])
            continue
        # Both exist (a migrate that stopped halfway let post_migrate make the new one): the
        # grants and the history move to it, the old one goes.
        for permission in permissions.objects.filter(content_type=old):
            twin = permissions.objects.filter(content_type=new, codename=permission.codename)
            if (kept := twin.first()) is None:
                permission.content_type = new
                permission.save(update_fields=["content_type"])
                continue
            kept.user_set.add(*permission.user_set.all())
            kept.group_set.add(*permission.group_set.all())
            permission.delete()
        log_entries.objects.filter(content_type=old).update(content_type=new)
        old.delete()
