"""The FSDP2 trainer backend: the engine (`engine.py`), the model wrapper that returns token
logprobs (`model.py`) and whole-weight I/O and checkpoints (`weights.py`)."""
