"""The file-system broker covey uses when CELERY_BROKER_URL is unset (``make run``): kombu's,
with messages that appear whole, in folders of the control plane's directory that the built-in
runner shares. Here, with no Django, because the runner host takes its orders through it too.

kombu's own writes a message under its final name and fills it afterwards (celery/kombu#1551):
a worker that lists the folder in between takes an empty file, fails to decode it and stops the
whole process ("Unrecoverable error: JSONDecodeError"), which took ``make run`` down. Here a
message is written under a name no reader takes (it does not end in ``.msg``) and renamed into
place once whole; a rename within a folder is atomic. Everything else is kombu's.
"""

import os
import uuid
from pathlib import Path
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

DRAFT = ".part"  # a message being written: no reader's queue name ends so
FOLDERS = ("queue", "processed", "control")
BROKER = "broker"  # the folder of the broker's folders, in the control plane's directory


class Channel(filesystem.Channel):
    # The signature of kombu's filesystem Channel, which its base class's stubs do not know.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put ``payload`` onto ``queue``: written beside its name, then renamed to it."""
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        draft = final + DRAFT
        try:
            with open(draft, "xb", buffering=0) as file:
                file.write(str_to_bytes(dumps(payload)))
            os.rename(draft, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def install() -> None:
    """``filesystem://`` means this transport from now on, in this process."""
    TRANSPORT_ALIASES["filesystem"] = f"{__name__}:Transport"


def folder(var_dir: Path, name: str) -> Path:
    """One of the broker's folders (queue, processed, control) under ``var_dir``."""
    return var_dir / BROKER / name


def transport_options(var_dir: Path) -> dict[str, object]:
    """kombu's options for the file-system broker whose folders are under ``var_dir``."""
    return {
        "data_folder_in": str(folder(var_dir, "queue")),
        "data_folder_out": str(folder(var_dir, "queue")),
        "processed_folder": str(folder(var_dir, "processed")),
        "control_folder": str(folder(var_dir, "control")),
        "store_processed": False,
        # It polls the folder; the default second would be most of a run's time to start.
        "polling_interval": 0.05,
    }
