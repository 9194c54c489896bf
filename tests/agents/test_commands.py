"""The ensure_admin command: a first superuser, never with a fixed password."""

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import override_settings

pytestmark = pytest.mark.django_db


def run():
    out = StringIO()
    call_command("ensure_admin", stdout=out)
    return out.getvalue()


def test_it_generates_a_password_prints_it_once_and_it_works():
    output = run()
    password = output.split("password: ", 1)[1].split()[0]
    assert len(password) >= 20
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser
    assert admin.check_password(password)
    assert run() == ""  # a second run creates nothing and shows nothing


def test_two_installations_get_different_passwords():
    first = run().split("password: ", 1)[1].split()[0]
    get_user_model().objects.all().delete()
    second = run().split("password: ", 1)[1].split()[0]
    assert first != second


@override_settings(COVEY_ADMIN_PASSWORD="chosen-by-the-operator")
def test_it_uses_the_given_password_and_does_not_print_it():
    output = run()
    assert "chosen-by-the-operator" not in output
    assert get_user_model().objects.get(username="admin").check_password("chosen-by-the-operator")
