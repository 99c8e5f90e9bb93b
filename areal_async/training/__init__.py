"""The learner side: the trainer backends (`fsdp/`, `megatron/`), their shared step (`loop.py`),
set-up (`setup.py`), packing (`batching.py`), context parallelism, packed attention, the learner
that turns scored groups into steps (`learner.py`) and run checkpoints (`checkpoint.py`)."""
