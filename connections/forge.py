"""A stand-in git host for trying covey: git's own ``git http-backend`` behind a small TLS
server, holding bare repositories that answer only to one token (HTTP basic, user
``x-access-token``, as GitHub takes an installation token). ``make run`` starts it as the *demo
forge* (``manage.py demo_forge``) with the repository ``demo/app``, its certificate from a CA of
its own that the model gateway is told to trust (COVEY_CONNECTIONS_CA_BUNDLE): what README.md's
first five minutes pushes a branch to. The tests' stand-in hosts are built on it. Not a git host
for real work. No Django.
"""

import asyncio
import datetime
import hmac
import ipaddress
import os
import secrets
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import encode_basic_auth, web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CHUNK = 64 * 1024
DEMO_REPOSITORY = "demo/app"
CA_FILE, CERT_FILE, KEY_FILE, TOKEN_FILE = "ca.pem", "cert.pem", "key.pem", "token"


@dataclass
class Forge:
    """Bare repositories under ``root`` (``owner/name.git``), served to ``credential``."""

    root: Path
    credential: str = field(repr=False)

    def accepts(self, authorization: str | None) -> bool:
        """Whether a request with this ``Authorization`` header may read and push."""
        expected = encode_basic_auth("x-access-token", self.credential)
        return hmac.compare_digest((authorization or "").encode(), expected.encode())

    def environment(self) -> dict[str, str]:
        """What ``git http-backend`` runs with (no prompt for a password, ever)."""
        return {**os.environ, "GIT_TERMINAL_PROMPT": "0"}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One request, through ``git http-backend`` as CGI, both ways streamed (a large clone
        or push holds no more than a chunk of it here)."""
        if not self.accepts(request.headers.get("Authorization")):
            return web.Response(status=401, headers={"WWW-Authenticate": 'Basic realm="git"'})
        env = {
            **self.environment(),
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "REMOTE_USER": "x-access-token",
            "REQUEST_METHOD": request.method,
            "PATH_INFO": request.path,
            "QUERY_STRING": request.query_string,
            "CONTENT_TYPE": request.headers.get("Content-Type", ""),
            "GIT_PROTOCOL": request.headers.get("Git-Protocol", ""),
            "HTTP_CONTENT_ENCODING": request.headers.get("Content-Encoding", ""),
        }
        if request.content_length is not None:
            env["CONTENT_LENGTH"] = str(request.content_length)
        process = await asyncio.create_subprocess_exec(
            "git", "http-backend", env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert process.stdin is not None and process.stdout is not None  # noqa: S101 - piped
        feeding = asyncio.ensure_future(_feed(request, process.stdin))
        status, headers = 200, {}
        while (line := (await process.stdout.readline()).rstrip(b"\r\n")) != b"":
            name, _, value = line.decode().partition(": ")
            if name.lower() == "status":
                status = int(value.split()[0])
            else:
                headers[name] = value
        answer = web.StreamResponse(status=status, headers=headers)
        await answer.prepare(request)
        try:
            while chunk := await process.stdout.read(CHUNK):
                await answer.write(chunk)
        except ConnectionResetError:  # the client read what it wanted (a default branch)
            process.kill()
            feeding.cancel()
            await process.wait()
            return answer
        await feeding
        await process.wait()
        await answer.write_eof()
        return answer

    def app(self) -> web.Application:
        app = web.Application(client_max_size=0)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


async def _feed(request: web.Request, stdin: asyncio.StreamWriter) -> None:
    async for chunk in request.content.iter_chunked(CHUNK):
        stdin.write(chunk)
        await stdin.drain()
    stdin.close()


def prepare(directory: Path, host: str) -> Forge:
    """The demo forge in ``directory``, made on first use and kept after: the repository
    ``demo/app`` (one commit on ``main``), a token (in ``token``, readable by its owner only),
    and a CA (``ca.pem``) with a certificate for ``host`` (a name or an address)."""
    directory.mkdir(parents=True, exist_ok=True)
    token_file = directory / TOKEN_FILE
    if not token_file.exists():
        token_file.touch(mode=0o600)
        token_file.write_text(f"forge-{secrets.token_urlsafe(24)}\n")
    repositories = directory / "repositories"
    if not (repositories / f"{DEMO_REPOSITORY}.git").exists():
        _seed(repositories, DEMO_REPOSITORY)
    if not (directory / CERT_FILE).exists() or _names(directory / CERT_FILE) != {host}:
        _certify(directory, host)
    return Forge(repositories, token_file.read_text().strip())


def server_context(directory: Path) -> ssl.SSLContext:
    """The TLS context the forge serves with (its certificate, from its CA)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(directory / CERT_FILE, directory / KEY_FILE)
    return context


def _seed(repositories: Path, owner_name: str) -> None:
    bare = repositories / f"{owner_name}.git"
    work = repositories / ".seed" / owner_name
    env = {
        **os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repositories),
        "GIT_AUTHOR_NAME": "covey", "GIT_AUTHOR_EMAIL": "demo@covey.invalid",
        "GIT_COMMITTER_NAME": "covey", "GIT_COMMITTER_EMAIL": "demo@covey.invalid",
    }  # fmt: skip
    bare.parent.mkdir(parents=True, exist_ok=True)
    for args, cwd in (
        (["init", "-q", "--bare", "--initial-branch=main", str(bare)], repositories),
        (["init", "-q", "--initial-branch=main", str(work)], repositories),
    ):
        subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)  # noqa: S603, S607
    (work / "README.md").write_text(f"# {owner_name}\n\nA repository of covey's demo forge.\n")
    for args in (
        ["add", "README.md"],
        ["commit", "-q", "-m", "First"],
        ["push", "-q", str(bare), "main"],
    ):
        subprocess.run(["git", *args], cwd=work, env=env, check=True, capture_output=True)  # noqa: S603, S607


def _names(certificate: Path) -> set[str]:
    loaded = x509.load_pem_x509_certificate(certificate.read_bytes())
    names = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(name.value) for name in names}


def _certify(directory: Path, host: str) -> None:
    """A CA of the forge's own, which may certify ``host`` only (a name constraint: the
    gateway trusts it for every connection, so it must vouch for nothing else; its key is
    dropped once it has signed, so it never signs anything else), and a
    certificate for ``host``, with the key identifiers strict verification asks for (Python
    3.13's default)."""
    now = datetime.datetime.now(datetime.UTC)
    try:
        alternative: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        permitted: x509.GeneralName = x509.IPAddress(ipaddress.ip_network(host))
    except ValueError:
        alternative = permitted = x509.DNSName(host)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "covey demo forge CA")])
    ca = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.NameConstraints(permitted_subtrees=[permitted], excluded_subtrees=None),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    (directory / CA_FILE).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=825))
        .add_extension(x509.SubjectAlternativeName([alternative]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    _write(directory / KEY_FILE, _pem_key(key))
    (directory / CERT_FILE).write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes) -> None:
    """``data`` in a file only its owner reads."""
    path.touch(mode=0o600)
    path.write_bytes(data)
