"""The control plane's own directory (``COVEY_VAR_DIR``) on embedded defaults: its secret key,
the key secrets are encrypted with at rest, and the file-system broker's folders.

Settings only read it: every process imports them (gunicorn's workers at the same moment), and a
file made at import by one is read half-written by another. ``prepare`` makes it, once, by an
explicit step: ``make run`` (scripts/run), ``python -m covey.var``, the tests' control planes.
It is safe to run any number of times and from several processes at once. No Django here.
"""

import base64
import os
import secrets
import sys
import tempfile
from pathlib import Path

from runners.host import broker, config

SECRET_KEY_FILE = "secret_key"  # noqa: S105 - a file name
ENCRYPTION_KEY_FILE = "encryption_key"  # covey.crypto's (a Fernet key)
BROKER_FOLDERS = broker.FOLDERS
STATIC = "static"


def default_var_dir() -> Path:
    """``COVEY_VAR_DIR``, else ``var/`` in the checkout (read where the runner host reads it)."""
    return config.var_dir()


def secret_key(var_dir: Path) -> str:
    """The key kept in ``var_dir``, or "" when none has been made."""
    return _read(var_dir / SECRET_KEY_FILE)


def encryption_key(var_dir: Path) -> str:
    """The encryption key kept in ``var_dir``, or "" when none has been made."""
    return _read(var_dir / ENCRYPTION_KEY_FILE)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def broker_folder(var_dir: Path, name: str) -> Path:
    """One of the file-system broker's folders (runners/host/broker.py)."""
    return broker.folder(var_dir, name)


def prepare(var_dir: Path) -> Path:
    """Make ``var_dir``, its broker folders, its static folder and (the first time) its secret
    key and encryption key; returns the directory."""
    for name in BROKER_FOLDERS:
        broker_folder(var_dir, name).mkdir(parents=True, exist_ok=True)
    (var_dir / STATIC).mkdir(exist_ok=True)
    _make_key(var_dir / SECRET_KEY_FILE, secrets.token_urlsafe(50), "DJANGO_SECRET_KEY")
    key = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()  # a Fernet key
    _make_key(var_dir / ENCRYPTION_KEY_FILE, key, "COVEY_ENCRYPTION_KEYS")
    return var_dir


def _make_key(path: Path, key: str, setting: str) -> None:
    """Write a new key whole into a private file, then give it its name with link(2), which
    fails when the name exists: whoever comes second keeps the first key, and nobody ever reads
    a half-written one."""
    if path.exists():
        return
    descriptor, draft = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(key)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(draft, path)
        except FileExistsError:
            pass  # another process named its key first: that one stays
        except OSError as exc:
            raise OSError(
                f"cannot make the secret key {path}: its file system does not take hard links"
                f" ({exc.strerror or exc}); set {setting}, or COVEY_VAR_DIR to a"
                " directory on another file system"
            ) from exc
    finally:
        os.unlink(draft)


def main(argv: list[str]) -> int:
    if len(argv) > 2 or (len(argv) == 2 and argv[1].startswith("-")):
        print("usage: python -m covey.var [DIRECTORY]   (default: COVEY_VAR_DIR, else var/)")
        return 2
    print(prepare(Path(argv[1]) if len(argv) == 2 else default_var_dir()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
