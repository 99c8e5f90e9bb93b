"""Every worker role and the module that serves it (``serve(ctx)``; the trainer also ``follow``)."""

from __future__ import annotations

ROLE_MODULES = {
    "controller": "workers.controller",
    "generation": "workers.generation",
    "reward": "workers.reward",
    "trainer": "workers.trainer",
    "weight-sync": "workers.weight_sync",
    "agent": "workers.agent",
}

ROLES = tuple(ROLE_MODULES)
"""Every worker role."""


def run_roles(uses_agents: bool) -> tuple[str, ...]:
    """The roles ``areal-async run`` starts by default. With an agent workflow the ``agent`` role
    takes the prompts and scores its own episodes, so it replaces ``reward``; otherwise no agent."""
    skip = "reward" if uses_agents else "agent"
    return tuple(r for r in ROLES if r != skip)
