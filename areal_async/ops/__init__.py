"""Kernels: token logprobs (`logprobs.py`, Triton in `logprob_triton.py`), variable-length attention
(`varlen.py`, Triton in `attention_triton.py`) and the Triton availability checks."""
