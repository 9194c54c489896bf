"""WSGI entry point. It refuses to start without a secret key, saying where one comes from."""

import os

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "covey.settings")
application = get_wsgi_application()
try:
    settings.SECRET_KEY  # noqa: B018 - Django raises when it is empty
except ImproperlyConfigured:
    raise ImproperlyConfigured(
        "covey has no secret key: set DJANGO_SECRET_KEY, or run `python -m covey.var`"
        f" (make run does) to make one in {settings.VAR_DIR / 'secret_key'}"
    ) from None
