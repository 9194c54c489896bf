"""How the admin shows values to people: times to the second, and the admin pages a message
names (a refused run's "enter one in the admin (…: /admin/budgets/modelkey/add/)") as links."""

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.contrib import admin
from django.urls import Resolver404, resolve, reverse
from django.utils import timezone
from django.utils.html import escape, format_html, format_html_join
from django.utils.safestring import SafeString

# A path in running text: after the start, a space, "(" or "[", up to its last "/" (covey's
# admin paths all end in one), so the ")" or "." that closes the sentence is left out.
_PATH = re.compile(r"(?<![^\s(\[])/[A-Za-z0-9_\-./]*/")


def seconds(moment: datetime | None, empty: str = "-") -> str:
    """A time as people read it, to the second, in the site's time zone: 2026-12-06 14:03:07."""
    if moment is None:
        return empty
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S")


def moment(field: str, description: str, *, ordered: bool = False) -> Callable[[Any, Any], str]:
    """An admin column or read-only field showing a row's time ``field`` to the second
    (``ordered``: the list sorts by it)."""

    def shown(model_admin: Any, obj: Any) -> str:
        return seconds(getattr(obj, field))

    ordering = field if ordered else None
    return admin.display(description=description, ordering=ordering)(shown)


def linked(text: str) -> SafeString:
    """The text, escaped, with each path of this site's admin in it made a link to it (a path
    that names no admin page stays text)."""
    admin = reverse("admin:index")
    parts: list[str] = []
    last = 0
    for match in _PATH.finditer(text):
        path = match.group()
        if not path.startswith(admin) or not _resolves(path):
            continue
        parts += [
            escape(text[last : match.start()]),
            format_html('<a href="{}">{}</a>', path, path),
        ]
        last = match.end()
    parts.append(escape(text[last:]))
    return format_html_join("", "{}", ((part,) for part in parts))  # each escaped above


def _resolves(path: str) -> bool:
    try:
        resolve(path)
    except Resolver404:
        return False
    return True
