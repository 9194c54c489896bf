"""The demo forge's files: made once and kept (its token and repository), its CA able to vouch
for its own host only, its token compared in constant time."""

import ssl

import pytest
from aiohttp import encode_basic_auth
from cryptography import x509

from connections import forge


def test_what_it_keeps_is_made_once_and_kept(tmp_path):
    first = forge.prepare(tmp_path, "127.0.0.1")
    again = forge.prepare(tmp_path, "127.0.0.1")
    assert first.credential == again.credential and first.credential.startswith("forge-")
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "key.pem").stat().st_mode & 0o777 == 0o600
    assert (first.root / "demo" / "app.git" / "HEAD").exists()
    assert not (tmp_path / "ca-key.pem").exists()  # the CA never signs again


@pytest.mark.parametrize(
    ("host", "kind"), [("127.0.0.1", x509.IPAddress), ("forge.test", x509.DNSName)]
)
def test_its_ca_vouches_for_its_own_host_only(tmp_path, host, kind):
    forge.prepare(tmp_path, host)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    constraints = ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    (permitted,) = constraints.value.permitted_subtrees
    assert isinstance(permitted, kind) and host in str(permitted.value)
    context = ssl.create_default_context()
    context.load_verify_locations(tmp_path / "ca.pem")  # a CA Python takes, strict as it is


def test_a_new_host_gets_a_new_ca_and_certificate(tmp_path):
    forge.prepare(tmp_path, "127.0.0.1")
    before = (tmp_path / "ca.pem").read_bytes()
    forge.prepare(tmp_path, "127.0.0.2")
    assert (tmp_path / "ca.pem").read_bytes() != before


def test_only_its_token_is_taken(tmp_path):
    served = forge.prepare(tmp_path, "127.0.0.1")
    assert served.accepts(encode_basic_auth("x-access-token", served.credential))
    assert not served.accepts(encode_basic_auth("x-access-token", served.credential + "x"))
    assert not served.accepts(None) and not served.accepts(f"Bearer {served.credential}")
