"""Create the first superuser, ``admin``, once; its password is shown once and never stored."""

import secrets
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Create the 'admin' superuser if no superuser exists, with COVEY_ADMIN_PASSWORD or a "
        "generated password printed once."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        if user_model.objects.filter(is_superuser=True).exists():
            return
        given = settings.COVEY_ADMIN_PASSWORD
        password = given or secrets.token_urlsafe(18)
        user_model.objects.create_superuser("admin", email="", password=password)
        if given:
            self.stdout.write(
                "Created superuser 'admin' with the password in COVEY_ADMIN_PASSWORD."
            )
        else:
            self.stdout.write(
                self.style.WARNING(
                    f"Created superuser 'admin' with password: {password}\n"
                    "It is shown this once; change it in the admin."
                )
            )
