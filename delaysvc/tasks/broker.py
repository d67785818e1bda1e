"""The broker of the embedded mode: kombu's filesystem transport, made safe for several
processes.

kombu's own `_put` creates the message file and then writes it, so a consumer polling the
folder can take the file while it is still empty and crash on the empty JSON. Here a message
is written under a temporary name the consumers ignore and renamed into place: a rename within
one folder is atomic, so a consumer sees a whole message or none. Each consumed file is
deleted, so the folder does not grow. The folders are made by the first connection, so
importing `delaysvc.tasks` writes nothing. A worker drains it a quarter of a second at a time
(`Transport.drain_events`), so it sees a stop request soon.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from time import monotonic
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

SCHEME = "delaysvc-fs"


class Channel(filesystem.Channel):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # made when a process first connects, never when a module is imported
        for folder in (self.data_folder_in, self.data_folder_out):
            os.makedirs(folder, exist_ok=True)

    def _put(self, queue: str, payload: dict, **kwargs: object) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        fd, partial = tempfile.mkstemp(prefix=".partial-", dir=self.data_folder_out)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(str_to_bytes(dumps(payload)))
            os.replace(partial, os.path.join(self.data_folder_out, name))
        except BaseException:
            if os.path.exists(partial):
                os.unlink(partial)
            raise


DRAIN_SECONDS = 0.25
"""The longest one wait for messages lasts (they are still taken as they come, every 20 ms)."""


class Transport(filesystem.Transport):
    Channel = Channel

    def drain_events(self, connection: Any, timeout: Any = None, **kwargs: Any) -> Any:
        """kombu's drain, at most DRAIN_SECONDS long. Celery's loop for a transport without an
        event loop (this one) drains for 2 s at a time and looks for a stop request (SIGTERM,
        Ctrl-C on `delaysvc up`) only between drains: each worker stopped up to 2 s late."""
        if timeout is not None:
            timeout = min(timeout, DRAIN_SECONDS)
        return super().drain_events(connection, timeout=timeout, **kwargs)


TRANSPORT_ALIASES[SCHEME] = "delaysvc.tasks.broker:Transport"
