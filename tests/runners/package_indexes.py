"""Package indexes the workplace build tests serve on loopback, so no build reaches a mirror:
a flat apt repository of the .debs scripts/test-debs fetched, a PEP 503 simple index of wheels
(and an sdist) made here, and an npm registry of tarballs made here.

The Python and npm packages are small but real: a package with a dependency and a command
each, and one whose installation would leave a mark on the host if anything of it ran there.
"""

import base64
import csv
import hashlib
import http.server
import io
import json
import subprocess
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Where a package that runs anything at installation writes, on the host (the tests assert it
# never appears): its path is given to the package when it is made.
MARK = "covey-test-ran-on-host"


@contextmanager
def serve(root: Path, documents: frozenset[str] = frozenset()) -> Iterator[str]:
    """``root`` over HTTP on loopback; yields the base URL. A path in ``documents`` ("/name":
    an npm package document) is answered with root/name/index.json, as JSON."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def translate_path(self, path):
            name = path.split("?", 1)[0].rstrip("/")
            if name in documents:
                return str(root / name.lstrip("/") / "index.json")
            return super().translate_path(path)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# --- apt ---------------------------------------------------------------------------------------


def apt_repository(root: Path, debs: list[Path]) -> None:
    """A flat repository of ``debs`` in ``root`` (Packages and Release)."""
    stanzas = []
    for source in debs:
        deb = root / source.name
        deb.write_bytes(source.read_bytes())
        control = subprocess.run(
            ["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True
        ).stdout.strip()
        data = deb.read_bytes()
        stanzas.append(
            f"{control}\nFilename: ./{deb.name}\nSize: {len(data)}\n"
            f"SHA256: {hashlib.sha256(data).hexdigest()}\n"
        )
    (root / "Packages").write_text("\n".join(stanzas))
    packages = (root / "Packages").read_bytes()
    (root / "Release").write_text(
        "Origin: covey-test\nLabel: covey-test\nSuite: test\nCodename: test\n"
        "Architectures: amd64 all\nDate: Wed, 02 Dec 2026 00:00:00 UTC\nSHA256:\n"
        f" {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n"
    )


# --- pip ---------------------------------------------------------------------------------------


def wheel(
    folder: Path,
    name: str,
    version: str,
    files: dict[str, str],
    *,
    requires: tuple[str, ...] = (),
    scripts: dict[str, str] | None = None,
) -> Path:
    """A pure-Python wheel (py3-none-any) of ``files`` (path → text) in ``folder``."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    contents[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: covey-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    if scripts:
        contents[f"{info}/entry_points.txt"] = "[console_scripts]\n" + "".join(
            f"{command} = {target}\n" for command, target in scripts.items()
        )
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for member, text in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        writer.writerow([member, f"sha256={digest.decode()}", len(text.encode())])
    writer.writerow([f"{info}/RECORD", "", ""])
    contents[f"{info}/RECORD"] = record.getvalue()
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in, text in contents.items():
            archive.writestr(name_in, text)
    return path


def sdist(folder: Path, name: str, version: str, mark: Path) -> Path:
    """A source distribution whose setup.py writes ``mark``: building it runs code."""
    module = name.replace("-", "_")
    path = folder / f"{module}-{version}.tar.gz"
    setup = f"open({str(mark)!r}, 'w').write('ran')\nfrom setuptools import setup\nsetup()\n"
    with tarfile.open(path, "w:gz") as archive:
        for member, text in {
            "setup.py": setup,
            "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        }.items():
            data = text.encode()
            entry = tarfile.TarInfo(f"{module}-{version}/{member}")
            entry.size = len(data)
            archive.addfile(entry, io.BytesIO(data))
    return path


def pip_index(root: Path, mark: Path) -> None:
    """A simple index (root/simple) of covey-greeting 1.0 (needs covey-test-dep, has the command
    covey-greet), covey-test-dep 2.0, and covey-test-sdist 1.0 (an sdist alone, which writes
    ``mark`` if built)."""
    files = root / "files"
    files.mkdir()
    made = [
        wheel(
            files,
            "covey-greeting",
            "1.0",
            {
                "covey_greeting/__init__.py": "from covey_test_dep import WORD\n\n"
                "def main():\n    print(f'hello from pip, {WORD}')\n"
            },
            requires=("covey-test-dep>=2",),
            scripts={"covey-greet": "covey_greeting:main"},
        ),
        wheel(files, "covey-test-dep", "2.0", {"covey_test_dep/__init__.py": "WORD = 'dep 2.0'\n"}),
        sdist(files, "covey-test-sdist", "1.0", mark),
    ]
    for path in made:
        project = path.name.split("-")[0].replace("_", "-")
        page = root / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        (page / "index.html").write_text(
            f'<!DOCTYPE html><html><body><a href="../../files/{path.name}#sha256={digest}">'
            f"{path.name}</a></body></html>\n"
        )


# --- npm ---------------------------------------------------------------------------------------


def npm_tarball(folder: Path, manifest: dict[str, Any], files: dict[str, str]) -> Path:
    """An npm package tarball (package/...) of ``manifest`` and ``files``."""
    path = folder / f"{manifest['name']}-{manifest['version']}.tgz"
    contents = {"package.json": json.dumps(manifest), **files}
    with tarfile.open(path, "w:gz") as archive:
        for member, text in contents.items():
            data = text.encode()
            entry = tarfile.TarInfo(f"package/{member}")
            entry.size = len(data)
            entry.mode = 0o755 if text.startswith("#!") else 0o644
            archive.addfile(entry, io.BytesIO(data))
    return path


NPM_PACKAGES = ("covey-greet", "covey-test-dep-js")


def npm_registry(root: Path, base_url: str, mark: Path) -> None:
    """Package documents and tarballs in ``root`` (served at ``base_url``) of NPM_PACKAGES:
    covey-greet 1.0.0 (needs covey-test-dep-js ^2, has the command covey-greet-js, and install
    scripts that write ``mark``) and covey-test-dep-js 2.0.0."""
    packages: list[tuple[dict[str, Any], dict[str, str]]] = [
        (
            {
                "name": "covey-greet",
                "version": "1.0.0",
                "main": "index.js",
                "bin": {"covey-greet-js": "cli.js"},
                "dependencies": {"covey-test-dep-js": "^2.0.0"},
                "scripts": {"install": f"touch {mark}", "postinstall": f"touch {mark}"},
            },
            {
                "index.js": "const dep = require('covey-test-dep-js');\n"
                "exports.hello = () => `hello from npm, ${dep.word}`;\n",
                "cli.js": "#!/usr/bin/env node\nconsole.log(require('./index.js').hello());\n",
            },
        ),
        (
            {"name": "covey-test-dep-js", "version": "2.0.0", "main": "index.js"},
            {"index.js": "exports.word = 'dep 2.0.0';\n"},
        ),
    ]
    for manifest, files in packages:
        name, version = manifest["name"], manifest["version"]
        folder = root / name / "-"
        folder.mkdir(parents=True)
        tarball = npm_tarball(folder, manifest, files)
        data = tarball.read_bytes()
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
        document = {
            "name": name,
            "dist-tags": {"latest": version},
            "versions": {
                version: {
                    **manifest,
                    "dist": {
                        "tarball": f"{base_url}/{name}/-/{tarball.name}",
                        "integrity": integrity,
                        "shasum": hashlib.sha1(data).hexdigest(),  # noqa: S324 - npm's field
                    },
                }
            },
        }
        (root / name / "index.json").write_text(json.dumps(document))
