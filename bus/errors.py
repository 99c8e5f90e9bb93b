"""Every error the bus raises; all derive from ``BusError``::

    BusError
    ├── BusConnectError     first connect failed (URL, reason, fix)
    ├── BusPermissionError  the server refused a publish/KV write for permissions
    ├── PayloadTooLarge     refused before sending (also a ValueError)
    ├── StreamNotFound      stream/consumer/bucket missing: call provision()
    ├── StreamUnavailable   no leader for leader_wait_s: election or lost quorum
    ├── StreamFull          work queue at its limit: back off and retry
    ├── ProvisionError      existing config cannot be changed in place
    ├── KvConflict          kv_create on an existing key / stale kv_update revision
    └── NoResponders        a request found no worker serving its subject

Messages name the subject, stream or URL involved and the setting or command that fixes it.
Invalid arguments (a subject outside the run, a bad option) raise ValueError/TypeError instead.
"""

from __future__ import annotations


class BusError(RuntimeError):
    """Base of every error raised by the bus."""


class BusConnectError(BusError):
    """The first connect did not succeed within connect_timeout_s."""


class BusPermissionError(BusError):
    """The server refused a publish or KV write for permissions; retrying cannot help."""

    def __init__(self, message: str, *, subject: str, user: str | None = None) -> None:
        super().__init__(message)
        self.subject = subject
        self.user = user


class PayloadTooLarge(BusError, ValueError):
    """An event would exceed max_payload or the stream's max_msg_size; nothing was sent."""


class StreamNotFound(BusError):
    """A stream, consumer or bucket of the run does not exist: provision() was not called."""


class StreamUnavailable(BusError):
    """A stream or consumer had no leader for options.leader_wait_s (election or lost quorum)."""


class StreamFull(BusError):
    """A work-queue stream hit its limits (DiscardPolicy.NEW); back off and retry."""


class ProvisionError(BusError):
    """A stream/consumer/bucket exists with a config that cannot be changed in place."""


class KvConflict(BusError):
    """kv_create on an existing key, or kv_update whose ``last`` revision is stale."""


class NoResponders(BusError):
    """A request found no worker serving its subject (``Bus.request``)."""
