"""What each NATS user of a run may publish and subscribe to: the one home of these lists.

Rendered two ways, from the same dicts:

* ``render_permissions_conf()``: ``scripts/nats/permissions.conf``, the variables that the
  shipped cluster configs (``auth-users.conf``, ``auth-nkeys.conf``) attach to users; every
  run matches (``areal.*``). Regenerate with
  ``python -m bus.role_permissions > scripts/nats/permissions.conf``.
* ``render_authorization(passwords, run)``: the ``authorization`` block of the embedded
  server of ``areal-async run``: one user per entry of ``passwords``, each with its
  permissions pinned to ``run`` (its subjects, streams and buckets only).

Patterns name the run's parts by placeholder: ``{run}`` the run name, ``{state}`` and
``{workers}`` the KV buckets (``{state_kv}``, ``{workers_kv}`` their streams, ``KV_<bucket>``),
``{weights}`` the object store of the policy versions,
``{domain}`` the cluster's JetStream domain (``JS_DOMAIN``),
``{PROMPT}``... the streams (``bus.subjects``). Rendered for every
run they all become ``*``. A denied publish is not delivered; the server reports it to the
client (``Permissions Violation for Publish to ...``), which raises ``BusPermissionError``.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from bus.subjects import Subjects

Permissions = dict[str, Any]
"""``{"publish": {"allow": [...], "deny": [...]}, "subscribe": {"allow": [...]}}``, and
``"allow_responses": True`` for a user that answers requests (one reply per request, to the
requester's inbox, whatever its subject)."""

COMMON_DENY = [
    *(
        f"$JS.{domain}API.{call}.>"
        for call in ("STREAM.DELETE", "STREAM.PURGE", "STREAM.MSG.DELETE", "CONSUMER.DELETE")
        for domain in ("", "{domain}.")
    )
]
"""Deleting or purging streams and consumers is left to the ops user. ``$JS.<domain>.API`` is the
same API as a leaf node's account maps it to the cluster's JetStream domain (scripts/nats/leaf.conf)."""

JS_DOMAIN = "areal"
"""The JetStream domain of the shipped cluster (``common.conf``), which ``leaf-users.conf`` maps
``$JS.API.>`` to: ``{domain}`` in the patterns."""

SUBSCRIBE = {"allow": ["_INBOX.>", "areal.>"]}
"""Replies and pull deliveries (``_INBOX``), and events."""

CONTROLLER: Permissions = {
    "publish": {
        "allow": [
            "areal.{run}.prompt", "areal.{run}.metrics", "areal.{run}.run.ended", "areal.{run}.deadletter",
            "areal.{run}.heartbeat.controller.>",
            "$JS.API.>", "$JS.{domain}.API.>", "$JS.FC.>",
            "$JS.ACK.{STEPS}.controller-steps.>", "$JS.ACK.{FAILED}.controller-failed.>",
            "$JS.ACK.{EVAL}.controller-eval.>",
            "$KV.{state}.controller", "$KV.{state}.run.ended", "$KV.{state}.issued.>",
            "$KV.{state}.controller.>", "$KV.{workers}.controller.>",
        ],
        "deny": COMMON_DENY,
    },
    "subscribe": SUBSCRIBE,
}  # fmt: skip

GENERATION: Permissions = {
    "publish": {
        "allow": [
            "areal.{run}.rollout.generated", "areal.{run}.weights.loaded", "areal.{run}.deadletter",
            "areal.{run}.heartbeat.generation.>",
            "$JS.API.>", "$JS.{domain}.API.>", "$JS.FC.>", "$JS.ACK.{PROMPT}.generation.>",
            "$KV.{workers}.generation.>",
        ],
        "deny": ["$O.{weights}.>", *COMMON_DENY],
    },
    "subscribe": SUBSCRIBE,
    "allow_responses": True,
}  # fmt: skip

REWARD: Permissions = {
    "publish": {
        "allow": [
            "areal.{run}.rollout.scored", "areal.{run}.eval.scored", "areal.{run}.deadletter",
            "areal.{run}.heartbeat.reward.>",
            "$JS.API.>", "$JS.{domain}.API.>", "$JS.FC.>", "$JS.ACK.{GENERATED}.reward.>",
            "$KV.{workers}.reward.>",
        ],
        "deny": ["areal.{run}.weights.>", *COMMON_DENY],
    },
    "subscribe": SUBSCRIBE,
}  # fmt: skip

TRAINER: Permissions = {
    "publish": {
        "allow": [
            "areal.{run}.trainer.step", "areal.{run}.rollout.failed", "areal.{run}.weights.published",
            "areal.{run}.metrics", "areal.{run}.deadletter",
            "areal.{run}.heartbeat.trainer.>",
            "$JS.API.>", "$JS.{domain}.API.>", "$JS.FC.>", "$JS.ACK.{SCORED}.trainer.>",
            "$KV.{state}.weights.published", "$KV.{workers}.trainer.>",
            "$O.{weights}.>",
        ],
        "deny": COMMON_DENY,
    },
    "subscribe": SUBSCRIBE,
}  # fmt: skip

WEIGHT_SYNC: Permissions = {
    "publish": {
        "allow": [
            "areal.{run}.weights.load", "areal.{run}.weights.served", "areal.{run}.deadletter",
            "areal.{run}.heartbeat.weight-sync.>",
            "$JS.API.>", "$JS.{domain}.API.>", "$JS.FC.>",
            "$KV.{state}.weights.served", "$KV.{workers}.weight-sync.>",
        ],
        "deny": COMMON_DENY,
    },
    "subscribe": SUBSCRIBE,
}  # fmt: skip

AGENT: Permissions = {
    "publish": {
        "allow": [
            "areal.{run}.generate", "areal.{run}.rollout.scored", "areal.{run}.eval.scored",
            "areal.{run}.rollout.failed", "areal.{run}.deadletter", "areal.{run}.heartbeat.agent.>",
            "$JS.API.>", "$JS.{domain}.API.>", "$JS.FC.>", "$JS.ACK.{PROMPT}.generation.>",
            "$KV.{workers}.agent.>",
        ],
        "deny": ["areal.{run}.weights.>", *COMMON_DENY],
    },
    "subscribe": SUBSCRIBE,
}  # fmt: skip

VIEWER_STORED = ("{SCORED}", "{EVAL}", "{FAILED}", "{state_kv}", "{workers_kv}")
"""Streams the viewer reads by sequence or key: stream info, then ``STREAM.MSG.GET`` (nats-py's
``get_msg`` and KV gets) or ``DIRECT.GET`` (KV gets on buckets that allow direct reads)."""

VIEWER_FOLLOWED = ("{STEPS}", "{DEADLETTER}", "{state_kv}", "{workers_kv}")
"""Streams the viewer follows through ordered consumers: STEPS and DEADLETTER, and the KV watches
behind ``keys()`` and ``history()``."""


def _viewer_api(domain: str) -> list[str]:
    """The JetStream API requests of a reader, through ``$JS.API`` (domain "") or a leaf's domain."""
    api = f"$JS.{domain}API"
    return [
        f"{api}.STREAM.NAMES",  # js.subscribe(subject) looks up the stream of the subject
        *(f"{api}.STREAM.INFO.{s}" for s in dict.fromkeys(VIEWER_STORED + VIEWER_FOLLOWED)),
        *(f"{api}.STREAM.MSG.GET.{s}" for s in VIEWER_STORED),
        *(f"{api}.DIRECT.GET.{s}{tail}" for s in VIEWER_STORED for tail in ("", ".>")),
        # the unnamed form only: the server creates an ephemeral there and refuses a durable name
        *(f"{api}.CONSUMER.CREATE.{s}" for s in VIEWER_FOLLOWED),
        *(f"{api}.CONSUMER.INFO.{s}.*" for s in VIEWER_FOLLOWED),
    ]


VIEWER: Permissions = {
    "publish": {
        "allow": [
            *_viewer_api(""), *_viewer_api("{domain}."),
            *(f"$JS.FC.{s}.>" for s in VIEWER_FOLLOWED),
        ],
        "deny": COMMON_DENY,
    },
    "subscribe": {"allow": ["_INBOX.>", "areal.{run}.>"]},
}  # fmt: skip

OPS: Permissions = {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}

PERMISSIONS: dict[str, Permissions] = {
    "controller": CONTROLLER,
    "generation": GENERATION,
    "reward": REWARD,
    "trainer": TRAINER,
    "weight-sync": WEIGHT_SYNC,
    "agent": AGENT,
    "viewer": VIEWER,
    "ops": OPS,
}
"""User name -> permissions: one user per worker role, ``viewer`` (read only) and ``ops``."""

WORKER_ROLES = ("controller", "generation", "reward", "trainer", "weight-sync", "agent")
"""Every worker role, in start order; each connects as the NATS user of its name."""

SHIPPED_USERS = (*WORKER_ROLES, "viewer", "ops")
"""The users of the shipped cluster configs (``auth-users.conf``, ``auth-nkeys.conf``), whose
variables ``permissions.conf`` defines: nats-server refuses a variable no user refers to, so a
user joins here together with its entry in those files."""

NOTES = {
    "generation": "Engines read the weights bucket (JetStream API: direct gets, a pull consumer) and\n"
    "may never write it; the deny is spelled out for that.",
    "trainer": "The only writer of the weights bucket ($O.<bucket>.>: chunks and object info).",
    "reward": "The deny of weights is not needed given the allow list; it is spelled out because\n"
    "a reward worker must never be able to announce or load weights.",
    "agent": "Agents take prompt tasks (the generation durable), call generation workers and publish\n"
    "scored episodes; like reward workers they may never announce or load weights.",
    "viewer": "`areal-async dashboard`: reads and follows the run, and nothing else. JetStream API: stream\n"
    "names and info, message gets, ephemeral ordered consumers (the unnamed CONSUMER.CREATE form;\n"
    "a durable name is refused there) and their flow control. No run subject, KV put, ack, purge\n"
    "or delete.",
    "ops": "`areal-async inspect`, the watchdog, the NATS CLI and clean-up (`nats stream rm`): everything.",
}

HEADER = """\
# Publish/subscribe permissions of each areal-async role, as variables that the
# auth-*.conf files attach to users. Included by auth-users.conf and auth-nkeys.conf.
# Generated from bus/role_permissions.py; regenerate with
#   python -m bus.role_permissions > scripts/nats/permissions.conf
#
# What every worker needs (bus/ and workers/runtime.py):
#   $JS.API.>                      provision the run's streams/consumers/buckets at start,
#                                  fetch from pull consumers, read KV (direct get)
#   $JS.areal.API.>                the same through a leaf node (leaf-users.conf maps $JS.API.>
#                                  to the cluster's JetStream domain, areal)
#   $JS.ACK.<stream>.<durable>.>   ack its own durable consumer only
#   $JS.FC.>                       flow-control replies of KV watches
#   $KV.<workers bucket>.<role>.>  its own heartbeat key in areal_<run>_workers
#   areal.*.heartbeat.<role>.>     its heartbeats;  areal.*.deadletter  bad input it dropped
#   subscribe _INBOX.> (replies, pull deliveries) and areal.> (events)
# Each key of the state bucket areal_<run>_state has one writer: the controller
# (controller, controller.quarantined, run.ended, issued.<task_id>), the trainer
# (weights.published) or the weight-sync worker (weights.served). Only the trainer writes the
# object store of the policy versions ($O.<bucket>.>); engines read it through $JS.API.
# Deleting or purging streams and consumers is left to the ops user.
# `*` matches every run; `areal-async run` pins its embedded server's users to the run.
# A denied publish is not delivered and the server tells the client
# ("Permissions Violation for Publish to ..."), which raises BusPermissionError.
"""


def variable(user: str) -> str:
    """``weight-sync`` -> ``WEIGHT_SYNC``: the config variable holding a user's permissions."""
    return user.upper().replace("-", "_")


def _names(run: str | None) -> dict[str, str]:
    """Placeholder values: the run's names, or ``*`` everywhere when ``run`` is None."""
    if run is None:
        keys = ["run", "state", "workers", "weights", "state_kv", "workers_kv"]
        keys += [s.key for s in Subjects("x").streams]
        return dict.fromkeys(keys, "*") | {"domain": JS_DOMAIN}
    subjects = Subjects(run)
    names = {
        "run": run,
        "state": subjects.state_bucket,
        "workers": subjects.workers_bucket,
        "weights": subjects.weights_bucket,
        "state_kv": f"KV_{subjects.state_bucket}",
        "workers_kv": f"KV_{subjects.workers_bucket}",
        "domain": JS_DOMAIN,
    }
    return names | {s.key: s.name for s in subjects.streams}


def resolve(user: str, run: str | None = None) -> Permissions:
    """``user``'s permissions with placeholders filled in (``*`` for every run; patterns that
    become equal, such as a key in either bucket, appear once)."""
    names = _names(run)
    resolved: Permissions = dict(PERMISSIONS[user])
    for direction in ("publish", "subscribe"):
        resolved[direction] = {
            kind: list(dict.fromkeys(p.format_map(names) for p in patterns))
            for kind, patterns in PERMISSIONS[user][direction].items()
        }
    return resolved


def _subject_list(patterns: Sequence[str], indent: str) -> str:
    """A config list, wrapped at 100 columns; each pattern JSON-quoted."""
    quoted = ", ".join(json.dumps(p) for p in patterns)
    width = 100 - len(indent)
    lines = textwrap.wrap(quoted, width, break_long_words=False, break_on_hyphens=False)
    return "[\n" + "".join(f"{indent}{line}\n" for line in lines) + indent[:-2] + "]"


def render_block(user: str, run: str | None = None) -> str:
    """``VARIABLE = { publish: {...} subscribe: {...} }`` for one user, with its note if any."""
    perms = resolve(user, run)
    out = [f"# {line}" for line in NOTES.get(user, "").splitlines()]
    out.append(f"{variable(user)} = {{")
    for direction in ("publish", "subscribe"):
        rules = perms[direction]
        if list(rules) == ["allow"] and len(rules["allow"]) <= 2:
            out.append(f"  {direction}: {{ allow: {json.dumps(rules['allow'])} }}")
            continue
        out.append(f"  {direction}: {{")
        for kind in ("allow", "deny"):
            if kind in rules:
                out.append(f"    {kind}: {_subject_list(rules[kind], '      ')}")
        out.append("  }")
    if perms.get("allow_responses"):
        out.append("  allow_responses: true")
    out.append("}")
    return "\n".join(out)


def render_permissions_conf() -> str:
    """The text of ``scripts/nats/permissions.conf``: the variable of every shipped user, for every run."""
    return HEADER + "".join(f"\n{render_block(user)}\n" for user in SHIPPED_USERS)


def render_authorization(passwords: Mapping[str, str], run: str) -> str:
    """Server config text: one permissions variable per user and an ``authorization`` block
    with a password user per entry of ``passwords``, confined to ``run``.

    Users live in the server's global account, so the JetStream store keeps the layout of a
    server without auth (a plain ``nats-server -sd`` on it still reads the run's streams).
    """
    unknown = sorted(set(passwords) - set(PERMISSIONS))
    if unknown:
        raise ValueError(f"no permissions for user(s) {unknown}; known users: {sorted(PERMISSIONS)}")
    blocks = [render_block(user, run) for user in passwords]
    users = [
        f"    {{user: {json.dumps(user)}, password: {_quote_password(user, pw)}, permissions: ${variable(user)}}}"
        for user, pw in passwords.items()
    ]
    return "\n\n".join(blocks) + "\n\nauthorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def _quote_password(user: str, password: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", password):
        raise ValueError(
            f"password of user {user!r} must be non-empty letters, digits, '-' and '_' "
            "(as secrets.token_urlsafe makes them)"
        )
    return json.dumps(password)


def _main(out: Any = sys.stdout) -> None:
    out.write(render_permissions_conf())


if __name__ == "__main__":
    _main()
