"""The sections generation and agent workers read: ``rollout`` (with its ``sampling``) and
``agent`` (re-exported by ``areal_async.config``; defaults live here only).

No torch here: the CLI imports this module and must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from areal_async.config_checks import non_negative, positive


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature of training rollouts (0 = greedy)."""

    top_p: float = 1.0
    """Nucleus sampling mass."""

    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""

    max_new_tokens: int = 16
    """Completion length cap."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop tokens besides the tokenizer's EOS."""

    def __post_init__(self) -> None:
        non_negative(self, "temperature", "top_k")
        positive(self, "max_new_tokens")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    group_size: int = 8
    """Completions sampled per prompt; advantages are normalised within a group."""

    max_staleness: int = 2
    """How many policy versions a trained group's oldest token may trail the learner (0 = synchronous;
    docs/design.md section 5)."""

    max_inflight: int | None = None
    """Most issued-but-untrained tasks (None: (max_staleness + 1) * trainer.batch_size)."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling of training rollouts; evaluation is always greedy."""

    engine: Literal["local", "vllm", "sglang", "simulated"] = "local"
    """Inference engine of generation workers; ``simulated``: no model, tokens at the speed
    ``simulation.profile`` models (``areal_async/engines/simulated.py``)."""

    server_urls: list[str] = field(default_factory=list)
    """vLLM/SGLang server URLs when ``engine`` is remote."""

    max_batch_size: int = 32
    """Sequences decoded together by the local engine."""

    device: str = "cpu"
    """Device of the local engine (``cpu``, ``cuda``, ``cuda:1``)."""

    num_threads: int | None = None
    """torch threads of a generation worker (None: torch's default)."""

    cuda_graphs: bool = False
    """Local engine on CUDA: capture each decode step in a CUDA graph and replay it."""

    compile: bool = False
    """Local engine with ``cuda_graphs``: torch.compile the decode and prefill forwards once each
    (minutes of warm-up on the first requests; docs/benchmarks.md has the speed-ups)."""

    workflow: str = "single_turn"
    """How a dataset row becomes training data: ``single_turn`` (generation workers sample each group
    themselves), ``multi_turn``, ``tool_use`` or ``package.module:function`` (an async workflow run by
    ``agent`` workers, which then take the prompt tasks; docs/agents.md)."""

    kv_after_load: Literal["recompute", "keep", "finish"] = "recompute"
    """Requests running when new weights load: ``recompute`` drops their KV and re-prefills prompt +
    tokens so far with the new weights (as AReaL does); ``keep`` (local engine only) goes on decoding
    over the KV already computed, with the new weights, and redoes no work; ``finish`` (local engine
    only) does not interrupt: the engine stops admitting requests, lets the running ones finish on
    the old weights, then loads (one version per completion; the no-interruption baseline). Tokens
    carry the version and log-prob they were sampled with in every mode."""

    def __post_init__(self) -> None:
        if self.kv_after_load in ("keep", "finish") and self.engine != "local":
            raise ValueError(
                f"kv_after_load={self.kv_after_load} is implemented by the local engine only, "
                f"got engine={self.engine!r}; set rollout.kv_after_load=recompute or rollout.engine=local"
            )
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(
                f"cuda_graphs=true needs a CUDA device, got device={self.device!r}; "
                "set rollout.device=cuda or rollout.cuda_graphs=false"
            )
        if self.compile and not self.cuda_graphs:
            raise ValueError(
                "compile=true compiles the graph-captured decode step, so it needs cuda_graphs=true; "
                "set rollout.cuda_graphs=true (and rollout.device=cuda) or rollout.compile=false"
            )
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group advantages, got {self.group_size}")
        if self.workflow not in WORKFLOWS and ":" not in self.workflow:
            raise ValueError(
                f"workflow {self.workflow!r} is neither a built-in ({', '.join(WORKFLOWS)}) nor "
                "'package.module:function'; set rollout.workflow to one of them"
            )
        non_negative(self, "max_staleness")
        positive(self, "max_batch_size")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1 or null, got {self.max_inflight}")


WORKFLOWS = ("single_turn", "multi_turn", "tool_use")
"""Built-in workflows (``areal_async.agents.workflows``); anything else is ``package.module:function``."""

AGENT_TOOLS = ("calculator", "python")
"""Built-in tools an agent may offer the model (``areal_async.agents.tools`` / ``sandbox``)."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Agent workers (``areal-worker --role agent``): multi-turn and tool-using episodes
    (docs/agents.md). Used when ``rollout.workflow`` is not ``single_turn``."""

    max_turns: int = 4
    """Most model turns in one episode."""

    gamma: float | None = None
    """Discount of later turns' rewards in (0, 1]; None: the workflow's default (0.9 for multi_turn)."""

    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """Tools offered to the model by ``tool_use``: ``calculator``, ``python`` (sandboxed subprocess)."""

    tool_timeout_s: float = 10.0
    """Wall-time limit of one tool call (the python tool is killed at it)."""

    feedback: str | None = None
    """multi_turn: the message asking for another try after a wrong answer (None: the built-in one)."""

    concurrency: int = 64
    """Episodes one agent worker runs at a time (its generation calls in flight). The agent workers
    together should cover the episodes admission allows, (max_staleness + 1) x trainer.batch_size x
    group_size, or the generation fleet idles (docs/benchmarks.md "scale_summary")."""

    call_timeout_s: float = 120.0
    """How long one generation call may take before it is retried on another generation worker."""

    call_attempts: int = 3
    """Tries of one generation call (timeouts, no generation worker) before the task is handed back."""

    episode_timeout_s: float = 1800.0
    """Deadline of one episode (the workflow's whole run): one that passes it fails its task with the
    reason, as a workflow that raises does, instead of holding the agent worker."""

    http_port: int | None = None
    """Serve the OpenAI-compatible endpoint (``/episodes/<id>/v1/chat/completions``) on this port for
    ``openai_workflow`` agents (0: any free port); None: off."""

    http_host: str = "127.0.0.1"
    """Address of that endpoint; the agent code calling it runs in the agent worker's process."""

    def __post_init__(self) -> None:
        positive(self, "max_turns")
        positive(self, "concurrency")
        positive(self, "call_attempts")
        if not self.call_timeout_s > 0 or not self.tool_timeout_s > 0:
            raise ValueError(
                f"call_timeout_s and tool_timeout_s must be > 0, got {self.call_timeout_s}, {self.tool_timeout_s}"
            )
        positive(self, "episode_timeout_s")
        if self.gamma is not None and not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1] or null, got {self.gamma}")
        unknown = [t for t in self.tools if t not in AGENT_TOOLS]
        if unknown:
            raise ValueError(f"tools: unknown tool(s) {unknown}; choose from {list(AGENT_TOOLS)}")
