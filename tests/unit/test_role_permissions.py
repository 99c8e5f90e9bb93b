"""The per-role NATS permissions have one home (bus/role_permissions.py); the shipped config is its rendering."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bus.role_permissions import (
    PERMISSIONS,
    SHIPPED_USERS,
    render_authorization,
    render_permissions_conf,
    resolve,
    variable,
)
from workers.roles import ROLES

SHIPPED = Path(__file__).resolve().parents[2] / "scripts" / "nats" / "permissions.conf"


def test_the_shipped_permissions_conf_is_the_rendering_of_the_python_lists() -> None:
    """scripts/nats/permissions.conf equals render_permissions_conf(); regenerate it with
    `python -m bus.role_permissions > scripts/nats/permissions.conf` after changing a list."""
    assert SHIPPED.read_text() == render_permissions_conf()


def test_every_worker_role_the_viewer_and_ops_have_a_user() -> None:
    """``areal-async run`` gives each role it starts a user of its own, the dashboard the viewer
    user and inspect the ops user."""
    assert set(PERMISSIONS) == {*ROLES, "viewer", "ops"}


def test_only_the_controller_may_write_issued_task_records() -> None:
    """``$KV.<state bucket>.issued.>`` (one record per issued task) is the controller's alone."""
    writers = [user for user in PERMISSIONS if "$KV.*.issued.>" in resolve(user)["publish"]["allow"]]
    assert writers == ["controller"]
    assert resolve("ops")["publish"]["allow"] == [">"]


def test_only_the_trainer_may_write_the_weights_bucket() -> None:
    """Of the worker roles only the trainer may publish into ``$O.<weights bucket>.>``; the
    generation role's deny spells it out, and no role may delete or purge through the leaf
    domain's API either."""
    writers = [
        user
        for user in PERMISSIONS
        if any(p.startswith("$O.") for p in resolve(user, "r1")["publish"]["allow"])
    ]
    assert writers == ["trainer"]
    assert resolve("trainer", "r1")["publish"]["allow"].count("$O.areal_r1_weights.>") == 1
    assert "$O.areal_r1_weights.>" in resolve("generation", "r1")["publish"]["deny"]
    for user in PERMISSIONS.keys() - {"ops"}:
        assert "$JS.areal.API.STREAM.PURGE.>" in resolve(user)["publish"]["deny"], user


def test_a_leaf_node_has_the_clusters_users_with_the_same_permissions() -> None:
    """leaf-users.conf (a leaf node's account) lists every user of auth-users.conf, each with the
    same password variable and permissions."""
    entry = re.compile(r"\{user: ([\w-]+),[^}]*\}")
    cluster, leaf = (
        [m.group(0) for m in entry.finditer((SHIPPED.parent / name).read_text())]
        for name in ("auth-users.conf", "leaf-users.conf")
    )
    assert leaf == cluster
    assert set(SHIPPED_USERS) <= {entry.match(e).group(1) for e in cluster}  # type: ignore[union-attr]


def test_a_run_pinned_rendering_names_only_that_runs_subjects_streams_and_buckets() -> None:
    """Pinned to run r1, the reward user's publish list holds r1's subjects, r1's GENERATED
    stream and r1's workers bucket, and no wildcard run token."""
    allow = resolve("reward", "r1")["publish"]["allow"]
    assert "areal.r1.rollout.scored" in allow
    assert "$JS.ACK.AREAL_r1_GENERATED.reward.>" in allow
    assert "$KV.areal_r1_workers.reward.>" in allow
    assert not any(".*." in pattern for pattern in allow)
    assert "areal.r1.weights.>" in resolve("reward", "r1")["publish"]["deny"]


def test_the_authorization_block_refuses_unknown_users_and_unsafe_passwords() -> None:
    """Users must have permissions here; passwords must be token_urlsafe characters (they are
    written into the server config)."""
    text = render_authorization({"reward": "abc-DEF_123", "ops": "x"}, "r1")
    assert '{user: "reward", password: "abc-DEF_123", permissions: $REWARD}' in text
    with pytest.raises(ValueError, match="critic"):
        render_authorization({"critic": "abc"}, "r1")
    with pytest.raises(ValueError, match="token_urlsafe"):
        render_authorization({"reward": 'a"b'}, "r1")


@pytest.mark.parametrize("auth_file", ["auth-users.conf", "auth-nkeys.conf"])
def test_the_shipped_auth_files_use_exactly_the_rendered_variables(auth_file: str) -> None:
    """nats-server refuses a permissions variable no user refers to, and one that is not defined:
    the users of the shipped auth files and SHIPPED_USERS (the rendered variables) must agree."""
    used = set(re.findall(r"permissions:\s*\$(\w+)", (SHIPPED.parent / auth_file).read_text()))
    assert used == {variable(user) for user in SHIPPED_USERS}


def test_the_viewer_may_publish_read_requests_of_the_jetstream_api_and_nothing_else() -> None:
    """The dashboard's user publishes no run subject, KV key, object chunk or ack: only stream names,
    infos and message gets, the unnamed (ephemeral) consumer create, consumer infos and flow-control
    replies, each also through the leaf domain's API, and it subscribes to its run only."""
    allow = resolve("viewer", "r1")["publish"]["allow"]
    read = re.compile(
        r"\$JS\.FC\.|\$JS\.(areal\.)?API\.(STREAM\.(NAMES|INFO|MSG\.GET)|DIRECT\.GET|CONSUMER\.(CREATE|INFO))(\.|$)"
    )
    assert [p for p in allow if not read.match(p)] == []
    assert "$JS.API.CONSUMER.CREATE.AREAL_r1_STEPS" in allow and "$JS.areal.API.STREAM.NAMES" in allow
    api = sorted(p.removeprefix("$JS.API.") for p in allow if p.startswith("$JS.API."))
    assert api == sorted(p.removeprefix("$JS.areal.API.") for p in allow if p.startswith("$JS.areal.API."))
    assert resolve("viewer", "r1")["subscribe"]["allow"] == ["_INBOX.>", "areal.r1.>"]
