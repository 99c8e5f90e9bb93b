"""Pipeline parallelism of the Megatron backend (`trainer.megatron.pipeline_parallel`): stages, names,
the schedule, and whole weights gathered on rank 0.

Stages. megatron-core's parallel state puts the trainer's ranks into pipelines of P stages (rank 0 is
the first stage of the first pipeline); stage s builds layers `[s * L/P, (s + 1) * L/P)` of the GPT
model, the first stage also the embedding, the last the final norm and the output layer. With V
interleaved chunks (`trainer.megatron.virtual_pipeline`), stage s builds V GPT model chunks instead,
chunk c holding the L/(PV) layers of virtual stage `c * P + s`; a micro-batch runs through chunk 0
of every stage, then chunk 1 of every stage (the last stage sends on to the first), and so on.
Parameter names are the chunk's own (`decoder.layers.0` is its first layer; `chunks.<c>.` in front
with several chunks); `StageNames` maps them to the whole model's names, which checkpoints, HF
export and `megatron_layout` use. A tied embedding is held twice:
the first stage's embedding and a copy as the last stage's output layer, both loaded from the same
weights and kept equal by summing their gradients over megatron's embedding group before each update
(identical gradients and AdamW state give identical updates); the copy is neither exported nor counted
twice in the gradient norm.

Schedule (`schedule`: 1F1B, as megatron's default, and megatron's interleaved 1F1B with chunks;
megatron's own schedules need CUDA). Every stage of a pipeline gets
the same data shard and collates the same micro-batches, so the shape `[t, 1, hidden]` of each
hidden-state tensor is known on both sides and only the tensors travel (float32, point to point; tag 0
forward, 1 backward; sends are asynchronous, receives wait). Stage s of P runs P - s - 1 forwards, then
alternates one forward and one backward, then drains the remaining backwards, so it holds at most
P - s micro-batches' activations whatever the step's micro-batch count; the last stage runs each
backward right after its forward. With chunks, micro-batches go in groups of P (padded with empty
passes): forwards chunk by chunk through a group, backwards in the reverse chunk order, after a
warm-up of 2 (P - s - 1) + (V - 1) P forwards; the bubble shrinks by V. Only the last stage computes
logprobs (other stages return zeros in their place), losses and stats.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from areal_async.training.batching import ModelInputs, TrainSequence
from areal_async.training.loop import LossFn, Prox, UpdateSums
from areal_async.training.megatron.layout import MegatronShape
from areal_async.training.megatron.model import MegatronLogprobModel


class StagedLoop(Protocol):
    """What the schedule runs on: a `TrainLoop` (its micro-batch pieces) with a stage of the model.
    `MegatronTrainEngine` satisfies it."""

    model: MegatronLogprobModel
    shape: MegatronShape
    stages: Stages
    device: torch.device

    def autocast(self) -> torch.autocast: ...
    def new_sums(self) -> UpdateSums: ...
    def empty_batch(self) -> tuple[dict[str, torch.Tensor], ModelInputs]: ...
    def collate_batch(self, seqs: Sequence[TrainSequence]) -> tuple[dict[str, torch.Tensor], ModelInputs]: ...
    def loss_batch(
        self, seqs: Sequence[TrainSequence], bin_: list[int], done: Prox
    ) -> tuple[dict[str, torch.Tensor], ModelInputs]: ...
    def add_loss(
        self, sums: UpdateSums, mb: dict[str, torch.Tensor], loss_fn: LossFn, denominator: torch.Tensor
    ) -> torch.Tensor: ...
    def to_BT(
        self, shape: torch.Size, inputs: ModelInputs, logprobs_N: torch.Tensor, entropy_N: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


@dataclass(frozen=True)
class Stages:
    """This rank's place in its pipeline: `size` stages, this one `rank`, the pipeline's global ranks,
    and `chunks` model chunks per stage (interleaved stages; 1 = one contiguous block of layers)."""

    size: int
    rank: int
    ranks: tuple[int, ...]
    group: Any = None
    chunks: int = 1

    @classmethod
    def current(cls, chunks: int = 1) -> Stages:
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group()
        size = parallel_state.get_pipeline_model_parallel_world_size()
        ranks = tuple(dist.get_process_group_ranks(group)) if size > 1 else (dist.get_rank(),)
        return cls(size, parallel_state.get_pipeline_model_parallel_rank(), ranks, group, chunks)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def holds_embedding(self, chunk: int) -> bool:
        return self.first and chunk == 0

    def holds_head(self, chunk: int) -> bool:
        return self.last and chunk == self.chunks - 1

    def layer_offset(self, num_layers: int, chunk: int = 0) -> int:
        """The whole model's index of `chunk`'s first layer: virtual stage `chunk * size + rank`."""
        return num_layers // (self.size * self.chunks) * (chunk * self.size + self.rank)


class StageNames:
    """Stage-local parameter names <-> the whole model's (megatron-core) names; see the module docstring.
    With several chunks a local name starts with `chunks.<c>.`."""

    def __init__(self, stages: Stages, num_layers: int, *, tied: bool) -> None:
        self.stages = stages
        self.offsets = [stages.layer_offset(num_layers, c) for c in range(stages.chunks)]
        self.embedding = self.local(0, EMBEDDING)
        self.output = self.local(stages.chunks - 1, OUTPUT)
        self.tied_copy = tied and stages.size > 1 and stages.last
        """The last stage's output layer is the tied embedding's copy."""

    def local(self, chunk: int, name: str) -> str:
        """The local name of chunk `chunk`'s parameter `name` (the chunk's own megatron name)."""
        return f"chunks.{chunk}.{name}" if self.stages.chunks > 1 else name

    def whole(self, name: str) -> str:
        if self.tied_copy and name == self.output:
            return EMBEDDING
        chunk = 0
        if self.stages.chunks > 1:
            _, index, name = name.split(".", 2)
            chunk = int(index)
        m = _LAYER.match(name)
        return f"decoder.layers.{int(m.group(1)) + self.offsets[chunk]}.{m.group(2)}" if m else name

    def exported(self, name: str) -> bool:
        """False for the tied copy: the first stage exports the embedding."""
        return not (self.tied_copy and name == self.output)


class P2P:
    """Point-to-point hidden states and gradients between neighbouring stages (with chunks, the last
    stage's forward goes on to the first stage's next chunk: neighbours are modulo the size)."""

    def __init__(self, stages: Stages, device: torch.device) -> None:
        self.stages, self.device = stages, device
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def _peer(self, step: int) -> int:
        s = self.stages
        return s.ranks[(s.rank + step) % s.size]

    def send(self, tensor: torch.Tensor, *, forward: bool) -> None:
        data = tensor.detach().float().contiguous()
        # A send's buffer lives until the send completes, not until the step ends.
        self.pending = [(work, buf) for work, buf in self.pending if not work.is_completed()]
        self.pending.append(
            (dist.isend(data, self._peer(1 if forward else -1), tag=0 if forward else 1), data)
        )

    def recv(self, shape: Sequence[int], *, forward: bool) -> torch.Tensor:
        buf = torch.empty(tuple(shape), dtype=torch.float32, device=self.device)
        dist.irecv(buf, self._peer(-1 if forward else 1), tag=0 if forward else 1).wait()
        return buf

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _hidden_shape(engine: StagedLoop, inputs: ModelInputs) -> tuple[int, int, int]:
    return (engine.model.stage_tokens(int(inputs.input_ids.shape[1])), 1, engine.shape.hidden_size)


def _stage(
    engine: StagedLoop, inputs: ModelInputs, x: torch.Tensor | None, with_entropy: bool, chunk: int
) -> Any:
    with engine.autocast():
        return engine.model.stage_forward(*inputs.model_args(), with_entropy, x, chunk)


def schedule(stages: Stages, count: int) -> list[tuple[str, int, int]]:
    """This stage's order of passes over `count` micro-batches: ("F" or "B", micro-batch, chunk).

    One chunk: 1F1B (module docstring). Several: megatron's interleaved 1F1B, over micro-batches in
    groups of `size` (the caller pads `count` to a multiple): forwards go chunk by chunk through a
    group, backwards in the reverse chunk order; stage s warms up with 2 (size - s - 1) +
    (chunks - 1) size forwards (all of them when there is a single group)."""
    p, v, s = stages.size, stages.chunks, stages.rank
    total = count * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk if backward else chunk)

    if v == 1:
        warmup = min(p - s - 1, count)
    else:
        warmup = total if count == p else min(2 * (p - s - 1) + (v - 1) * p, total)
    order = [("F", *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", *unit(warmup + k, False)), ("B", *unit(k, True))]
    order += [("B", *unit(k, True)) for k in range(total - warmup, total)]
    return order


def update_passes(
    engine: StagedLoop,
    seqs: Sequence[TrainSequence],
    bins: list[list[int] | None],
    prox: list[Prox],
    loss_fn: LossFn,
    denominator: torch.Tensor,
    *,
    prox_from_update: bool = False,
) -> UpdateSums:
    """`TrainLoop._update_passes` over pipeline stages (`schedule`); the sums are the last stage's,
    and so is pi_prox from the update (`prox_from_update`: the last stage's own logprobs)."""
    stages, p2p = engine.stages, P2P(engine.stages, engine.device)
    sums = engine.new_sums()
    engine.model.train()
    if stages.chunks > 1:  # interleaving runs micro-batches in groups of `size`
        bins = bins + [None] * (-len(bins) % stages.size)
        prox = prox + [None] * (len(bins) - len(prox))
    batches: dict[int, tuple[dict[str, torch.Tensor], ModelInputs]] = {}
    kept: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    """(micro-batch, chunk) -> (its input from the previous stage, its output: hidden states, or the loss)."""

    def forward(k: int, chunk: int) -> None:
        bin_ = bins[k]
        if k not in batches:  # collated at the micro-batch's first chunk, kept until its last backward
            if bin_ is None:
                batches[k] = engine.empty_batch()
            else:
                done, prox[k] = prox[k], None
                batches[k] = engine.loss_batch(seqs, bin_, done)
        mb, inputs = batches[k]
        x = None
        if not stages.holds_embedding(chunk):
            x = p2p.recv(_hidden_shape(engine, inputs), forward=True).requires_grad_()
        out = _stage(engine, inputs, x, True, chunk)
        if not stages.holds_head(chunk):
            p2p.send(out, forward=True)
            kept[k, chunk] = (x, out)
            return
        logprobs_BT, entropy_BT = engine.to_BT(mb["input_ids"].shape, inputs, *out)
        if bin_ is None:
            kept[k, chunk] = (x, logprobs_BT.sum() * 0.0)
            return
        if prox_from_update:
            mb["prox_logprobs"] = logprobs_BT.detach()
        mb.update(logprobs=logprobs_BT, entropy=entropy_BT)
        kept[k, chunk] = (x, engine.add_loss(sums, mb, loss_fn, denominator))

    def backward(k: int, chunk: int) -> None:
        x, out = kept.pop((k, chunk))
        if stages.holds_head(chunk):
            out.backward()
        else:
            grad = p2p.recv(out.shape, forward=False)
            torch.autograd.backward(out, grad.to(out.dtype))
        if x is not None:
            p2p.send(x.grad, forward=False)  # type: ignore[arg-type]
        if chunk == 0:
            batches.pop(k)

    for kind, k, chunk in schedule(stages, len(bins)):
        (forward if kind == "F" else backward)(k, chunk)
    p2p.wait()
    return sums


@torch.no_grad()
def logprob_passes(
    engine: StagedLoop, seqs: Sequence[TrainSequence], bins: list[list[int] | None]
) -> list[Prox]:
    """`TrainLoop._logprob_pass` over pipeline stages: the last stage's logprobs, zeros elsewhere.
    Each micro-batch goes through every chunk before the next starts."""
    stages, p2p = engine.stages, P2P(engine.stages, engine.device)
    engine.model.eval()
    out: list[Prox] = []
    for bin_ in bins:
        mb, inputs = engine.empty_batch() if bin_ is None else engine.collate_batch([seqs[i] for i in bin_])
        shape = mb["input_ids"].shape
        logprobs_BT = torch.zeros(shape, dtype=torch.float32, device=engine.device)
        for chunk in range(stages.chunks):
            x = (
                None
                if stages.holds_embedding(chunk)
                else p2p.recv(_hidden_shape(engine, inputs), forward=True)
            )
            res = _stage(engine, inputs, x, False, chunk)
            if stages.holds_head(chunk):
                logprobs_BT, _ = engine.to_BT(shape, inputs, *res)
            else:
                p2p.send(res, forward=True)
        out.append(None if bin_ is None else (mb, inputs, logprobs_BT))
    p2p.wait()
    return out


def gather_to_first(
    stages: Stages, full: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Every stage's `full` tensors (whole-model names) on the pipeline's first stage; `{}` on the
    others. Called by one rank per stage of one pipeline (rank 0's, tensor-parallel rank 0)."""
    if stages.size == 1:
        return full
    if not stages.first:
        meta = [[(name, tuple(t.shape), t.dtype) for name, t in full.items()]]
        dist.send_object_list(meta, dst=stages.ranks[0], device=device)
        for t in full.values():
            dist.send(t.contiguous(), dst=stages.ranks[0])
        return {}
    out = dict(full)
    for src in stages.ranks[1:]:
        meta: list[Any] = [None]
        dist.recv_object_list(meta, src=src, device=device)
        for name, shape, dtype in meta[0]:
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src=src)
            out[name] = buf
    return out
