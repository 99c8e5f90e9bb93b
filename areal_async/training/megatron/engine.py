"""Training engine on megatron-core (`trainer.backend: megatron`): the HF model rebuilt as
megatron-core's GPT model with tensor and pipeline parallelism, trained by the same loop and loss
as FSDP2.

Model. `megatron_layout.MegatronShape` reads the HF config (Llama, Qwen2, Qwen3 families) into a
`TransformerConfig`; the layers are megatron-core's pure-PyTorch spec (`get_gpt_layer_local_spec`;
Transformer Engine is not needed) with `megatron_model.PackedCoreAttention` as core attention,
so micro-batches are always packed rows (THD) and no compute is spent on padding, on CPU too.
The HF weights load through `megatron_layout` (name and layout mapping, tensor-parallel shards).

Process model. megatron-core's `parallel_state` splits the trainer's ranks into tensor-parallel
groups of `trainer.megatron.tensor_parallel` ranks, context-parallel groups of `trainer.context_parallel` ranks
(`training/context_parallel.py`: each holds a part of every packed row), pipelines of
`trainer.megatron.pipeline_parallel` stages (`training/megatron/pipeline.py`: stages, schedule, stage-local names)
and data-parallel groups across them. Ranks of a tensor-parallel or context-parallel group or of a
pipeline get the same shard of the batch (`dp_rank`); the learner scatters over `dp_size`. Under
torchrun the process group is the trainer's (gloo on CPU, NCCL on CUDA); without torchrun the
engine creates a one-rank group, because megatron-core needs one. Gradients are summed over the
data-parallel x context-parallel ranks (norms whose tensor-parallel copies see other heads or other
tokens over the tensor-parallel group: `training/megatron/sequence_parallel.py`), then clipped by the norm
over all shards (each tensor-parallel slice and pipeline stage counted once).

Settings: the run file's trainer section, set up as FSDP2's (`training/setup.py`: device, dtype,
logprob kernel, AdamW and its schedule from `trainer.optimizer`).

Numerics as FSDP2's: float32 master weights and optimizer state, bf16 autocast with `trainer.dtype`
bfloat16 or auto, on CUDA; on CPU the backend trains in float32 (`auto` resolves to it), because megatron-core's
linear layers re-enter autocast in backward on CUDA only.

Same contracts as the FSDP2 engine: the training loop, loss and metrics (`training/loop.py`);
`snapshot_hf` / `save_hf` / `write_hf` give HF-named full weights on rank 0 (tensor-parallel
slices and pipeline stages gathered once per version). Checkpoints are sharded
(`save_sharded` / `load_sharded`, training/megatron/checkpoint.py): every rank writes its own slices
of the weights and AdamW moments, nothing is gathered, and a checkpoint resumes at any
tensor-parallel, pipeline or data-parallel size; it refuses to load into the FSDP2 backend (and the
reverse).
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn

from areal_async.config_trainer import TrainerConfig
from areal_async.ops import varlen
from areal_async.training.hf_writer import HFWriter
from areal_async.training.loop import TrainLoop
from areal_async.training.megatron import checkpoint as megatron_checkpoint
from areal_async.training.megatron import layout as megatron_layout
from areal_async.training.megatron import pipeline as megatron_pipeline
from areal_async.training.megatron.layout import MegatronShape
from areal_async.training.megatron.model import (
    MegatronLogprobModel,
    PackedCoreAttention,
    hf_rotary_embedding,
    vocab_parallel_logprobs,
)
from areal_async.training.megatron.pipeline import StageNames, Stages, gather_to_first
from areal_async.training.megatron.sequence_parallel import summed_over_tensor_parallel, use_sequence_parallel
from areal_async.training.setup import init_distributed, make_optimizer, place

log = structlog.get_logger(__name__)


def _import_megatron_core() -> None:
    """Import megatron-core's modules once, without its warnings about Transformer Engine and Apex
    (this backend uses neither); a missing megatron-core says how to install it."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning
        )
        try:
            import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
            import megatron.core.tensor_parallel  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"trainer.backend=megatron needs megatron-core ({e}); pip install 'areal-async[megatron]'"
            ) from e


def _join_group(device: str) -> None:
    """torchrun's process group, or a one-rank group on a free local port without torchrun."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        init_distributed(device)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _recompute_in_backward(layer: nn.Module) -> None:
    """Activation checkpointing of one layer with torch's non-reentrant checkpoint (megatron-core's own
    recompute needs CUDA's RNG tracker); parameter names do not change."""
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = run  # type: ignore[method-assign]


def _sum_over(grads: list[torch.Tensor], group: Any) -> None:
    """In place: each gradient summed over `group`, in one all-reduce."""
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def _init_parallel(
    tensor_parallel: int, pipeline_parallel: int, context_parallel: int, world_size: int
) -> None:
    from megatron.core import parallel_state

    sizes = (tensor_parallel, pipeline_parallel, context_parallel)
    if world_size % (tensor_parallel * pipeline_parallel * context_parallel):
        raise ValueError(
            f"trainer.megatron.tensor_parallel={tensor_parallel} x trainer.megatron.pipeline_parallel="
            f"{pipeline_parallel} x trainer.context_parallel={context_parallel} does not divide the "
            f"trainer's {world_size} ranks (trainer.num_ranks x nodes); choose sizes whose product divides it"
        )
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        ) != sizes:
            raise ValueError("megatron-core's parallel state was set up with other parallel sizes")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
    )


class MegatronTrainEngine(TrainLoop, HFWriter):
    """megatron-core GPT model, its AdamW optimizer and lr schedule; one instance per rank."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        trainer: TrainerConfig | None = None,
        *,
        seed: int = 0,
        temperature: float = 1.0,
        logprob_chunk_tokens: int = 4096,
    ) -> None:
        """`trainer`: the run file's trainer section (None: its defaults), as the FSDP2 engine takes it;
        this backend reads its dtype, device, micro-batch budget, optimizer and schedule, kernels,
        gradient checkpointing, compile, `context_parallel` and `megatron` (tensor and pipeline
        parallelism). `seed`, `temperature`, `logprob_chunk_tokens`: as FSDP2's."""
        from transformers import AutoConfig

        trainer = trainer or TrainerConfig()
        device = trainer.device
        self.model_path = Path(model_path)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.config = hf_config
        self.shape = MegatronShape.from_hf_config(hf_config)
        parallel = trainer.megatron
        tensor_parallel = parallel.tensor_parallel
        self.shape.check_parallel(
            tensor_parallel=tensor_parallel,
            pipeline_parallel=parallel.pipeline_parallel,
            virtual_pipeline=parallel.virtual_pipeline,
        )

        # megatron-core's linear layers re-enter autocast in backward on CUDA only.
        if device != "cuda" and trainer.dtype == "bfloat16":
            raise ValueError(
                "trainer.dtype=bfloat16 with trainer.backend=megatron needs trainer.device=cuda "
                "(megatron-core's layers autocast on CUDA only); set trainer.dtype: auto or float32"
            )
        _import_megatron_core()
        _join_group(device)
        from megatron.core import parallel_state
        from megatron.core import tensor_parallel as mtp

        self.distributed = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        _init_parallel(tensor_parallel, parallel.pipeline_parallel, trainer.context_parallel, self.world_size)
        self.stages = Stages.current(parallel.virtual_pipeline)
        self.names = StageNames(self.stages, self.shape.num_layers, tied=self.shape.tied)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = tensor_parallel
        self.sequence_parallel = parallel.sequence_parallel
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.grad_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        """Ranks whose gradients are summed: data-parallel x context-parallel."""
        placement = place(
            trainer,
            temperature=temperature,
            logprob_chunk_tokens=logprob_chunk_tokens,
            dtype=None if device == "cuda" else "float32",
        )
        self.device, self.autocast_dtype = placement.device, placement.autocast_dtype
        logprob_fn = placement.logprob_fn
        if tensor_parallel > 1:
            logprob_fn = partial(vocab_parallel_logprobs, rows_gathered=self.sequence_parallel)
        self.micro_batch_tokens = trainer.micro_batch_tokens
        self.packed = True
        self.attention_kernel = varlen.pick_attention_kernel(
            self.device, trainer.attention_kernel, self.shape.head_dim
        )
        self.grad_clip = trainer.optimizer.grad_clip
        self.version = 0
        self.lora = None
        pad = getattr(hf_config, "pad_token_id", None)
        self.pad_token_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.shape.vocab_size else 0

        torch.manual_seed(seed)
        if self.device.type == "cuda":
            mtp.model_parallel_cuda_manual_seed(seed)
        chunks = [self._build_gpt(chunk) for chunk in range(self.stages.chunks)]
        self._load_hf_weights(chunks)
        for layer in (layer for gpt in chunks for layer in gpt.decoder.layers):
            if trainer.gradient_checkpointing:
                _recompute_in_backward(layer)
            if trainer.compile:  # in place: parameter names stay megatron-core's
                layer.compile()
        self.model = MegatronLogprobModel(
            chunks,
            hf_rotary_embedding(hf_config, self.shape.architecture).to(self.device),
            temperature=temperature,
            chunk_tokens=logprob_chunk_tokens,
            logprob_fn=logprob_fn,
            attention_kernel=self.attention_kernel,
            context_group=parallel_state.get_context_parallel_group() if self.cp_size > 1 else None,
            sequence_group=self.tp_group if self.sequence_parallel else None,
            pad_token_id=self.pad_token_id,
        )
        self.named = {
            self.names.local(c, n): p
            for c, gpt in enumerate(chunks)
            for n, p in gpt.named_parameters()
            if p.requires_grad
        }
        """Local names (`StageNames`) -> this rank's (tensor-parallel slice of the) parameter."""
        self.params = list(self.named.values())
        self.optimizer, self.scheduler = make_optimizer(
            self.params, self.device, trainer.optimizer, total_steps=trainer.total_steps
        )
        log.info(
            "megatron train engine ready",
            model=str(self.model_path),
            architecture=self.shape.architecture,
            params=sum(p.numel() for p in self.params),
            tensor_parallel=self.tp_size,
            pipeline_parallel=self.stages.size,
            context_parallel=self.cp_size,
            data_parallel=self.dp_size,
            device=str(self.device),
            autocast=str(self.autocast_dtype).removeprefix("torch.") if self.autocast_dtype else None,
        )

    # ------------------------------------------------------------------ model

    def _build_gpt(self, chunk: int) -> nn.Module:
        """Model chunk `chunk` of this stage (the whole stage without interleaving)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = self.shape
        config = TransformerConfig(
            num_layers=s.num_layers,
            hidden_size=s.hidden_size,
            num_attention_heads=s.num_heads,
            num_query_groups=s.num_kv_heads,
            kv_channels=s.head_dim,
            ffn_hidden_size=s.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=s.norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=s.qkv_bias,
            qk_layernorm=s.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            use_cpu_initialization=self.device.type != "cuda",
            perform_initialization=False,  # the HF weights are loaded next
            tensor_model_parallel_size=self.tp_size,
            pipeline_model_parallel_size=self.stages.size,
            virtual_pipeline_model_parallel_size=self.stages.chunks if self.stages.chunks > 1 else None,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
        )
        spec = get_gpt_layer_local_spec(qk_layernorm=s.qk_norm, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
        if self.sequence_parallel:
            use_sequence_parallel(spec)
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=s.vocab_size,
            max_sequence_length=int(getattr(self.config, "max_position_embeddings", 4096)),
            pre_process=self.stages.holds_embedding(chunk),
            post_process=self.stages.holds_head(chunk),
            vp_stage=chunk if self.stages.chunks > 1 else None,
            # Over pipeline stages a tied embedding is kept as two equal copies (megatron_pipeline).
            share_embeddings_and_output_weights=s.tied and self.stages.size == 1,
            position_embedding_type="none",  # PackedCoreAttention applies the HF rotary embedding
        )

    def _load_hf_weights(self, chunks: list[nn.Module]) -> None:
        from safetensors.torch import load_file

        files = sorted(self.model_path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {self.model_path}")
        hf: dict[str, torch.Tensor] = {}
        for f in files:
            hf.update(load_file(f))
        if self.shape.tied:
            hf.pop("lm_head.weight", None)
        full = megatron_layout.to_megatron(hf, self.shape)
        params = {
            self.names.whole(self.names.local(c, n)): p
            for c, gpt in enumerate(chunks)
            for n, p in gpt.named_parameters()
        }
        missing = sorted(set(params) - set(full))
        if missing:
            raise ValueError(f"{self.model_path} lacks weights for {missing[:4]} (megatron-core names)")
        with torch.no_grad():
            for name, param in params.items():
                part = megatron_layout.tp_shard(name, full[name], self.tp_rank, self.tp_size)
                param.copy_(part.to(param.dtype))
        for gpt in chunks:
            gpt.to(self.device)

    # ------------------------------------------------------------- pipeline

    def _update_passes(
        self,
        seqs: Any,
        bins: Any,
        prox: Any,
        loss_fn: Any,
        denominator: Any,
        *,
        prox_from_update: bool = False,
    ) -> Any:
        if self.stages.size == 1:
            return super()._update_passes(
                seqs, bins, prox, loss_fn, denominator, prox_from_update=prox_from_update
            )
        return megatron_pipeline.update_passes(
            self, seqs, bins, prox, loss_fn, denominator, prox_from_update=prox_from_update
        )

    def _logprob_pass(self, seqs: Any, bins: Any) -> Any:
        if self.stages.size == 1:
            return super()._logprob_pass(seqs, bins)
        return megatron_pipeline.logprob_passes(self, seqs, bins)

    def _sum_over_ranks(self, values: torch.Tensor) -> None:
        """Over pipeline stages only the last one's sums count (the others compute no loss)."""
        if self.stages.size > 1 and not self.stages.last:
            values.zero_()
        super()._sum_over_ranks(values)
        if self.stages.size > 1:
            dist.all_reduce(values, group=self.stages.group)

    def _sum_tied_embedding_grads(self) -> None:
        """A tied embedding over pipeline stages: the first stage's embedding and the last stage's copy
        get the sum of both gradients (megatron's embedding group), so they stay equal."""
        if not (self.shape.tied and self.stages.size > 1 and (self.stages.first or self.stages.last)):
            return
        from megatron.core import parallel_state

        param = self.named[self.names.embedding if self.stages.first else self.names.output]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=parallel_state.get_embedding_group())

    def _sum_replicated_grads(self) -> None:
        """Replicated parameters whose tensor-parallel copies see other heads (q/k norms) or other
        tokens (every norm under sequence parallelism): gradients summed over the group."""
        if self.tp_size == 1:
            return
        names = [n for n in self.named if summed_over_tensor_parallel(n, self.sequence_parallel)]
        _sum_over([g for n in names if (g := self.named[n].grad) is not None], self.tp_group)

    # ------------------------------------------------------------ gradients

    def _clip_gradients(self) -> float:
        """Sum gradients over data-parallel and context-parallel ranks (and a tied embedding's two copies over pipeline
        stages), then the global norm (each slice once) and clip."""
        self._sum_tied_embedding_grads()
        self._sum_replicated_grads()
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        if self.dp_size * self.cp_size > 1:
            _sum_over(grads, self.grad_group)
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, p in self.named.items():
            whole = self.names.whole(name)
            counted = self.names.exported(name) and (megatron_layout.tp_split(whole) or self.tp_rank == 0)
            if p.grad is not None and counted:
                local += p.grad.float().pow(2).sum()
        if self.tp_size > 1:
            dist.all_reduce(local, group=self.tp_group)
        if self.stages.size > 1:
            dist.all_reduce(local, group=self.stages.group)
        total = local.sqrt()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, total)
        return float(total)

    # ---------------------------------------------------------------- weights

    def _full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of `name` from this rank's slice (collective over the tensor-parallel group)."""
        if self.tp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return megatron_layout.tp_merge(name, parts)

    def _full_megatron(self, tensors: dict[str, torch.Tensor], *, on_device: bool) -> dict[str, torch.Tensor]:
        """Whole copies of per-parameter `tensors` (keyed by this stage's names) under the whole model's
        names, every stage's, on rank 0; others get {}. Collective."""
        leader = self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0  # rank 0's pipeline
        mine: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if not self.names.exported(name):
                continue
            whole = self.names.whole(name)
            full = self._full(whole, tensor.detach())
            if leader:
                mine[whole] = full
        if not leader:
            return {}
        out = gather_to_first(self.stages, mine, self.device)
        return {k: v.clone() if on_device else v.to("cpu", copy=True) for k, v in out.items()}

    def snapshot_hf(
        self, *, dtype: torch.dtype | None = None, on_device: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """HF-named copies of the full weights on rank 0 (None elsewhere); see FSDP2's. Collective."""
        full = self._full_megatron(dict(self.named), on_device=on_device)
        if self.rank != 0:
            return None
        hf = megatron_layout.to_hf(full, self.shape)
        return {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in hf.items()}

    def merged_hf(self, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        return self.snapshot_hf(dtype=dtype)

    def save_sharded(self, path: Path) -> dict[str, Any]:
        """Write this rank's slices of the weights and moments under `path` (megatron_checkpoint);
        returns the replicated state for the caller to store. Collective."""
        return megatron_checkpoint.save(self, path)

    def load_sharded(self, path: Path, state: Mapping[str, Any]) -> None:
        """Restore `save_sharded`'s checkpoint at any parallel layout. Collective."""
        megatron_checkpoint.load(self, path, state)
