"""The trainer's sections of the run configuration (``trainer:`` and its ``optimizer`` and ``loss``,
and ``sft:``, the supervised warm start on the same engines); the tree they belong to and its
other sections: ``areal_async/config.py``.

No torch here: the CLI imports the configuration and must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from areal_async.config_checks import non_negative, positive
from areal_async.lora import LoraConfig


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float = 1e-5
    """Peak learning rate of AdamW."""

    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""

    eps: float = 1e-8
    """AdamW epsilon."""

    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""

    warmup_steps: int = 0
    """Linear warm-up steps."""

    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""

    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of ``lr``."""

    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""

    def __post_init__(self) -> None:
        positive(self, "lr")
        non_negative(self, "warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    preset: str = "ppo_decoupled"
    """Named recipe: ``ppo_decoupled``, ``grpo``, ``dr_grpo``, ``rloo``, ``dapo``, ``gspo``."""

    eps_clip_low: float = 0.2
    """Lower PPO clip: the ratio is clipped at 1 - eps_clip_low."""

    eps_clip_high: float = 0.2
    """Upper PPO clip (clip-higher when larger than eps_clip_low)."""

    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (None = off)."""

    decoupled: bool = True
    """Decoupled PPO: ratio against pi_prox, times the capped behaviour weight pi_prox/pi_behave."""

    behave_cap: float | None = 5.0
    """Cap of the behaviour weight (None = uncapped)."""

    behave_cap_mode: Literal["mask", "clamp"] = "mask"
    """``mask`` drops tokens above the cap; ``clamp`` clips their weight to the cap."""

    ratio_level: Literal["token", "sequence"] = "token"
    """``sequence`` is GSPO's length-normalised sequence ratio."""

    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """How token losses are averaged over the global batch."""

    reward_bias: float = 0.0
    """Added to every reward before scaling."""

    reward_scale: float = 1.0
    """Multiplies every reward."""

    reward_clip: float | None = None
    """Clip shaped rewards to [-c, c] (None = off)."""

    group_baseline: Literal["mean", "loo", "none"] = "mean"
    """Group baseline: group mean, leave-one-out mean (RLOO), or none."""

    group_std: bool = True
    """Divide group advantages by the group's reward std."""

    batch_adv_norm: bool = True
    """Normalise advantages over all tokens of the batch."""

    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model (0 = no reference model)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator (Schulman's k1/k2/k3)."""

    kl_in_reward: bool = False
    """Put the KL penalty into the reward instead of the loss."""

    overlong_buffer: int = 0
    """DAPO overlong penalty: length of the soft-penalty zone before max_new_tokens (0 = off)."""

    overlong_penalty: float = 1.0
    """DAPO overlong penalty at max_new_tokens."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and keep sampling."""

    def __post_init__(self) -> None:
        non_negative(self, "eps_clip_low", "eps_clip_high", "kl_coef", "overlong_buffer")
        if self.behave_cap is not None and self.behave_cap <= 1.0:
            raise ValueError(f"behave_cap must be > 1 or null, got {self.behave_cap}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 or null, got {self.dual_clip}")


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """Model parallelism of ``trainer.backend: megatron`` (``areal_async/training/megatron/engine.py``);
    its context parallelism is ``trainer.context_parallel``, as on fsdp2. The trainer's ranks not used
    by model or context parallelism are data-parallel ranks."""

    tensor_parallel: int = 1
    """Ranks each layer is split over (must divide the heads, K/V heads, FFN width and vocabulary,
    and trainer.num_ranks: tensor-parallel ranks stay within a node)."""

    pipeline_parallel: int = 1
    """Pipeline stages (must divide the layers); the product tensor_parallel x pipeline_parallel x
    trainer.context_parallel must divide the trainer's ranks. Stages pass hidden states point to
    point (training/megatron/pipeline.py)."""

    virtual_pipeline: int = 1
    """Model chunks per pipeline stage (interleaved stages, megatron's virtual pipeline): stage s
    holds layer blocks s, s + P, s + 2P, ... of L / (P x V) layers each, which shrinks the pipeline
    bubble by V at the cost of V times the point-to-point sends; needs pipeline_parallel > 1, and
    P x V must divide the layers."""

    sequence_parallel: bool = False
    """Between the tensor-parallel layers (embedding output, norms, residual adds, the hidden states
    sent between pipeline stages) each tensor-parallel rank holds 1/tensor_parallel of the packed
    row's tokens: all-gathered before QKV and fc1, reduce-scattered after the attention output and
    fc2, so it communicates as plain tensor parallelism does (training/megatron/sequence_parallel.py). Rows
    are padded to a multiple of tensor_parallel tokens (2 x context_parallel x tensor_parallel with
    trainer.context_parallel). Needs tensor_parallel > 1."""

    def __post_init__(self) -> None:
        positive(self, "tensor_parallel", "pipeline_parallel", "virtual_pipeline")
        if self.virtual_pipeline > 1 and self.pipeline_parallel == 1:
            raise ValueError(
                f"trainer.megatron.virtual_pipeline={self.virtual_pipeline} needs pipeline_parallel > 1 "
                "(it interleaves the layers over pipeline stages); set virtual_pipeline: 1"
            )
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(
                "trainer.megatron.sequence_parallel=true needs tensor_parallel > 1 (it splits the tokens "
                "over the tensor-parallel ranks), got tensor_parallel=1; set tensor_parallel: 2 or more, "
                "or sequence_parallel: false"
            )


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    batch_size: int = 4
    """B: prompt groups per training step."""

    total_steps: int = 30
    """Training steps of the run; the run ends after the last one."""

    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch: padded tokens, or real tokens where the trainer packs
    sequences into one row (CUDA with bf16)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """``bfloat16`` = autocast with fp32 master weights; ``auto`` = bfloat16 where it runs natively
    (CUDA, CPUs with AVX-512 BF16 or AMX), float32 elsewhere (on AVX2-only CPUs bf16 is emulated,
    ~40x slower)."""

    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL)."""

    num_ranks: int = 1
    """Processes of the trainer's torchrun job on this node."""

    num_threads: int | None = None
    """torch threads per trainer rank (None: torch's default). They share the cores with the other
    roles on one machine; areal-async makes waiting OpenMP threads sleep rather than spin
    (``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it), so more threads than free cores
    costs little."""

    malloc_arenas: int = 1
    """glibc malloc arenas of a trainer process (0: glibc's default, up to 8 per core). Every thread
    that allocates gets an arena of its own, and an arena keeps the memory it freed: the step, the
    weight snapshot and the writer each held a step's worth. One arena reuses it (CPU demo: peak RSS
    6.3 -> 4.5 GiB, step time within noise). ``MALLOC_ARENA_MAX`` in the environment wins."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW and learning-rate schedule."""

    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss and advantage estimation."""

    ref_model: str | None = None
    """Reference model for the KL penalty (None: the initial policy when kl_coef > 0)."""

    eval_every: int = 5
    """Evaluate on the held-out split every this many steps (0 = only at start and end)."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    prox_pass: bool = False
    """Compute pi_prox with a no-grad forward of the batch before the update (the two-pass step)
    instead of taking it from the update's own forward. Both give the same numbers, since a step
    makes one optimizer step; the separate pass costs one more forward. On by itself where the
    training forward is random (``lora.dropout`` > 0)."""

    compile: bool = False
    """torch.compile each decoder layer and the token-logprob head (GPU: 22.9% -> 37.1% MFU measured)."""

    logprob_kernel: Literal["auto", "triton", "torch"] = "auto"
    """Token logprob and entropy over the logits: ``triton`` = one pass each way over the
    ``[tokens, vocab]`` logits (CUDA, needs Triton); ``torch`` = torch ops (compiled with
    ``compile``); ``auto`` = Triton where it runs."""

    attention_kernel: Literal["auto", "triton", "flash"] = "auto"
    """Attention over packed rows (CUDA, bf16): ``triton`` = this project's kernels (grouped K/V
    gradients summed in registers); ``flash`` = FlashAttention-2 varlen from torch; ``auto`` =
    Triton where it runs and its launch shapes were tuned (head_dim 64 or 128), else flash. CPU
    trainers run exact SDPA per sequence whatever this says."""

    backend: Literal["fsdp2", "megatron", "simulated"] = "fsdp2"
    """``fsdp2``: the HF model sharded by PyTorch FSDP2. ``megatron``: the model rebuilt on megatron-core
    with tensor parallelism (Llama, Qwen2, Qwen3 families; ``pip install areal-async[megatron]``).
    ``simulated``: no model; each step takes the time ``simulation.profile`` models for its tokens and
    ``num_ranks`` ranks, in one process (``areal_async/training/simulated.py``)."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallelism of the megatron backend (ignored by fsdp2)."""

    lora: LoraConfig | None = None
    """Train LoRA adapters on the frozen base model (``areal_async/lora.py``); None: full fine-tuning.
    Each weights version is then an adapter directory of a few MB."""

    context_parallel: int = 1
    """Ranks each packed row of tokens is split over (``training/context_parallel.py``), for sequences
    whose activations do not fit one rank; both backends. fsdp2: must divide trainer.num_ranks (a
    group is a run of consecutive ranks of one node). megatron: megatron-core's context-parallel
    groups; tensor_parallel x pipeline_parallel x context_parallel must divide the trainer's ranks.
    A run file's ``trainer.megatron.context_parallel`` (older run files) is read as this key, with a
    warning (``areal_async/run_file.py``)."""

    def __post_init__(self) -> None:
        positive(self, "batch_size", "total_steps", "micro_batch_tokens", "num_ranks", "context_parallel")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"trainer.dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}; "
                "auto picks bfloat16 where it runs natively"
            )
        if self.backend == "fsdp2" and self.num_ranks % self.context_parallel:
            raise ValueError(
                f"trainer.context_parallel={self.context_parallel} does not divide "
                f"trainer.num_ranks={self.num_ranks} (a context-parallel group shares a node); make "
                "num_ranks a multiple of it"
            )
        non_negative(self, "eval_every", "malloc_arenas")
        if self.backend == "megatron":
            tp = self.megatron.tensor_parallel
            if self.num_ranks % tp:
                raise ValueError(
                    f"trainer.megatron.tensor_parallel={tp} does not divide trainer.num_ranks={self.num_ranks} "
                    "(tensor-parallel ranks share a node); make num_ranks a multiple of it"
                )
            if self.lora is not None:
                raise ValueError("trainer.lora trains on trainer.backend: fsdp2 only; set backend: fsdp2")
        for key in ("logprob_kernel", "attention_kernel"):
            if getattr(self, key) == "triton" and self.device != "cuda":
                raise ValueError(
                    f"{key}=triton runs only on CUDA, but device is {self.device!r}; "
                    f"set trainer.{key}=auto, or trainer.device=cuda"
                )


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """``areal-async sft RUN.yaml``: supervised fine-tuning on the trainer's engines (docs/training.md,
    "Supervised warm start"). Model, backend, LoRA, optimizer, micro-batch budget, dtype and the
    checkpoint keys come from the run file's ``model``, ``trainer`` and ``checkpoint`` sections."""

    data: str = ""
    """JSON-lines file of training rows: ``{"messages": [...]}`` (OpenAI chat messages, tool calls
    included) or ``{"prompt": ..., "completion": ...}``."""

    eval_data: str | None = None
    """JSON-lines file of held-out rows for ``eval_loss`` (None: ``eval_fraction`` of ``data``)."""

    eval_fraction: float = 0.0
    """Share of ``data`` held out for ``eval_loss`` (a seeded choice) when ``eval_data`` is null."""

    epochs: int = 1
    """Passes over the training rows; each epoch reshuffles them with the run's ``seed``."""

    batch_size: int = 8
    """Sequences per optimizer step (the last step of an epoch may hold fewer)."""

    eval_every: int = 0
    """Evaluate every this many steps (0: only after the last step)."""

    out: str = "{dir}/sft/model"
    """Where the trained model is written (``{dir}``: the run directory, ``{name}``: the run name):
    a Hugging Face directory that ``model.path`` takes as is; LoRA adapters are merged into it."""

    max_tokens: int | None = None
    """Longest row in tokens (prompt + completion); a longer row is a bad row (``on_bad_row``).
    None: the model's context (the tokenizer's ``model_max_length``, else the config's
    ``max_position_embeddings``)."""

    on_bad_row: Literal["error", "skip"] = "error"
    """``error``: the first bad row stops the command, naming its line and what is wrong; ``skip``:
    bad rows are left out, counted and logged by kind."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("sft.data is required: set it to the path of a JSON-lines file of training rows")
        positive(self, "epochs", "batch_size")
        non_negative(self, "eval_every")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(
                f"sft.eval_fraction must be in [0, 1), got {self.eval_fraction!r}; "
                "e.g. 0.05 holds out one row in twenty"
            )
        if self.eval_data is not None and self.eval_fraction > 0:
            raise ValueError(
                f"sft.eval_data ({self.eval_data!r}) and sft.eval_fraction ({self.eval_fraction}) both "
                "name the held-out rows; set one of them"
            )
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError(f"sft.max_tokens must be >= 2 or null, got {self.max_tokens!r}")
        if self.on_bad_row not in ("error", "skip"):
            raise ValueError(f"sft.on_bad_row must be 'error' or 'skip', got {self.on_bad_row!r}")
