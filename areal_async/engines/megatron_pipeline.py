"""Pipeline parallelism of the Megatron backend (`trainer.megatron.pipeline_parallel`): stages, names,
the schedule, and whole weights gathered on rank 0.

Stages. megatron-core's parallel state puts the trainer's ranks into pipelines of P stages (rank 0 is
the first stage of the first pipeline); stage s builds layers `[s * L/P, (s + 1) * L/P)` of the GPT
model, the first stage also the embedding, the last the final norm and the output layer. Parameter
names are the stage's own (`decoder.layers.0` is its first layer); `StageNames` maps them to the whole
model's names, which checkpoints, HF export and `megatron_layout` use. A tied embedding is held twice:
the first stage's embedding and a copy as the last stage's output layer, both loaded from the same
weights and kept equal by summing their gradients over megatron's embedding group before each update
(identical gradients and AdamW state give identical updates); the copy is neither exported nor counted
twice in the gradient norm.

Schedule (1F1B, as megatron's default, whose own schedules need CUDA). Every stage of a pipeline gets
the same data shard and collates the same micro-batches, so the shape `[t, 1, hidden]` of each
hidden-state tensor is known on both sides and only the tensors travel (float32, point to point; tag 0
forward, 1 backward; sends are asynchronous, receives wait). Stage s of P runs P - s - 1 forwards, then
alternates one forward and one backward, then drains the remaining backwards, so it holds at most
P - s micro-batches' activations whatever the step's micro-batch count; the last stage runs each
backward right after its forward. Only the last stage computes logprobs (other stages return zeros in
their place), losses and stats.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from areal_async.engines.batching import ModelInputs, TrainSequence

if TYPE_CHECKING:
    from areal_async.engines.megatron import MegatronTrainEngine
    from areal_async.engines.train_loop import LossFn, Prox, UpdateSums

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


@dataclass(frozen=True)
class Stages:
    """This rank's place in its pipeline: `size` stages, this one `rank`, the pipeline's global ranks."""

    size: int
    rank: int
    ranks: tuple[int, ...]
    group: Any = None

    @classmethod
    def current(cls) -> Stages:
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group()
        size = parallel_state.get_pipeline_model_parallel_world_size()
        ranks = tuple(dist.get_process_group_ranks(group)) if size > 1 else (dist.get_rank(),)
        return cls(size, parallel_state.get_pipeline_model_parallel_rank(), ranks, group)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def layer_offset(self, num_layers: int) -> int:
        return num_layers // self.size * self.rank


class StageNames:
    """Stage-local parameter names <-> the whole model's (megatron-core) names; see the module docstring."""

    def __init__(self, stages: Stages, num_layers: int, *, tied: bool) -> None:
        self.offset = stages.layer_offset(num_layers)
        self.tied_copy = tied and stages.size > 1 and stages.last
        """The last stage's output layer is the tied embedding's copy."""

    def whole(self, name: str) -> str:
        if self.tied_copy and name == OUTPUT:
            return EMBEDDING
        m = _LAYER.match(name)
        return f"decoder.layers.{int(m.group(1)) + self.offset}.{m.group(2)}" if m else name

    def exported(self, name: str) -> bool:
        """False for the tied copy: the first stage exports the embedding."""
        return not (self.tied_copy and name == OUTPUT)


class P2P:
    """Point-to-point hidden states and gradients between neighbouring stages."""

    def __init__(self, stages: Stages, device: torch.device) -> None:
        self.stages, self.device = stages, device
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, *, forward: bool) -> None:
        s = self.stages
        dst = s.ranks[s.rank + 1] if forward else s.ranks[s.rank - 1]
        data = tensor.detach().float().contiguous()
        # A send's buffer lives until the send completes, not until the step ends.
        self.pending = [(work, buf) for work, buf in self.pending if not work.is_completed()]
        self.pending.append((dist.isend(data, dst, tag=0 if forward else 1), data))

    def recv(self, shape: Sequence[int], *, forward: bool) -> torch.Tensor:
        s = self.stages
        src = s.ranks[s.rank - 1] if forward else s.ranks[s.rank + 1]
        buf = torch.empty(tuple(shape), dtype=torch.float32, device=self.device)
        dist.irecv(buf, src, tag=0 if forward else 1).wait()
        return buf

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _hidden_shape(engine: MegatronTrainEngine, inputs: ModelInputs) -> tuple[int, int, int]:
    return (engine.model.stage_tokens(int(inputs.input_ids.shape[1])), 1, engine.shape.hidden_size)


def _stage(
    engine: MegatronTrainEngine, inputs: ModelInputs, x: torch.Tensor | None, with_entropy: bool
) -> Any:
    with engine._autocast():
        return engine.model.stage_forward(*inputs.model_args(), with_entropy, x)


def update_passes(
    engine: MegatronTrainEngine,
    seqs: Sequence[TrainSequence],
    bins: list[list[int] | None],
    prox: list[Prox],
    loss_fn: LossFn,
    denominator: torch.Tensor,
) -> UpdateSums:
    """`TrainLoop._update_passes` over pipeline stages (1F1B); the sums are the last stage's."""
    stages, p2p = engine.stages, P2P(engine.stages, engine.device)
    sums = engine._new_sums()
    engine.model.train()
    kept: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    """Micro-batch -> (its input from the previous stage, its output: hidden states, or the loss)."""

    def forward(k: int) -> None:
        bin_ = bins[k]
        if bin_ is None:
            mb, inputs = engine._empty_batch()
        else:
            done, prox[k] = prox[k], None
            mb, inputs = engine._loss_batch(seqs, bin_, done)
        x = None if stages.first else p2p.recv(_hidden_shape(engine, inputs), forward=True).requires_grad_()
        out = _stage(engine, inputs, x, True)
        if not stages.last:
            p2p.send(out, forward=True)
            kept[k] = (x, out)
            return
        logprobs_BT, entropy_BT = engine._to_BT(mb["input_ids"].shape, inputs, *out)
        if bin_ is None:
            kept[k] = (x, logprobs_BT.sum() * 0.0)
            return
        mb.update(logprobs=logprobs_BT, entropy=entropy_BT)
        kept[k] = (x, engine._add_loss(sums, mb, loss_fn, denominator))

    def backward(k: int) -> None:
        x, out = kept.pop(k)
        if stages.last:
            out.backward()
        else:
            grad = p2p.recv(out.shape, forward=False)
            torch.autograd.backward(out, grad.to(out.dtype))
        if x is not None:
            p2p.send(x.grad, forward=False)  # type: ignore[arg-type]

    count = len(bins)
    warmup = min(stages.size - stages.rank - 1, count)
    for k in range(warmup):
        forward(k)
    for k in range(warmup, count):
        forward(k)
        backward(k - warmup)
    for k in range(count - warmup, count):
        backward(k)
    p2p.wait()
    return sums


@torch.no_grad()
def logprob_passes(
    engine: MegatronTrainEngine, seqs: Sequence[TrainSequence], bins: list[list[int] | None]
) -> list[Prox]:
    """`TrainLoop._logprob_pass` over pipeline stages: the last stage's logprobs, zeros elsewhere."""
    stages, p2p = engine.stages, P2P(engine.stages, engine.device)
    engine.model.eval()
    out: list[Prox] = []
    for bin_ in bins:
        mb, inputs = engine._empty_batch() if bin_ is None else engine._collate([seqs[i] for i in bin_])
        x = None if stages.first else p2p.recv(_hidden_shape(engine, inputs), forward=True)
        res = _stage(engine, inputs, x, False)
        shape = mb["input_ids"].shape
        if stages.last:
            logprobs_BT, _ = engine._to_BT(shape, inputs, *res)
        else:
            p2p.send(res, forward=True)
            logprobs_BT = torch.zeros(shape, dtype=torch.float32, device=engine.device)
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
