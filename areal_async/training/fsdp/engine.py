"""Training engine: a Hugging Face causal LM under PyTorch FSDP2, trained by a loss callable.

Process model. Without a process group the engine trains a plain module in this process.
Under torchrun (`init_distributed` creates the group: gloo on CPU, NCCL on GPU) every
decoder layer and then the root are wrapped with `fully_shard`, parameters are sharded
over the ranks and gradients are summed (not averaged) across ranks.

Data, loss and model contracts, micro-batching and the optimizer step: `training/loop.py`
(`TrainLoop`); this module builds the model, shards it and owns its optimizer. Every rank is a
data-parallel rank here, so `dp_rank`/`dp_size` are the rank and world size, unless
`trainer.context_parallel` C > 1: then runs of C consecutive ranks share each packed row
(`training/context_parallel.py`), get the same shard of the batch (`dp_rank` = rank // C), and
their gradients are summed with everyone's by FSDP2's reduction over all ranks.

Packing. With `packed` (default: where `varlen.varlen_available`: CUDA, bf16) a micro-batch
is one row of its sequences back to back, up to `micro_batch_tokens` real tokens; matmuls,
norms and the lm_head see no padding, and attention stays within each sequence
(`training/attention.py`). Otherwise rows are right-padded and the budget counts padded tokens.
The loss sees the same `[b, T]` batch either way.

Numerics. Master weights and optimizer state are float32; `trainer.dtype` bfloat16 runs the
forward under autocast. Token logprobs and entropy are computed in float32 from the
logits of the completion tokens only, `logprob_chunk_tokens` rows at a time; with grad
and more rows than one chunk each chunk is recomputed in backward, so the `[tokens,
vocab]` logits never exist for the whole micro-batch. `temperature` divides the logits,
matching the sampler that produced pi_behave. On CUDA with Triton the logprob and entropy
come from one pass over the logits each way (`ops/logprob_triton.py`; `trainer.logprob_kernel`
chooses, `ops/logprobs.py`), and packed attention runs this project's Triton kernels
(`ops/attention_triton.py`) or FlashAttention-2 varlen (`trainer.attention_kernel` chooses,
`varlen.pick_attention_kernel`).

Weights out, checkpoints and LoRA: `training/fsdp/weights.py` (the `FSDPWeights` methods).
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from areal_async import lora as lora_lib
from areal_async.config_trainer import TrainerConfig
from areal_async.ops import varlen
from areal_async.training import attention  # noqa: F401  (registers the packed-row attention implementations)
from areal_async.training import context_parallel as context_parallel_lib
from areal_async.training.fsdp.model import TokenLogprobModel
from areal_async.training.fsdp.weights import FSDPWeights
from areal_async.training.loop import LossFn, TrainLoop
from areal_async.training.setup import (
    fast_bf16,
    init_distributed,
    lr_factor,
    make_optimizer,
    place,
    resolve_train_dtype,
)

log = structlog.get_logger(__name__)

__all__ = [
    "FSDPTrainEngine",
    "LossFn",
    "fast_bf16",
    "init_distributed",
    "lr_factor",
    "resolve_train_dtype",
]


class FSDPTrainEngine(TrainLoop, FSDPWeights):
    """A causal LM, its AdamW optimizer and lr schedule; one instance per rank."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        trainer: TrainerConfig | None = None,
        *,
        seed: int = 0,
        temperature: float = 1.0,
        logprob_chunk_tokens: int = 4096,
        packed: bool | None = None,
    ) -> None:
        """`trainer`: the run file's trainer section (None: its defaults); this backend reads its
        dtype, device, micro-batch budget, optimizer and schedule, kernels, gradient checkpointing,
        compile, `lora` and `context_parallel`. `seed` is the run's, `temperature` the rollouts'
        sampling temperature (pi_behave's). Not run-file keys: `logprob_chunk_tokens`, logits rows
        per logprob chunk; `packed`, None for packed rows where varlen attention runs."""
        from transformers import AutoConfig, AutoModelForCausalLM

        trainer = trainer or TrainerConfig()
        context_parallel, lora = trainer.context_parallel, trainer.lora
        self.model_path = Path(model_path)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.dp_rank, self.dp_size = self.rank, self.world_size
        context_group = None
        if context_parallel > 1:
            if not self.distributed or packed is False:
                raise ValueError(
                    f"trainer.context_parallel={context_parallel} splits packed rows over trainer ranks: it "
                    "needs trainer.num_ranks > 1 (under torchrun) and packed rows"
                )
            context_group, self.dp_group, self.dp_rank, self.dp_size = context_parallel_lib.groups(
                context_parallel
            )
            packed = True
        placement = place(trainer, temperature=temperature, logprob_chunk_tokens=logprob_chunk_tokens)
        self.device, self.autocast_dtype = placement.device, placement.autocast_dtype
        self.micro_batch_tokens = trainer.micro_batch_tokens
        self.packed = varlen.varlen_available(self.device, self.autocast_dtype) if packed is None else packed
        """Micro-batches as one packed row (no padding) instead of padded rows."""
        hf_config = AutoConfig.from_pretrained(self.model_path)  # read once, handed to the model below
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        self.attention_kernel = varlen.pick_attention_kernel(self.device, trainer.attention_kernel, head_dim)
        """CUDA kernel of packed attention: `flash` (FlashAttention-2 varlen) or `triton`."""
        self.grad_clip = trainer.optimizer.grad_clip
        self.version = 0
        """Policy version: optimizer steps taken since the initial weights (version 0)."""

        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_pretrained(
            self.model_path,
            config=hf_config,
            dtype=torch.float32,
            attn_implementation=varlen.ATTN_IMPLEMENTATIONS[self.attention_kernel] if self.packed else "sdpa",
        )
        self.config = hf.config
        pad = getattr(hf.config, "pad_token_id", None)
        self.pad_token_id = int(pad) if isinstance(pad, int) and 0 <= pad < hf.config.vocab_size else 0
        if trainer.gradient_checkpointing:
            enable = getattr(hf, "activation_checkpointing_enable", None)  # transformers >= 5.x
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lora
        """Adapters train on the frozen base (areal_async/lora.py); None: every weight trains."""
        if lora is not None:
            adapters = lora_lib.inject(hf, lora, base_dtype=self.autocast_dtype or torch.float32)
            log.info("lora adapters added", rank=lora.rank, alpha=lora.alpha, params=adapters)
        decoder_layers = hf.get_decoder().layers
        if trainer.compile:
            # Compile blocks, then shard the compiled wrappers (FSDP hooks stay outside the graphs);
            # the torch.distributed.checkpoint helpers strip the `_orig_mod` prefix from names.
            for i, layer in enumerate(decoder_layers):
                decoder_layers[i] = torch.compile(layer)
        layers = list(decoder_layers)
        self.model = TokenLogprobModel(
            hf,
            temperature=temperature,
            chunk_tokens=logprob_chunk_tokens,
            logprob_fn=placement.logprob_fn,
            context_group=context_group,
            pad_token_id=self.pad_token_id,
        )
        if self.distributed:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import FSDPModule, fully_shard

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            for layer in layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    # loss_fn divides by the global token count already: sum gradients, do not average.
                    # Plain SUM (gloo has no pre-multiplied sum).
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
        else:
            self.model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(
            self.params, self.device, trainer.optimizer, total_steps=trainer.total_steps
        )
        log.info(
            "train engine ready",
            model=str(self.model_path),
            params=sum(p.numel() for p in self.params),
            world_size=self.world_size,
            context_parallel=context_parallel,
            device=str(self.device),
            dtype=trainer.dtype,
            autocast=str(self.autocast_dtype).removeprefix("torch.") if self.autocast_dtype else None,
            fsdp=self.distributed,
        )
