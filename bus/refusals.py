"""Permission refusals: turning the server's ``-ERR`` into ``BusPermissionError`` at once.

The server answers a publish or KV write it refuses for permissions with an ``-ERR`` on the
connection, never with a reply, so the request would wait request_timeout_s for a plain
timeout. ``connect()``'s error callback parses the ``-ERR`` (``refused``) and hands the subject
to ``Refusals.deny``, which cancels every request waiting on that subject inside
``Refusals.raises``; that block then raises ``BusPermissionError`` naming the subject, the
user and the fix. Retrying cannot help, so nothing is retried.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio

from bus.errors import BusPermissionError

PERMISSION_DENIED = re.compile(r'permissions violation for (\w+) to "([^"]*)"', re.IGNORECASE)
"""The server's ``-ERR`` for a refused publish or subscription (nats-py lowercases it)."""


def refused(error: Exception) -> tuple[str, str] | None:
    """``(operation, subject)``, both lowercased, if ``error`` is a permissions ``-ERR``; else None."""
    denied = PERMISSION_DENIED.search(str(error))
    if denied is None:
        return None
    return denied.group(1).lower(), denied.group(2).lower()


@dataclass(eq=False)
class _Refusable:
    """A JetStream request in flight that a permissions ``-ERR`` for ``subject`` cancels."""

    subject: str
    """Lowercased, as nats-py reports refused subjects."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    denied: bool = False


class Refusals:
    """The requests of one connection that a permission refusal may fail."""

    def __init__(self, user: str | None) -> None:
        self.user = user
        self._waiting: set[_Refusable] = set()

    def deny(self, subject: str) -> None:
        """The server refused ``subject`` (lowercased): fail the requests waiting on it now."""
        for request in list(self._waiting):
            if request.subject == subject:
                request.denied = True
                request.scope.cancel()

    @contextmanager
    def raises(self, subject: str) -> Iterator[None]:
        """Raise BusPermissionError as soon as the server refuses ``subject`` for permissions."""
        request = _Refusable(subject.lower())
        self._waiting.add(request)
        try:
            with request.scope:
                yield
        finally:
            self._waiting.discard(request)
        if request.denied:
            user = self.user
            raise BusPermissionError(
                f"{f'user {user!r}' if user else 'this connection'} may not publish to {subject} "
                "(the server refused it: permissions violation); grant it in the server's permissions "
                "(scripts/nats/permissions.conf) or run this worker with its role's credentials",
                subject=subject,
                user=user,
            )
