"""Exception tree of areal-async.

    AreaLError
    ├── ConfigError          a run file or override a user can fix
    ├── ModelError           a model path, file or package that cannot be loaded
    └── RoleNotAvailable     a worker role this build cannot run

Errors say what went wrong and what to do about it: they name the file or key, the
value, and the fix. Bus errors live in ``bus`` (which knows nothing of this module).
"""

from __future__ import annotations


class AreaLError(Exception):
    """Base class for errors a user can act on."""


class ConfigError(AreaLError, ValueError):
    """A run file or ``--set`` override is invalid; the message names the key and the fix."""


class ModelError(AreaLError):
    """A model could not be located or loaded."""


class RoleNotAvailable(AreaLError):
    """The requested worker role cannot run in this build or with this configuration."""
