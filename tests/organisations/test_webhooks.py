"""Organisations' webhooks: the signing secret shown once and kept encrypted, deliveries to a
real receiver on loopback (plain and TLS with the test's own CA) that checks the signature, the
outcome kept, the API and the admin; and end to end, a request filed in a transaction that
commits, delivered by a real Celery worker on the Redis broker."""

import hashlib
import hmac
import http.server
import json
import os
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import trustme
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import connection, transaction

from covey import crypto
from organisations import webhooks
from organisations.models import Webhook
from tests.agents.test_admin_browser import browser, page  # noqa: F401 (fixtures)
from tests.egress.conftest import subprocess_database_url
from tests.factories import AgentFactory
from tests.processes import running, wait_for

EVENT = {"id": 7, "thing": "registry.example.org:443"}
LOOPBACK = ["127.0.0.0/8"]


@pytest.fixture(autouse=True)
def _loopback_receivers(settings):
    """The tests' receivers are on loopback, which covey refuses unless it is allowed."""
    settings.COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS = LOOPBACK


@dataclass
class Receiver:
    url: str
    answer: int = 204
    got: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    hold: threading.Event | None = None  # set: each POST is answered once it is set


@contextmanager
def receiver(tls: ssl.SSLContext | None = None) -> Iterator[Receiver]:
    """An HTTP(S) server on loopback that keeps what is POSTed to it."""
    found = Receiver("")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            found.got.append((dict(self.headers), body))
            if found.hold is not None:
                found.hold.wait(10)
            self.send_response(found.answer)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    found.url = f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}/hooks/covey"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()


def verified(secret: str, headers: dict[str, str], body: bytes) -> dict:
    """What a receiver does: check the signature (and that it is recent), then read."""
    parts = dict(part.split("=", 1) for part in headers[webhooks.SIGNATURE_HEADER].split(","))
    expected = hmac.new(secret.encode(), f"{parts['t']}.".encode() + body, hashlib.sha256)
    assert hmac.compare_digest(parts["v1"], expected.hexdigest())
    assert abs(time.time() - int(parts["t"])) < 60
    return json.loads(body)


# --- encryption --------------------------------------------------------------------------------


def test_secrets_are_encrypted_and_keys_rotate(settings):
    old, new = crypto.Fernet.generate_key().decode(), crypto.Fernet.generate_key().decode()
    settings.COVEY_ENCRYPTION_KEYS = [old]
    kept = crypto.encrypt("whsec_abc")
    assert kept.startswith(crypto.PREFIX) and "whsec_abc" not in kept
    assert crypto.decrypt(kept) == "whsec_abc"
    settings.COVEY_ENCRYPTION_KEYS = [new, old]  # a new key first: the old one still opens
    assert crypto.decrypt(kept) == "whsec_abc"
    rotated = crypto.rotate(kept)
    settings.COVEY_ENCRYPTION_KEYS = [new]
    assert crypto.decrypt(rotated) == "whsec_abc"
    with pytest.raises(crypto.Undecryptable, match="no key of COVEY_ENCRYPTION_KEYS opens it"):
        crypto.decrypt(kept)
    with pytest.raises(crypto.Undecryptable, match="not encrypted by covey"):
        crypto.decrypt("whsec_abc")
    settings.COVEY_ENCRYPTION_KEYS = ["not-a-key"]
    with pytest.raises(ImproperlyConfigured, match="32 url-safe base64-encoded bytes"):
        crypto.encrypt("x")
    settings.COVEY_ENCRYPTION_KEYS = []
    with pytest.raises(ImproperlyConfigured, match="no encryption key"):
        crypto.encrypt("x")


# --- the webhook and its deliveries ------------------------------------------------------------


def test_the_secret_is_given_once_and_kept_encrypted(acme):
    secret = webhooks.set_webhook(acme, "https://hooks.example.org/covey")
    assert secret and secret.startswith(webhooks.SECRET_PREFIX)
    with connection.cursor() as cursor:
        cursor.execute("SELECT secret FROM organisations_webhook")
        (raw,) = cursor.fetchone()
    assert secret not in raw and crypto.decrypt(raw) == secret
    # Moving it keeps the secret; asking for a new one replaces it.
    assert webhooks.set_webhook(acme, "https://hooks.example.org/v2") is None
    assert crypto.decrypt(Webhook.objects.get().secret) == secret
    again = webhooks.set_webhook(acme, "https://hooks.example.org/v2", new_secret=True)
    assert again and again != secret and crypto.decrypt(Webhook.objects.get().secret) == again
    for bad in ("ftp://hooks.example.org/", "hooks.example.org", "http://"):
        with pytest.raises(ValidationError, match="give an http or https URL"):
            webhooks.set_webhook(acme, bad)
    assert Webhook.objects.get().url == "https://hooks.example.org/v2"  # nothing changed


def test_a_delivery_is_signed_and_its_outcome_kept(acme):
    with receiver() as hooks:
        secret = webhooks.set_webhook(acme, hooks.url)
        assert secret
        outcome = webhooks.post(acme.pk, "request.pending", "d-1", "2026-12-02T00:00:00Z", EVENT)
        assert outcome == "delivered: 204"
        ((headers, body),) = hooks.got
        sent = verified(secret, headers, body)
        assert sent == {
            "event": "request.pending",
            "delivery": "d-1",
            "at": "2026-12-02T00:00:00Z",
            "organisation": {"id": acme.pk, "slug": acme.slug},
            "data": EVENT,
        }
        assert headers["X-Covey-Event"] == "request.pending"
        assert headers["X-Covey-Delivery"] == "d-1"
        assert headers["Content-Type"] == "application/json"
        assert Webhook.objects.get().last_delivery == "delivered: 204"
        hooks.answer = 500
        outcome = webhooks.post(acme.pk, "request.pending", "d-2", "2026-12-02T00:00:01Z", EVENT)
        assert outcome == "failed: the receiver answered 500"
        assert Webhook.objects.get().last_delivery == outcome
    assert webhooks.post(acme.pk, "request.pending", "d-3", "x", EVENT).startswith("failed: Conn")


def test_a_receiver_at_a_private_address_is_refused_unless_allowed(acme, settings, monkeypatch):
    with receiver() as hooks:
        webhooks.set_webhook(acme, hooks.url)
        settings.COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS = []
        outcome = webhooks.post(acme.pk, "request.pending", "d-1", "x", EVENT)
        assert outcome == (
            "failed: 127.0.0.1 is at 127.0.0.1, not a public address; the platform team allows"
            " private receivers with COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS"
        )
        assert hooks.got == []
    # A name is resolved once, checked, and its address connected to, under its own Host.
    answers = {"hooks.example.org": "10.1.2.3"}
    monkeypatch.setattr(
        webhooks.socket,
        "getaddrinfo",
        lambda name, port, **kw: [(2, 1, 6, "", (answers[name], port))],
    )
    with pytest.raises(ValueError, match=r"hooks\.example\.org is at 10\.1\.2\.3, not a public"):
        webhooks._pinned("https://hooks.example.org/covey")
    settings.COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS = ["10.0.0.0/8"]
    assert webhooks._pinned("https://hooks.example.org:8443/covey?x=1") == (
        "https://10.1.2.3:8443/covey?x=1",
        "hooks.example.org:8443",
    )


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("http://127.0.0.1:8080/hooks", "127.0.0.1"),
        ("http://localhost/hooks", "127.0.0.1"),
        ("https://api.localhost./hooks", "127.0.0.1"),
        ("http://[::1]:9000/", "::1"),
        ("http://[::ffff:127.0.0.1]/", "::ffff:127.0.0.1"),
        ("http://10.1.2.3/", "10.1.2.3"),
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
        ("http://0.0.0.0:80/", "0.0.0.0"),
    ],
)
def test_a_receiver_at_a_private_address_is_refused_when_saved_unless_allowed(
    acme, settings, api, alice, url, address
):
    """Refused on save (service, API), not only at delivery; what DNS would say of a name is
    checked at each delivery, as its answer may change."""
    settings.COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS = []
    said = f"is at {address}, not a public address; the platform team allows private receivers"
    with pytest.raises(ValidationError, match=said) as refused:
        webhooks.set_webhook(acme, url)
    assert list(refused.value.message_dict) == ["url"]
    path = f"/api/v1/organisations/{acme.pk}/webhook/"
    answer = api(alice).put(path, {"url": url}, format="json")
    assert answer.status_code == 400 and said in answer.json()["url"][0]
    assert not Webhook.objects.exists()
    settings.COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS = ["0.0.0.0/0", "::/0"]
    assert webhooks.set_webhook(acme, url)  # allowed: kept


def test_a_named_receiver_is_saved_without_asking_dns(acme, settings, monkeypatch):
    settings.COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS = []
    asked = []
    real = webhooks.socket.getaddrinfo

    def getaddrinfo(name, port, *args, **kwargs):
        asked.append((name, kwargs.get("flags", 0) & webhooks.socket.AI_NUMERICHOST))
        return real(name, port, *args, **kwargs)

    monkeypatch.setattr(webhooks.socket, "getaddrinfo", getaddrinfo)
    assert webhooks.set_webhook(acme, "https://hooks.example.org/covey")
    assert asked == [("hooks.example.org", webhooks.socket.AI_NUMERICHOST)]  # parsed, not looked up


def test_a_delivery_that_cannot_be_signed_or_verified_is_recorded_not_raised(acme, settings):
    with receiver() as hooks:
        webhooks.set_webhook(acme, hooks.url)
        settings.COVEY_WEBHOOK_CA_BUNDLE = "/nonexistent/ca.pem"
        outcome = webhooks.post(acme.pk, "request.pending", "d-1", "x", EVENT)
        assert outcome.startswith("failed: the CA bundle /nonexistent/ca.pem")
        settings.COVEY_ENCRYPTION_KEYS = []
        outcome = webhooks.post(acme.pk, "request.pending", "d-2", "x", EVENT)
        assert outcome.startswith("failed: the signing secret cannot be read: no encryption key")
        assert Webhook.objects.get().last_delivery == outcome and hooks.got == []


def test_decisions_are_sent_once_they_commit_and_not_when_they_roll_back(
    acme, april, django_capture_on_commit_callbacks, monkeypatch
):
    from approvals import services as approvals

    sent: list[tuple[str, list]] = []
    monkeypatch.setattr(webhooks.app, "send_task", lambda name, args: sent.append((name, args)))
    webhooks.set_webhook(acme, "https://hooks.example.org/covey")
    agent = AgentFactory(organisation=acme)
    with django_capture_on_commit_callbacks(execute=True):
        request = approvals.file_egress(agent, "registry.example.org", reason="the SDK")
    with (
        django_capture_on_commit_callbacks(execute=True),
        pytest.raises(RuntimeError),
        transaction.atomic(),
    ):
        approvals.approve(request, by=april, note="fine")
        raise RuntimeError("something after it failed: the decision rolls back")
    assert [args[1] for _, args in sent] == ["request.pending"]  # nothing of the rolled back
    request.refresh_from_db()
    assert request.status == "pending"
    with django_capture_on_commit_callbacks(execute=True):
        approvals.approve(request, by=april, note="fine")
    name, (organisation, event, _, _, data) = sent[-1]
    assert (name, organisation, event) == (webhooks.DELIVER, acme.pk, "request.decided")
    assert (data["status"], data["decided_by"], data["note"]) == ("approved", "april", "fine")
    assert data["produced"] == {"agent_versions": {str(agent.pk): agent.version + 1}}


def test_a_retry_of_a_pending_request_after_its_decision_is_dropped(acme, april, monkeypatch):
    """The receiver is down when the request is filed, back when it is decided: the pending
    event's retry comes after the decision went, and is dropped, not delivered."""
    from approvals import services as approvals
    from organisations import tasks

    monkeypatch.setattr(webhooks.app, "send_task", lambda name, args: None)
    with receiver() as hooks:
        webhooks.set_webhook(acme, hooks.url)
        request = approvals.file_egress(AgentFactory(organisation=acme), "x.example", reason="r")
        pending = approvals.event_data(request)
        hooks.answer = 503
        assert webhooks.post(acme.pk, "request.pending", "d-1", "t1", pending).startswith("failed")
        hooks.answer = 204
        approvals.approve(request, by=april, note="fine")
        request.refresh_from_db()
        decided = approvals.event_data(request)
        assert webhooks.post(acme.pk, "request.decided", "d-2", "t2", decided) == "delivered: 204"
        retried = tasks.deliver(acme.pk, "request.pending", "d-1", "t1", pending)
        assert retried == f"dropped: request #{request.pk} is approved now"  # and not retried
    tried = [(headers["X-Covey-Event"], headers["X-Covey-Delivery"]) for headers, _ in hooks.got]
    assert tried == [("request.pending", "d-1"), ("request.decided", "d-2")]  # d-1 was a 503
    assert Webhook.objects.get().last_delivery == "delivered: 204"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_decision_waits_for_the_pending_event_in_flight(acme, april, monkeypatch):
    """The pending event's try is on its way (a slow receiver) when the request is decided:
    the decision is sent once it has been answered, never before it."""
    from approvals import services as approvals

    monkeypatch.setattr(webhooks.app, "send_task", lambda name, args: None)
    with receiver() as hooks:
        webhooks.set_webhook(acme, hooks.url)
        request = approvals.file_egress(AgentFactory(organisation=acme), "x.example", reason="r")
        outcomes: dict[str, str] = {}

        def deliver(event: str, data: dict) -> threading.Thread:
            def run() -> None:
                try:
                    outcomes[event] = webhooks.post(acme.pk, event, event, "t", data)
                finally:
                    connection.close()

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        hooks.hold = threading.Event()
        pending = deliver("request.pending", approvals.event_data(request))
        wait_for(lambda: len(hooks.got) == 1, 10, "the pending event at the receiver")
        approvals.approve(request, by=april, note="fine")
        request.refresh_from_db()
        decided = deliver("request.decided", approvals.event_data(request))
        time.sleep(0.5)
        assert len(hooks.got) == 1  # the decision waits for the pending event's answer
        hooks.hold.set()
        pending.join(10)
        decided.join(10)
    assert [headers["X-Covey-Event"] for headers, _ in hooks.got] == [
        "request.pending",
        "request.decided",
    ]
    assert outcomes == {"request.pending": "delivered: 204", "request.decided": "delivered: 204"}


def test_a_tls_receiver_is_verified(acme, settings, tmp_path):
    authority = trustme.CA()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(tls)
    with receiver(tls) as hooks:
        webhooks.set_webhook(acme, hooks.url)
        # Not a CA this machine trusts: refused, nothing sent.
        outcome = webhooks.post(acme.pk, "request.pending", "d-1", "x", EVENT)
        assert outcome.startswith("failed: ConnectError") and "CERTIFICATE_VERIFY_FAILED" in outcome
        assert hooks.got == []
        bundle = tmp_path / "ca.pem"
        authority.cert_pem.write_to_path(str(bundle))
        settings.COVEY_WEBHOOK_CA_BUNDLE = str(bundle)
        assert webhooks.post(acme.pk, "request.pending", "d-2", "x", EVENT) == "delivered: 204"


def test_an_organisation_without_a_webhook_sends_nothing(acme, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        webhooks.send(acme.pk, "request.pending", EVENT)
    assert callbacks == []
    with pytest.raises(ValueError, match="unknown webhook event"):
        webhooks.send(acme.pk, "request.eaten", EVENT)


# --- API and admin -----------------------------------------------------------------------------


def test_the_api_shows_the_secret_once_and_only_admins_change_it(api, acme, alice, vera, gary):
    path = f"/api/v1/organisations/{acme.pk}/webhook/"
    assert api(alice).get(path).status_code == 404
    made = api(alice).put(path, {"url": "https://hooks.example.org/covey"}, format="json")
    assert made.status_code == 200, made.content
    secret = made.json()["secret"]
    assert secret.startswith(webhooks.SECRET_PREFIX)
    shown = api(alice).get(path)  # without the secret
    assert shown.json()["url"] == "https://hooks.example.org/covey" and secret not in shown.text
    assert api(vera).get(path).status_code == 403  # its URL may hold a credential of its own
    moved = api(alice).put(path, {"url": "https://hooks.example.org/v2"}, format="json")
    assert "secret" not in moved.json() and secret not in moved.text
    assert api(vera).put(path, {"url": "https://evil.example/"}, format="json").status_code == 403
    assert api(gary).get(path).status_code == 404  # another organisation's
    bad = api(alice).put(path, {"url": "ftp://x"}, format="json")
    assert bad.status_code == 400 and "url" in bad.json()
    assert Webhook.objects.get().url == "https://hooks.example.org/v2"
    organisation = api(alice).get(f"/api/v1/organisations/{acme.pk}/")
    assert secret not in organisation.text
    assert api(alice).delete(path).status_code == 204
    assert not Webhook.objects.exists()


# --- end to end --------------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
def test_a_filed_request_reaches_the_receiver_through_a_real_worker(acme, tmp_path, settings):
    from approvals import services as approvals

    with receiver() as hooks:
        secret = webhooks.set_webhook(acme, hooks.url)
        assert secret
        hostname = f"covey-webhook-test-{os.getpid()}@localhost"
        env = {
            **os.environ,
            "DATABASE_URL": subprocess_database_url(),
            "COVEY_ENCRYPTION_KEYS": ",".join(settings.COVEY_ENCRYPTION_KEYS),
            "COVEY_WEBHOOK_ALLOWED_PRIVATE_CIDRS": ",".join(LOOPBACK),
            "PYTHONUNBUFFERED": "1",
        }
        args = [
            sys.executable, "-m", "celery", "--app", "covey", "worker", "--pool", "solo",
            "--hostname", hostname, "--without-mingle", "--without-gossip",
        ]  # fmt: skip
        log = tmp_path / "worker.log"
        with running(args, env, log) as worker:
            agent = AgentFactory(organisation=acme)
            request = approvals.file_egress(agent, "registry.example.org", reason="the SDK")

            def delivered() -> bool:
                assert worker.poll() is None, log.read_text()
                return bool(hooks.got)

            wait_for(delivered, 60, "the webhook delivered", log)
        ((headers, body),) = hooks.got
        sent = verified(secret, headers, body)
        assert sent["event"] == "request.pending"
        assert sent["data"]["id"] == request.pk and sent["data"]["reason"] == "the SDK"
        assert sent["data"]["decide"].endswith(f"/admin/approvals/request/{request.pk}/decide/")
        assert Webhook.objects.get().last_delivery == "delivered: 204"


@pytest.mark.django_db(transaction=True)
def test_a_webhook_is_set_in_the_admin_in_a_browser(page, acme):  # noqa: F811
    page.goto(f"/admin/organisations/organisation/{acme.pk}/change/")
    page.fill("#id_webhook_url", "ftp://hooks.example.org/")
    page.click("input[name=_continue]")
    assert "http or https URL" in page.inner_text(".field-webhook_url")
    assert not Webhook.objects.exists()
    page.fill("#id_webhook_url", "https://hooks.example.org/covey")
    page.click("input[name=_continue]")
    page.wait_for_selector("text=Webhook signing secret (shown once")
    secret = crypto.decrypt(Webhook.objects.get(organisation=acme).secret)
    assert secret in page.inner_text(".messagelist")
    page.reload()
    assert secret not in page.content()
    assert "nothing sent yet" in page.inner_text(".field-webhook_state")
    page.check("#id_new_webhook_secret")
    page.click("input[name=_continue]")
    page.wait_for_selector("text=Webhook signing secret (shown once")
    assert crypto.decrypt(Webhook.objects.get(organisation=acme).secret) != secret
    page.fill("#id_webhook_url", "")
    page.click("input[name=_continue]")
    page.wait_for_selector("text=The webhook was removed.")
    assert not Webhook.objects.exists()


def test_a_request_filed_from_a_run_is_sent_with_its_run(acme, orders):
    """From a sandbox a request has its run, whose id is a UUID: the event carries it as text
    (a UUID made the JSON fail, and the delivery with it)."""
    from approvals import services as approvals
    from runs import services as runs
    from tests.factories import online_runner

    online_runner(acme)
    agent = AgentFactory(organisation=acme)
    run = runs.queue_run(agent, "work")
    request = approvals.file_egress(agent, "registry.example.org", reason="the SDK", run=run)
    data = approvals.event_data(request)
    assert data["run"] == str(run.pk)
    with receiver() as hooks:
        secret = webhooks.set_webhook(acme, hooks.url)
        assert secret
        assert webhooks.post(acme.pk, "request.pending", "d-1", "x", data) == "delivered: 204"
        ((headers, body),) = hooks.got
        assert verified(secret, headers, body)["data"]["run"] == str(run.pk)
        # Were an event not JSON, the failure is kept on the webhook, not lost in the worker.
        outcome = webhooks.post(acme.pk, "request.pending", "d-2", "x", {"run": run.pk})
        assert outcome.startswith("failed: the event could not be written as JSON")
        assert Webhook.objects.get().last_delivery == outcome
