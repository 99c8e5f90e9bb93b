"""In-memory weight transfer over real gloo process groups (separate processes on this machine)."""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from areal_async import weight_buckets
from areal_async.weight_buckets import (
    TransferError,
    digest,
    manifest_of,
    open_group,
    pack,
    plan_buckets,
    receive_buckets,
    send_buckets,
    serve_store,
)
from bus.events import WeightsLoad
from workers.weight_memory import WeightReceiver, WeightSender

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.1.mlp.up_proj.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(300, 32, generator=g),  # 38,400 bytes: a bucket of its own
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(48, generator=g).to(torch.bfloat16),
        "step_counter": torch.arange(5, dtype=torch.int64),
    }


def _receiver(
    rank: int, address: str, name: str, world: int, mode: str, results: Path, timeout_s: float
) -> None:
    """A receiving member: ``ok`` receives and compares, ``die`` takes one bucket and is killed."""
    try:
        (results / f"ready{rank}").touch()  # torch imported: joining takes no longer than the others
        group = open_group("gloo", address, name, rank=rank, world_size=world, timeout_s=timeout_s)
        tensors = _weights()
        plan = plan_buckets(manifest_of(tensors), bucket_bytes=6200)
        digests = [digest(pack(b, tensors, "cpu")) for b in plan]
        if mode == "die":
            buffer = torch.empty(plan[0][0].nbytes, dtype=torch.uint8)
            weight_buckets._broadcast(group, buffer)
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            got = receive_buckets(group, plan, digests, "cpu")
        except TransferError as exc:
            outcome = f"refused: {exc}"
        except Exception as exc:  # a peer died: the collective fails, it does not hang
            outcome = f"failed after {time.monotonic() - started:.1f} s: {type(exc).__name__}"
        else:
            same = all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())
            outcome = f"received {len(got)} tensors in {len(plan)} buckets, equal={same}"
        (results / f"rank{rank}").write_text(outcome)
    except Exception:
        (results / f"rank{rank}").write_text("error: " + traceback.format_exc())


def _transfer(
    tmp_path: Path, modes: list[str], *, corrupt: bool = False, timeout_s: float = 20.0
) -> tuple[str, list[str]]:
    """Rank 0 in this process sends ``_weights()`` to one child per mode; returns what each saw."""
    store = serve_store("127.0.0.1", 0)
    address, name, world = f"127.0.0.1:{store.port}", f"t{time.time_ns()}", len(modes) + 1
    ctx = mp.get_context("spawn")
    children = [
        ctx.Process(target=_receiver, args=(i + 1, address, name, world, mode, tmp_path, timeout_s))
        for i, mode in enumerate(modes)
    ]
    for c in children:
        c.start()
    tensors = _weights()
    plan = plan_buckets(manifest_of(tensors), bucket_bytes=6200)
    if corrupt:  # bytes change after the digests were announced: a broken transfer
        tensors["model.layers.0.input_layernorm.weight"][3] += 1.0
    # The group's timeout bounds its forming too: wait until each child has imported torch (seconds
    # on a busy machine), so what is timed is the transfer, not a process start.
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i + 1}").exists() for i in range(len(modes))):
        assert time.monotonic() < deadline and all(c.is_alive() for c in children), "a member did not start"
        time.sleep(0.05)
    try:
        group = open_group("gloo", address, name, rank=0, world_size=world, timeout_s=timeout_s, store=store)
        send_buckets(group, [pack(b, tensors, "cpu") for b in plan])
        sent = "sent"
    except Exception as exc:
        sent = f"send failed: {type(exc).__name__}"
    for c in children:
        c.join(60)
    return sent, [(tmp_path / f"rank{i + 1}").read_text() for i, m in enumerate(modes) if m != "die"]


@pytest.mark.timeout(120)
def test_a_version_reaches_every_member_bit_exact_in_name_ordered_buckets(tmp_path: Path) -> None:
    sent, received = _transfer(tmp_path, ["ok", "ok"])
    assert sent == "sent"
    assert received == ["received 5 tensors in 3 buckets, equal=True"] * 2, received


@pytest.mark.timeout(120)
def test_a_corrupted_bucket_refuses_the_version(tmp_path: Path) -> None:
    sent, (received,) = _transfer(tmp_path, ["ok"], corrupt=True)
    assert sent == "sent"
    assert received.startswith("refused: 1 of 3 weight buckets arrived corrupted"), received
    assert "model.layers.0.input_layernorm.weight" in received


@pytest.mark.timeout(120)
def test_a_member_killed_mid_transfer_fails_the_others_at_the_timeout(tmp_path: Path) -> None:
    """The sender's broadcast raises at once; the survivor's receive raises at the group timeout
    (``weight_sync.transfer_timeout_s``, 4 s here), and its worker then loads the disk copy."""
    sent, (survivor,) = _transfer(tmp_path, ["die", "ok"], timeout_s=4.0)
    assert sent.startswith("send failed"), sent
    assert survivor.startswith("failed after"), survivor
    assert float(survivor.split()[2]) < 8.0, survivor


def _engine(address_file: Path, load: WeightsLoad, results: Path) -> None:
    cfg = SimpleNamespace(weight_sync=SimpleNamespace(transfer_timeout_s=20.0))
    try:
        got = WeightReceiver(cfg, "cpu", "gen-1").receive(load)  # type: ignore[arg-type]
        want = _weights()
        same = all(torch.equal(got[k], want[k]) for k in want)
        (results / "engine").write_text(f"{len(got)} tensors, equal={same}")
    except Exception:
        (results / "engine").write_text("error: " + traceback.format_exc())


@pytest.mark.timeout(120)
def test_the_trainers_offer_is_what_an_engine_receives(tmp_path: Path) -> None:
    """WeightSender.prepare -> TransferOffer -> WeightReceiver: the plan each side derives agrees,
    and the views handed to the disk writer hold the same bytes as the snapshot."""
    cfg = SimpleNamespace(
        weight_sync=SimpleNamespace(transport="gloo", bucket_mb=1, transfer_timeout_s=20.0, host="127.0.0.1")
    )
    sender = WeightSender(cfg, "cpu")  # type: ignore[arg-type]
    views = sender.prepare(7, _weights())
    assert all(torch.equal(views[k], v) for k, v in _weights().items())
    offer = sender.offer(7)
    assert offer is not None and offer.transport == "gloo" and offer.address == sender.address
    load = WeightsLoad(policy_version=7, path="/x", transfer=offer, group="g1", members=["gen-1"])
    child = mp.get_context("spawn").Process(target=_engine, args=(tmp_path, load, tmp_path))
    child.start()
    sender._broadcast("g1", 2, sender.prepared[7].buffers)
    child.join(60)
    assert (tmp_path / "engine").read_text() == "5 tensors, equal=True"
    for v in (8, 9):
        sender.prepare(v, _weights())
    assert list(sender.prepared) == [8, 9], "only the newest versions stay in memory"


def test_buckets_follow_name_order_and_an_oversized_tensor_goes_alone() -> None:
    buckets = plan_buckets(manifest_of(_weights()), bucket_bytes=6200)
    names = [[s.name for s in b] for b in buckets]
    assert names == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"],
        ["model.layers.1.mlp.up_proj.weight", "step_counter"],
    ]
    assert [s.offset for s in buckets[1]] == [0, 128]
    assert len(plan_buckets(manifest_of(_weights()), bucket_bytes=None)) == 1
    with pytest.raises(ValueError, match="names a tensor twice"):
        plan_buckets([("a", [1], torch.float32), ("a", [2], torch.float32)])
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        plan_buckets([("a", [1], torch.float32)], bucket_bytes=0)


def test_the_digest_sees_a_changed_byte_swapped_words_and_a_short_buffer(monkeypatch) -> None:
    buf = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = digest(buf)
    flipped = buf.clone()
    flipped[100] ^= 1
    swapped = buf.clone()
    swapped[[10, 2000]] = buf[[2000, 10]]
    assert buf[10] != buf[2000]
    assert digest(flipped) != base
    assert digest(swapped) != base
    assert digest(buf[:-1]) != base
    assert digest(torch.zeros(8, dtype=torch.uint8)) != digest(torch.zeros(9, dtype=torch.uint8))
    monkeypatch.setattr(weight_buckets, "_DIGEST_CHUNK_WORDS", 7)  # chunking does not change it
    assert digest(buf) == base


@pytest.mark.timeout(60)
def test_an_engine_refuses_a_group_that_failed_before_without_waiting_again() -> None:
    """A later version offered under the name of a group that did not form (a member died) is
    refused at once: the sender refuses that group too, so waiting would cost another timeout."""
    sender = WeightSender(
        SimpleNamespace(  # type: ignore[arg-type]
            weight_sync=SimpleNamespace(
                transport="gloo", bucket_mb=1, transfer_timeout_s=1.0, host="127.0.0.1"
            )
        ),
        "cpu",
    )
    sender.prepare(4, _weights())
    load = WeightsLoad(
        policy_version=4, path="/x", transfer=sender.offer(4), group="g-dead", members=["gen-dead", "gen-1"]
    )
    receiver = WeightReceiver(
        SimpleNamespace(weight_sync=SimpleNamespace(transfer_timeout_s=1.0)), "cpu", "gen-1"
    )  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(Exception, match="timeout"):  # rank 0 and the dead rank 1 never joined
        receiver.receive(load)
    assert time.monotonic() - started >= 0.9
    started = time.monotonic()
    with pytest.raises(TransferError, match="g-dead failed before"):
        receiver.receive(load)  # the next version, offered to the same group
    assert time.monotonic() - started < 0.2
