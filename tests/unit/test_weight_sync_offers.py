"""Which engines weight-sync offers a version in memory to, and how it names their group."""

from __future__ import annotations

import time
from types import SimpleNamespace

from bus.events import TransferOffer
from workers.weight_memory import group_layout
from workers.weight_sync import EngineState, WeightSync


def _sync(transport: str = "gloo") -> WeightSync:
    sync = object.__new__(WeightSync)  # only the offer bookkeeping, no bus
    sync.offer = (
        5,
        TransferOffer(transport=transport, manifest=[], digests=[], bucket_bytes=1, address="h:1"),
    )
    sync.epoch = 0
    sync.cfg = SimpleNamespace(bus=SimpleNamespace(heartbeat_interval_s=2.0, heartbeat_ttl_s=10.0))
    now = time.monotonic()
    sync.engines = {
        "gen-a": EngineState(4, now, transports=(transport,)),
        "gen-b": EngineState(4, now, transports=(transport,), ranks=2),  # a remote engine with 2 servers
        "gen-c": EngineState(4, now),  # takes disk only (e.g. SGLang)
    }
    return sync


def test_the_first_word_goes_in_memory_to_engines_that_take_the_transport() -> None:
    sync = _sync()
    load = sync.load_event(5, "/w/v5", ["gen-a", "gen-b", "gen-c"], in_memory=True)
    assert load.engine_ids == ["gen-a", "gen-b", "gen-c"] and load.members == ["gen-a", "gen-b"]
    assert load.ranks == [1, 2] and load.transfer is sync.offer[1] and load.group
    assert group_layout(load) == (4, {"gen-a": 1, "gen-b": 2})  # the trainer is rank 0


def test_a_retelling_an_old_offer_and_cuda_ipc_change_what_is_sent() -> None:
    sync = _sync()
    assert sync.load_event(5, "/w/v5", ["gen-a"], in_memory=False).transfer is None  # retold: disk
    assert sync.load_event(6, "/w/v6", ["gen-a"], in_memory=True).transfer is None  # no offer for v6
    ipc = _sync("cuda_ipc").load_event(5, "/w/v5", ["gen-a"], in_memory=True)
    assert ipc.members == ["gen-a"] and ipc.group == ""  # nothing to rendezvous


def test_the_group_name_is_kept_while_nothing_changes_and_changes_with_members_or_epoch() -> None:
    sync = _sync()
    first = sync.load_event(5, "/w/v5", ["gen-a", "gen-b"], in_memory=True).group
    assert sync.load_event(5, "/w/v5", ["gen-a", "gen-b"], in_memory=True).group == first
    assert sync.load_event(5, "/w/v5", ["gen-a"], in_memory=True).group != first
    sync.epoch += 1
    assert sync.load_event(5, "/w/v5", ["gen-a", "gen-b"], in_memory=True).group != first


def test_an_engine_silent_for_two_heartbeat_intervals_is_told_but_loads_the_disk_copy() -> None:
    """An engine killed without a word is live until its TTL ends; it must not join (and stall) a group."""
    sync = _sync()
    sync.engines["gen-b"].seen_at -= 4.5  # live (TTL 10 s) but missed two beats
    assert set(sync.live_engines()) == {"gen-a", "gen-b", "gen-c"}
    load = sync.load_event(5, "/w/v5", ["gen-a", "gen-b"], in_memory=True)
    assert load.engine_ids == ["gen-a", "gen-b"] and load.members == ["gen-a"]
    assert group_layout(load) == (2, {"gen-a": 1})
    sync.engines["gen-b"].seen_at = time.monotonic()  # it beat again: back in a (new) group
    assert sync.load_event(5, "/w/v5", ["gen-a", "gen-b"], in_memory=True).members == ["gen-a", "gen-b"]
