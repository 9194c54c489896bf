"""The web server's own settings (gunicorn.conf.py), seen on a running gunicorn."""

import os

import pytest

from tests.egress.conftest import subprocess_database_url
from tests.processes import control_plane

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.mark.e2e  # a control plane of its own
def test_two_control_planes_on_one_host_share_no_control_socket(tmp_path):
    """gunicorn's control socket is one path per user: two control planes (or two test
    processes) would share it, and the first to stop would remove the other's."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": ""}
    with (
        control_plane(tmp_path / "a", subprocess_database_url(), **env),
        control_plane(tmp_path / "b", subprocess_database_url(), **env),
    ):
        pass
    assert not (home / ".gunicorn").exists(), os.listdir(home / ".gunicorn")
