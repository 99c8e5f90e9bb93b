"""Every worker role and the module that serves it (``serve(ctx)``; the trainer also ``follow``)."""

from __future__ import annotations

from bus.role_permissions import WORKER_ROLES

ROLES = WORKER_ROLES
"""Every worker role (named once, in ``bus``: each is also a NATS user)."""

ROLE_MODULES = {role: f"workers.{role.replace('-', '_')}" for role in ROLES}


def run_roles(uses_agents: bool) -> tuple[str, ...]:
    """The roles ``areal-async run`` starts by default. With an agent workflow the ``agent`` role
    takes the prompts and scores its own episodes, so it replaces ``reward``; otherwise no agent."""
    skip = "reward" if uses_agents else "agent"
    return tuple(r for r in ROLES if r != skip)
