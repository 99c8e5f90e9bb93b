"""The megatron-core trainer backend: the engine (`engine.py`), the GPT model and its packed
attention (`model.py`), HF <-> megatron weight layout (`layout.py`), pipeline stages
(`pipeline.py`), sequence parallelism and sharded checkpoints (`checkpoint.py`)."""
