"""Where this project's Triton kernels can run, and the error when they are asked for elsewhere.

`triton` (and `tl`) are the imported modules, or None on installs without Triton (CPU-only
wheels), where the torch forms of every kernel are used instead.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None


def triton_available(device: torch.device) -> bool:
    """True where the Triton kernels can run: a CUDA device and an importable Triton."""
    return device.type == "cuda" and triton is not None


def require_triton(device: torch.device, setting: str, fallback: str) -> None:
    """Raise a ValueError naming `trainer.<setting>` when `<setting>='triton'` cannot run on `device`."""
    if not triton_available(device):
        raise ValueError(
            f"{setting}='triton' needs a CUDA device and an importable Triton; the trainer runs on "
            f"{device} {'without' if triton is None else 'with'} Triton. "
            f"Set trainer.{setting}=auto (or {fallback})"
        )
