"""A stand-in private package index for the tests (served over TLS with a test CA): PEP 503's
simple pages for one project, whose links are relative, and its wheel, to one user name and
password only; it remembers every request's path and headers."""

import base64
import hashlib
import io
import zipfile
from dataclasses import dataclass, field

from aiohttp import encode_basic_auth, web

PROJECT = "covey-demo"
WHEEL = "covey_demo-1.0-py3-none-any.whl"
WORD = "brokered"  # what the wheel's module says


def wheel() -> bytes:
    """A wheel of ``covey_demo`` 1.0, pure Python, made here."""
    files = {
        "covey_demo/__init__.py": f"WORD = {WORD!r}\n",
        "covey_demo-1.0.dist-info/METADATA": (
            "Metadata-Version: 2.1\nName: covey-demo\nVersion: 1.0\n"
        ),
        "covey_demo-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: covey-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(
        f"{name},sha256={_digest(text.encode())},{len(text.encode())}\n"
        for name, text in files.items()
    )
    files["covey_demo-1.0.dist-info/RECORD"] = record + "covey_demo-1.0.dist-info/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@dataclass
class Index:
    """The index, for ``username`` and ``password``."""

    username: str
    password: str = field(repr=False)
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    built: bytes = field(default_factory=wheel, repr=False)

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path_qs, dict(request.headers)))
        expected = encode_basic_auth(self.username, self.password)
        if request.headers.get("Authorization") != expected:
            return web.Response(status=401, headers={"WWW-Authenticate": 'Basic realm="index"'})
        if request.path == f"/simple/{PROJECT}/":
            digest = hashlib.sha256(self.built).hexdigest()
            link = f'<a href="../../packages/{WHEEL}#sha256={digest}">{WHEEL}</a>'
            return web.Response(text=f"<html><body>{link}</body></html>", content_type="text/html")
        if request.path == f"/packages/{WHEEL}":
            return web.Response(body=self.built, content_type="application/octet-stream")
        return web.Response(status=404, text="not here")
