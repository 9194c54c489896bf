"""The file-system broker covey uses when CELERY_BROKER_URL is unset (``make run``): kombu's,
with messages that appear whole.

kombu's own writes a message under its final name and fills it afterwards (celery/kombu#1551):
a worker that lists the folder in between takes an empty file, fails to decode it and stops the
whole process ("Unrecoverable error: JSONDecodeError"), which took ``make run`` down. Here a
message is written under a name no reader takes (it does not end in ``.msg``) and renamed into
place once whole; a rename within a folder is atomic. Everything else is kombu's.
"""

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

DRAFT = ".part"  # a message being written: no reader's queue name ends so


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
